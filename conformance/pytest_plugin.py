"""pytest plugin: one test item per conformance case of your kernel.

::

    pytest --pyargs conformance --attn-kernel mypkg.mod:fn --attn-variant softmax \\
        --attn-backend torch --attn-dtype float16 --attn-dtype bfloat16

Registered through the ``pytest11`` entry point, so it loads in every pytest run of an
environment where attn-ref is installed: at import it touches nothing but pytest and
the standard library, and it does nothing unless ``--attn-kernel`` is given. The items
live in ``conformance/test_kernel.py`` and are named ``test_case[<dtype>-<case id>]``;
a case the kernel cannot take is skipped with the reason, a failure shows the verdict
row and the diagnosis.
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
                metavar="FEATURE[=PARAM|false]", help="override signature detection")
    g.addoption("--attn-grads", action="store_true", default=False,
                help="also check dq, dk, dv (torch autograd / jax.vjp of the kernel)")
    g.addoption("--attn-time-limit", type=float, default=60.0, metavar="SECONDS",
                help="seconds per kernel call; a call still running then is stopped and the "
                     "item fails as timed out (default 60)")


class _Item:
    def __init__(self, sess, case, dtype):
        self.sess, self.case, self.dtype = sess, case, dtype

    def run(self):
        res = self.sess.run(self.case, self.dtype)
        if res.verdict == "n/a":
            pytest.skip(f"not applicable: {res.diagnosis}")
        if res.verdict != "pass":
            pytest.fail(
                f"{res.verdict}: {self.case.id} [{self.dtype}] max err {res.max_err:.3g} "
                f"(tol {res.tol_max:.3g}), rms err {res.rms_err:.3g} (tol {res.tol_rms:.3g}), "
                f"worst at (batch, head, query) {tuple(res.worst)}\n  -> {res.diagnosis}",
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
        from .calling import load_kernel, parse_supports
        from .oracle import session

        sem = {}
        if config.getoption("attn_fully_masked"):
            sem["fully_masked"] = config.getoption("attn_fully_masked")
        if config.getoption("attn_causal"):
            sem["causal"] = config.getoption("attn_causal")
        sess = session(load_kernel(config.getoption("attn_kernel")),
                       config.getoption("attn_variant"), backend=config.getoption("attn_backend"),
                       layout=config.getoption("attn_layout"), seed=config.getoption("attn_seed"),
                       supports=parse_supports(config.getoption("attn_supports")),
                       grads=config.getoption("attn_grads"),
                       time_limit=config.getoption("attn_time_limit"), **sem)
        setattr(config, key, sess)
    return getattr(config, key)


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
    todo = cases(None, config.getoption("attn_suite"))
    params, ids = [], []
    for dt in config.getoption("attn_dtype") or ["float32"]:
        for c in todo:
            params.append(_Item(sess, c, dt))
            ids.append(f"{dt}-{c.id}")
    metafunc.parametrize("attn_case", params, ids=ids)
