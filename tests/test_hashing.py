"""attn_ref.hashing: Reformer LSH attention, its defining form and its limits."""

import numpy as np
import pytest

from attn_ref import softmax_attention
from attn_ref.hashing import (
    combine_rounds,
    lsh_buckets,
    lsh_chunks,
    lsh_rotations,
    reformer_attention,
    reformer_rounds,
    reformer_weights,
    shared_keys,
)
from conformance.backends import from_numpy
from tests.helpers import assert_close, call, host, randn
from tests.plain import naive_attention, naive_lsh_buckets, naive_reformer


def _rot(backend, d, n_hashes, n_buckets, seed=0, dtype="float64"):
    r = lsh_rotations(d, n_hashes, n_buckets, seed=seed, dtype=getattr(backend.xp, dtype),
                      device=backend.device, xp=backend.xp)
    return r, host(r)


def _qkv(backend, batch, n, d, dv, dtype="float64", seed=0):
    q, qh = randn(backend, batch + (n, d), dtype, seed=seed + 1)
    k, kh = randn(backend, batch + (n, d), dtype, seed=seed + 2)
    v, vh = randn(backend, batch + (n, dv), dtype, seed=seed + 3)
    return (q, k, v), (qh, kh, vh)


def test_buckets_are_the_angular_hash(backend):
    (_, k, _), (_, kh, _) = _qkv(backend, (), 11, 5, 2)
    r, rh = _rot(backend, 5, 3, 6)
    got = host(call(backend, lsh_buckets, k, r))
    np.testing.assert_array_equal(got, naive_lsh_buckets(kh, rh))
    # scale-invariant: the shared-QK keys q/|q| hash like q
    np.testing.assert_array_equal(host(call(backend, lsh_buckets, k * 3.0, r)), got)


def test_chunks_sort_by_bucket_then_position(backend):
    b = from_numpy(np.array([[1, 0, 1, 0, 2]]), backend, "int64")
    order, chunk = call(backend, lsh_chunks, b, 2)
    np.testing.assert_array_equal(host(order), [[1, 3, 0, 2, 4]])
    np.testing.assert_array_equal(host(chunk), [[1, 0, 1, 0, 2]])


@pytest.mark.parametrize("n,chunk,n_hashes,n_buckets,causal", [
    (12, 3, 2, 4, False), (13, 4, 3, 6, True), (10, 2, 1, 4, True), (9, 5, 2, 8, False)])
def test_efficient_form_is_the_plain_rounds_and_the_dense_softmax(backend, n, chunk, n_hashes, n_buckets,
                                                                  causal):
    (q, k, v), (qh, kh, vh) = _qkv(backend, (2, 1), n, 4, 3)
    r, rh = _rot(backend, 4, n_hashes, n_buckets, seed=n)
    opts = {"rotations": r, "chunk_size": chunk, "causal": causal}
    out = call(backend, reformer_attention, q, k, v, **opts)
    w = call(backend, reformer_weights, q, k, **opts)
    want, want_w = naive_reformer(qh, kh, vh, rh, chunk, causal=causal)
    assert_close(out, want, backend, rtol=1e-12, atol=1e-12)
    assert_close(w, want_w, backend, rtol=1e-12, atol=1e-12)


def test_rounds_combine_by_their_log_sum_exp(backend):
    # Each round's softmax output and lse, combined by the lse weights, is the output;
    # a plain average of the rounds is not.
    (q, k, v), _ = _qkv(backend, (), 16, 4, 3, seed=5)
    r, _ = _rot(backend, 4, 3, 4, seed=5)
    opts = {"rotations": r, "chunk_size": 2}
    o, lse = call(backend, reformer_rounds, q, k, v, **opts)
    out = host(call(backend, reformer_attention, q, k, v, **opts))
    np.testing.assert_allclose(host(call(backend, combine_rounds, o, lse)), out, rtol=1e-13, atol=1e-13)
    assert np.abs(host(o).mean(axis=0) - out).max() > 1e-3


def test_one_chunk_is_softmax_over_every_other_key(backend):
    (q, k, v), (qh, kh, vh) = _qkv(backend, (2,), 9, 4, 3)
    r, _ = _rot(backend, 4, 2, 4)
    for causal in (False, True):
        out = call(backend, reformer_attention, q, k, v, rotations=r, chunk_size=9, causal=causal)
        others = ~np.eye(9, dtype=bool)
        if causal:
            others[0, 0] = True  # position 0 has no other key: it attends to itself
        want, _ = naive_attention(qh, kh, vh, mask=others, causal="top-left" if causal else None)
        assert_close(out, want, backend, rtol=1e-12, atol=1e-12)


def test_identical_rounds_are_one_round(backend):
    (q, k, v), _ = _qkv(backend, (), 14, 4, 3, seed=2)
    r1, rh = _rot(backend, 4, 1, 6, seed=2)
    r3 = from_numpy(np.repeat(rh, 3, axis=1), backend)
    for causal in (False, True):
        one = call(backend, reformer_attention, q, k, v, rotations=r1, chunk_size=3, causal=causal)
        three = call(backend, reformer_attention, q, k, v, rotations=r3, chunk_size=3, causal=causal)
        assert_close(three, host(one), backend, rtol=1e-12, atol=1e-12)


