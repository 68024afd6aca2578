"""attn_ref.routing: Routing Transformer attention, balanced and plain routing."""

import array_api_compat.numpy as npx
import numpy as np
import pytest

from attn_ref.routing import routing_attention, routing_centroids, routing_weights
from conformance.backends import from_numpy
from tests.helpers import assert_close, call, host, randn
from tests.plain import naive_attention, naive_routing

N, D, DV = 10, 4, 3


def _qkv(backend, dtype="float64", nq=N, nk=N, batch=(2, 3)):
    q, qh = randn(backend, batch + (nq, D), dtype, seed=1)
    k, kh = randn(backend, batch + (nk, D), dtype, seed=2)
    v, vh = randn(backend, batch + (nk, DV), dtype, seed=3)
    return (q, k, v), (qh, kh, vh)


def _centroids(backend, c, dtype="float64", seed=5):
    mu = routing_centroids(c, D, seed=seed, xp=npx)
    return from_numpy(np.asarray(mu), backend, dtype), np.asarray(mu)


# ------------------------------------------------------------------------------ limits


@pytest.mark.parametrize("balanced", [True, False])
@pytest.mark.parametrize("causal", [False, True, "bottom-right"])
def test_one_cluster_is_softmax(backend, balanced, causal):
    (q, k, v), (qh, kh, vh) = _qkv(backend, nq=7)
    mu, _ = _centroids(backend, 1)
    out = call(backend, routing_attention, q, k, v, centroids=mu, balanced=balanced, causal=causal)
    align = {False: None, True: "top-left"}.get(causal, causal)
    assert_close(out, naive_attention(qh, kh, vh, causal=align)[0], backend, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("balanced", [True, False])
def test_every_token_its_own_centroid_is_the_identity(backend, balanced):
    # q = k and the centroids are the unit tokens themselves: centroid i takes token i
    # (w = N / C = 1) and nothing else, so every query attends to itself alone.
    (q, _, v), (qh, _, vh) = _qkv(backend, batch=())
    mu = from_numpy(qh / np.linalg.norm(qh, axis=-1, keepdims=True), backend)
    out = call(backend, routing_attention, q, q, v, centroids=mu, balanced=balanced)
    assert_close(out, vh, backend, rtol=1e-13, atol=1e-13)


# ----------------------------------------------------------- forms against plain loops


@pytest.mark.parametrize("balanced", [True, False])
@pytest.mark.parametrize("causal,nq,size", [(False, N, None), (True, N, 4), ("bottom-right", 7, None),
                                            (False, 13, 2)])
def test_matches_plain_loops_and_weights(backend, balanced, causal, nq, size):
    (q, k, v), (qh, kh, vh) = _qkv(backend, nq=nq)
    mu, muh = _centroids(backend, 3)
    opts = dict(centroids=mu, balanced=balanced, causal=causal, cluster_size=size)
    out = call(backend, routing_attention, q, k, v, **opts)
    w = call(backend, routing_weights, q, k, **opts)
    align = {False: None, True: "top-left"}.get(causal, causal)
    want, want_w = naive_routing(qh, kh, vh, muh, align, size, balanced)
    assert_close(out, want, backend, rtol=1e-12, atol=1e-12)
    assert_close(w, want_w, backend, rtol=1e-12, atol=1e-12)
    # defining form (dense weights) == efficient form (gather, attend, average)
    np.testing.assert_allclose(host(w) @ vh, host(out), rtol=1e-12, atol=1e-12)


def _other_routes(seed, batch, c, w, n):
    """A routing no score would choose: ``w`` distinct random tokens per centroid."""
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(n)[:w] for _ in range(int(np.prod(batch)) * c)]).reshape(
        batch + (c, w))


