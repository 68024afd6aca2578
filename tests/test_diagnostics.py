"""attn_ref.diagnostics: spectra, effective rank and Eckart-Young errors, on every backend."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from attn_ref import attention_weights
from attn_ref.diagnostics import (
    VariantError,
    approximation_error,
    best_rank_k_approximation,
    best_rank_k_error,
    compare_variants,
    effective_rank,
    format_comparison,
    normalized_cumulative_spectrum,
    numerical_rank,
    singular_values,
)
from attn_ref.registry import variants
from conformance.backends import from_numpy
from tests.helpers import assert_close, call, host, property_test, randn

EPS64 = 2.0**-52


def _m(backend, a, dtype="float64"):
    return from_numpy(np.asarray(a, dtype=np.float64), backend, dtype)


# ---------------------------------------------------------------- known matrices


def test_singular_values_of_known_matrices(backend):
    # Diagonal with signs and an unsorted order: |entries|, sorted descending.
    d = _m(backend, np.diag([1.0, -5.0, 3.0]))
    assert_close(call(backend, singular_values, d), np.array([5.0, 3.0, 1.0]), backend)
    # Rank one: u v^T has the single singular value |u| |v|.
    rng = np.random.default_rng(0)
    u, v = rng.standard_normal(6), rng.standard_normal(4)
    s = host(call(backend, singular_values, _m(backend, np.outer(u, v))))
    assert s.shape == (4,)
    np.testing.assert_allclose(s[0], np.linalg.norm(u) * np.linalg.norm(v), rtol=1e-14)
    assert np.all(np.abs(s[1:]) < 1e-14 * s[0])
    # Identity and an orthogonal matrix: all ones.
    q, _ = np.linalg.qr(rng.standard_normal((5, 5)))
    for a in (np.eye(5), q):
        assert_close(call(backend, singular_values, _m(backend, a)), np.ones(5), backend)


@pytest.mark.parametrize("d", [1, 3, 6])
def test_qk_of_rank_d_has_exactly_d_nonzero_singular_values(backend, d):
    q, qh = randn(backend, (2, 16, d), seed=1)
    k, kh = randn(backend, (2, 16, d), seed=2)
    logits = q @ backend.xp.matrix_transpose(k)
    s = host(call(backend, singular_values, logits))
    want = np.linalg.svd(qh @ np.swapaxes(kh, -1, -2), compute_uv=False)
    np.testing.assert_allclose(s, want, rtol=1e-12, atol=1e-12 * want[..., :1].max())
    assert np.all(s[:, :d] > 1e-3) and np.all(s[:, d:] < 1e-12 * s[:, :1])
    np.testing.assert_array_equal(host(call(backend, numerical_rank, logits)), [d, d])


def test_attention_matrix_spectrum_matches_numpy(backend):
    q, qh = randn(backend, (3, 12, 4), seed=3)
    k, kh = randn(backend, (3, 12, 4), seed=4)
    p = call(backend, attention_weights, q, k)
    want = np.linalg.svd(host(p), compute_uv=False)
    assert_close(call(backend, singular_values, p), want, backend)
    # A row-stochastic matrix has sigma_max >= 1 (the all-ones vector is fixed).
    assert np.all(want[:, 0] >= 1 - 1e-12)


# ---------------------------------------------------------------- spectrum summaries


def test_effective_rank_of_known_spectra(backend):
    cases = [
        (np.eye(4), 4.0),
        (np.diag([2.0, 2.0, 2.0, 0.0, 0.0]), 3.0),  # k equal singular values: exactly k
        (np.outer(np.arange(1.0, 6.0), np.ones(3)), 1.0),  # rank one
        (np.zeros((3, 4)), 0.0),  # defined as 0
        (np.diag([3.0, 1.0]), np.exp(-(0.75 * np.log(0.75) + 0.25 * np.log(0.25)))),
    ]
    for a, want in cases:
        got = float(host(call(backend, effective_rank, _m(backend, a))))
        assert abs(got - want) < 1e-12, (a, got, want)


def test_effective_rank_between_one_and_rank(backend):
    x, xh = randn(backend, (4, 9, 5), seed=5)
    erank = host(call(backend, effective_rank, x))
    assert erank.shape == (4,)
    assert np.all(erank >= 1.0) and np.all(erank <= 5.0 + 1e-12)


def test_normalized_cumulative_spectrum(backend):
    x, xh = randn(backend, (2, 8, 6), seed=6)
    s = np.linalg.svd(xh, compute_uv=False)
    c1 = host(call(backend, normalized_cumulative_spectrum, x))
    np.testing.assert_allclose(c1, np.cumsum(s, -1) / s.sum(-1, keepdims=True), rtol=1e-13)
    c2 = call(backend, normalized_cumulative_spectrum, x, power=2)
    assert np.all(np.diff(host(c2), axis=-1) >= 0) and np.allclose(host(c2)[:, -1], 1.0)
    # 1 - c2[k-1] is the squared relative Frobenius error of the best rank-k matrix.
    for k in (1, 3, 5):
        rel = host(call(backend, best_rank_k_error, x, k=k, relative=True))
        np.testing.assert_allclose(1 - host(c2)[:, k - 1], rel**2, rtol=1e-10, atol=1e-14)
    z = _m(backend, np.zeros((3, 3)))
    assert np.all(host(call(backend, normalized_cumulative_spectrum, z)) == 0.0)


# ---------------------------------------------------------------- Eckart-Young


@pytest.mark.parametrize("norm", ["fro", "spectral"])
def test_eckart_young_equals_truncated_svd_error(backend, norm):
    x, xh = randn(backend, (2, 10, 7), seed=7)
    s = np.linalg.svd(xh, compute_uv=False)
    for k in (0, 1, 3, 7, 9):
        best = host(call(backend, best_rank_k_error, x, k=k, norm=norm))
        xk = call(backend, best_rank_k_approximation, x, k=k)
        assert np.all(host(call(backend, numerical_rank, xk)) == min(k, 7)) if k else True
        direct = host(call(backend, approximation_error, x, xk, norm=norm))
        np.testing.assert_allclose(best, direct, rtol=1e-10, atol=1e-12)
        tail = s[:, k:]
        want = (tail[:, 0] if tail.shape[1] else np.zeros(2)) if norm == "spectral" else np.sqrt(
            (tail**2).sum(-1))
        np.testing.assert_allclose(best, want, rtol=1e-12, atol=1e-13)
    # The relative form divides by the norm of x.
    rel = host(call(backend, best_rank_k_error, x, k=0, norm=norm, relative=True))
    np.testing.assert_allclose(rel, 1.0, rtol=1e-13)


def test_truncated_svd_of_full_rank_is_identity_map(backend):
    x, xh = randn(backend, (3, 5, 4), seed=8)
    assert_close(call(backend, best_rank_k_approximation, x, k=4), xh, backend, rtol=1e-12, atol=1e-12)
    assert np.all(host(call(backend, best_rank_k_approximation, x, k=0)) == 0.0)


def test_property_no_rank_k_matrix_beats_the_bound(backend):
    @property_test(backend, examples=12)
    @given(m=st.integers(2, 8), n=st.integers(2, 8), k=st.integers(0, 8), seed=st.integers(0, 2**31 - 1))
    def check(m, n, k, seed):
        rng = np.random.default_rng(seed)
        p = rng.standard_normal((m, n))
        x = rng.standard_normal((m, k)) @ rng.standard_normal((k, n))  # any rank-<=k matrix
        pb, xb = _m(backend, p), _m(backend, x)
        for norm in ("fro", "spectral"):
            bound = float(host(best_rank_k_error(pb, k, norm=norm)))
            got = float(host(approximation_error(pb, xb, norm=norm)))
            assert got >= bound * (1 - 1e-10) - 1e-12

    check()


def test_approximation_error_norms(backend):
    a = _m(backend, np.diag([3.0, 4.0]))
    z = _m(backend, np.zeros((2, 2)))
    assert float(host(approximation_error(a, z, norm="fro"))) == pytest.approx(5.0, rel=1e-15)
    assert float(host(approximation_error(a, z, norm="spectral"))) == pytest.approx(4.0, rel=1e-14)
    assert float(host(approximation_error(a, a, relative=True))) == 0.0
    assert float(host(approximation_error(z, z, relative=True))) == 0.0  # 0/0 := 0
    assert float(host(approximation_error(a, z, relative=True))) == pytest.approx(1.0, rel=1e-15)


def test_float32_and_batch_shapes(backend):
    x, _ = randn(backend, (2, 3, 6, 5), "float32", seed=9)
    for fn, shape in ((singular_values, (2, 3, 5)), (effective_rank, (2, 3)), (numerical_rank, (2, 3))):
        assert tuple(call(backend, fn, x).shape) == shape
    assert str(call(backend, effective_rank, x).dtype).endswith("float32")
    assert tuple(call(backend, best_rank_k_error, x, k=2).shape) == (2, 3)


def test_empty_matrices(backend):
    xp = backend.xp
    e = xp.zeros((2, 0, 3), dtype=xp.float64, device=backend.device)
    assert tuple(singular_values(e).shape) == (2, 0)
    assert np.all(host(effective_rank(e)) == 0.0)
    assert np.all(host(numerical_rank(e)) == 0)
    assert np.all(host(best_rank_k_error(e, 1, norm="spectral")) == 0.0)
    assert tuple(normalized_cumulative_spectrum(e).shape) == (2, 0)


# ---------------------------------------------------------------- variants against the bound


def test_compare_variants_known_rows(backend):
    q, _ = randn(backend, (2, 12, 4), seed=10)
    k, _ = randn(backend, (2, 12, 4), seed=11)
    rows = compare_variants(q, k, names=["softmax", "local", "bigbird"],
                            options={"local": {"window": 11}, "bigbird": {"random_blocks": 0}})
    by = {r.name: r for r in rows}
    assert [r.name for r in rows] == ["softmax", "local", "bigbird"]
    assert all(isinstance(r, VariantError) for r in rows)
    # Exact softmax and a window covering everything: no error, full rank.
    for name in ("softmax", "local"):
        assert by[name].error < 1e-13 and by[name].rank == 12 and by[name].best_error < 1e-12
    p = host(attention_weights(q, k))
    w = host(_weights(backend, "bigbird", q, k, random_blocks=0))
    want = np.linalg.norm(p - w, axis=(-2, -1))
    assert by["bigbird"].error == pytest.approx(want.mean(), rel=1e-12)
    assert by["bigbird"].relative_error == pytest.approx((want / np.linalg.norm(p, axis=(-2, -1))).mean(),
                                                         rel=1e-12)
    # A fixed budget: the Eckart-Young column is the best rank-3 error of P.
    fixed = compare_variants(q, k, names=["local"], rank=3, norm="spectral")[0]
    s = np.linalg.svd(p, compute_uv=False)
    assert fixed.budget == 3 and fixed.best_error == pytest.approx(s[:, 3].mean(), rel=1e-12)
    assert "| local | sparse |" in format_comparison([fixed])


def _weights(backend, name, q, k, **over):
    from attn_ref.registry import get

    v = get(name)
    extra = v.extra(0, q.shape[-2], k.shape[-2], q.shape[-1], q.shape[-1], dtype=q.dtype,
                    device=backend.device, xp=backend.xp)
    extra.update(over)
    return v.weights(q, k, **extra)


def test_compare_variants_covers_the_registry():
    # Every registered variant, on array_api_strict (which proves the path is pure); the
    # other backends run compare_variants in test_compare_variants_known_rows.
    from conformance.backends import load

    strict = load("array_api_strict")
    q, _ = randn(strict, (1, 16, 4), seed=12)
    k, _ = randn(strict, (1, 16, 4), seed=13)
    rows = compare_variants(q, k)
    want = [v.name for v in variants() if v.weights is not None]
    assert [r.name for r in rows] == want
    for r in rows:
        assert 0 <= r.rank <= 16 and r.budget == r.rank and np.isfinite(r.error)
        # Eckart-Young: no matrix of rank r, the variant's included, beats the bound.
        assert r.error >= r.best_error - 1e-9, r
    causal = compare_variants(q, k, causal=True)
    assert [r.name for r in causal] == [v.name for v in variants() if v.weights is not None and v.causal]
    assert {r.name: r for r in causal}["softmax"].error < 1e-13


def test_compare_variants_refuses_what_it_cannot_compare(backend):
    q, _ = randn(backend, (10, 4), seed=1)
    k, _ = randn(backend, (12, 4), seed=2)
    with pytest.raises(ValueError, match="names: cannot compare variant 'local': it is self-attention"):
        compare_variants(q, k, names=["local"])
    causal_less = [v.name for v in variants() if v.weights is not None and not v.causal]
    if causal_less:
        with pytest.raises(ValueError, match="does not support causal masking"):
            compare_variants(q, q, names=causal_less[:1], causal=True)
    with pytest.raises(ValueError, match="options names variants that are not compared"):
        compare_variants(q, q, names=["softmax"], options={"local": {"window": 2}})
    with pytest.raises(KeyError, match="unknown variant"):
        compare_variants(q, q, names=["no_such_variant"])
    with pytest.raises(ValueError, match="rank must be a non-negative integer"):
        compare_variants(q, q, names=["softmax"], rank=-1)


# ---------------------------------------------------------------- bad input


class _NoLinalg:
    """A namespace that is the backend's in every respect but has no linalg extension."""

    def __init__(self, xp):
        self._xp = xp

    def __getattr__(self, name):
        if name == "linalg":
            raise AttributeError(name)
        return getattr(self._xp, name)


