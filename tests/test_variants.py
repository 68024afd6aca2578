"""Every registered variant, generically: what the catalogue promises for each one.

The tests are parametrized over :func:`attn_ref.registry.variants` when pytest collects
them, so a variant is covered the moment it registers. A variant passes when it has

- a weights function: its output equals ``weights @ v``;
- a VJP (:attr:`attn_ref.registry.Variant.vjp`) that is its gradient;
- a benchmark configuration (``BENCH_CONFIGS`` in ``asv_benches/_common.py``);
- a plain reference (``PLAIN`` in ``tests/plain.py``) that its output and weights equal;
- an output with the namespace, dtype, shape and device of ``q``, on every backend, and
  under ``jax.jit`` (``tests.helpers.call``) unless ``tests.helpers.NOT_TRACEABLE`` says why not.

A failure says which of these is missing. The last test proves it, with a variant
that has none of them.
"""

import inspect

import array_api_compat
import numpy as np
import pytest

from asv_benches import _common as bench
from attn_ref import grad, registry
from attn_ref.registry import Variant
from attn_ref.softmax import softmax_attention
from conformance.backends import load
from tests import plain
from tests.helpers import EPS, NOT_TRACEABLE, Reports, assert_close, call, host, randn

BATCH, N, D, DV = (2, 3), 12, 4, 3
SEED = 3


def pytest_generate_tests(metafunc):
    # At collection, not at import: a variant registered by then (a plugin's, or the
    # throwaway one below) is covered too.
    if "name" in metafunc.fixturenames:
        metafunc.parametrize("name", [v.name for v in registry.variants()])


def _inputs(backend, variant, dtype="float64"):
    """Seeded q, k, v of shape (2, 3, 12, d) and the registry's extra arguments."""
    (q, qh), (k, kh), (v, vh) = (randn(backend, BATCH + (N, c), dtype, seed=s)
                                 for s, c in ((1, D), (2, D), (3, DV)))
    xp = backend.xp
    extra = variant.extra(SEED, N, N, D, DV, dtype=getattr(xp, dtype), device=backend.device, xp=xp,
                          batch=BATCH)
    return (q, k, v), (qh, kh, vh), extra


def _options(variant):
    # Causal where the variant supports it: the mask is where the forms differ most.
    return {"causal": True} if variant.causal else {}


def _taken_by(fn, kwargs):
    """The arguments ``fn`` takes: a weights function ignores tile sizes, say."""
    names = inspect.signature(fn).parameters
    return {n: a for n, a in kwargs.items() if n in names}


def _on_host(extra):
    return {n: host(a) if array_api_compat.is_array_api_obj(a) else a for n, a in extra.items()}


def _like_q(out, q, shape, what):
    """``out`` is an array of q's library, dtype and device, of ``shape``."""
    assert array_api_compat.array_namespace(out) is array_api_compat.array_namespace(q), (
        f"{what} is a {type(out)}, q a {type(q)}")
    assert out.dtype == q.dtype, f"{what} has dtype {out.dtype}, q {q.dtype}"
    assert tuple(out.shape) == shape, f"{what} has shape {tuple(out.shape)}, expected {shape}"
    assert array_api_compat.device(out) == array_api_compat.device(q), (
        f"{what} is on {array_api_compat.device(out)}, q on {array_api_compat.device(q)}")


# ---------------------------------------------------------------- the catalogue entry


def test_has_a_weights_function(name):
    assert registry.get(name).weights is not None, (
        f"variant {name!r} registers no weights function: set Variant.weights to the "
        f"function giving the (..., Nq, Nk) attention matrix it implies")


def test_has_a_vjp(name):
    variant = registry.get(name)
    assert variant.vjp is not None, (
        f"variant {name!r} registers no VJP: set Variant.vjp to its exact gradient, "
        f"'attn_ref.grad.<family>:<function>'")
    assert callable(variant.vjp), f"variant {name!r}: Variant.vjp is {variant.vjp!r}, not a function"
    # The VJP mirrors the forward: the function of the same name in attn_ref.grad.
    assert (variant.vjp.__module__.startswith("attn_ref.grad")
            and variant.vjp.__name__ == variant.fn.__name__), (
        f"variant {name!r}: VJP {variant.vjp.__module__}.{variant.vjp.__name__} does not mirror "
        f"the forward {variant.fn.__module__}.{variant.fn.__name__}")
    assert grad.VJPS[name] is variant.vjp


