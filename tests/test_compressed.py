"""attn_ref.compressed: memory-compressed attention (strided convolution), on every backend."""

import numpy as np
import pytest

from attn_ref import compressed_attention, compressed_weights, pooled_attention
from attn_ref.compressed import num_blocks, strided_conv
from conformance.backends import from_numpy
from tests.helpers import assert_close, call, host, randn
from tests.plain import naive_attention, naive_compressed, naive_conv

N, D, DV = 12, 4, 3


def _qkv(backend, dtype="float64", nq=N, nk=N, batch=(2, 3)):
    q, qh = randn(backend, batch + (nq, D), dtype, seed=1)
    k, kh = randn(backend, batch + (nk, D), dtype, seed=2)
    v, vh = randn(backend, batch + (nk, DV), dtype, seed=3)
    return (q, k, v), (qh, kh, vh)


def _weights(backend, shape, seed, dtype="float64"):
    w = np.random.default_rng(seed).standard_normal(shape) / np.sqrt(shape[-2])
    return from_numpy(w, backend, dtype)


@pytest.mark.parametrize("dtype,causal", [("float32", False), ("float64", False),
                                          ("float64", "top-left"), ("float64", "bottom-right")])
def test_identity_kernel_stride_one_is_softmax(backend, dtype, causal):
    nq = N if causal != "bottom-right" else 7  # bottom-right with Nq < Nk
    (q, k, v), (qh, kh, vh) = _qkv(backend, dtype, nq=nq)
    wk = from_numpy(np.eye(D)[None], backend, dtype)
    wv = from_numpy(np.eye(DV)[None], backend, dtype)
    out = call(backend, compressed_attention, q, k, v, k_weight=wk, v_weight=wv, stride=1,
               causal=causal)
    want = naive_attention(qh, kh, vh, causal=None if causal is False else causal)[0]
    assert_close(out, want, backend, dtype=dtype)


