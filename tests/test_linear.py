"""attn_ref.linear: both orders, the chunked and recurrent causal forms, on every backend."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from attn_ref import (
    linear_attention,
    linear_attention_state,
    linear_attention_step,
    linear_attention_weights,
)
from attn_ref.linear import FEATURE_MAPS
from conformance.backends import from_numpy
from tests.helpers import assert_close, call, host, property_test, randn
from tests.plain import np_linear, visible

CAUSAL = [False, "top-left", "bottom-right"]
SHAPES = [
    ((2, 3), 12, 12, 8, 8),  # batch, heads, self-attention
    ((3,), 9, 14, 4, 6),  # cross-attention, Nq < Nk, dv != d
    ((), 14, 5, 5, 3),  # Nq > Nk, single head
]

def _qkv(backend, batch, nq, nk, d, dv, dtype="float64", seed=0):
    q, qh = randn(backend, batch + (nq, d), dtype, seed=seed + 1)
    k, kh = randn(backend, batch + (nk, d), dtype, seed=seed + 2)
    v, vh = randn(backend, batch + (nk, dv), dtype, seed=seed + 3)
    return (q, k, v), (qh, kh, vh)


# ---------------------------------------------------------------- the function


# (shapes, causal, dtype): every shape with every causal mode, one of the three in float32;
# the quadratic order is checked against the linear one below.
CASES = [(s, c, "float32" if i == j else "float64")
         for i, s in enumerate(SHAPES) for j, c in enumerate(CAUSAL)]


@pytest.mark.parametrize("shapes,causal,dtype", CASES)
def test_matches_plain_numpy(backend, shapes, causal, dtype):
    (q, k, v), (qh, kh, vh) = _qkv(backend, *shapes, dtype=dtype)
    out = call(backend, linear_attention, q, k, v, causal=causal, chunk_size=5)
    want, _ = np_linear(qh, kh, vh, causal=causal)
    assert_close(out, want, backend, dtype=dtype)


@pytest.mark.parametrize("feature_map,causal", [
    ("elu+1", False), ("relu", "top-left"), ("identity", "bottom-right"), ("identity", False)
])
def test_reordering_identity(backend, feature_map, causal):
    # "sum then interact" == "interact then sum", for every map, unnormalised too
    # (the identity map's normalised form is not bounded; see the denominator tests).
    (q, k, v), (qh, kh, vh) = _qkv(backend, (2,), 11, 13, 6, 4, seed=10)
    normalize = feature_map != "identity"
    kw = dict(feature_map=feature_map, causal=causal, normalize=normalize, scale=0.7)
    lin = call(backend, linear_attention, q, k, v, order="linear", chunk_size=4, **kw)
    quad = call(backend, linear_attention, q, k, v, order="quadratic", **kw)
    assert_close(lin, host(quad), backend)
    assert_close(lin, np_linear(qh, kh, vh, **kw)[0], backend)


def test_identity_unnormalised_is_qkt_v(backend):
    (q, k, v), (qh, kh, vh) = _qkv(backend, (2, 2), 10, 12, 5, 3, seed=20)
    for order in ("linear", "quadratic"):
        out = call(backend, linear_attention, q, k, v, feature_map="identity", normalize=False, order=order)
        assert_close(out, (qh @ np.swapaxes(kh, -1, -2)) @ vh, backend)
    causal = call(backend, linear_attention, q, k, v, feature_map="identity", normalize=False,
                  causal=True, chunk_size=3)
    assert_close(causal, (np.tril(qh @ np.swapaxes(kh, -1, -2))) @ vh, backend)


def test_callable_feature_map_and_broadcast(backend):
    xp = backend.xp

    def phi(x):  # d' = 2 d: [relu(x), relu(-x)] + 0.1, positive
        zero = xp.zeros_like(x)
        return xp.concat([xp.maximum(x, zero), xp.maximum(-x, zero)], axis=-1) + 0.1

    def phi_np(x):
        return np.concatenate([np.maximum(x, 0), np.maximum(-x, 0)], axis=-1) + 0.1

    q, qh = randn(backend, (2, 3, 9, 4), seed=1)
    k, kh = randn(backend, (1, 3, 9, 4), seed=2)  # batch broadcasts
    v, vh = randn(backend, (2, 1, 9, 5), seed=3)  # heads broadcast
    for causal in (False, True):
        out = call(backend, linear_attention, q, k, v, feature_map=phi, causal=causal, chunk_size=4)
        assert_close(out, np_linear(qh, kh, vh, feature_map=phi_np, causal=causal)[0], backend)


@pytest.mark.parametrize("causal,chunks", [("top-left", (1, 5)), ("bottom-right", (3, 64))])
def test_chunked_equals_quadratic_any_chunk(backend, causal, chunks):
    # N = 12 (top-left keeps the first 12 of 15 keys; bottom-right pads to 15) against
    # chunks 1..64: exact multiples, ragged tails, C > N.
    (q, k, v), _ = _qkv(backend, (2,), 12, 15, 4, 3, seed=30)
    b = host(call(backend, linear_attention, q, k, v, causal=causal, order="quadratic"))
    for chunk_size in chunks:
        a = call(backend, linear_attention, q, k, v, causal=causal, chunk_size=chunk_size)
        assert_close(a, b, backend)


# On JAX Nq < Nk in each alignment: XLA unrolls every block (5 compilations a case, 2 s
# of CPU); Nq > Nk runs there in the next test, and all shapes on the other backends.
@pytest.mark.jax_subset("causal")
@pytest.mark.parametrize("causal", [False, "top-left", "bottom-right"])
@pytest.mark.parametrize("nq,nk", [(12, 15), (15, 12), (13, 13)])
def test_blocks_equal_one_pass(backend, causal, nq, nk):
    # block_size only changes how many rows the linear order takes at a time:
    # 1 (every row its own block), 3 (rounded up to one chunk of 4 when causal), 8,
    # a ragged last block, and one block for all.
    (q, k, v), _ = _qkv(backend, (2,), nq, nk, 4, 3, seed=31)
    want = host(call(backend, linear_attention, q, k, v, causal=causal, order="quadratic"))
    for block_size in (1, 3, 8, 100):
        got = call(backend, linear_attention, q, k, v, causal=causal, chunk_size=4, block_size=block_size)
        assert_close(got, want, backend)


def test_blocks_with_broadcast_batch_and_queries_before_any_key(backend):
    # Bottom-right with Nq > Nk: the first block's queries see no key (zeros), later
    # blocks see keys whose batch (3,) is larger than the queries' (1,).
    q, qh = randn(backend, (1, 12, 4), seed=33)
    k, kh = randn(backend, (3, 5, 4), seed=34)
    v, vh = randn(backend, (3, 5, 2), seed=35)
    for causal in (False, "bottom-right", "top-left"):
        got = call(backend, linear_attention, q, k, v, causal=causal, chunk_size=2, block_size=4)
        assert tuple(got.shape) == (3, 12, 2)
        assert_close(got, np_linear(qh, kh, vh, causal=causal)[0], backend)


def test_feature_maps_see_one_block_at_a_time():
    # The linear order never applies phi to more than one block of rows, so phi(Q),
    # phi(K) and the chunk states never exist for the whole sequence.
    import array_api_compat.numpy as xp

    rng = np.random.default_rng(32)
    q, k, v = (rng.standard_normal((2, 50, 4)) for _ in range(3))
    for causal, limit in ((False, 10), ("top-left", 12), ("bottom-right", 12)):
        rows = []

        def phi(x, rows=rows):
            rows.append(x.shape[-2])
            return xp.exp(-x * x)

        out = linear_attention(q, k[:, :40], v[:, :40], feature_map=phi, causal=causal, chunk_size=4,
                               block_size=10)  # causal blocks round up to 12 = 3 chunks
        assert 0 < max(rows) <= limit, (causal, rows)
        want = linear_attention(q, k[:, :40], v[:, :40], feature_map=phi, causal=causal, order="quadratic")
        np.testing.assert_allclose(out, want, rtol=1e-13, atol=1e-13)


def test_recurrent_equals_chunked_and_quadratic(backend):
    (q, k, v), (qh, kh, vh) = _qkv(backend, (2, 3), 7, 7, 4, 3, seed=40)
    state = call(backend, linear_attention_state, from_numpy(kh[..., :0, :], backend),
                 from_numpy(vh[..., :0, :], backend))
    assert tuple(state[0].shape) == (2, 3, 4, 3) and tuple(state[1].shape) == (2, 3, 4)
    assert np.all(host(state[0]) == 0) and np.all(host(state[1]) == 0)
    outs = []
    for t in range(7):  # host-side slices: no per-index compilation on JAX
        o, state = call(backend, linear_attention_step, state,
                        *(from_numpy(a[..., t, :], backend) for a in (qh, kh, vh)))
        outs.append(host(o))
    rec = np.stack(outs, axis=-2)
    chunked = call(backend, linear_attention, q, k, v, causal=True, chunk_size=3)
    quad = call(backend, linear_attention, q, k, v, causal=True, order="quadratic")
    assert_close(chunked, rec, backend)
    assert_close(quad, rec, backend)
    assert_close(chunked, np_linear(qh, kh, vh, causal=True)[0], backend)
    # The final state summarises every key.
    s, z = call(backend, linear_attention_state, k, v)
    assert_close(state[0], host(s), backend)
    assert_close(state[1], host(z), backend)


def test_prefill_then_decode_is_bottom_right(backend):
    # A state built from a prefix, then steps: the causal "bottom-right" convention
    # of KV-cache decoding, with Nq < Nk.
    (q, k, v), (qh, kh, vh) = _qkv(backend, (2,), 3, 8, 4, 2, seed=50)
    state = call(backend, linear_attention_state, from_numpy(kh[..., :5, :], backend),
                 from_numpy(vh[..., :5, :], backend), feature_map="relu")
    outs = []
    for t in range(3):
        o, state = call(backend, linear_attention_step, state,
                        *(from_numpy(a[..., t, :], backend) for a in (qh, kh[..., 5:, :], vh[..., 5:, :])),
                        feature_map="relu", scale=0.5, normalize=False)
        outs.append(host(o))
    want = np_linear(qh, kh, vh, feature_map="relu", causal="bottom-right", scale=0.5, normalize=False)[0]
    np.testing.assert_allclose(np.stack(outs, axis=-2), want, rtol=1e-13, atol=1e-13)


def test_weights(backend):
    (q, k, v), (qh, kh, vh) = _qkv(backend, (2,), 9, 11, 5, 3, seed=60)
    for fm, causal in (("elu+1", False), ("elu+1", "bottom-right"), ("relu", "top-left")):
        p = call(backend, linear_attention_weights, q, k, feature_map=fm, causal=causal)
        want_o, want_p = np_linear(qh, kh, vh, feature_map=fm, causal=causal)
        assert_close(p, want_p, backend)
        ph = host(p)
        assert np.all(ph >= 0), "positive feature maps give non-negative weights"
        sums = ph.sum(-1)
        has_key = visible(9, 11, causal).any(-1) & (np.abs(want_p).sum(-1) > 0)
        np.testing.assert_allclose(sums[has_key], 1.0, rtol=0, atol=1e-14)
        assert np.all(sums[~has_key] == 0)
        assert np.all(ph[..., ~visible(9, 11, causal)] == 0)
        out = call(backend, linear_attention, q, k, v, feature_map=fm, causal=causal, chunk_size=4)
        assert_close(out, ph @ vh, backend)
    raw = call(backend, linear_attention_weights, q, k, feature_map="identity", normalize=False, scale=2.0)
    assert_close(raw, 2.0 * qh @ np.swapaxes(kh, -1, -2), backend)


@pytest.mark.parametrize("order", ["linear", "quadratic"])
@pytest.mark.parametrize("causal", ["top-left", "bottom-right"])
def test_causal_future_does_not_leak(backend, order, causal):
    # Blocks of 8 rows (2 chunks): rows 5 and 7 lie in the first block, 11 in the second.
    (q, k, v), (qh, kh, vh) = _qkv(backend, (2,), 13, 13, 4, 3, seed=70)
    opts = {"causal": causal, "order": order, "chunk_size": 4, "block_size": 8}
    base = host(call(backend, linear_attention, q, k, v, **opts))
    rng = np.random.default_rng(71)
    for i in (0, 5, 7, 11):  # first row, mid-chunk, chunk end, last chunk
        k2, v2 = kh.copy(), vh.copy()
        k2[:, i + 1:] += rng.standard_normal(k2[:, i + 1:].shape) * 10
        v2[:, i + 1:] += rng.standard_normal(v2[:, i + 1:].shape) * 10
        out = host(call(backend, linear_attention, q, from_numpy(k2, backend), from_numpy(v2, backend),
                        **opts))
        if backend.name in ("numpy", "array_api_strict"):
            assert np.array_equal(out[:, : i + 1], base[:, : i + 1]), f"future leaked into row <= {i}"
        else:  # other libraries may reassociate; the past still must not move
            np.testing.assert_allclose(out[:, : i + 1], base[:, : i + 1], rtol=1e-13, atol=1e-13)
        if i < 12:
            assert not np.allclose(out[:, i + 1:], base[:, i + 1:])


def test_hidden_in_chunk_products_that_overflow_stay_hidden(backend):
    # Row 0's feature against key 1's overflows float32 (1e20 * 1e20), above the diagonal of
    # the first chunk: the chunked form masks such a block by selection (inf * 0 is NaN),
    # while every visible product, the state and the denominators stay finite.
    rng = np.random.default_rng(72)
    qh, kh, vh = (np.abs(rng.standard_normal((5, 24, 4))).astype(np.float32) for _ in range(3))
    qh[:, 0, 0] = kh[:, 1, 0] = 1e20
    q, k, v = (from_numpy(x, backend) for x in (qh, kh, vh))
    kw = {"feature_map": "relu", "causal": "top-left", "chunk_size": 4, "block_size": 8}
    out = host(call(backend, linear_attention, q, k, v, **kw))
    assert np.isfinite(out).all(), "a hidden overflow reached the output"
    quad = host(call(backend, linear_attention, q, k, v, order="quadratic", **kw))
    np.testing.assert_allclose(out, quad, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- the denominator


def test_denominator_relu_zero_features_give_zeros(backend):
    # relu features of a query with no positive entry are all zero: den = 0 -> output 0.
    qh = np.abs(np.random.default_rng(1).standard_normal((2, 6, 4)))
    qh[:, 2] = -qh[:, 2]
    (_, k, v), _ = _qkv(backend, (2,), 6, 6, 4, 3, seed=80)
    q = from_numpy(qh, backend)
    for causal in (False, True):
        for order in ("linear", "quadratic"):
            out = host(call(backend, linear_attention, q, k, v, feature_map="relu", causal=causal,
                            order=order, chunk_size=4))
            assert np.all(np.isfinite(out))
            assert np.all(out[:, 2] == 0)
    w = host(call(backend, linear_attention_weights, q, k, feature_map="relu"))
    assert np.all(w[:, 2] == 0)


def test_denominator_identity_crossing_zero_is_finite(backend):
    # Identity features are signed: den = q . sum_j k_j takes both signs and can be 0.
    kh = np.array([[1.0, 0.0], [0.0, 1.0]])
    vh = np.array([[1.0, 2.0], [3.0, 5.0]])
    qh = np.array([[1.0, 1.0], [1.0, -1.0], [1.0, -1.0 - 1e-9], [-2.0, -1.0]])  # den 2, 0, -1e-9, -3
    q, k, v = (from_numpy(a, backend) for a in (qh, kh, vh))
    for order in ("linear", "quadratic"):
        out = host(call(backend, linear_attention, q, k, v, feature_map="identity", order=order, eps=1e-6))
        assert np.all(np.isfinite(out))
        num = (qh @ kh.T) @ vh
        np.testing.assert_allclose(out[0], num[0] / 2.0, rtol=1e-15)
        np.testing.assert_allclose(out[1], num[1] / 1e-6, rtol=1e-12)  # den 0 -> +eps
        np.testing.assert_allclose(out[2], num[2] / -1e-6, rtol=1e-6)  # |den| < eps -> -eps
        np.testing.assert_allclose(out[3], num[3] / -3.0, rtol=1e-15)  # negative den kept


def test_denominator_eps_threshold(backend):
    # den >= eps is used as is (rows sum to exactly 1); below eps it is floored.
    (q, k, v), (qh, kh, vh) = _qkv(backend, (), 5, 6, 3, 2, seed=90)
    out = host(call(backend, linear_attention, q, k, v, scale=1e-9, eps=1e-6))
    raw = np_linear(qh, kh, vh, normalize=False)[0] * 1e-9
    den = 1e-9 * np_linear(qh, kh, np.ones((6, 1)), normalize=False)[0]
    assert np.all(den < 1e-6)
    np.testing.assert_allclose(out, raw / 1e-6, rtol=1e-12)
    big = host(call(backend, linear_attention, q, k, v, scale=1e-9, eps=1e-12))
    np.testing.assert_allclose(big, np_linear(qh, kh, vh)[0], rtol=1e-12)


def test_empty_sequences(backend):
    xp = backend.xp
    z = lambda *s: xp.zeros(s, dtype=xp.float64, device=backend.device)  # noqa: E731
    (q, k, v), _ = _qkv(backend, (2,), 3, 4, 5, 6)
    for causal, order in ((False, "linear"), ("top-left", "linear"), ("bottom-right", "quadratic")):
        out = call(backend, linear_attention, z(2, 0, 5), k, v, causal=causal, order=order)
        assert tuple(out.shape) == (2, 0, 6)
        out = call(backend, linear_attention, q, z(2, 0, 5), z(2, 0, 6), causal=causal, order=order)
        assert tuple(out.shape) == (2, 3, 6) and np.all(host(out) == 0)
    assert tuple(call(backend, linear_attention_weights, q, z(2, 0, 5)).shape) == (2, 3, 0)


def test_bottom_right_with_more_queries_than_keys_gives_zero_rows(backend):
    (q, k, v), _ = _qkv(backend, (), 7, 3, 4, 2, seed=95)
    for order in ("linear", "quadratic"):
        out = host(call(backend, linear_attention, q, k, v, causal="bottom-right", order=order, chunk_size=2))
        assert np.all(out[:4] == 0) and np.all(out[4:] != 0)


def test_float32_large_inputs_stay_finite(backend):
    # elu+1 never exponentiates a positive argument, so large inputs cannot overflow.
    (q, k, v), (qh, kh, vh) = _qkv(backend, (2,), 16, 16, 8, 4, dtype="float32", seed=96)
    out = call(backend, linear_attention, q * 1e4, k * 1e4, v, causal=True, chunk_size=4)
    want, _ = np_linear(qh * 1e4, kh * 1e4, vh, causal=True)
    assert np.all(np.isfinite(host(out)))
    assert_close(out, want, backend, dtype="float32", rtol=1e-4, atol=1e-4)


def test_inputs_not_modified(backend):
    (q, k, v), (qh, kh, vh) = _qkv(backend, (2,), 9, 9, 4, 3, seed=97)
    call(backend, linear_attention, q, k, v, causal=True, chunk_size=4)
    state = call(backend, linear_attention_state, k, v)
    s0, z0 = host(state[0]), host(state[1])
    q0, k0, v0 = (from_numpy(a[:, 0, :], backend) for a in (qh, kh, vh))
    call(backend, linear_attention_step, state, q0, k0, v0)
    for x, h in ((q, qh), (k, kh), (v, vh), (state[0], s0), (state[1], z0)):
        assert np.array_equal(host(x), h)


# ---------------------------------------------------------------- bad input


def test_bad_input(backend):
    xp = backend.xp
    r = lambda *s: randn(backend, s)[0]  # noqa: E731
    q, k, v = r(3, 4), r(5, 4), r(5, 2)
    cases = [
        ((r(4), k, v), {}, ValueError, "q must have shape"),
        ((q, r(5, 3), v), {}, ValueError, "same head dimension d"),
        ((q, k, r(6, 2)), {}, ValueError, "same sequence length Nk"),
        ((q, k, v), {"feature_map": "softplus"}, ValueError, "feature_map must be one of"),
        ((q, k, v), {"feature_map": lambda x: x[..., :-1, :]}, ValueError,
         r"feature_map applied to [qk] \([35], 4\) must return shape \(\.\.\., N, d'\)"),
        ((q, k, v), {"feature_map": lambda x: x[..., 0]}, ValueError, "must return shape"),
        ((q, k, v), {"feature_map": lambda x: 3.0}, TypeError, "must return an array"),
        ((q, k, v), {"feature_map": lambda x: xp.astype(x, xp.float32)}, TypeError,
         r"feature_map applied to ([qk]) \([35], 4\) must have the dtype of \1 \(.*float64\), got .*float32"),
        # Row-wise, but d' depends on the rank: q (1, 3, 4) gets 4 features, k (5, 4) 2.
        ((q[None, ...], k, v), {"feature_map": lambda x: x if x.ndim == 3 else x[..., :2]}, ValueError,
         "same feature dimension d'"),
        # d' depends on the number of rows: not row-wise.
        ((q, k, v), {"feature_map": lambda x: x if x.shape[-2] == 3 else x[..., :2]}, ValueError,
         r"feature_map applied to [qk] \([35], 4\) is not row-wise"),
        ((q, k, v), {"order": "cubic"}, ValueError, "order must be one of"),
        ((q, k, v), {"causal": True, "chunk_size": 0}, ValueError, "chunk_size must be a positive integer"),
        ((q, k, v), {"chunk_size": 2.5}, TypeError, "chunk_size must be a positive integer"),
        ((q, k, v), {"block_size": 0}, ValueError, "block_size must be a positive integer"),
        ((q, k, v), {"eps": 0.0}, ValueError, "eps must be a positive"),
        ((q, k, v), {"eps": float("nan")}, ValueError, "eps must be a positive"),
        ((q, k, v), {"scale": float("inf")}, ValueError, "scale"),
        ((q, k, v), {"causal": "diagonal"}, ValueError, "causal must be"),
        ((xp.ones((3, 4), dtype=xp.int32, device=backend.device), k, v), {}, TypeError, "real floating"),
    ]
    for args, kwargs, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            linear_attention(*args, **kwargs)
    with pytest.raises(ValueError, match="feature_map must be one of"):
        linear_attention_weights(q, k, feature_map="tanh")


def test_bad_step_input(backend):
    r = lambda *s: randn(backend, s)[0]  # noqa: E731
    state = linear_attention_state(r(0, 4), r(0, 2))
    q, k, v = r(4), r(4), r(2)
    with pytest.raises(TypeError, match=r"state must be a pair \(S, z\)"):
        linear_attention_step(state[0], q, k, v)
    with pytest.raises(ValueError, match=r"state does not fit this token: need S \(\.\.\., d', dv\) = "
                                         r"\(\.\.\., 4, 3\)"):
        linear_attention_step(state, q, k, r(3))
    with pytest.raises(ValueError, match="same head dimension"):
        linear_attention_step(state, q, r(5), v)
    with pytest.raises(ValueError, match=r"S must have shape \(\.\.\., d', dv\)"):
        linear_attention_step((r(4), state[1]), q, k, v)
    with pytest.raises(TypeError, match="state must have the dtype of q"):
        xp = backend.xp
        linear_attention_step((xp.astype(state[0], xp.float32), state[1]), q, k, v)


# ---------------------------------------------------------------- properties

shape_st = st.tuples(
    st.integers(1, 9), st.integers(1, 9), st.integers(1, 5), st.integers(1, 4), st.integers(0, 2**31 - 1)
)


def test_property_reordering_identity(backend):
    @property_test(backend)
    @given(shape=shape_st, feature_map=st.sampled_from(FEATURE_MAPS), causal=st.sampled_from(CAUSAL),
           chunk=st.integers(2, 6))
    def check(shape, feature_map, causal, chunk):
        nq, nk, d, dv, seed = shape
        rng = np.random.default_rng(seed)
        hs = [rng.standard_normal(s) for s in ((2, nq, d), (2, nk, d), (2, nk, dv))]
        q, k, v = (from_numpy(a, backend) for a in hs)
        kw = dict(feature_map=feature_map, causal=causal, normalize=feature_map != "identity")
        lin = host(call(backend, linear_attention, q, k, v, chunk_size=chunk, **kw))
        quad = host(call(backend, linear_attention, q, k, v, order="quadratic", **kw))
        np.testing.assert_allclose(lin, quad, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lin, np_linear(*hs, **kw)[0], rtol=1e-12, atol=1e-12)

    check()


def test_property_convex_combination(backend):
    # elu+1 features are positive: every output lies within the visible values' range.
    @property_test(backend)
    @given(shape=shape_st, causal=st.sampled_from(CAUSAL))
    def check(shape, causal):
        nq, nk, d, dv, seed = shape
        rng = np.random.default_rng(seed)
        hs = [rng.standard_normal(s) * 3 for s in ((nq, d), (nk, d), (nk, dv))]
        out = host(call(backend, linear_attention, *(from_numpy(a, backend) for a in hs), causal=causal,
                        chunk_size=3))
        vis = visible(nq, nk, causal)
        for i in range(nq):
            if not vis[i].any():
                assert np.all(out[i] == 0)
                continue
            vals = hs[2][vis[i]]
            assert np.all(out[i] >= vals.min(0) - 1e-12) and np.all(out[i] <= vals.max(0) + 1e-12)

    check()


# ---------------------------------------------------------------- catalogue



# ---------------------------------------------------------------- the thread pool


# On JAX the pool never runs (pool_helps: its arrays count as lazy), so each case is
# the serial form, which test_blocks_equal_one_pass checks there, causal too: one case
# (the eager form's ~55 compilations a case).
@pytest.mark.jax_subset()
@pytest.mark.parametrize("causal", [False, True, "bottom-right"])
def test_heads_on_the_thread_pool_give_the_serial_bits(backend, monkeypatch, causal):
    # POOL_MIN_ROWS = 1 makes every call "large": the heads are split among the CPUs,
    # each group the same computation as the batched call, joined in order.
    import attn_ref.linear.engine as lin

    q, qh = randn(backend, (2, 3, 21, 4), seed=41)
    k, kh = randn(backend, (2, 3, 25, 4), seed=42)
    v, vh = randn(backend, (2, 3, 25, 5), seed=43)
    serial = host(linear_attention(q, k, v, causal=causal, chunk_size=4, block_size=8))
    monkeypatch.setattr(lin, "POOL_MIN_ROWS", 1)
    pooled = [host(linear_attention(q, k, v, causal=causal, chunk_size=4, block_size=8)) for _ in range(2)]
    assert np.array_equal(pooled[0], pooled[1])
    want = host(linear_attention(q, k, v, causal=causal, order="quadratic"))
    np.testing.assert_allclose(pooled[0], want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(serial, want, rtol=1e-12, atol=1e-12)


def test_a_callable_feature_map_stays_on_the_calling_thread(backend, monkeypatch):
    # A user's feature map is not promised to be thread-safe: never pooled.
    import threading

    import attn_ref.linear.engine as lin

    monkeypatch.setattr(lin, "POOL_MIN_ROWS", 1)
    seen = set()
    xp = backend.xp

    def phi(x):
        seen.add(threading.get_ident())
        return xp.exp(x)

    q, _ = randn(backend, (4, 9, 3), seed=44)
    linear_attention(q, q, q, feature_map=phi, causal=True, chunk_size=2, block_size=4)
    linear_attention(q, q, q, feature_map=phi)
    assert seen == {threading.get_ident()}


@pytest.mark.parametrize("causal", [False, True])
def test_torch_autograd_flows_through_the_blocks(causal):
    # The linear order updates its own arrays in place (features, summary, readout) to
    # save fresh ones; on tensors that record a graph it must not, or torch's backward
    # finds a tensor it needs overwritten. Several blocks with a ragged tail, fold and read.
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 11, 3, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    assert torch.autograd.gradcheck(
        lambda q, k, v: linear_attention(q, k, v, causal=causal, chunk_size=2, block_size=4), (q, k, v))


# ---------------------------------------------------------------- GEMMs in row chunks


@pytest.mark.parametrize("rows", [2, 4])
def test_gemm_row_chunks_give_the_function_of_one_gemm_per_block(backend, monkeypatch, rows):
    # The non-causal loop takes each block's fold ([V, 1]^T phi(K), summed over chunks) and
    # read (phi(Q) [S, z]) as GEMM_ROWS-row chunks; a block that GEMM_ROWS does not divide
    # (the ragged last one) is one product. Broadcast batch: the keys' summary is shared.
    import attn_ref.linear.engine as lin

    monkeypatch.setattr(lin, "GEMM_ROWS", rows)
    q, _ = randn(backend, (2, 3, 21, 4), seed=51)
    k, _ = randn(backend, (1, 3, 27, 4), seed=52)
    v, _ = randn(backend, (1, 3, 27, 5), seed=53)
    want = host(linear_attention(q, k, v, order="quadratic"))
    for block in (8, 12):  # chunked blocks, then a ragged tail of 5 queries and 3 keys
        got = host(linear_attention(q, k, v, block_size=block))
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    got = host(linear_attention(q, k, v, block_size=8, normalize=False))
    np.testing.assert_allclose(got, host(linear_attention(q, k, v, order="quadratic", normalize=False)),
                               rtol=1e-12, atol=1e-12)


def test_default_gemm_rows_chunk_a_default_block(backend):
    # The defaults themselves: 512-row blocks of 128-row GEMMs, and a ragged last block.
    import attn_ref.linear.engine as lin

    assert lin.DEFAULT_BLOCK_SIZE % lin.GEMM_ROWS == 0 and lin.DEFAULT_BLOCK_SIZE > lin.GEMM_ROWS
    q, _ = randn(backend, (2, 1100, 3), seed=54)
    k, _ = randn(backend, (2, 1100, 3), seed=55)
    v, _ = randn(backend, (2, 1100, 2), seed=56)
    got = host(linear_attention(q, k, v))
    np.testing.assert_allclose(got, host(linear_attention(q, k, v, order="quadratic")),
                               rtol=1e-11, atol=1e-12)


def test_torch_autograd_flows_through_gemm_row_chunks(monkeypatch):
    # The chunked fold sums in place on its own arrays; on tensors recording a graph it must not.
    torch = pytest.importorskip("torch")
    import attn_ref.linear.engine as lin

    monkeypatch.setattr(lin, "GEMM_ROWS", 2)
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 11, 3, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    assert torch.autograd.gradcheck(lambda q, k, v: linear_attention(q, k, v, block_size=4), (q, k, v))


def test_wide_features_take_smaller_gemm_chunks(backend):
    # d' (dv + 1) = 96 x 65 is wider than 64 x 65: 64-row chunks of the 512-row blocks.
    from attn_ref.linear import linear_from_features

    xp = backend.xp
    fq, _ = randn(backend, (2, 700, 96), seed=57)
    fk, _ = randn(backend, (2, 700, 96), seed=58)
    v, _ = randn(backend, (2, 700, 64), seed=59)
    fq, fk = xp.abs(fq), xp.abs(fk)
    got = host(linear_from_features(fq, fk, v))
    np.testing.assert_allclose(got, host(linear_from_features(fq, fk, v, order="quadratic")),
                               rtol=1e-11, atol=1e-12)


# ---------------------------------------------------------------- the heads pool, BLAS on one thread


@pytest.mark.parametrize("gemm_rows", [None, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_linear_heads_pool_gives_the_unpooled_bits_and_leaves_blas_alone(backend, monkeypatch, causal,
                                                                        gemm_rows):
    # POOL_MIN_ROWS = 1: every call with several heads is "large". On NumPy (and
    # array-api-strict) the heads run in two groups on the pool and the result is the
    # unpooled call's bit for bit; BLAS keeps its threads there (its GEMMs are small,
    # and the limit measured slower); on torch and on JAX's arrays (eager and traced)
    # nothing is pooled.
    import threading

    from threadpoolctl import threadpool_limits

    import attn_ref._common as common
    import attn_ref.linear.engine as lin

    q, _ = randn(backend, (2, 3, 21, 4), seed=45)
    k, _ = randn(backend, (2, 3, 25, 4), seed=46)
    v, _ = randn(backend, (2, 3, 25, 5), seed=47)
    kw = dict(causal=causal, chunk_size=4, block_size=8)
    if gemm_rows is not None:
        # blocks of 8 rows read as GEMMs of 4-row chunks: a whole pass of two blocks is
        # then read in one call, its chunks the blocks' own
        monkeypatch.setattr(lin, "GEMM_ROWS", gemm_rows)
    serial = host(linear_attention(q, k, v, **kw))
    monkeypatch.setattr(lin, "POOL_MIN_ROWS", 1)
    monkeypatch.setattr(common, "cpu_count", lambda: 2)
    seen, passes = [], []
    real = lin._stream

    def stream(*args, **kwargs):
        seen.append((threading.get_ident(),
                     [lib["num_threads"] for lib in common.blas_one_thread().controller().info()]))
        passes.append(kwargs.get("blocks_per_pass", 1))
        return real(*args, **kwargs)

    monkeypatch.setattr(lin, "_stream", stream)
    with threadpool_limits(2, "blas"):
        pooled = host(linear_attention(q, k, v, **kw))
    assert np.array_equal(pooled, serial)
    assert all(set(t) == {2} for _, t in seen)  # BLAS as it was
    if backend.name in ("numpy", "array_api_strict"):
        assert len(seen) == 2 and threading.get_ident() not in {i for i, _ in seen}
        # each group of 3 of the 6 heads takes two blocks per pass non-causal (a pass of
        # 16 rows and a ragged one of 5 and 9), the same bits as block by block
        assert passes == [1 if causal else 2] * 2
    else:
        assert [i for i, _ in seen] == [threading.get_ident()]  # one call, this thread
    if backend.name == "jax":
        seen.clear()
        import jax

        jax.jit(lambda q, k, v: linear_attention(q, k, v, **kw))(q, k, v)
        assert len(seen) == 1  # traced: one call on all heads


def test_row_maps_holding_whole_batch_arrays_are_not_pooled(monkeypatch):
    # A row map may close over an array shaped like the whole batch (Performer's key
    # stabiliser, one per head): cutting the heads into groups would not broadcast
    # against it, so linear_from_row_maps never pools, and Performer gives the same
    # bits however low the threshold.
    import attn_ref._common as common
    import attn_ref.linear.engine as lin
    from attn_ref import performer_attention
    from attn_ref.linear import linear_from_row_maps
    from attn_ref.performer import random_features

    rng = np.random.default_rng(48)
    q, k, v = (rng.standard_normal((4, 40, 8)) for _ in range(3))
    shift = rng.standard_normal((4, 1, 1))  # one number per head

    def phi(x):
        return np.exp(x - shift)

    w = random_features(8, 16, seed=0, xp=np)
    want = (linear_from_row_maps(q, k, v, phi, phi, block_size=8),
            performer_attention(q, k, v, projection=w))
    monkeypatch.setattr(lin, "POOL_MIN_ROWS", 1)
    monkeypatch.setattr(common, "cpu_count", lambda: 2)
    got = (linear_from_row_maps(q, k, v, phi, phi, block_size=8),
           performer_attention(q, k, v, projection=w))
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_blocks_written_into_one_output_keep_a_rounding_array_type(causal, dtype):
    # The oracle's half-precision baselines run the reference on NumPy subclasses whose
    # every operation rounds its result (conformance.tolerance.LowPrecisionArray). With
    # several row blocks, the block loop wrote into one output made by the namespace (the
    # base ndarray) and divided it in place: the output came back a plain ndarray whose
    # values had not been rounded. Now it is of the inputs' type, each value in the dtype.
    from conformance.tolerance import LOW_PRECISION, lp_array

    rng = np.random.default_rng(0)
    q, k, v = (lp_array(rng.standard_normal((2, 300, 16)), dtype) for _ in range(3))
    cls = LOW_PRECISION[dtype]
    out = linear_attention(q, k, v, causal=causal, block_size=64)
    assert type(out) is cls
    plain = np.asarray(out).view(np.ndarray).astype(np.float32)
    np.testing.assert_array_equal(cls.round(plain), plain)
