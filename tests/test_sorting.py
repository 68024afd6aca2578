"""attn_ref.sorting: sparse Sinkhorn attention, its defining form and its limits."""

import numpy as np
import pytest

from attn_ref import block_sparse_attention
from attn_ref.sorting import (
    block_sorted_attention,
    sinkhorn_attention,
    sinkhorn_sort_matrix,
    sinkhorn_weights,
)
from conformance.backends import from_numpy
from tests.helpers import assert_close, call, host, randn
from tests.plain import naive_sinkhorn, naive_sinkhorn_attention


def _qkv(backend, batch, n, d, dv, dtype="float64", seed=0):
    q, qh = randn(backend, batch + (n, d), dtype, seed=seed + 1)
    k, kh = randn(backend, batch + (n, d), dtype, seed=seed + 2)
    v, vh = randn(backend, batch + (n, dv), dtype, seed=seed + 3)
    return (q, k, v), (qh, kh, vh)


@pytest.mark.parametrize("n,b,causal,n_iters,temperature", [
    (12, 3, False, 8, 0.75), (12, 4, True, 8, 0.75), (8, 2, True, 0, 1.0), (10, 1, True, 5, 0.3),
    (6, 6, False, 3, 2.0)])
def test_efficient_form_is_the_plain_blocks_and_the_dense_softmax(backend, n, b, causal, n_iters,
                                                                  temperature):
    (q, k, v), (qh, kh, vh) = _qkv(backend, (2, 1), n, 4, 3)
    r, rh = randn(backend, (n // b, n // b), seed=n)
    opts = {"sort_logits": r, "block_size": b, "causal": causal, "n_iters": n_iters,
            "temperature": temperature}
    out = call(backend, sinkhorn_attention, q, k, v, **opts)
    w = call(backend, sinkhorn_weights, q, k, **opts)
    want, want_w = naive_sinkhorn_attention(qh, kh, vh, rh, b, n_iters, temperature, causal)
    assert_close(out, want, backend, rtol=1e-12, atol=1e-12)
    assert_close(w, want_w, backend, rtol=1e-12, atol=1e-12)


def test_sort_matrix_is_the_plain_iteration(backend):
    r, rh = randn(backend, (3, 5, 5), seed=1)
    for causal, n_iters in ((False, 0), (False, 4), (True, 6)):
        p = call(backend, sinkhorn_sort_matrix, r, n_iters=n_iters, temperature=0.5, causal=causal)
        want = np.stack([naive_sinkhorn(x, n_iters, 0.5, causal) for x in rh])
        assert_close(p, want, backend, rtol=1e-12, atol=1e-14)
    # no iteration: exp(R / temperature) itself, rows not normalised
    p0 = host(call(backend, sinkhorn_sort_matrix, r, n_iters=0, temperature=0.5))
    np.testing.assert_allclose(p0, np.exp(rh / 0.5), rtol=1e-14)


def test_many_iterations_make_it_doubly_stochastic():
    # The limit is a property of the iteration, which test_sort_matrix_is_the_plain_iteration
    # checks on every backend; here on NumPy (under jax.jit thousands of iterations unroll).
    r = np.random.default_rng(2).standard_normal((6, 6))
    p = sinkhorn_sort_matrix(r, n_iters=300, temperature=0.75)
    np.testing.assert_allclose(p.sum(axis=-1), 1.0, atol=1e-10)
    np.testing.assert_allclose(p.sum(axis=-2), 1.0, atol=1e-12)
    few = sinkhorn_sort_matrix(r, n_iters=1, temperature=0.75)
    assert np.abs(few.sum(axis=-1) - 1).max() > 1e-3  # one iteration: columns only
    # causal: strictly earlier blocks only; on that support the iteration converges to
    # the one doubly stochastic matrix it holds, "each block sorts its predecessor"
    pc = sinkhorn_sort_matrix(r, n_iters=3000, temperature=0.75, causal=True)
    assert np.all(np.triu(pc) == 0.0)
    np.testing.assert_allclose(pc, np.eye(6, k=-1), atol=1e-2)


def test_identity_sort_is_block_local_attention(backend):
    # P = I: each block's sorted block is itself, so each key is there twice, with equal
    # logits: the softmax is block-local attention (the causal sort has no identity)
    (q, k, v), _ = _qkv(backend, (2,), 12, 4, 3)
    diag = tuple(tuple(i == j for j in range(3)) for i in range(3))
    local = host(call(backend, block_sparse_attention, q, k, v, layout=diag, block_size=4))
    got = call(backend, block_sorted_attention, q, k, v, from_numpy(np.eye(3), backend), block_size=4)
    assert_close(got, local, backend, rtol=1e-12, atol=1e-12)
    # a sorting network that scores each block highest against itself gives P ~ I
    r = from_numpy(30.0 * np.eye(3), backend)
    assert_close(call(backend, sinkhorn_attention, q, k, v, sort_logits=r, block_size=4), local, backend,
                 rtol=1e-12, atol=1e-12)
    # and a sort that is not the identity is not local attention
    shift = from_numpy(30.0 * np.roll(np.eye(3), 1, axis=1), backend)
    assert np.abs(host(call(backend, sinkhorn_attention, q, k, v, sort_logits=shift, block_size=4))
                  - local).max() > 1e-2


def test_causal_outputs_ignore_the_future(backend):
    rng = np.random.default_rng(5)
    qh, kh, vh = rng.standard_normal((3, 12, 4))
    rh = rng.standard_normal((4, 4))
    out = sinkhorn_attention(qh, kh, vh, sort_logits=rh, block_size=3, causal=True)
    k2, v2 = kh.copy(), vh.copy()
    k2[7:] += 1.0
    v2[7:] -= 2.0
    out2 = sinkhorn_attention(qh, k2, v2, sort_logits=rh, block_size=3, causal=True)
    np.testing.assert_allclose(out2[:7], out[:7], rtol=1e-14, atol=1e-14)
    assert np.abs(out2[7:] - out[7:]).max() > 1e-3
    # the first block sees its own past only
    w = sinkhorn_weights(qh, kh, sort_logits=rh, block_size=3, causal=True)
    assert np.all(np.triu(w, 1) == 0.0)
    np.testing.assert_allclose(out[0], vh[0], rtol=1e-14)


def test_float32_and_broadcast_batch(backend):
    (q, k, v), (qh, kh, vh) = _qkv(backend, (2, 3), 8, 4, 5, dtype="float32", seed=7)
    r, rh = randn(backend, (1, 3, 4, 4), dtype="float32", seed=8)
    out = call(backend, sinkhorn_attention, q, k[:1, ...], v[:, :1, ...], sort_logits=r, block_size=2,
               causal=True)
    assert str(out.dtype).endswith("float32") and tuple(out.shape) == (2, 3, 8, 5)
    want, _ = naive_sinkhorn_attention(qh, kh[:1], vh[:, :1], rh, 2, 8, 0.75, True)
    np.testing.assert_allclose(host(out), want, atol=1e-5)


def test_inputs_are_not_mutated(backend):
    (q, k, v), (qh, kh, vh) = _qkv(backend, (2,), 8, 4, 3)
    r, rh = randn(backend, (4, 4), seed=3)
    call(backend, sinkhorn_attention, q, k, v, sort_logits=r, block_size=2, causal=True)
    for x, xh in ((q, qh), (k, kh), (v, vh), (r, rh)):
        np.testing.assert_array_equal(host(x), xh)


def test_bad_inputs_name_the_argument():
    q = np.zeros((8, 4))
    r = np.zeros((4, 4))
    with pytest.raises(ValueError, match="block_size must divide the sequence length N=8"):
        sinkhorn_attention(q, q, q, sort_logits=r, block_size=3)
    with pytest.raises(ValueError, match=r"sort_logits must have shape \(..., n_b, n_b\) = \(..., 2, 2\)"):
        sinkhorn_attention(q, q, q, sort_logits=r, block_size=4)
    with pytest.raises(TypeError, match="sort_logits must have the dtype of q"):
        sinkhorn_attention(q, q, q, sort_logits=r.astype(np.float32), block_size=2)
    with pytest.raises(ValueError, match="temperature must be positive"):
        sinkhorn_attention(q, q, q, sort_logits=r, block_size=2, temperature=0.0)
    with pytest.raises(ValueError, match="n_iters must be a non-negative integer"):
        sinkhorn_attention(q, q, q, sort_logits=r, block_size=2, n_iters=-1)
    with pytest.raises(ValueError, match="self-attention only"):
        sinkhorn_attention(q, np.zeros((4, 4)), np.zeros((4, 4)), sort_logits=r, block_size=2)


def test_calibration_sinkhorn_operator_is_sinkhorn_transformers():
    st = pytest.importorskip("sinkhorn_transformer.sinkhorn_transformer")
    import torch

    r = np.random.default_rng(0).standard_normal((2, 5, 5))
    for n_iters in (0, 1, 7, 30):
        theirs = st.sinkhorn_sorting_operator(torch.tensor(r), n_iters).numpy()
        np.testing.assert_allclose(sinkhorn_sort_matrix(r, n_iters=n_iters, temperature=1.0), theirs,
                                   rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("n,b", [(16, 4), (64, 8)])
def test_calibration_against_sinkhorn_transformer(monkeypatch, n, b):
    # sinkhorn-transformer 0.11.4's SinkhornAttention with the Sinkhorn sort
    # (non_permutative=False) and its Gumbel noise set to zero: its sort net scores blocks
    # by R = relu(mean(q block) . mean(k block) / sqrt d) and takes log(R + 1e-6) as the
    # logits; fed those logits this reference is the same function - except that the
    # package attends the sorted *keys* as the sorted block's values
    # (``b_v_r = b_k_r.reshape(...)``), so it agrees for v = k and for v != k equals
    # this reference with the sorted keys put in the values' place.
    st = pytest.importorskip("sinkhorn_transformer.sinkhorn_transformer")
    import torch

    from attn_ref.sorting import block_keys_and_mask, blocked

    d, it, temp = 16, 7, 0.75
    rng = np.random.default_rng(n)
    q, k, v = rng.standard_normal((3, 1, 1, n, d))
    monkeypatch.setattr(st, "sample_gumbel",
                        lambda shape, device, dtype, eps=1e-6: torch.zeros(shape, dtype=dtype))
    att = st.SinkhornAttention(b, d, d, 1, n, temperature=temp, non_permutative=False,
                               sinkhorn_iter=it).eval()
    nb = n // b
    sq, sk = q[0, 0].reshape(nb, b, d).mean(1), k[0, 0].reshape(nb, b, d).mean(1)
    logits = np.log(np.maximum(sq @ sk.T / np.sqrt(d), 0) + 1e-6)
    opts = {"sort_logits": logits, "block_size": b, "n_iters": it, "temperature": temp}
    with torch.no_grad():
        same = att(*(torch.tensor(x) for x in (q, k, k))).numpy()[0, 0]
        theirs = att(*(torch.tensor(x) for x in (q, k, v))).numpy()[0, 0]
    np.testing.assert_allclose(same, sinkhorn_attention(q[0, 0], k[0, 0], k[0, 0], **opts), rtol=1e-12,
                               atol=1e-12)
    ours = sinkhorn_attention(q[0, 0], k[0, 0], v[0, 0], **opts)
    assert np.abs(theirs - ours).max() > 0.1
    # the package's values: own block, then the sorted keys
    p = sinkhorn_sort_matrix(logits, n_iters=it, temperature=temp)
    kk, _, _ = block_keys_and_mask(np, k[0, 0], v[0, 0], p, b, False)
    vv = np.concatenate([blocked(np, v[0, 0], b), kk[..., b:, :]], axis=-2)
    s = blocked(np, q[0, 0], b) @ np.swapaxes(kk, -1, -2) / np.sqrt(d)
    a = np.exp(s - s.max(-1, keepdims=True))
    emulated = ((a / a.sum(-1, keepdims=True)) @ vv).reshape(n, d)
    np.testing.assert_allclose(theirs, emulated, rtol=1e-12, atol=1e-12)