@pytest.mark.parametrize("causal", [False, "bottom-right"])
def test_given_routes_are_the_function_of_that_routing(backend, causal):
    # The tie handle of conformance.ties: each centroid's tokens given instead of chosen.
    (q, k, v), (qh, kh, vh) = _qkv(backend, nq=7)
    mu, muh = _centroids(backend, 3)
    qr, kr = _other_routes(0, (2, 3), 3, 3, 7), _other_routes(1, (3,), 3, 4, N)  # keys: per head
    out = call(backend, routing_attention, q, k, v, centroids=mu, causal=causal,
               query_routes=from_numpy(qr, backend), key_routes=from_numpy(kr, backend))
    want, _ = naive_routing(qh, kh, vh, muh, causal or None, None, True, qr, kr)
    assert not np.allclose(want, naive_routing(qh, kh, vh, muh, causal or None)[0])
    assert_close(out, want, backend, rtol=1e-12, atol=1e-12)
    # the routing the scores choose, given in another slot order, is the default
    from attn_ref.routing import balanced_routes

    qi, _ = balanced_routes(npx, qh, muh, 3, (2, 3))
    ki, _ = balanced_routes(npx, kh, muh, 4, (2, 3))
    same = call(backend, routing_attention, q, k, v, centroids=mu, causal=causal,
                query_routes=from_numpy(np.ascontiguousarray(qi[..., ::-1]), backend),
                key_routes=from_numpy(ki, backend))
    assert_close(same, host(call(backend, routing_attention, q, k, v, centroids=mu, causal=causal)),
                 backend, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("causal", [False, "bottom-right"])
def test_given_clusters_are_the_function_of_that_plain_routing(backend, causal):
    # conformance.ties' handle on plain routing: a token's centroid given where >= 0; all
    # -1 is the nearest, bit for bit; two queries and a key moved is the plain loop with
    # them moved, another function
    (q, k, v), (qh, kh, vh) = _qkv(backend, nq=7)
    mu, muh = _centroids(backend, 3)
    kw = {"centroids": mu, "causal": causal, "balanced": False}
    free_q, free_k = np.full((2, 3, 7), -1), np.full((3, N), -1)  # keys: per head
    got = call(backend, routing_attention, q, k, v, **kw, query_clusters=from_numpy(free_q, backend),
               key_clusters=from_numpy(free_k, backend))
    assert np.array_equal(host(got), host(call(backend, routing_attention, q, k, v, **kw)))
    qc, kc = free_q.copy(), free_k.copy()
    qc[0, 1, 2], qc[1, 2, 6], kc[1, 4] = 2, 0, 1
    out = call(backend, routing_attention, q, k, v, **kw, query_clusters=from_numpy(qc, backend),
               key_clusters=from_numpy(kc, backend))
    want, _ = naive_routing(qh, kh, vh, muh, causal or None, None, False, query_clusters=qc,
                            key_clusters=kc)
    assert not np.allclose(want, naive_routing(qh, kh, vh, muh, causal or None, None, False)[0])
    assert_close(out, want, backend, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="query_clusters fixes plain routing's nearest centroids, "
                                         "but balanced is True"):
        routing_attention(q, k, v, centroids=mu, query_clusters=from_numpy(qc, backend))
    with pytest.raises(ValueError, match=r"key_clusters must be an integer array of shape "
                                         r"\(\.\.\., N\) = \(\.\.\., 10\).*got shape \(3, 7\)"):
        routing_attention(q, k, v, **kw, key_clusters=from_numpy(kc[:, :7], backend))


def test_balanced_average_zeros_and_overlaps():
    # The rules the docs state, on one case with each: a query in two clusters gets the
    # mean of two softmax outputs, one in none gets zeros.
    import array_api_compat.numpy as xp

    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((8, 4)), rng.standard_normal((8, 4)), rng.standard_normal((8, 3))
    mu = np.asarray(routing_centroids(3, 4, seed=1, xp=xp))
    out = routing_attention(q, k, v, centroids=mu)  # w = 3: 9 places for 8 queries
    unit = q / np.linalg.norm(q, axis=-1, keepdims=True)
    member = [set(np.argsort(-(unit @ m), kind="stable")[:3]) for m in mu]
    kmember = [list(np.argsort(-(k / np.linalg.norm(k, axis=-1, keepdims=True) @ m),
                               kind="stable")[:3]) for m in mu]
    counts = [sum(i in s for s in member) for i in range(8)]
    assert 0 in counts and max(counts) >= 2
    for i in range(8):
        outs = [naive_attention(q[i:i + 1], k[ks], v[ks])[0][0] for s, ks in zip(member, kmember) if i in s]
        want = np.mean(outs, axis=0) if outs else np.zeros(3)
        np.testing.assert_allclose(out[i], want, rtol=1e-13, atol=1e-14)


def test_routing_uses_directions_only(backend):
    # Scaling a query by a positive factor moves no token between clusters: only its
    # logits change. (An unnormalised routing would move the scaled token.)
    (q, k, v), (qh, kh, vh) = _qkv(backend, batch=())
    mu, muh = _centroids(backend, 3)
    factor = np.ones((N, 1))
    factor[::2] = 40.0
    qs = from_numpy(qh * factor, backend)
    w0 = host(call(backend, routing_weights, q, k, centroids=mu))
    w1 = host(call(backend, routing_weights, qs, k, centroids=mu))
    np.testing.assert_array_equal(w0 > 0, w1 > 0)


def test_causal_inside_a_cluster(backend):
    (q, k, v), (qh, kh, vh) = _qkv(backend)
    mu, _ = _centroids(backend, 2)
    for balanced in (True, False):
        w = host(call(backend, routing_weights, q, k, centroids=mu, causal=True, balanced=balanced))
        assert np.all(np.triu(w, 1) == 0)
        free = host(call(backend, routing_weights, q, k, centroids=mu, balanced=balanced))
        assert np.any(np.triu(free, 1) > 0)  # the mask is what removed them


def test_per_head_centroids_broadcast(backend):
    (q, k, v), (qh, kh, vh) = _qkv(backend, batch=(2, 3))
    muh = np.stack([np.asarray(routing_centroids(3, D, seed=s, xp=npx))
                    for s in range(3)])  # (H, C, d)
    out = call(backend, routing_attention, q, k, v, centroids=from_numpy(muh, backend))
    for h in range(3):
        want, _ = naive_routing(qh[:, h], kh[:, h], vh[:, h], muh[h])
        np.testing.assert_allclose(host(out)[:, h], want, rtol=1e-12, atol=1e-12)


def test_float32_and_inputs_untouched(backend):
    (q, k, v), (qh, kh, vh) = _qkv(backend, dtype="float32")
    mu, muh = _centroids(backend, 3, dtype="float32")
    before = [host(x) for x in (q, k, v, mu)]
    out = call(backend, routing_attention, q, k, v, centroids=mu, causal=True)
    assert str(out.dtype).endswith("float32")
    want, _ = naive_routing(qh, kh, vh, host(mu), "top-left")
    np.testing.assert_allclose(host(out), want, rtol=0, atol=1e-5)
    for b, x in zip(before, (q, k, v, mu)):
        np.testing.assert_array_equal(host(x), b)


def test_bad_input(backend):
    (q, k, v), _ = _qkv(backend)
    mu, muh = _centroids(backend, 3)
    with pytest.raises(ValueError, match=r"centroids must have shape \(\.\.\., C, d\) with C >= 1 and the "
                                         r"head dimension of q \(d=4\), got shape \(3, 2\)"):
        routing_attention(q, k, v, centroids=mu[:, :2])
    with pytest.raises(ValueError, match=r"got shape \(0, 4\)"):
        routing_attention(q, k, v, centroids=mu[:0, :])
    with pytest.raises(TypeError, match=r"centroids must have the dtype of q"):
        routing_attention(q, k, v, centroids=from_numpy(muh, backend, "float32"))
    with pytest.raises(TypeError, match="centroids must be an array"):
        routing_attention(q, k, v, centroids=muh.tolist())
    with pytest.raises(ValueError, match="cluster_size must be a positive integer, got 0"):
        routing_attention(q, k, v, centroids=mu, cluster_size=0)
    with pytest.raises(TypeError, match="balanced must be True or False"):
        routing_attention(q, k, v, centroids=mu, balanced="no")
    with pytest.raises(ValueError, match="causal must be False, True"):
        routing_attention(q, k, v, centroids=mu, causal="yes")
    with pytest.raises(ValueError, match="leading .batch, head. dimensions do not broadcast"):
        routing_attention(q, k, v, centroids=from_numpy(np.ones((4, 3, D)), backend))
    routes = from_numpy(_other_routes(0, (), 3, 5, N), backend)  # w = ceil(10 / 3) = 4
    with pytest.raises(ValueError, match=r"query_routes must be an integer array of shape "
                                         r"\(\.\.\., C, w\) = \(\.\.\., 3, 4\) indexing the 10 "
                                         r"tokens; got shape \(3, 5\)"):
        routing_attention(q, k, v, centroids=mu, query_routes=routes)
    with pytest.raises(ValueError, match=r"key_routes must be an integer array .* got shape "
                                         r"\(3, 4\) and dtype .*float"):
        routing_attention(q, k, v, centroids=mu, key_routes=from_numpy(np.ones((3, 4)), backend))
    with pytest.raises(ValueError, match="key_routes fixes the balanced routing, but balanced is "
                                         "False"):
        routing_attention(q, k, v, centroids=mu, key_routes=routes, balanced=False)


# ------------------------------------------------------- calibration: routing-transformer


def test_calibration_against_routing_transformer():
    """``routing_transformer.KmeansAttention`` (1.6.1, non-causal, separate q and k) fed
    the same unit centroids: the same clusters and outputs, up to one convention.

    Its ``scatter_mean`` divides by ``count + 1e-5``, so every chosen query's output is
    ``count / (count + 1e-5)`` of ours (relative 1e-5 for a query in one cluster);
    with that factor the two agree to float64 rounding. Its causal form adds a learned
    memory key and value to every cluster (``num_mem_kv >= 1``), which this reference
    does not have, so only the non-causal form is compared (``docs/routing.md``).
    """
    torch = pytest.importorskip("torch")
    rt = pytest.importorskip("routing_transformer.routing_transformer")
    from attn_ref.routing import balanced_routes

    rng = np.random.default_rng(0)
    b, h, n, d, c = 2, 2, 12, 8, 3
    w = n // c  # the library needs N = C w
    q, k, v = (rng.standard_normal((b, h, n, d)) for _ in range(3))
    mu = rng.standard_normal((h, c, d))
    mu /= np.linalg.norm(mu, axis=-1, keepdims=True)
    att = rt.KmeansAttention(c, w, h, d, causal=False).double().eval()
    att.kmeans.means.data.copy_(torch.tensor(mu))
    att.kmeans.initted.data.copy_(torch.tensor(True))  # skip its own k-means initialisation
    with torch.no_grad():
        theirs, _ = att(*(torch.tensor(x) for x in (q, k, v)))
    theirs = theirs.numpy()
    ours = routing_attention(q, k, v, centroids=mu[None], cluster_size=w)
    _, rank = balanced_routes(npx, q, mu[None], w, (b, h))
    count = np.sum(rank < w, axis=-2)[..., None]
    assert 0 in count and np.max(count) > 1  # zeros and averages are both compared
    chosen = np.broadcast_to(count > 0, ours.shape)
    rel = np.abs(theirs - ours)[chosen] / np.abs(ours)[chosen]
    assert 0.9e-5 / np.max(count) < np.min(rel) and np.max(rel) < 1.01e-5
    np.testing.assert_allclose(theirs * (count + 1e-5) / np.maximum(count, 1), ours, rtol=1e-13,
                               atol=1e-14)


def test_the_routing_mutants_fail_because_of_their_mistake():
    # conformance.mutants' routing kernels without their mistake pass where, with it,
    # they fail (tests/test_conformance_tolerance.py runs them with it).
    from conformance.mutants import Mutant, first_failure, routing_kernel

    for opts in ({}, {"options": {"balanced": False}}):
        m = Mutant("no mistake", routing_kernel(), "", opts, variant="routing")
        res, ran = first_failure(m, "float32", suite="quick")
        assert res is None and ran >= 5, (opts, res, ran)
