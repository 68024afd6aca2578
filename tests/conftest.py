"""The backend matrix: every reference test runs on every array library present.

A backend that is not installed is skipped with its reason, unless
``ATTN_REF_REQUIRE_BACKENDS`` lists it: then it fails, so CI cannot go green by
silently skipping a backend.

A run that requires backends also runs every test it has: with
``ATTN_REF_REQUIRE_BACKENDS`` set, any other skip is a failure too, except

- a backend that the variable does not list being unavailable (CuPy without a GPU,
  say), whether the ``backend`` fixture or a test's ``importorskip`` found it missing;
- a reason in :data:`EXPECTED_SKIPS`: a test that does not apply by design.

So a test extra that lacks a package (matplotlib), or a committed file gone missing,
fails CI instead of skipping quietly.
"""

import os
import re

# JAX compiles every traced function for the CPU; the tests' arrays are tiny, so LLVM's
# expensive optimisation passes buy nothing and cost most of the suite's time (compiles
# about 2x faster without them). XLA's own optimisation level stays at its default: level
# 0 changed inf/NaN handling in jax.vjp of masked rows (tests.helpers.jit compiles the
# references under test at level 0, where that is no excuse). Set before anything imports jax;
# an explicit XLA_FLAGS wins. XLA also runs single-threaded: `pytest -n auto` already runs
# one worker per core, and a worker whose XLA thread pool waited on itself hung CI once
# (tests/test_recurrent.py's float16 case on JAX, after 90 % of the suite; not reproduced
# alone), a wait that cannot happen without the pool.
os.environ.setdefault("XLA_FLAGS", "--xla_llvm_disable_expensive_passes=true "
                      "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
# For the same reason a pytest-xdist worker (one per core) runs NumPy's BLAS and torch on
# one thread: their pools on every worker only made the workers compete for the cores.
# `pytest -n 2 tests/test_reference_finite.py -k performer` (QR-bound at d = 256) on the
# loaded 2-core machine: 34 s and 25 s wall with the pools, 19 s and 18 s without (CPU
# 13.6/10.2 s against 7.8/7.3 s). Nothing has imported NumPy or torch yet when this runs
# (checked in the workers); a value the user set wins; a run without xdist keeps them.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

# The built-in job's persistent JAX cache (conformance.cli.jax_compilation_cache) stays
# off in a test run unless the user points it somewhere: the tests that run the job add
# nothing to the user's cache, and a first run (CI's) would only pay for the writes.
os.environ.setdefault("ATTN_REF_JAX_CACHE", "")

import pytest  # noqa: E402

from conformance import backends as B

# pytester runs pytest inside a test: the conformance plugin's options and the generic
# variant tests are checked by their behaviour (tests/test_variants.py,
# tests/test_conformance_grads.py).
pytest_plugins = ["pytester"]

# ATTN_REF_TEST_BACKENDS=numpy,array_api_strict narrows the matrix for a quick local run
# (CI never sets it; ATTN_REF_REQUIRE_BACKENDS still fails on a required backend left out).
_ONLY = [n.strip() for n in os.environ.get("ATTN_REF_TEST_BACKENDS", "").split(",") if n.strip()]
for _n in _ONLY:
    if _n not in B.BACKENDS:
        raise ValueError(f"ATTN_REF_TEST_BACKENDS names unknown backend {_n!r}; known: {B.BACKENDS}")
_LEFT_OUT = set(B.required()) - set(_ONLY) if _ONLY else set()
if _LEFT_OUT:
    raise ValueError(f"ATTN_REF_TEST_BACKENDS leaves out required backends {sorted(_LEFT_OUT)}")
MATRIX = tuple(n for n in B.BACKENDS if not _ONLY or n in _ONLY)


#: Skip reasons that are not a missing dependency but a test that does not apply, with why.
EXPECTED_SKIPS = {
    # "inputs are not modified" has nothing to check where arrays cannot be written to.
    "JAX arrays are immutable": "JAX arrays cannot be modified in place",
    # float16 is not in the array API standard; array-api-strict has none to test.
    "array_api_strict has no float16": "the standard has no float16",
}

# The module each backend is imported as (what importorskip names).
_BACKEND_MODULES = {"numpy": "numpy", "array_api_strict": "array_api_strict", "torch": "torch",
                    "jax": "jax", "cupy": "cupy"}


def _allowed_skip(reason, required):
    if reason in EXPECTED_SKIPS:
        return True
    # conformance.backends.BackendUnavailable says "<backend> is not installed ...",
    # "cupy is installed but CUDA is not usable ..."; importorskip "could not import 'torch'".
    m = re.match(r"(\w+) is ", reason) or re.match(r"could not import '(\w+)'", reason)
    backend = m and {mod: b for b, mod in _BACKEND_MODULES.items()}.get(m.group(1))
    return bool(backend) and backend not in required


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    required = B.required()
    if required and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        if not _allowed_skip(reason, required):
            report.outcome = "failed"
            report.longrepr = (
                f"skipped ({reason}), but ATTN_REF_REQUIRE_BACKENDS={','.join(required)} requires every "
                f"test to run: install what it needs, or, if it cannot apply by design, list the "
                f"reason in EXPECTED_SKIPS in tests/conftest.py")
    return report


def _backend_or_skip(name):
    try:
        return B.load(name)
    except B.BackendUnavailable as exc:
        if name in B.required():
            pytest.fail(f"backend {name} is required by ATTN_REF_REQUIRE_BACKENDS but unavailable: {exc}")
        pytest.skip(str(exc))


@pytest.fixture(params=MATRIX)
def backend(request):
    """A :class:`conformance.backends.Backend` for each library of the matrix."""
    return _backend_or_skip(request.param)


@pytest.fixture
def xp(backend):
    return backend.xp


def pytest_collection_modifyitems(config, items):
    """On JAX, a sweep marked ``jax_subset(*params)`` keeps one case (the first collected)
    per distinct value of ``params`` (no params: one case in all); the others are
    deselected, and pytest counts them as such.

    Eager JAX compiles every operation it meets at a new shape or with new static
    arguments: one delta-rule backward of 7 tokens compiles 267 XLA programs (9 s of
    its 15 s). A sweep over chunkings, groupings or options runs the same array-API code
    on every backend; what JAX can get wrong on its own (immutability, dtype promotion,
    its indexing) shows in one case. The marked tests are sweeps whose every case still
    runs on NumPy, array-api-strict and PyTorch, and whose JAX case is kept per variant
    where the variants take different code.
    """
    seen, kept, dropped = set(), [], []
    for item in items:
        marker = item.get_closest_marker("jax_subset")
        spec = getattr(item, "callspec", None)
        if marker is None or spec is None or spec.params.get("backend") != "jax":
            kept.append(item)
            continue
        key = (item.originalname, item.path) + tuple(spec.params[p] for p in marker.args)
        (dropped if key in seen else kept).append(item)
        seen.add(key)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_report_header(config):
    lines = []
    for name, b in B.available().items():
        lines.append(f"  {name}: {'available' if not isinstance(b, str) else b}")
    return ["attn-ref backends:"] + lines
