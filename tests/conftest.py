"""The backend matrix: every reference test runs on every array library present.

A backend that is not installed is skipped with its reason, unless
``ATTN_REF_REQUIRE_BACKENDS`` lists it: then it fails, so CI cannot go green by
silently skipping a backend.
"""

import os

# JAX compiles every traced function for the CPU; the tests' arrays are tiny, so LLVM's
# expensive optimisation passes buy nothing and cost most of the suite's time (compiles
# about 2x faster without them). XLA's own optimisation level stays at its default: level
# 0 changed inf/NaN handling in jax.vjp of masked rows. Set before anything imports jax;
# an explicit XLA_FLAGS wins.
os.environ.setdefault("XLA_FLAGS", "--xla_llvm_disable_expensive_passes=true")

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


def pytest_report_header(config):
    lines = []
    for name, b in B.available().items():
        lines.append(f"  {name}: {'available' if not isinstance(b, str) else b}")
    return ["attn-ref backends:"] + lines