def test_has_a_benchmark_configuration(name):
    assert name in bench.BENCH_CONFIGS, (
        f"variant {name!r} has no benchmark configuration: add its paper's parameters to "
        f"BENCH_CONFIGS in asv_benches/_common.py")


def test_has_a_plain_reference(name):
    assert name in plain.PLAIN, (
        f"variant {name!r} has no plain reference: add PLAIN[{name!r}] to tests/plain.py, a "
        f"loop-and-formula NumPy form written from the paper")


# ---------------------------------------------------------------- what it computes


def test_output_is_the_plain_reference_and_weights_at_v(backend, name):
    variant = registry.get(name)
    (q, k, v), (qh, kh, vh), extra = _inputs(backend, variant)
    opts = _options(variant)
    # On JAX, under jax.jit: a variant that does not trace fails here, saying so.
    out = call(backend, variant.fn, q, k, v, **extra, **opts)
    _like_q(out, q, BATCH + (N, DV), f"the output of {name!r}")
    assert name in plain.PLAIN, f"variant {name!r} has no plain reference (PLAIN in tests/plain.py)"
    want, want_w = plain.PLAIN[name](qh, kh, vh, bool(opts), **_on_host(extra))
    assert_close(out, want, backend, rtol=1e-11, atol=1e-11)
    assert variant.weights is not None, f"variant {name!r} registers no weights function"
    w = call(backend, variant.weights, q, k, **_taken_by(variant.weights, {**extra, **opts}))
    _like_q(w, q, BATCH + (N, N), f"the weights of {name!r}")
    assert_close(w, want_w, backend, rtol=1e-11, atol=1e-11)
    # The promise the weights function makes: the output is weights @ v.
    np.testing.assert_allclose(host(w) @ vh, host(out), rtol=1e-12, atol=1e-12,
                               err_msg=f"{name}: output != weights @ v")


def test_float32_in_float32_out(backend, name):
    variant = registry.get(name)
    (q, k, v), (qh, kh, vh), extra = _inputs(backend, variant, "float32")
    opts = _options(variant)
    out = call(backend, variant.fn, q, k, v, **extra, **opts)
    _like_q(out, q, BATCH + (N, DV), f"the float32 output of {name!r}")
    # Close to the plain reference on the same (float32-rounded) inputs: within 2^10
    # float32 epsilons of the output's scale, room for rounding but not for a mistake.
    got = host(out)
    assert name in plain.PLAIN, f"variant {name!r} has no plain reference (PLAIN in tests/plain.py)"
    want = plain.PLAIN[name](qh, kh, vh, bool(opts), **_on_host(extra))[0]
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=0, atol=2**10 * EPS["float32"] * np.abs(want).max())


def test_vjp_is_the_gradient(name):
    # Directional central differences of the forward on NumPy float64; each family's
    # tests check its VJPs on every backend, against finite differences and autodiff.
    variant = registry.get(name)
    assert variant.vjp is not None, f"variant {name!r} registers no VJP (Variant.vjp)"
    backend = load("numpy")
    (q, k, v), _, extra = _inputs(backend, variant)
    opts = _options(variant)
    do = randn(backend, BATCH + (N, DV), seed=4)[0]
    g = variant.vjp(q, k, v, do, **extra, **opts)
    rng = np.random.default_rng(5)
    h = 1e-6
    for i, n in enumerate("qkv"):
        e = rng.standard_normal((q, k, v)[i].shape)
        step = [host(x) for x in (q, k, v)]
        step[i] = step[i] + h * e
        plus = host(variant.fn(*step, **extra, **opts))
        step[i] = step[i] - 2 * h * e
        minus = host(variant.fn(*step, **extra, **opts))
        fd = np.sum(host(do) * (plus - minus)) / (2 * h)
        assert n in g, f"variant {name!r}: the VJP returned no gradient for {n} (got {sorted(g)})"
        np.testing.assert_allclose(np.sum(host(g[n]) * e), fd, rtol=1e-6, atol=1e-8,
                                   err_msg=f"{name}: d{n} is not the gradient")


