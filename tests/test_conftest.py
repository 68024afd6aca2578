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


SWEEP = '''
import pytest

@pytest.fixture(params=["numpy", "jax"])
def backend(request):
    return request.param

@pytest.mark.jax_subset("variant")
@pytest.mark.parametrize("variant,case", [("a", 1), ("a", 2), ("b", 1), ("b", 2)])
def test_per_variant(backend, variant, case):
    pass

@pytest.mark.jax_subset()
@pytest.mark.parametrize("variant", ["a", "b"])
def test_one_in_all(backend, variant):
    pass

@pytest.mark.parametrize("variant", ["a", "b"])
def test_unmarked(backend, variant):
    pass
'''


def test_jax_subset_keeps_the_first_case_per_key_on_jax_only(pytester):
    pytester.makeconftest("from tests.conftest import pytest_collection_modifyitems  # noqa: F401\n"
                          "def pytest_configure(config):\n"
                          "    config.addinivalue_line('markers', 'jax_subset: x')\n")
    pytester.makepyfile(test_sweep=SWEEP)
    rec = pytester.inline_run("-p", "no:cacheprovider", "-q", "--no-header")
    ran = sorted(r.nodeid.split("::")[-1] for r in rec.getreports("pytest_runtest_logreport")
                 if r.when == "call")
    assert ran == sorted([
        *(f"test_per_variant[numpy-{v}-{c}]" for v in "ab" for c in (1, 2)),
        "test_per_variant[jax-a-1]", "test_per_variant[jax-b-1]",
        "test_one_in_all[numpy-a]", "test_one_in_all[numpy-b]", "test_one_in_all[jax-a]",
        *(f"test_unmarked[{b}-{v}]" for b in ("numpy", "jax") for v in "ab")])
    assert len(rec.getcalls("pytest_deselected")[0].items) == 3
