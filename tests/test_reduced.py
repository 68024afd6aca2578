"""attn_ref.reduced: pooled keys, query reduction, Nystromformer, clustered attention."""

import numpy as np
import pytest

from attn_ref import (
    clustered_attention,
    clustered_weights,
    iterative_pinv,
    nystrom_attention,
    nystrom_weights,
    pooled_attention,
    pooled_weights,
    query_reduced_attention,
    query_reduced_weights,
)
from attn_ref.reduced import kmeans, kmeans_initial_rows, segment_expand, segment_means, segment_sizes
from conformance.backends import from_numpy
from tests.helpers import assert_close, call, host, randn
from tests.plain import (
    naive_attention,
    naive_clustered,
    naive_expand,
    naive_means,
    naive_nystrom,
    pool_mask,
)

N, D, DV = 10, 4, 3


def _qkv(backend, dtype="float64", nq=N, nk=N, batch=(2, 3)):
    q, qh = randn(backend, batch + (nq, D), dtype, seed=1)
    k, kh = randn(backend, batch + (nk, D), dtype, seed=2)
    v, vh = randn(backend, batch + (nk, DV), dtype, seed=3)
    return (q, k, v), (qh, kh, vh)


def _rel(a, b):
    return np.abs(a - b).max() / np.abs(b).max()


# ---------------------------------------------------------------------------- segments

def test_segment_sizes():
    import array_api_compat.numpy as xp

    for n in range(1, 25):
        for m in range(1, n + 1):
            sizes = segment_sizes(n, m)
            assert sum(sizes) == n and len(sizes) == m and max(sizes) - min(sizes) <= 1
            assert sizes == sorted(sizes, reverse=True)
            x = np.random.default_rng(n).standard_normal((n, 2))
            np.testing.assert_allclose(segment_means(x, m, xp=xp), naive_means(x, m), rtol=1e-14)
            np.testing.assert_array_equal(segment_expand(x[:m], n, xp=xp), naive_expand(x[:m], n))


@pytest.mark.parametrize("n,m", [(10, 3), (12, 4)])
def test_segment_means_and_expand(backend, n, m):
    x, xh = randn(backend, (2, n, 3), seed=4)
    means = call(backend, segment_means, x, m)
    assert_close(means, naive_means(xh, m), backend)
    assert_close(call(backend, segment_expand, means, n), naive_expand(naive_means(xh, m), n),
                 backend)


# ------------------------------------------------------------------------------ pooled

@pytest.mark.parametrize("causal", [False, "top-left"])
def test_pooled_all_segments_is_softmax(backend, causal):
    (q, k, v), (qh, kh, vh) = _qkv(backend)
    out = call(backend, pooled_attention, q, k, v, num_segments=N, causal=causal)
    want = naive_attention(qh, kh, vh, causal=None if causal is False else causal)[0]
    assert_close(out, want, backend)


@pytest.mark.parametrize("causal,nq", [(False, N), ("top-left", N), ("bottom-right", 6)])
def test_pooled_matches_plain_numpy(backend, causal, nq):
    (q, k, v), (qh, kh, vh) = _qkv(backend, nq=nq)
    m = 3  # segments of 4, 3, 3
    out = call(backend, pooled_attention, q, k, v, num_segments=m, causal=causal)
    want, p = naive_attention(qh, naive_means(kh, m), naive_means(vh, m),
                              mask=pool_mask(nq, N, m, causal))
    assert_close(out, want, backend)
    if causal == "top-left":  # queries before the end of the first segment see nothing
        w = host(call(backend, pooled_weights, q, k, num_segments=m, causal=causal))
        np.testing.assert_allclose(w @ vh, want, rtol=1e-13, atol=1e-13)
        assert np.all(host(out)[..., :3, :] == 0.0) and np.all(host(out)[..., 3:, :] != 0.0)


# ----------------------------------------------------------------------- query reduced

def test_query_reduced_all_segments_is_softmax(backend):
    (q, k, v), (qh, kh, vh) = _qkv(backend, nk=7)
    out = call(backend, query_reduced_attention, q, k, v, num_segments=N)
    assert_close(out, naive_attention(qh, kh, vh)[0], backend)


