"""Gradient of Routing Transformer attention, routing held constant.

Which queries and keys a centroid takes is piecewise constant in ``q`` and ``k`` (a
top-``w`` of scores, or a nearest centroid), so it is held constant, as for clustered
attention: the derivative almost everywhere. Given the routing, balanced routing is
``C`` independent softmax attentions on gathered rows, averaged back at the queries:

* the output's cotangent, divided by each query's number of clusters, is gathered
  to the clusters' query slots;
* each cluster's softmax attention VJP (:mod:`attn_ref.grad.softmax`) gives the
  cotangents of its gathered queries, keys and values;
* those are summed back at the tokens they were gathered from - the same gather by
  inverse permutation as the forward's combination, without the average.

Plain routing is softmax attention under a mask, whose VJP is the masked softmax's.
The centroids get no gradient (they enter only through the routing).
"""

from __future__ import annotations

from ..reduced import gather_rows
from ..routing import (
    check_clusters,
    cluster_causal_mask,
    combine_clusters,
    plain_routing_mask,
    prepare_routing,
    refuse_routes,
    route_tokens,
)
from ._common import check_cotangent, unbroadcast
from .softmax import softmax_attention

__all__ = ["routing_attention"]


def routing_attention(q, k, v, do, /, *, centroids, cluster_size=None, balanced=True, causal=False,
                      scale=None, query_routes=None, key_routes=None, query_clusters=None,
                      key_clusters=None, xp=None):
    """VJP of :func:`attn_ref.routing.routing_attention`: ``{"q", "k", "v"}``.

    ``query_routes`` and ``key_routes`` fix the balanced routing as in the forward, and
    ``query_clusters`` and ``key_clusters`` the plain routing (the routing is held
    constant either way).

    Same cost as the forward: ``O(N C d + C w^2 (d + dv))`` balanced.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import grad
    >>> from attn_ref.routing import routing_centroids
    >>> x = xp.reshape(xp.sin(xp.arange(24.0)), (6, 4))
    >>> mu = routing_centroids(1, 4, seed=0, xp=xp)   # one cluster: softmax
    >>> a = grad.routing_attention(x, x, x, x, centroids=mu)
    >>> b = grad.softmax_attention(x, x, x, x)
    >>> all(bool(xp.max(xp.abs(a[n] - b[n])) < 1e-12) for n in "qkv")
    True
    """
    xp, batch, alignment, scale, wq, wk = prepare_routing(q, k, v, centroids, cluster_size, balanced,
                                                          causal, scale, xp)
    nq, nk = q.shape[-2], k.shape[-2]
    do = check_cotangent(xp, do, batch + (nq, v.shape[-1]), q)
    check_clusters(query_clusters, key_clusters, balanced, nq, nk, "routing_attention")
    if not balanced:
        refuse_routes(query_routes, key_routes, "routing_attention")
        mask = plain_routing_mask(xp, q, k, centroids, query_clusters, key_clusters)
        g = softmax_attention(q, k, v, do, mask=mask, causal=alignment or False, scale=scale, xp=xp)
        return {n: g[n] for n in "qkv"}
    qidx, qrank = route_tokens(xp, q, centroids, wq, batch, query_routes, "query_routes",
                               "routing_attention")
    kidx, krank = route_tokens(xp, k, centroids, wk, batch, key_routes, "key_routes",
                               "routing_attention")
    qg, kg, vg = (gather_rows(xp, x, i, batch) for x, i in ((q, qidx), (k, kidx), (v, kidx)))
    mask = cluster_causal_mask(xp, qidx, kidx, alignment, nq, nk)
    # d out_c[s] = do[i] / n_i for the query i at slot s of cluster c.
    count = xp.sum(xp.astype(qrank < wq, q.dtype), axis=-2)[..., None]
    dog = gather_rows(xp, do / xp.where(count > 0, count, xp.ones_like(count)), qidx, batch)
    g = softmax_attention(qg, kg, vg, dog, mask=mask, scale=scale, xp=xp)
    dq = combine_clusters(xp, g["q"], qrank, wq, average=False)
    dk = combine_clusters(xp, g["k"], krank, wk, average=False)
    dv = combine_clusters(xp, g["v"], krank, wk, average=False)
    return {"q": unbroadcast(xp, dq, q.shape), "k": unbroadcast(xp, dk, k.shape),
            "v": unbroadcast(xp, dv, v.shape)}