def test_bad_input(backend):
    xp = backend.xp
    x, _ = randn(backend, (4, 3))
    v1, _ = randn(backend, (4,))
    ints = xp.ones((3, 3), dtype=xp.int32, device=backend.device)
    cases = [
        (singular_values, (v1,), {}, ValueError, r"p must have shape \(\.\.\., M, N\).*got shape \(4,\)"),
        (singular_values, (ints,), {}, TypeError, "real floating"),
        (effective_rank, (x,), {"xp": _NoLinalg(xp)}, TypeError, "no linalg extension"),
        (best_rank_k_error, (x, -1), {}, ValueError, "k must be a non-negative integer"),
        (best_rank_k_error, (x, 1), {"norm": "nuclear"}, ValueError, "norm must be one of"),
        (best_rank_k_approximation, (x, 1.5), {}, TypeError, "k must be"),
        (normalized_cumulative_spectrum, (x,), {"power": 3}, ValueError, "power must be 1 or 2"),
        (normalized_cumulative_spectrum, (x,), {"power": True}, TypeError, "power must be 1 or 2"),
        (normalized_cumulative_spectrum, (x,), {"power": 2.0}, TypeError, "power must be 1 or 2"),
        (approximation_error, (x, xp.matrix_transpose(x)), {}, ValueError,
         r"p_approx must have the shape of p, \(4, 3\).*got \(3, 4\)"),
        (approximation_error, (x, xp.astype(x, xp.float32)), {}, TypeError, "share one dtype"),
        (approximation_error, (x, np.zeros((4, 3)) if backend.name != "numpy" else [[0.0] * 3] * 4), {},
         TypeError, "p_approx"),
    ]
    for fn, args, kwargs, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            fn(*args, **kwargs)