def test_query_reduced_matches_plain_numpy(backend):
    (q, k, v), (qh, kh, vh) = _qkv(backend, nk=7)
    m = 4  # segments of 3, 3, 2, 2
    short, p = naive_attention(naive_means(qh, m), kh, vh)
    out = call(backend, query_reduced_attention, q, k, v, num_segments=m, expand=False)
    assert_close(out, short, backend)
    full = call(backend, query_reduced_attention, q, k, v, num_segments=m)
    assert_close(full, naive_expand(short, N), backend)
    w = host(call(backend, query_reduced_weights, q, k, num_segments=m))
    np.testing.assert_allclose(w, naive_expand(p, N), rtol=1e-13, atol=1e-13)


# ----------------------------------------------------------------------- iterative pinv

def _matrices():
    rng = np.random.default_rng(5)
    well = np.eye(5) * 3 + rng.standard_normal((5, 5)) * 0.3
    general = rng.standard_normal((5, 5))  # condition number ~ 80
    s = rng.standard_normal((5, 5))
    softmax = np.exp(s) / np.exp(s).sum(-1, keepdims=True)
    return np.stack([well, general, softmax])


def test_iterative_pinv_converges_to_pinv(backend):
    xp = backend.xp
    a = from_numpy(_matrices(), backend)
    want = call(backend, xp.linalg.pinv, a)
    errors = []
    for it in (2, 6, 25):
        z = host(call(backend, iterative_pinv, a, iterations=it))
        errors.append(np.abs(z - host(want)).max(axis=(-2, -1)))
    assert_close(call(backend, iterative_pinv, a, iterations=25), host(want), backend,
                 rtol=1e-11, atol=1e-11)
    assert np.all(errors[1] <= errors[0]) and np.all(errors[2] < 1e-11)
    assert errors[0].max() > 1e-3  # two steps are not enough: the test can tell


def test_iterative_pinv_rank_deficient_and_zero(backend):
    rng = np.random.default_rng(6)
    u = np.linalg.qr(rng.standard_normal((4, 4)))[0][:, :2]
    low = u @ np.diag([1.0, 0.5]) @ u.T  # rank 2
    a = from_numpy(np.stack([low, np.zeros((4, 4))]), backend)
    z = host(call(backend, iterative_pinv, a, iterations=7))
    np.testing.assert_allclose(z[0], np.linalg.pinv(low), rtol=1e-11, atol=1e-11)
    assert np.all(z[1] == 0.0)


def test_iterative_pinv_initialises_per_matrix(backend):
    # A batch of a matrix and 1e-3 times another: with one batch-wide scale for Z_0 the
    # small matrix would start 1e6 times too small and be nowhere near its inverse
    # after 6 steps (relative error ~1, computed in NumPy below); per matrix it is exact.
    m = _matrices()[0]
    batch = np.stack([m, 1e-3 * m])
    z = host(call(backend, iterative_pinv, from_numpy(batch, backend), iterations=6))
    assert _rel(z[1], np.linalg.pinv(1e-3 * m)) < 1e-12
    assert _rel(z[0], np.linalg.pinv(m)) < 1e-12
    absb = np.abs(batch)
    zg = np.swapaxes(batch, -1, -2) / (absb.sum(-2).max() * absb.sum(-1).max())
    eye = np.eye(5)
    for _ in range(6):
        az = batch @ zg
        zg = 0.25 * zg @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    assert _rel(zg[1], np.linalg.pinv(1e-3 * m)) > 0.5
    # ... which is what pinv_init="global" computes.
    zgot = host(call(backend, iterative_pinv, from_numpy(batch, backend), iterations=6,
                     pinv_init="global"))
    np.testing.assert_allclose(zgot, zg, rtol=1e-12, atol=0)


def _softmax_batch(b=2, h=3, m=4, seed=7):
    """Softmax matrices whose column sums differ across heads (logits scaled by head)."""
    s = np.random.default_rng(seed).standard_normal((b, h, m, m))
    s = s * np.arange(1, h + 1)[:, None, None]
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _newton_schulz(k, v, iterations=6):
    """HuggingFace's ``iterative_inv`` loop from the start ``v``."""
    eye = np.eye(k.shape[-1])
    for _ in range(iterations):
        kv = k @ v
        v = (0.25 * v) @ (13 * eye - kv @ (15 * eye - kv @ (7 * eye - kv)))
    return v