def test_averaging_kernel_is_mean_pooling(backend):
    (q, k, v), (qh, kh, vh) = _qkv(backend)
    c = 4
    wk = from_numpy(np.stack([np.eye(D) / c] * c), backend)
    wv = from_numpy(np.stack([np.eye(DV) / c] * c), backend)
    out = call(backend, compressed_attention, q, k, v, k_weight=wk, v_weight=wv, stride=c)
    pool = lambda x: x.reshape(x.shape[:-2] + (N // c, c, x.shape[-1])).mean(-2)  # noqa: E731
    assert_close(out, naive_attention(qh, pool(kh), pool(vh))[0], backend)
    assert_close(out, host(call(backend, pooled_attention, q, k, v, num_segments=N // c)), backend)


@pytest.mark.parametrize("c,s,nk,causal", [
    (3, 3, 12, False),  # the paper's kernel 3 / stride 3, N divisible
    (3, 2, 12, "top-left"),  # overlapping windows; the last window [10, 13) runs past the end
    (3, 3, 10, False),  # ragged tail of one position
    (3, 3, 10, "top-left"),
])
def test_matches_plain_numpy(backend, causal, c, s, nk):
    (q, k, v), (qh, kh, vh) = _qkv(backend, nk=nk)
    wk = _weights(backend, (3, c, D, D), seed=4)  # per head
    wv = _weights(backend, (c, DV, 5), seed=5)  # values to a different width
    out = call(backend, compressed_attention, q, k, v, k_weight=wk, v_weight=wv, stride=s,
               causal=causal)
    want = naive_compressed(qh, kh, vh, host(wk), host(wv), s, None if causal is False else causal)
    assert_close(out, want, backend)
    if causal:  # the query-blocked (online softmax) form computes the same function
        blocked = call(backend, compressed_attention, q, k, v, k_weight=wk, v_weight=wv, stride=s,
                       causal=causal, block_q=5)
        assert_close(blocked, want, backend)


@pytest.mark.parametrize("n,c,s", [(12, 3, 3), (10, 3, 3), (11, 4, 2), (2, 3, 3), (5, 1, 3)])
def test_strided_conv(backend, n, c, s):
    x, xh = randn(backend, (2, n, D), seed=6)
    w = _weights(backend, (c, D, 2), seed=7)
    out = call(backend, strided_conv, x, w, stride=s)
    assert tuple(out.shape) == (2, num_blocks(n, c, s), 2)
    assert_close(out, naive_conv(xh, host(w), s), backend)


def test_num_blocks_covers_every_position():
    for n in range(0, 30):
        for c in range(1, 6):
            for s in range(1, 6):
                m = num_blocks(n, c, s)
                reachable = {p for p in range(n) if p % s < c}  # all of range(n) when s <= c
                windows = [set(range(j * s, j * s + c)) for j in range(m)]
                assert reachable <= set().union(*windows)
                assert all(j * s < n for j in range(m))  # no window of padding only
                # Fewest windows: dropping the last leaves a position uncovered.
                assert m == 0 or not reachable <= set().union(*windows[:-1])


def test_causal_no_future_leak(backend):
    # Perturb every token from position t on (queries, keys and values); under the
    # tensor2tensor rule the outputs before t must not move at all.
    (q, k, v), (qh, kh, vh) = _qkv(backend)
    wk = _weights(backend, (3, D, D), seed=8)
    wv = _weights(backend, (3, DV, DV), seed=9)
    base = host(call(backend, compressed_attention, q, k, v, k_weight=wk, v_weight=wv, stride=2,
                     causal=True))
    rng = np.random.default_rng(10)
    for t in (1, 4, 7, 11):
        qp, kp, vp = (a.copy() for a in (qh, kh, vh))
        for a in (qp, kp, vp):
            a[..., t:, :] += rng.standard_normal(a[..., t:, :].shape)
        out = host(call(backend, compressed_attention, *(from_numpy(a, backend) for a in (qp, kp, vp)),
                        k_weight=wk, v_weight=wv, stride=2, causal=True))
        if backend.name == "numpy":
            assert np.array_equal(out[..., :t, :], base[..., :t, :])
        else:
            np.testing.assert_allclose(out[..., :t, :], base[..., :t, :], rtol=1e-14, atol=1e-14)
        assert np.abs(out[..., t:, :] - base[..., t:, :]).max() > 1e-3
    # Without the causal rule the same perturbation reaches the past: the check bites.
    kp = kh.copy()
    kp[..., 11:, :] += 1.0
    free = host(call(backend, compressed_attention, q, from_numpy(kp, backend), v, k_weight=wk,
                     v_weight=wv, stride=2))
    free0 = host(call(backend, compressed_attention, q, k, v, k_weight=wk, v_weight=wv, stride=2))
    assert np.abs(free[..., :11, :] - free0[..., :11, :]).max() > 1e-6


def test_causal_first_queries_see_nothing(backend):
    # Kernel 3: the first block ends at position 2, so queries 0 and 1 return zeros.
    (q, k, v), _ = _qkv(backend)
    w = from_numpy(np.stack([np.eye(D)] * 3), backend)
    out = host(call(backend, compressed_attention, q, k, k, k_weight=w, stride=3, causal=True))
    assert np.all(out[..., :2, :] == 0.0) and np.all(out[..., 2:, :] != 0.0)


def test_weights_reproduce_output(backend):
    (q, k, v), (qh, kh, vh) = _qkv(backend)
    wk = _weights(backend, (3, D, D), seed=11)
    taps = np.array([0.2, -0.5, 1.3])
    wv = from_numpy(taps[:, None, None] * np.eye(DV), backend)
    out = call(backend, compressed_attention, q, k, v, k_weight=wk, v_weight=wv, stride=2,
               causal=True)
    w = call(backend, compressed_weights, q, k, k_weight=wk, v_weight=wv, stride=2, causal=True)
    assert tuple(w.shape) == (2, 3, N, N)
    np.testing.assert_allclose(host(w) @ vh, host(out), rtol=1e-12, atol=1e-12)
    # v_weight=None: the averaging kernel.
    avg = call(backend, compressed_weights, q, k, k_weight=wk, stride=2)
    want = naive_compressed(qh, kh, vh, host(wk), np.stack([np.eye(DV) / 3] * 3), 2)
    np.testing.assert_allclose(host(avg) @ vh, want, rtol=1e-12, atol=1e-12)


def test_empty_sequences(backend):
    xp = backend.xp
    w = from_numpy(np.stack([np.eye(D)] * 3), backend)
    q0 = xp.zeros((2, 0, D), dtype=xp.float64, device=backend.device)
    k, _ = randn(backend, (2, 5, D))
    assert tuple(call(backend, compressed_attention, q0, k, k, k_weight=w).shape) == (2, 0, D)
    k0 = xp.zeros((2, 0, D), dtype=xp.float64, device=backend.device)
    out = call(backend, compressed_attention, k, k0, k0, k_weight=w, causal=True)
    assert tuple(out.shape) == (2, 5, D) and np.all(host(out) == 0.0)


def test_bad_input(backend):
    (q, k, v), _ = _qkv(backend)

    def arr(shape, dtype="float64"):
        return from_numpy(np.ones(shape), backend, dtype)

    wk, wv = arr((3, D, D)), arr((3, DV, DV))
    cases = [
        (dict(stride=0), ValueError, "stride must be a positive integer, got 0"),
        (dict(stride=-2), ValueError, "stride must be a positive integer, got -2"),
        (dict(stride=1.5), TypeError, "stride must be a positive integer, got 1.5"),
        (dict(stride=True), TypeError, "stride must be a positive integer, got True"),
        (dict(k_weight=arr((3, D + 1, D))), ValueError,
         r"k_weight must have shape .*d_in=4.*got shape \(3, 5, 4\)"),
        (dict(k_weight=arr((3, D, D + 1))), ValueError,
         "k_weight must map keys back to the query dimension d=4"),
        (dict(k_weight=arr((D, D))), ValueError, r"k_weight must have shape .*got shape \(4, 4\)"),
        (dict(k_weight=arr((0, D, D))), ValueError, r"k_weight must have shape .*got shape \(0, 4, 4\)"),
        (dict(k_weight=arr((2, 3, D, D))), ValueError, "k_weight has per-head shape .*h=2 does not match"),
        (dict(k_weight=arr((3, D, D), "float32")), TypeError, "k_weight must have the dtype of q"),
        (dict(v_weight=arr((2, DV, DV))), ValueError, "k_weight and v_weight must have the same kernel size"),
        (dict(v_weight=arr((3, D, DV))), ValueError, r"v_weight must have shape .*d_in=3"),
        (dict(causal="left"), ValueError, "causal must be False, True"),
        (dict(k_weight="w"), TypeError, "k_weight must be an array"),
        (dict(block_q=0), ValueError, "block_q must be a positive integer, got 0"),
    ]
    for kwargs, exc, msg in cases:
        kw = {"k_weight": wk, "v_weight": wv, **kwargs}
        with pytest.raises(exc, match=msg):
            compressed_attention(q, k, v, **kw)
    with pytest.raises(ValueError, match=r"v_weight must be a scalar kernel of shape \(c, dv, dv\)"):
        compressed_weights(q, k, k_weight=wk, v_weight=arr((3, D, 2)))