def test_more_rounds_find_more_keys(backend):
    (q, k, _), _ = _qkv(backend, (), 24, 4, 3, seed=3)
    r, rh = _rot(backend, 4, 4, 8, seed=3)
    seen = [np.count_nonzero(host(call(backend, reformer_weights, q, k,
                                       rotations=from_numpy(rh[:, :h], backend), chunk_size=2)))
            for h in (1, 2, 4)]
    assert seen[0] < seen[1] < seen[2]


def test_self_only_when_alone_and_the_self_logit_option(backend):
    (q, k, v), (qh, kh, vh) = _qkv(backend, (), 6, 4, 3)
    r, _ = _rot(backend, 4, 1, 2)
    # causal, one chunk: position 0 sees only itself, the others never themselves
    w = host(call(backend, reformer_weights, q, k, rotations=r, chunk_size=6, causal=True))
    assert w[0, 0] == 1.0 and np.all(np.diag(w)[1:] == 0.0)
    out = call(backend, reformer_attention, q, k, v, rotations=r, chunk_size=6, causal=True)
    np.testing.assert_allclose(host(out)[0], vh[0], rtol=1e-14)
    # self_logit=None: plain (causal) softmax over the chunk, self included
    plain = call(backend, reformer_attention, q, k, v, rotations=r, chunk_size=6, causal=True,
                 self_logit=None)
    assert_close(plain, naive_attention(qh, kh, vh, causal="top-left")[0], backend, rtol=1e-12, atol=1e-12)


def test_shared_qk_attention(backend):
    (q, _, v), (qh, _, vh) = _qkv(backend, (), 10, 4, 3)
    kk = call(backend, shared_keys, q)
    np.testing.assert_allclose(host(kk), qh / np.linalg.norm(qh, axis=-1, keepdims=True), rtol=1e-14)
    r, rh = _rot(backend, 4, 2, 4)
    out = call(backend, reformer_attention, q, kk, v, rotations=r, chunk_size=10)
    want, _ = naive_attention(qh, host(kk), vh, mask=~np.eye(10, dtype=bool))
    assert_close(out, want, backend, rtol=1e-12, atol=1e-12)


def test_float32_and_broadcast_batch(backend):
    (q, k, v), (qh, kh, vh) = _qkv(backend, (2, 3), 11, 4, 5, dtype="float32", seed=7)
    k1, v1 = k[:1, ...], v[:, :1, ...]
    r, rh = _rot(backend, 4, 2, 4, seed=7, dtype="float32")
    out = call(backend, reformer_attention, q, k1, v1, rotations=r, chunk_size=3, causal=True)
    assert str(out.dtype).endswith("float32") and tuple(out.shape) == (2, 3, 11, 5)
    want, _ = naive_reformer(qh, kh[:1], vh[:, :1], rh, 3, causal=True)
    np.testing.assert_allclose(host(out), want, atol=1e-5)


def test_inputs_are_not_mutated(backend):
    (q, k, v), (qh, kh, vh) = _qkv(backend, (2,), 8, 4, 3)
    r, rh = _rot(backend, 4, 2, 4)
    call(backend, reformer_attention, q, k, v, rotations=r, chunk_size=3, causal=True)
    for x, xh in ((q, qh), (k, kh), (v, vh), (r, rh)):
        np.testing.assert_array_equal(host(x), xh)


def test_bad_inputs_name_the_argument():
    q = np.zeros((5, 4))
    r = lsh_rotations(4, 2, 4, seed=0, xp=np)
    with pytest.raises(ValueError, match=r"rotations must have shape \(d, n_hashes, n_buckets / 2\)"):
        reformer_attention(q, q, q, rotations=np.zeros((3, 2, 2)), chunk_size=2)
    with pytest.raises(TypeError, match="rotations must have the dtype of k"):
        reformer_attention(q, q, q, rotations=r.astype(np.float32), chunk_size=2)
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
        reformer_attention(q, q, q, rotations=r, chunk_size=0)
    with pytest.raises(ValueError, match="self-attention only"):
        reformer_attention(q, np.zeros((6, 4)), np.zeros((6, 4)), rotations=r, chunk_size=2)
    with pytest.raises(ValueError, match="n_buckets must be even"):
        lsh_rotations(4, 2, 3, seed=0, xp=np)
    with pytest.raises(TypeError, match="self_logit"):
        reformer_attention(q, q, q, rotations=r, chunk_size=2, self_logit="big")


def test_approaches_softmax_when_every_key_is_found():
    # One chunk holds everything: the only change from softmax is the missing self term,
    # which vanishes when the self logit is kept.
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((3, 7, 4))
    r = lsh_rotations(4, 1, 2, seed=0, xp=np)
    np.testing.assert_allclose(reformer_attention(q, k, v, rotations=r, chunk_size=7, self_logit=None),
                               softmax_attention(q, k, v), rtol=1e-13)


