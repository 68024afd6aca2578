"""tests/conftest.py: with ATTN_REF_REQUIRE_BACKENDS set, a skip is a failure unless a
backend the variable does not list is missing or the test does not apply by design."""

SKIPS = '''
import pytest

def test_needs_a_package():
    pytest.importorskip("attn_ref_no_such_module")

def test_required_backend_missing():
    pytest.skip("numpy is not installed (No module named 'numpy')")

def test_optional_backend_missing():
    pytest.skip("cupy is installed but CUDA is not usable: no driver")

def test_similar_module_missing():
    pytest.importorskip("cupy_no_such_module")

def test_optional_backend_importorskip():
    pytest.skip("could not import 'cupy': No module named 'cupy'")

def test_not_applicable():
    pytest.skip("JAX arrays are immutable")
'''

CONFTEST = "from tests.conftest import pytest_runtest_makereport  # noqa: F401\n"


def _outcomes(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_skips=SKIPS)
    rec = pytester.inline_run("-p", "no:cacheprovider", "-q", "--no-header")
    return {r.nodeid.split("::")[-1]: r.outcome for r in rec.getreports("pytest_runtest_logreport")
            if r.when == "call"}


def test_skips_stay_skips_when_no_backend_is_required(pytester, monkeypatch):
    monkeypatch.delenv("ATTN_REF_REQUIRE_BACKENDS", raising=False)
    assert set(_outcomes(pytester).values()) == {"skipped"}


def test_unexpected_skips_fail_when_backends_are_required(pytester, monkeypatch):
    monkeypatch.setenv("ATTN_REF_REQUIRE_BACKENDS", "numpy")
    assert _outcomes(pytester) == {
        "test_needs_a_package": "failed",
        "test_required_backend_missing": "failed",
        "test_optional_backend_missing": "skipped",
        # Only the backends' own modules are excused, not one whose name starts like one.
        "test_similar_module_missing": "failed",
        "test_optional_backend_importorskip": "skipped",
        "test_not_applicable": "skipped",
    }
