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
    # JAX is shared out per variant; every other backend is in one unit, variant by
    # variant, so the goldens a worker computes for a variant serve all its backends
    assert [u for u in units if cli._is_jax(u)] == [[(v.name, "jax")] for v in vs]
    (rest,) = [u for u in units if not cli._is_jax(u)]
    assert [n for n, _ in rest] == [v.name for v in vs for _ in range(4)]
    assert {b for _, b in rest} == {"array_api_strict", "numpy", "torch", "cupy"}
    # one worker starts on JAX (the longest part), the next on everything else
    assert units[0] == [("softmax", "jax")] and units[1] is rest
    assert cli._work_units(vs, ["numpy", "torch"]) == [[(v.name, b) for v in vs
                                                       for b in ("numpy", "torch")]]


def test_a_free_worker_imports_jax_only_when_it_shortens_the_job():
    def nxt(has_jax, n_jax, n_other, jax_workers=1, paces=()):
        jax_left = [[(f"j{i}", "jax")] for i in range(n_jax)]
        other_left = [[(f"o{i}", "numpy")] for i in range(n_other)]
        got = cli._next_unit(has_jax, jax_left, other_left, jax_workers, list(paces))
        return None if got is None else got[0][1]

    assert nxt(True, 3, 1) == "jax"  # a JAX worker stays on JAX
    assert nxt(False, 3, 1) == "numpy"  # the others' units first
    assert nxt(True, 0, 1) == "numpy" and nxt(False, 0, 0) is None
    # no JAX worker yet, or none has finished a unit after importing JAX: take one
    assert nxt(False, 3, 0, jax_workers=0) == "jax"
    assert nxt(False, 3, 0, paces=()) == "jax"
    # 3 units at 0.2 s on one JAX worker: 0.6 s, less than importing JAX
    assert nxt(False, 3, 0, paces=(0.2,)) is None
    # 20 units at 0.5 s (a cold compilation cache): 10 s, worth a second JAX worker
    assert nxt(False, 20, 0, paces=(0.5,)) == "jax"
    assert nxt(False, 20, 0, jax_workers=8, paces=(0.5,)) is None


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

    def spy(unit, settings):
        seen.update({t: (settings["jit_subset"], settings["dtypes"][t[1]]) for t in unit})
        return {t: "not run (spy)" for t in unit}

    monkeypatch.setattr(cli, "_verify_tasks", spy)
    both = ["float32", "float64"]
    for argv, jax in ((["verify"], (True, list(cli.JIT_DTYPES))),
                      (["verify", "--dtype", "float64"], (True, ["float64"])),
                      (["verify", "--suite", "quick"], (False, both)),
                      (["verify", "--backend", "numpy", "--backend", "jax"], (False, both))):
        seen.clear()
        assert cli.main(argv + ["--variant", "softmax", "--jobs", "1"]) == 1  # nothing ran
        assert seen[("softmax", "jax")] == jax, argv
        assert seen[("softmax", "numpy")] == (jax[0], both if "--dtype" not in argv
                                              else ["float64"]), argv


def test_builtin_job_on_jax_fails_a_reference_that_does_not_trace(broken_variant, capsys,
                                                                 monkeypatch):
    # The default job's JAX rows (two cases under jax.jit, float32) are what catches a
    # reference that leaves the array API; the NumPy rows cannot (it computes the same).
    pytest.importorskip("jax")
    from conformance import backends

    monkeypatch.setattr(backends, "BACKENDS", ("numpy", "jax"))
    # CI requires four backends by name; with only two known, that list is not valid here
    # (and tests/conftest.py reads it again while it reports this test).
    monkeypatch.delenv("ATTN_REF_REQUIRE_BACKENDS", raising=False)
    code = cli.main(["verify", "--variant", "softmax", "--variant", broken_variant,
                     "--jobs", "1"])
    out = capsys.readouterr().out
    rows = {tuple(line.split()[:3]): line.split()[-1] for line in out.splitlines()
            if line.startswith(("softmax ", broken_variant)) and line.endswith(("pass", "FAIL"))}
    assert code == 1
    assert rows == {(n, "numpy", dt): "pass" for n in ("softmax", broken_variant)
                    for dt in ("float32", "float64")} | {
        ("softmax", "jax", "float32"): "pass", (broken_variant, "jax", "float32"): "FAIL"}
    assert "1 of 6 combinations FAILED" in out and "jax float32 only" in out


def test_units_run_in_workers_give_the_reports_of_one_process():
    # Two units on two spawned workers (no JAX, so no import of it): each unit's reports
    # come back to this process whole, as _verify_tasks gives them here.
    settings = dict(suite="quick", seed=0, time_limit=60.0, options={}, semantics={},
                    cases=cli.jit_cases("softmax"), jit_subset=False,
                    dtypes={"numpy": ["float32"], "array_api_strict": ["float64"]})
    units = [[("softmax", "numpy"), ("linear", "numpy")], [("softmax", "array_api_strict")]]
    got = {}
    cli._run_units(units, settings, 2, lambda unit, res: got.update({tuple(unit): res}))
    assert set(got) == {tuple(u) for u in units}
    # Every worker has exited when it returns (each pool shut down and joined): a pool
    # left to the interpreter's exit races CPython's exit handler ("Bad file descriptor").
    import multiprocessing

    assert multiprocessing.active_children() == []

    def verdicts(results):
        return {t: [(r.case, r.dtype, r.output, r.verdict, r.max_err) for rep in reps
                    for r in rep.results] for t, reps in results.items()}

    for unit in units:
        here = cli._verify_tasks(unit, settings)
        assert verdicts(got[tuple(unit)]) == verdicts(here)
        assert all(len(reps) == 1 and reps[0].passed for reps in here.values())


def test_the_jobs_jax_compilations_are_cached_only_while_it_runs(tmp_path, monkeypatch):
    # The built-in job keeps its references' compilations in ATTN_REF_JAX_CACHE; JAX's
    # cache is a setting of the whole process, so it is on only around the job's JAX
    # tasks: a compilation after them (this test worker's, a user's) is not written there.
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    jax.jit(lambda x: x - 1.0)(jnp.ones(5))  # JAX has compiled in this process already
    monkeypatch.setenv("ATTN_REF_JAX_CACHE", str(tmp_path))
    before = {name: getattr(jax.config, name) for name in cli._JAX_CACHE_SETTINGS}
    settings = dict(suite="quick", seed=0, time_limit=60.0, options={}, semantics={},
                    cases=cli.jit_cases("softmax")[:1], jit_subset=False,
                    dtypes={"jax": ["float32"]})
    (report,), = cli._verify_tasks([("softmax", "jax")], settings).values()
    assert report.passed and len(report.results) == 1
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert any("softmax" in name for name in kept), kept
    assert {name: getattr(jax.config, name) for name in cli._JAX_CACHE_SETTINGS} == before
    jax.jit(lambda x: x * 3.0 + 1.0)(jnp.ones(7))
    assert sorted(p.name for p in tmp_path.iterdir()) == kept