def test_a_vjp_path_that_does_not_import_is_named():
    name = "bad_vjp_path_variant"
    registry.register(Variant(name=name, fn=softmax_attention, family="softmax", exact=True,
                              causal=False, time="O(N^2 d)", memory="O(N^2)",
                              vjp="attn_ref.grad.softmax:no_such_function"))
    try:
        with pytest.raises(ImportError, match=f"variant '{name}': cannot import its vjp "
                                              f"'attn_ref.grad.softmax:no_such_function'"):
            registry.get("softmax")
    finally:
        registry.unregister(name)
    assert registry.get("softmax").vjp is grad.softmax_attention


# ---------------------------------------------------------------- a variant that has nothing


def _throwaway(q, k, v, /):
    xp = array_api_compat.array_namespace(q)
    # A host round trip: jax.jit cannot trace it.
    if float(xp.max(xp.abs(q))) > 1e300:
        raise ValueError("q is too large")
    return softmax_attention(q, k, v)


def test_a_variant_without_its_parts_fails_here_saying_what_is_missing(monkeypatch):
    # The run below must stay in this process (no -n, no --junitxml of the outer run's).
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    name = "throwaway_test_variant"
    registry.register(Variant(name=name, fn=_throwaway, family="softmax", exact=True, causal=False,
                              time="O(N^2 d)", memory="O(N^2)"))
    seen = Reports()
    try:
        assert name in [v.name for v in registry.variants()]
        # This module run again, in this process (the registry is this process's), by
        # pytest.main rather than pytester, which would drop the modules the run imports
        # (torch, jax) from sys.modules afterwards.
        pytest.main([__file__, "-p", "no:cacheprovider", "-q", "--no-header", "-k", name], plugins=[seen])
    finally:
        registry.unregister(name)
    assert name not in [v.name for v in registry.variants()]
    failed = {r.nodeid.split("::")[-1]: r.longreprtext for r in seen.reports if r.failed}
    ran = {r.nodeid.split("::")[-1] for r in seen.reports if r.when == "call"}
    want = {
        f"test_has_a_weights_function[{name}]": "registers no weights function",
        f"test_has_a_vjp[{name}]": "registers no VJP",
        f"test_vjp_is_the_gradient[{name}]": "registers no VJP",
        f"test_has_a_benchmark_configuration[{name}]": "has no benchmark configuration",
        f"test_has_a_plain_reference[{name}]": "has no plain reference",
    }
    for test in ran:
        if test.startswith(("test_output_is_the_plain_reference_and_weights_at_v[",
                            "test_float32_in_float32_out[")):
            want[test] = "has no plain reference"
        if test.endswith(f"[{name}-jax]"):  # both tests on JAX: jit comes first
            want[test] = "cannot be traced under jax.jit"
    assert any(t.startswith("test_output_is_the_plain_reference") for t in want), sorted(ran)
    for test, words in want.items():
        assert test in failed, f"{test} did not fail; failed: {sorted(failed)}"
        assert words in failed[test], f"{test}: {words!r} not in\n{failed[test]}"


def test_a_function_runs_eagerly_on_jax_only_when_not_traceable_lists_it():
    from conformance.backends import BackendUnavailable

    try:
        backend = load("jax")
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    q, qh = randn(backend, (3, 4), seed=1)
    with pytest.raises(AssertionError, match="_throwaway cannot be traced under jax.jit"):
        call(backend, _throwaway, q, q, q)
    NOT_TRACEABLE[_throwaway] = "inspects q on the host (a test of the mechanism)"
    try:
        assert_close(call(backend, _throwaway, q, q, q), plain.naive_attention(qh, qh, qh)[0], backend)
    finally:
        del NOT_TRACEABLE[_throwaway]