def test_iterative_pinv_global_init_is_huggingface_original_and_lucidrains(backend):
    # HuggingFace NystromformerSelfAttention.iterative_inv, init_option="original":
    # V = 1 / torch.max(torch.sum(K, dim=-2)) * K^T, one maximum over the whole tensor;
    # the other option: 1 / torch.max(torch.sum(K, dim=-2), dim=-1) per matrix.
    k = _softmax_batch()
    hf_original = _newton_schulz(k, np.swapaxes(k, -1, -2) / np.max(k.sum(-2)))
    hf_exact = _newton_schulz(k, np.swapaxes(k, -1, -2) / k.sum(-2).max(-1)[..., None, None])
    a = from_numpy(k, backend)
    glob = host(call(backend, iterative_pinv, a, pinv_init="global"))
    per = host(call(backend, iterative_pinv, a))
    np.testing.assert_allclose(glob, hf_original, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(per, hf_exact, rtol=1e-12, atol=1e-12)
    assert _rel(glob, per) > 1e-3  # after 6 steps the two starts are two functions
    # lucidrains' moore_penrose_iter_pinv, also for matrices that are not softmax:
    # z = x^T / (max(|x|.sum(-1)) * max(|x|.sum(-2))), maxima over the whole tensor.
    x = np.random.default_rng(8).standard_normal((2, 3, 4, 4)) + 3 * np.eye(4)
    x[1] *= 5.0
    ax = np.abs(x)
    want = _newton_schulz(x, np.swapaxes(x, -1, -2) / (ax.sum(-1).max() * ax.sum(-2).max()))
    got = host(call(backend, iterative_pinv, from_numpy(x, backend), pinv_init="global"))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_iterative_pinv_bad_input(backend):
    a, _ = randn(backend, (2, 3, 4))
    msg = r"a must have shape \(..., m, m\) \(square\), got shape \(2, 3, 4\)"
    with pytest.raises(ValueError, match=msg):
        iterative_pinv(a)
    sq, _ = randn(backend, (3, 3))
    with pytest.raises(ValueError, match="iterations must be a non-negative integer, got -1"):
        iterative_pinv(sq, iterations=-1)
    ints = backend.xp.asarray([[1, 0], [0, 1]], device=backend.device)
    with pytest.raises(TypeError, match="a must have a real floating dtype"):
        iterative_pinv(ints)


# ------------------------------------------------------------------------ Nystromformer

@pytest.mark.parametrize("iterations", [None, 20])
def test_nystrom_all_landmarks_is_softmax(backend, iterations):
    (q, k, v), (qh, kh, vh) = _qkv(backend)
    out = call(backend, nystrom_attention, q, k, v, num_landmarks=N, pinv_iterations=iterations)
    assert_close(out, naive_attention(qh, kh, vh)[0], backend, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("iterations,nq", [(6, N), (None, 7)])
def test_nystrom_matches_plain_numpy(backend, iterations, nq):
    (q, k, v), (qh, kh, vh) = _qkv(backend, nq=nq)
    m = 3  # N = 10 is not a multiple of 3: segments of 4, 3, 3
    out = call(backend, nystrom_attention, q, k, v, num_landmarks=m, pinv_iterations=iterations)
    want, want_w = naive_nystrom(qh, kh, vh, m, iterations)
    assert_close(out, want, backend, rtol=1e-11, atol=1e-11)
    if iterations is not None:
        w = call(backend, nystrom_weights, q, k, num_landmarks=m, pinv_iterations=iterations)
        assert_close(w, want_w, backend, rtol=1e-11, atol=1e-11)
    # An approximation, not softmax: three landmarks cannot reproduce ten keys.
    assert np.abs(host(out) - naive_attention(qh, kh, vh)[0]).max() > 1e-3


def test_nystrom_global_pinv_init_matches_plain_numpy(backend):
    # b2h3: six landmark matrices share one start (HuggingFace's "original" formula in
    # tests.plain), so each output depends on the other heads' inputs too.
    (q, k, v), (qh, kh, vh) = _qkv(backend)
    out = call(backend, nystrom_attention, q, k, v, num_landmarks=3, pinv_init="global")
    w = call(backend, nystrom_weights, q, k, num_landmarks=3, pinv_init="global")
    want, want_w = naive_nystrom(qh, kh, vh, 3, 6, pinv_init="global")
    assert_close(out, want, backend, rtol=1e-11, atol=1e-11)
    assert_close(w, want_w, backend, rtol=1e-11, atol=1e-11)
    assert np.abs(want - naive_nystrom(qh, kh, vh, 3, 6)[0]).max() > 1e-4
    # the batch is coupled: scaling one head's logits changes another head's output
    q2 = from_numpy(np.concatenate([qh[:1], 3 * qh[1:]]), backend)
    out2 = host(call(backend, nystrom_attention, q2, k, v, num_landmarks=3, pinv_init="global"))
    assert np.abs(out2[0] - host(out)[0]).max() > 1e-6


def test_nystrom_float32(backend):
    (q, k, v), (qh, kh, vh) = _qkv(backend, "float32")
    out = call(backend, nystrom_attention, q, k, v, num_landmarks=5)
    want, _ = naive_nystrom(qh, kh, vh, 5, 6)
    assert_close(out, want, backend, dtype="float32", rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------- clustered

def _with_duplicates(backend, dtype):
    (q, k, v), (qh, kh, vh) = _qkv(backend, dtype)
    qh = qh.copy()
    qh[..., 7, :] = qh[..., 3, :]  # duplicate queries share a centroid
    q = from_numpy(qh, backend, dtype)
    return (q, k, v), (host(q), kh, vh)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_clustered_all_clusters_is_softmax(backend, dtype):
    (q, k, v), (qh, kh, vh) = _with_duplicates(backend, dtype)
    out = call(backend, clustered_attention, q, k, v, num_clusters=N, iterations=2)
    assert_close(out, naive_attention(qh, kh, vh)[0], backend, dtype=dtype)


def test_clustered_topk_all_keys_is_softmax(backend):
    # topk = Nk: every query gets exact softmax whatever its cluster. Batch and head
    # axes broadcast (q per batch, k per head), which the per-query gathers must follow.
    q, qh = randn(backend, (2, 1, N, D), seed=1)
    k, kh = randn(backend, (1, 3, N, D), seed=2)
    v, vh = randn(backend, (2, 3, N, DV), seed=3)
    out = call(backend, clustered_attention, q, k, v, num_clusters=2, iterations=2, topk=N)
    assert_close(out, naive_attention(qh, kh, vh)[0], backend, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("topk", [None, 4])
def test_clustered_matches_plain_numpy(backend, topk):
    (q, k, v), (qh, kh, vh) = _qkv(backend)
    out = call(backend, clustered_attention, q, k, v, num_clusters=3, iterations=3, topk=topk,
               seed=7)
    want, want_w = naive_clustered(qh, kh, vh, 3, 3, 7, topk)
    assert_close(out, want, backend, rtol=1e-12, atol=1e-12)
    # Deterministic from the seed: a second run is bit-identical.
    again = call(backend, clustered_attention, q, k, v, num_clusters=3, iterations=3, topk=topk,
                 seed=7)
    assert np.array_equal(host(again), host(out))
    w = host(call(backend, clustered_weights, q, k, num_clusters=3, iterations=3, topk=topk,
                  seed=7))
    np.testing.assert_allclose(w, want_w, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-13)
    np.testing.assert_allclose(w @ vh, want, rtol=1e-12, atol=1e-12)
    if topk is None:  # members of a cluster share one output row
        assert len(np.unique(np.round(host(out)[0, 0], 12), axis=0)) <= 3


def test_clustered_topk_keys_fix_the_selection(backend):
    # topk_keys replaces each centroid's top-k by the given keys (conformance judges a near
    # tie's other admissible selection with it): the plain form with that selection, which
    # is another function than the natural one here.
    (q, k, v), (qh, kh, vh) = _qkv(backend)
    keys = np.array([[0, 1, 2, 3], [9, 8, 7, 6], [1, 3, 5, 7]])
    out = call(backend, clustered_attention, q, k, v, num_clusters=3, iterations=3, topk=4, seed=7,
               topk_keys=from_numpy(keys, backend))
    want, _ = naive_clustered(qh, kh, vh, 3, 3, 7, 4, topk_keys=keys)
    assert_close(out, want, backend, rtol=1e-12, atol=1e-12)
    natural, _ = naive_clustered(qh, kh, vh, 3, 3, 7, 4)
    assert np.max(np.abs(want - natural)) > 1e-2
    with pytest.raises(ValueError, match=r"topk_keys must be an integer array of shape \(\.\.\., C, topk\) "
                       r"= \(\.\.\., 3, 4\).*got shape \(3, 3\)"):
        clustered_attention(q, k, v, num_clusters=3, topk=4, topk_keys=from_numpy(keys[:, :3], backend))
    with pytest.raises(ValueError, match="topk_keys fixes the top-k selection, but topk is None"):
        clustered_attention(q, k, v, num_clusters=3, topk_keys=from_numpy(keys, backend))
    with pytest.raises(ValueError, match=r"got shape \(3, 4\) and dtype .*float64"):
        clustered_attention(q, k, v, num_clusters=3, topk=4, topk_keys=from_numpy(keys * 1.0, backend))


@pytest.mark.parametrize("topk", [None, 4])
def test_clustered_assignments_fix_the_clustering(backend, topk):
    # assignments overrides k-means assignments where >= 0 and lets Lloyd's iterations go
    # on from there (conformance judges a near tie of an assignment with it): all -1 is
    # the natural clustering, bit for bit; one query moved at step 1 and another at the
    # final step is the plain form moved likewise, another function than the natural one.
    (q, k, v), (qh, kh, vh) = _qkv(backend)
    kw = {"num_clusters": 3, "iterations": 3, "topk": topk, "seed": 7}
    free = np.full((2, 3, 4, N), -1)
    got = call(backend, clustered_attention, q, k, v, **kw, assignments=from_numpy(free, backend))
    assert np.array_equal(host(got), host(call(backend, clustered_attention, q, k, v, **kw)))
    moved = free.copy()
    moved[:, :, 1, 2] = 0
    moved[1, 2, 3, 5] = 2
    out = call(backend, clustered_attention, q, k, v, **kw, assignments=from_numpy(moved, backend))
    want, _ = naive_clustered(qh, kh, vh, 3, 3, 7, topk, assignments=moved)
    assert_close(out, want, backend, rtol=1e-12, atol=1e-12)
    natural, _ = naive_clustered(qh, kh, vh, 3, 3, 7, topk)
    assert np.max(np.abs(want - natural)) > 1e-2
    with pytest.raises(ValueError, match=r"assignments must be an integer array of shape "
                       r"\(\.\.\., iterations \+ 1, N\) = \(\.\.\., 4, 10\).*got shape \(2, 3, 3, 10\)"):
        clustered_attention(q, k, v, **kw, assignments=from_numpy(moved[:, :, :3], backend))
    with pytest.raises(ValueError, match=r"got shape \(2, 3, 4, 10\) and dtype .*float64"):
        clustered_attention(q, k, v, **kw, assignments=from_numpy(moved * 1.0, backend))


def test_kmeans_lloyd_never_increases_inertia():
    import array_api_compat.numpy as xp

    x = np.random.default_rng(8).standard_normal((3, 40, 2))
    inertia = []
    for it in range(6):
        cent, idx, _ = kmeans(x, 5, iterations=it, seed=2, xp=xp)
        inertia.append(((x - np.take_along_axis(cent, idx[..., None], axis=-2)) ** 2).sum((-2, -1)))
    assert np.all(np.diff(np.array(inertia), axis=0) <= 1e-12)


def test_kmeans_starts_from_its_published_initial_rows():
    # The exported vectors hand these rows to external kernels: they must be the rows
    # kmeans itself starts from, for every seed (seeds 3 and 4 draw different rows).
    import array_api_compat.numpy as xp

    x = np.random.default_rng(9).standard_normal((2, 30, 3))
    starts = set()
    for seed in (3, 4):
        rows = kmeans_initial_rows(30, 4, seed)
        assert len(set(rows)) == 4 and all(0 <= r < 30 for r in rows)
        cent, _, _ = kmeans(x, 4, iterations=0, seed=seed, xp=xp)
        np.testing.assert_array_equal(cent, x[:, rows, :])
        starts.add(tuple(rows))
    assert len(starts) == 2
    with pytest.raises(ValueError, match="num_clusters"):
        kmeans_initial_rows(3, 4)


# -------------------------------------------------------------------------- refusals

NO_CAUSAL = [
    (query_reduced_attention, dict(num_segments=2)),
    (nystrom_attention, dict(num_landmarks=2)),
    (clustered_attention, dict(num_clusters=2)),
]


@pytest.mark.parametrize("fn,kw", NO_CAUSAL, ids=lambda x: getattr(x, "__name__", ""))
def test_refuses_causal(backend, fn, kw):
    (q, k, v), _ = _qkv(backend)
    for causal in (True, "top-left", "bottom-right"):
        with pytest.raises(ValueError, match=f"{fn.__name__} does not support causal masking"):
            fn(q, k, v, causal=causal, **kw)


def test_bad_input(backend):
    (q, k, v), _ = _qkv(backend, nq=6)
    cases = [
        (pooled_attention, dict(num_segments=11), "num_segments must be at most the number of keys Nk=10"),
        (pooled_attention, dict(num_segments=0), "num_segments must be a positive integer, got 0"),
        (pooled_attention, dict(num_segments=2, causal="yes"), "causal must be False, True"),
        (query_reduced_attention, dict(num_segments=7),
         "num_segments must be at most the number of queries Nq=6"),
        (nystrom_attention, dict(num_landmarks=7), r"num_landmarks must be at most .*min\(6, 10\)"),
        (nystrom_attention, dict(num_landmarks=0), "num_landmarks must be a positive integer"),
        (nystrom_attention, dict(num_landmarks=2, pinv_iterations=0), "pinv_iterations must be a positive"),
        (clustered_attention, dict(num_clusters=7),
         "num_clusters must be at most the number of queries Nq=6"),
        (clustered_attention, dict(num_clusters=0), "num_clusters must be a positive integer"),
        (clustered_attention, dict(num_clusters=2, topk=11), "topk must be at most the number of keys Nk=10"),
        (clustered_attention, dict(num_clusters=2, topk=0), "topk must be a positive integer"),
        (clustered_attention, dict(num_clusters=2, iterations=-1),
         "iterations must be a non-negative integer"),
        (clustered_attention, dict(num_clusters=2, seed=-1), "seed must be a non-negative integer"),
        (clustered_attention, dict(num_clusters=2, scale=float("inf")), "scale must be a finite real number"),
    ]
    for fn, kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            fn(q, k, v, **kw)
    with pytest.raises(ValueError, match="k and v must have the same sequence length"):
        nystrom_attention(q, k, v[..., :9, :], num_landmarks=2)
    # A non-integer count is a wrong type, not a wrong value.
    with pytest.raises(TypeError, match=r"pinv_iterations must be a positive integer, got 2\.5 \(float\)"):
        nystrom_attention(q, k, v, num_landmarks=2, pinv_iterations=2.5)
    msg = r"pinv_init must be one of \('matrix', 'global'\), got 'batch'"
    with pytest.raises(ValueError, match=msg):
        nystrom_attention(q, k, v, num_landmarks=2, pinv_init="batch")
    with pytest.raises(ValueError, match=msg):
        nystrom_weights(q, k, num_landmarks=2, pinv_init="batch")
    with pytest.raises(ValueError, match=msg):
        iterative_pinv(q[..., :4, :], pinv_init="batch")
    with pytest.raises(TypeError, match=r"pinv_init must be a str, .*got None \(NoneType\)"):
        nystrom_attention(q, k, v, num_landmarks=2, pinv_init=None)


# -------------------------------------------------------------------------- registry
