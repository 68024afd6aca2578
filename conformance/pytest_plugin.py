"""pytest plugin: one test item per conformance case of your kernel.

::

    pytest --pyargs conformance --attn-kernel mypkg.mod:fn --attn-variant softmax \\
        --attn-backend torch --attn-dtype float16 --attn-dtype bfloat16

Registered through the ``pytest11`` entry point, so it loads in every pytest run of an
environment where attn-ref is installed: at import it touches nothing but pytest and
the standard library, and it does nothing unless ``--attn-kernel`` is given. The items
live in ``conformance/test_kernel.py`` and are named ``test_case[<dtype>-<case id>]``
(``-k`` takes a case id as the report table prints it); a case the kernel cannot take
is skipped with the reason, a failure shows the verdict row and the diagnosis.
``--attn-option NAME=VALUE`` sets an option of the variant's function,
``--attn-supports`` declares features and subsets (``causal=always``, ``cross=false``),
``--attn-backward MODULE:FUNCTION`` checks an explicit backward. A kernel, backward,
option or declaration that cannot be used stops the run with a one-line usage error
(pytest's exit status 4).
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser):
    g = parser.getgroup("attn-ref", "attention kernel conformance (attn-ref)")
    g.addoption("--attn-kernel", default=None, metavar="MODULE:FUNCTION",
                help="kernel to check against the attn-ref oracle")
    g.addoption("--attn-variant", default="softmax", help="attn_ref variant (default softmax)")
    g.addoption("--attn-backend", default="numpy", help="array library the kernel takes")
    g.addoption("--attn-dtype", action="append", default=None,
                help="kernel dtype, repeatable (default float32)")
    g.addoption("--attn-layout", default="bhnd", choices=("bhnd", "bnhd", "nd"))
    g.addoption("--attn-suite", default="standard", choices=("quick", "standard", "exhaustive"))
    g.addoption("--attn-seed", type=int, default=0)
    g.addoption("--attn-fully-masked", default=None, choices=("zeros", "mean", "excluded"))
    g.addoption("--attn-causal", default=None, choices=("top-left", "bottom-right", "both"))
    g.addoption("--attn-supports", action="append", default=None,
                metavar="FEATURE[=PARAM|false|always]",
                help="override signature detection or declare a subset (causal=always, "
                     "cross=false, head_dims=64,128, max_seq_len=N)")
    g.addoption("--attn-option", action="append", default=None, metavar="NAME=VALUE",
                help="an option of the variant's function, e.g. feature_map=identity "
                     "(repeatable; VALUE read as a Python literal when it is one)")
    g.addoption("--attn-grads", action="store_true", default=False,
                help="also check dq, dk, dv (torch autograd / jax.vjp of the kernel)")
    g.addoption("--attn-time-limit", type=float, default=60.0, metavar="SECONDS",
                help="seconds per kernel call; a call still running then is stopped and the "
                     "item fails as timed out (default 60)")
    g.addoption("--attn-backward", default=None, metavar="MODULE:FUNCTION",
                help="the kernel's explicit backward(q, k, v, do, **kw) -> (dq, dk, dv); "
                     "implies --attn-grads")


def pytest_configure(config):
    # check the kernel, options and declarations before collection, so that a mistake
    # is a usage error (exit status 4), not a collection error
    if config.getoption("attn_kernel", None):
        _session(config)


class _Item:
    def __init__(self, sess, case, dtype):
        self.sess, self.case, self.dtype = sess, case, dtype

    def run(self):
        from .report import worst_axes

        res = self.sess.run(self.case, self.dtype)
        if res.verdict == "n/a":
            pytest.skip(f"not applicable: {res.diagnosis}")
        if res.verdict != "pass":
            pytest.fail(
                f"{res.verdict}: {self.case.id} [{self.dtype}] max err {res.max_err:.3g} "
                f"(tol {res.tol_max:.3g}), rms err {res.rms_err:.3g} (tol {res.tol_rms:.3g}), "
                f"worst at {worst_axes(res.output)} {tuple(res.worst)}\n  -> {res.diagnosis}",
                pytrace=False,
            )
        if self.sess.extra.get("grads"):
            from .oracle import run_case

            bad = [r for r in run_case(self.sess, self.case, self.dtype)[1:]
                   if r.verdict not in ("pass", "n/a")]
            if bad:
                pytest.fail("\n".join(
                    f"{r.verdict}: {self.case.id} [{self.dtype}] {r.output} max err {r.max_err:.3g} "
                    f"(tol {r.tol_max:.3g}), rms err {r.rms_err:.3g} (tol {r.tol_rms:.3g})"
                    f"\n  -> {r.diagnosis}" for r in bad), pytrace=False)


def _session(config):
    key = "_attn_ref_session"
    if not hasattr(config, key):
        import numpy as np

        from .backends import BackendUnavailable
        from .calling import KernelNotFound, load_kernel, parse_options, parse_supports
        from .oracle import session

        sem = {}
        if config.getoption("attn_fully_masked"):
            sem["fully_masked"] = config.getoption("attn_fully_masked")
        if config.getoption("attn_causal"):
            sem["causal"] = config.getoption("attn_causal")
        try:
            backward = config.getoption("attn_backward")
            sess = session(load_kernel(config.getoption("attn_kernel")),
                           config.getoption("attn_variant"),
                           backend=config.getoption("attn_backend"),
                           layout=config.getoption("attn_layout"),
                           seed=config.getoption("attn_seed"),
                           supports=parse_supports(config.getoption("attn_supports")),
                           options=parse_options(config.getoption("attn_option")),
                           grads=config.getoption("attn_grads"),
                           backward=load_kernel(backward, "backward") if backward else None,
                           time_limit=config.getoption("attn_time_limit"), **sem)
            for dt in _dtypes(config):  # an unknown dtype, or one the backend lacks
                sess.to_kernel(np.zeros(1), dt)
        except (KernelNotFound, BackendUnavailable, KeyError, TypeError, ValueError) as exc:
            text = (exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc))
            line = str(text).strip().splitlines()
            raise pytest.UsageError(f"attn-ref: {line[0] if line else type(exc).__name__}") from exc
        setattr(config, key, sess)
    return getattr(config, key)


def _dtypes(config):
    return config.getoption("attn_dtype") or ["float32"]


def pytest_generate_tests(metafunc):
    if "attn_case" not in metafunc.fixturenames:
        return
    config = metafunc.config
    if not config.getoption("attn_kernel"):
        metafunc.parametrize("attn_case", [pytest.param(None, marks=pytest.mark.skip(
            reason="no kernel given: pass --attn-kernel MODULE:FUNCTION"))], ids=["no-kernel"])
        return
    from .catalogue import cases

    sess = _session(config)
    # a family's cases (Case.family) only for that family's variants, a variant's
    # (Case.variant) for that variant
    todo = [c for c in cases(None, config.getoption("attn_suite")) if c.belongs_to(sess.variant)]
    params, ids = [], []
    for dt in _dtypes(config):
        for c in todo:
            params.append(_Item(sess, c, dt))
            ids.append(f"{dt}-{c.id}")
    metafunc.parametrize("attn_case", params, ids=ids)
