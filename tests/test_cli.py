"""The no-argument ``attn-ref verify`` (the README's main job): what it runs, and where.

The table itself and the ``--jobs 1``/``--jobs 2`` equivalence are checked in
``tests/test_conformance.py``; here: that the job fails when a registered reference
is broken, and how its work is cut between the worker processes.
"""

import dataclasses
import functools

import pytest

from attn_ref.registry import get, register, unregister
from conformance import cli


def _numpy_inside(fn):
    """``fn`` computing with NumPy whatever library its inputs are from: a reference
    that leaves the array API standard, the bug the job exists to catch."""

    @functools.wraps(fn)  # same signature, so the oracle sees the same features
    def broken(q, k, v, /, *args, xp=None, **kw):
        import numpy as np

        return fn(np.asarray(q), np.asarray(k), np.asarray(v), *args, **kw)

    return broken


@pytest.fixture
def broken_variant():
    """``softmax`` registered again as ``softmax_numpy_inside``, with that bug."""
    v = dataclasses.replace(get("softmax"), name="softmax_numpy_inside",
                            fn=_numpy_inside(get("softmax").fn))
    register(v)
    yield v.name
    unregister(v.name)


def test_builtin_job_fails_on_a_broken_reference(broken_variant, capsys):
    # The job's golden is each reference itself, in float64/longdouble on NumPy, so it
    # catches what a backend or a dtype changes: the broken reference still passes on
    # NumPy but must fail on array-api-strict, and the intact one pass on both.
    code = cli.main(["verify", "--backend", "numpy", "--backend", "array_api_strict",
                     "--variant", "softmax", "--variant", broken_variant, "--dtype", "float32",
                     "--jobs", "1"])
    out = capsys.readouterr().out
    assert code == 1
    rows = {tuple(line.split()[:2]): line.split()[-1] for line in out.splitlines()
            if line.startswith(("softmax ", broken_variant)) and line.endswith(("pass", "FAIL"))}
    assert rows == {("softmax", "numpy"): "pass", ("softmax", "array_api_strict"): "pass",
                    (broken_variant, "numpy"): "pass",
                    (broken_variant, "array_api_strict"): "FAIL"}
    assert "1 of 4 combinations FAILED" in out


def test_work_units_import_each_library_in_few_workers():
    vs = [get("softmax"), get("linear"), get("local")]
    units = cli._work_units(vs, ["array_api_strict", "numpy", "torch", "jax", "cupy"])
    flat = [t for u in units for t in u]
    # every (variant, backend) exactly once
    assert sorted(flat) == sorted((v.name, b) for v in vs
                                  for b in ("array_api_strict", "numpy", "torch", "jax", "cupy"))
    # a non-JAX backend is one unit (one worker imports it); JAX is shared out per variant
    by_backend = {}
    for u in units:
        assert len({b for _, b in u}) == 1
        by_backend.setdefault(u[0][1], []).append(len(u))
    assert by_backend == {"torch": [3], "cupy": [3], "jax": [1, 1, 1],
                          "array_api_strict": [3], "numpy": [3]}
    # torch first, then JAX (the long part), the short NumPy-like units last
    order = [u[0][1] for u in units]
    assert order[0] == "torch" and order.index("jax") < order.index("numpy")


def test_worker_threads_default_to_one_but_the_users_setting_wins(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    cli._worker_init()
    import os

    assert os.environ["OMP_NUM_THREADS"] == "1" and os.environ["MKL_NUM_THREADS"] == "1"
    assert os.environ["OPENBLAS_NUM_THREADS"] == "2"


def test_jit_cases_are_a_few_applicable_quick_cases_of_every_reference():
    from attn_ref.registry import variants
    from conformance.catalogue import cases
    from conformance.judging import prepare

    for v in variants():
        chosen = cli.jit_cases(v.name)
        quick = {c.id for c in cases(v.name, "quick")}
        assert 1 <= len(chosen) <= cli.JIT_CASES_PER_REFERENCE, v.name
        assert {c.id for c in chosen} <= quick, v.name
        for c in chosen:
            prepare(c, v.name, "float64")  # applicable: raises NotApplicable otherwise
    # unequal lengths and a causal mask, where the reference takes them
    assert [c.tag for c in cli.jit_cases("softmax")] == ["cross", "causal"]


def test_the_jit_subset_is_only_for_the_job_without_a_suite_backend_or_case(monkeypatch):
    seen = {}

    def spy(name, backend_name, dtypes, settings):
        seen[name, backend_name] = settings["jit_subset"]
        return []

    monkeypatch.setattr(cli, "_verify_task", spy)
    monkeypatch.setattr(cli, "_work_units", lambda vs, names: [[(vs[0].name, "numpy")]])
    for argv, subset in ((["verify"], True), (["verify", "--suite", "quick"], False),
                         (["verify", "--backend", "numpy"], False)):
        seen.clear()
        try:
            cli.main(argv + ["--variant", "softmax", "--jobs", "1"])
        except (KeyError, ValueError, TypeError):
            pass  # the spy's empty report list; only the settings matter here
        assert seen == {("softmax", "numpy"): subset}, argv