def test_the_oracles_reformer_mutants_fail_by_their_mistake_alone():
    # conformance.mutants builds the look-back, duplicate and averaging mistakes on a
    # dense per-round kernel; without a mistake that kernel passes the quick suite, so
    # the mutants' failures (tests/test_conformance_tolerance.py) are the mistakes'.
    from conformance.mutants import Mutant, first_failure, reformer_mutant_kernel

    res, ran = first_failure(Mutant("correct", reformer_mutant_kernel(), "", variant="reformer"), "float32",
                             suite="quick")
    assert res is None and ran >= 5, (res, ran)


def _reformer_pytorch(monkeypatch, qk, v, rotations, bucket_size, causal):
    """reformer-pytorch 1.4.4's LSHAttention (shared QK, duplicates corrected) fed ``rotations``."""
    rp = pytest.importorskip("reformer_pytorch.reformer_pytorch")
    import torch

    fixed = torch.tensor(rotations)
    # LSHAttention draws its rotations with torch.randn(shape) inside hash_vectors
    monkeypatch.setattr(rp.torch, "randn",
                        lambda shape, dtype=None, device=None: fixed.to(dtype).reshape(shape))
    lsh = rp.LSHAttention(bucket_size=bucket_size, n_hashes=rotations.shape[1], causal=causal,
                          allow_duplicate_attention=False).eval()
    with torch.no_grad():
        out = lsh(torch.tensor(qk), torch.tensor(v))[0].numpy()
    monkeypatch.undo()
    return out


@pytest.mark.parametrize("n,c,causal", [(32, 4, False), (64, 8, True), (128, 16, False)])
def test_calibration_one_round_is_reformer_pytorch(monkeypatch, n, c, causal):
    # one hashing round: reformer-pytorch and this reference are the same function
    rng = np.random.default_rng(n)
    qk, v = rng.standard_normal((2, 1, n, 8))
    r = lsh_rotations(8, 1, n // c, seed=n, xp=np)
    theirs = _reformer_pytorch(monkeypatch, qk, v, r, c, causal)
    ours = reformer_attention(qk, shared_keys(qk), v, rotations=r, chunk_size=c, causal=causal)
    np.testing.assert_allclose(theirs, ours, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n_hashes", [2, 4])
def test_calibration_rounds_differ_only_on_first_chunks(monkeypatch, n_hashes):
    # Several rounds: reformer-pytorch sorts all rounds as one sequence, so the first
    # chunk of round r looks back at the last chunk of round r - 1 (this reference: of
    # round r), and its duplicate counts miss those pairs. Only queries in the first
    # chunk of some round see that; every other row agrees to the 1e-9 that
    # reformer-pytorch adds to the counts (log(count + 1e-9): ~3e-9 measured here).
    n, c = 64, 8
    rng = np.random.default_rng(n_hashes)
    qk, v = rng.standard_normal((2, 1, n, 8))
    r = lsh_rotations(8, n_hashes, n // c, seed=n_hashes, xp=np)
    theirs = _reformer_pytorch(monkeypatch, qk, v, r, c, False)
    ours = reformer_attention(qk, shared_keys(qk), v, rotations=r, chunk_size=c)
    _, chunk = lsh_chunks(lsh_buckets(qk, r), c)
    first = np.any(chunk == 0, axis=-2)
    np.testing.assert_allclose(theirs[~first], ours[~first], rtol=0, atol=1e-8)
    assert np.abs(theirs[first] - ours[first]).max() > 1e-2  # a real convention difference


def test_given_buckets_fix_the_hash_where_set():
    import array_api_strict as xp

    x = xp.reshape(xp.sin(xp.arange(96.0)), (2, 12, 4))
    r = lsh_rotations(4, 2, 4, seed=0, xp=xp)
    hashed = lsh_buckets(x, r)
    kw = dict(rotations=r, chunk_size=3)
    none = xp.full(tuple(hashed.shape), -1, dtype=xp.int64)
    np.testing.assert_array_equal(np.asarray(reformer_attention(x, x, x, buckets=none, **kw)),
                                  np.asarray(reformer_attention(x, x, x, **kw)))
    moved = np.asarray(hashed).copy()
    moved[0, 1, 5] = (moved[0, 1, 5] + 1) % 4  # one token of one round in another bucket
    given = xp.asarray(moved)
    out = reformer_attention(x, x, x, buckets=given, **kw)
    assert not np.allclose(np.asarray(out), np.asarray(reformer_attention(x, x, x, **kw)))
    # the efficient form and the defining one agree on the given buckets
    np.testing.assert_allclose(np.asarray(out), np.asarray(reformer_weights(x, x, buckets=given, **kw) @ x),
                               rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"buckets must be an integer array of shape \(\.\.\., n_hashes"):
        reformer_attention(x, x, x, buckets=given[..., :5], **kw)
