"""Routing Transformer attention (Roy et al. 2021): attention within k-means clusters.

Queries and keys are routed to ``C`` centroids ``mu (C, d)`` (the state of the
paper's online k-means, given here as a parameter) and each query attends only to
the keys routed to the same centroid. Routing looks at *directions*: a token ``x``
is routed by ``x_hat = x / |x|`` (the unit sphere of the paper; the attention itself
uses ``q`` and ``k`` as given). ``docs/routing.md`` derives both forms and lists the
conventions against the paper and ``routing-transformer``.

Two routings:

* **balanced** (``balanced=True``, the paper's implementation and the registered
  ``"routing"``): every centroid ``c`` takes its ``w`` nearest queries and its ``w``
  nearest keys (top-``w`` of ``mu_c . x_hat`` over the sequence; ``w = ceil(N / C)``
  by default), so every cluster has the same size and the work is ``C`` dense
  ``w x w`` blocks. A query chosen by several centroids gets the *average* of their
  outputs; a query chosen by none gets zeros.
* **plain** (``balanced=False``): every token goes to its nearest centroid (Euclidean
  distance from ``x_hat``, :func:`attn_ref.reduced.assign_clusters`) and attends to
  the keys of its cluster. Cluster sizes are data-dependent.

Causal masking (``causal=True``) masks, inside a cluster, the keys whose *original*
position is after the query's. The top-``w`` selection itself looks at the whole
sequence, so with balanced routing whether a query is in a cluster depends on later
tokens (non-differentiably) - the paper's implementation has the same property.
"""

from __future__ import annotations

import array_api_compat

from ._checks import (
    broadcast_batch,
    check_array,
    check_flag,
    check_index_array,
    check_positive_int,
    check_qkv,
    default_scale,
)
from ._common import causal_alignment, causal_offset, ceil_div
from .random import standard_normal
from .reduced import assign_clusters, gather_rows
from .softmax import attention_weights, softmax_attention

__all__ = [
    "routing_attention",
    "routing_weights",
    "routing_centroids",
    "unit_rows",
    "routing_scores",
    # Named steps that attn_ref.grad differentiates.
    "prepare_routing",
    "balanced_routes",
    "check_routes",
    "fixed_routes",
    "refuse_routes",
    "check_clusters",
    "route_tokens",
    "combine_clusters",
    "cluster_causal_mask",
    "plain_routing_mask",
]


def unit_rows(xp, x):
    """``x / |x|`` row by row; a zero row stays zero (it has no direction to route by)."""
    norm = xp.sqrt(xp.sum(x * x, axis=-1, keepdims=True))
    return x / xp.where(norm > 0, norm, xp.ones_like(norm))


def routing_scores(xp, x, centroids):
    """``mu_c . x_hat_i``, shape ``(..., C, N)``: how near token ``i`` is to centroid ``c``.

    For a fixed centroid the ranking of the tokens by this score is their ranking by
    Euclidean distance ``|x_hat_i - mu_c|`` (``|x_hat_i| = 1`` for every token), so the
    top-``w`` selection is the ``w`` nearest tokens whatever the centroids' norms.
    """
    return centroids @ xp.matrix_transpose(unit_rows(xp, x))


def routing_centroids(num_clusters, d, /, *, seed, dtype=None, device=None, xp):
    """``(C, d)`` centroids on the unit sphere, drawn from ``seed`` (Gaussian directions).

    The paper's centroids are running means of unit vectors, renormalised; these stand
    in for a trained state. The same seed gives the same centroids on every backend.
    """
    c = standard_normal((check_positive_int("num_clusters", num_clusters), d), seed=seed,
                        dtype=dtype, device=device, xp=xp)
    return unit_rows(xp, c)


def prepare_routing(q, k, v, centroids, cluster_size, balanced, causal, scale, xp):
    """Check the inputs of :func:`routing_attention`.

    Returns ``(xp, batch, alignment, scale, wq, wk)``: the batch shape of ``q, k, v``
    and ``centroids`` together, the causal alignment (None when not causal) and the
    number of queries and keys each centroid takes (``cluster_size`` or
    ``ceil(N / C)``, at most ``N``).
    """
    xp, batch = check_qkv(q, k, v, xp=xp)
    check_array("centroids", centroids, like=q, dtype=q.dtype)
    d = q.shape[-1]
    if centroids.ndim < 2 or centroids.shape[-1] != d or centroids.shape[-2] < 1:
        raise ValueError(f"centroids must have shape (..., C, d) with C >= 1 and the head "
                         f"dimension of q (d={d}), got shape {tuple(centroids.shape)}")
    batch = broadcast_batch([("q, k, v", batch), ("centroids", tuple(centroids.shape[:-2]))])
    check_flag("balanced", balanced)
    alignment = causal_alignment(causal)
    c, nq, nk = centroids.shape[-2], q.shape[-2], k.shape[-2]
    if cluster_size is None:
        wq, wk = ceil_div(nq, c), ceil_div(nk, c)
    else:
        w = check_positive_int("cluster_size", cluster_size)
        wq, wk = w, w
    return xp, batch, alignment, default_scale(d, scale), min(wq, nq), min(wk, nk)


def balanced_routes(xp, x, centroids, w, batch):
    """Each centroid's ``w`` nearest tokens of ``x (..., N, d)``.

    Returns ``(idx, rank)``: ``idx (batch..., C, w)`` the chosen token indices, nearest
    first, and ``rank (batch..., C, N)`` each token's place in its centroid's order, so
    token ``i`` is in cluster ``c`` iff ``rank[c, i] < w``, at slot ``rank[c, i]``.
    Ties go to the lower token index (stable sort).
    """
    s = routing_scores(xp, x, centroids)
    s = xp.broadcast_to(s, batch + tuple(s.shape[-2:]))
    order = xp.argsort(s, axis=-1, descending=True, stable=True)
    # the inverse permutation: where each token sits in its centroid's order
    rank = xp.argsort(order, axis=-1, stable=True)
    return order[..., :w], rank


def fixed_routes(xp, idx, n, batch):
    """:func:`balanced_routes`' ``(idx, rank)`` for a given selection ``idx (..., C, w)``
    of ``n`` tokens: token ``i`` is in cluster ``c`` at slot ``s`` iff ``idx[c, s] == i``,
    and its rank is ``w`` (not chosen) otherwise.

    The array API has no scatter, so the ranks come from a sort: the keys
    ``idx[c, s] (w + 1) + s`` of the chosen tokens and ``i (w + 1) + w`` of every token,
    sorted, put each chosen token's key just before its own token key. ``O(C (w + n)
    log(w + n))`` (a comparison of every slot with every token, ``O(C w n)``, took
    40% of the oracle's time on routing's standard suite in bfloat16).
    """
    c, w = idx.shape[-2], idx.shape[-1]
    idx = xp.broadcast_to(idx, batch + (c, w))
    dev = array_api_compat.device(idx)
    step = w + 1
    slots = xp.arange(w, dtype=xp.int64, device=dev)
    tokens = xp.arange(n, dtype=xp.int64, device=dev) * step + w
    keys = xp.concat([xp.astype(idx, xp.int64) * step + slots,
                      xp.broadcast_to(tokens, batch + (c, n))], axis=-1)
    perm = xp.argsort(keys, axis=-1, stable=True)
    where_ = xp.argsort(perm, axis=-1, stable=True)[..., w:]  # each token key's sorted place
    # the key sorted just before each token's own: a chosen key of that token (its slot),
    # or another token's (not chosen); the first token key reads itself, slot w
    before = xp.take_along_axis(xp.take_along_axis(keys, perm, axis=-1),
                                xp.clip(where_ - 1, min=0), axis=-1)
    token = xp.arange(n, dtype=xp.int64, device=dev)
    rank = xp.where(before // step == token, before % step, xp.full_like(before, w))
    return idx, xp.astype(rank, idx.dtype)


def check_routes(name, routes, c, w, n, fn):
    """Refuse a ``query_routes`` / ``key_routes`` (``name``) of :func:`routing_attention`
    that is not ``(..., C, w)`` integers. Its values (distinct tokens in ``[0, n)``) are
    the caller's to keep: checking them would read the array on the host."""
    if routes is not None:
        check_index_array(fn, name, routes, (c, w), "C, w", f" indexing the {n} tokens")


def refuse_routes(query_routes, key_routes, fn):
    """Plain routing has no top-``w`` selection: a given one is refused, by name."""
    for name, given in (("query_routes", query_routes), ("key_routes", key_routes)):
        if given is not None:
            raise ValueError(f"{fn}: {name} fixes the balanced routing, but balanced is False")


def check_clusters(query_clusters, key_clusters, balanced, nq, nk, fn):
    """Refuse a ``query_clusters`` / ``key_clusters`` of :func:`routing_attention` given
    with balanced routing (it fixes plain routing's nearest centroids), or not ``(..., N)``
    integers. Their values (``-1`` or a centroid in ``[0, C)``) are the caller's to keep:
    checking them would read the array on the host."""
    for name, given, n in (("query_clusters", query_clusters, nq), ("key_clusters", key_clusters, nk)):
        if given is None:
            continue
        if balanced:
            raise ValueError(f"{fn}: {name} fixes plain routing's nearest centroids, but balanced "
                             f"is True")
        check_index_array(fn, name, given, (n,), "N", ", one centroid (or -1) per token")


def route_tokens(xp, x, centroids, w, batch, given, name, fn):
    """Each centroid's ``w`` tokens of ``x`` and their ranks (:func:`balanced_routes`), or
    those of the selection ``given`` (:func:`fixed_routes`), checked as ``name``."""
    n = x.shape[-2]
    check_routes(name, given, centroids.shape[-2], w, n, fn)
    if given is None:
        return balanced_routes(xp, x, centroids, w, batch)
    return fixed_routes(xp, given, n, batch)


def cluster_causal_mask(xp, qidx, kidx, alignment, nq, nk):
    """``(..., C, wq, wk)``: inside each cluster, key ``kidx`` is not after query ``qidx``."""
    if alignment is None:
        return None
    return kidx[..., None, :] <= qidx[..., :, None] + causal_offset(alignment, nq, nk)


def combine_clusters(xp, y, rank, w, *, average):
    """Per-cluster rows ``y (..., C, w, e)`` back at their tokens: ``(..., N, e)``.

    Token ``i`` receives ``sum_c [rank[c, i] < w] y[c, rank[c, i]]`` (divided by the
    number of its clusters when ``average``; zero when it has none). A gather by the
    inverse permutation instead of a scatter-add, which the array API lacks:
    ``O(C N e)``.
    """
    e = y.shape[-1]
    lead = tuple(rank.shape[:-1])
    chosen = rank < w
    slot = xp.where(chosen, rank, xp.zeros_like(rank))
    if w == 0:
        return xp.zeros(tuple(lead[:-1]) + (rank.shape[-1], e), dtype=y.dtype,
                        device=array_api_compat.device(y))
    at = xp.broadcast_to(slot[..., None], lead + (rank.shape[-1], e))
    rows = xp.take_along_axis(xp.broadcast_to(y, lead + tuple(y.shape[-2:])), at, axis=-2)
    sel = xp.astype(chosen, y.dtype)[..., None]
    total = xp.sum(rows * sel, axis=-3)
    if not average:
        return total
    count = xp.sum(sel, axis=-3)
    return total / xp.where(count > 0, count, xp.ones_like(count))


def plain_routing_mask(xp, q, k, centroids, query_clusters=None, key_clusters=None):
    """``(..., Nq, Nk)``: query ``i`` and key ``j`` share their nearest centroid (or the
    centroid ``query_clusters`` / ``key_clusters`` gives a token, where ``>= 0``)."""
    cq, _ = assign_clusters(xp, unit_rows(xp, q), centroids, query_clusters)
    ck, _ = assign_clusters(xp, unit_rows(xp, k), centroids, key_clusters)
    return cq[..., :, None] == ck[..., None, :]


def routing_attention(q, k, v, /, *, centroids, cluster_size=None, balanced=True, causal=False,
                      scale=None, query_routes=None, key_routes=None, query_clusters=None,
                      key_clusters=None, xp=None):
    """Routing Transformer attention: each query attends to the keys of its clusters.

    Parameters
    ----------
    q : array, shape (..., Nq, d)
    k : array, shape (..., Nk, d)
    v : array, shape (..., Nk, dv)
    centroids : array, shape (..., C, d)
        The k-means centroids ``mu`` (per head, say, broadcast against the batch);
        :func:`routing_centroids` draws unit ones from a seed.
    cluster_size : int, optional
        Balanced routing: the ``w`` queries and ``w`` keys each centroid takes
        (at most ``N``; ``routing-transformer``'s ``window_size``). Default
        ``ceil(Nq / C)`` queries and ``ceil(Nk / C)`` keys, the paper's ``w = N / C``.
    balanced : bool
        True: top-``w`` balanced clusters (the paper's implementation). False: every
        token to its nearest centroid (clusters of any size).
    causal : {False, True, "top-left", "bottom-right"}
        Inside a cluster, keys after the query (by original position) are masked.
    scale : float, optional
        Logit scale, default ``1/sqrt(d)``.
    query_routes, key_routes : int array, shape (..., C, w), optional
        Balanced routing: each centroid's ``w`` queries (keys), distinct token indices,
        instead of its ``w`` nearest. The routing is a discrete choice: where a
        centroid's ``w``-th and next scores are closer than a dtype's rounding, a correct
        kernel may take either token, and ``conformance`` judges it against the
        function of each admissible routing (:mod:`conformance.ties`). None (default)
        routes by the scores. ``O(C (w + N) log(w + N))`` more to place them.
    query_clusters, key_clusters : int array, shape (..., Nq) and (..., Nk), optional
        Plain routing: each token's centroid where it is ``>= 0``, instead of its
        nearest (``-1``: the nearest). A token about as near two centroids as a dtype
        resolves is a discrete choice too, judged the same way.

    Returns
    -------
    array, shape (..., Nq, dv)
        Balanced: the mean over the clusters that chose query ``i`` of its softmax
        attention over each cluster's keys (a cluster where it sees no key contributes
        zeros, and counts); zeros for a query no cluster chose. Plain: softmax over the
        keys of the query's cluster, zeros when it has none (visible). ``C = 1`` is
        softmax attention in both.

    Notes
    -----
    Balanced: ``O(N C d)`` routing, ``O(C N log N)`` for the sorts, ``O(C w^2 (d + dv))``
    attention - with ``C ~ sqrt(N)``, ``O(N^1.5 d)`` - and ``O(C w^2)`` extra memory.
    Plain: this reference builds the ``(Nq, Nk)`` same-cluster mask, ``O(N^2 d)``; a
    kernel sorts tokens by cluster instead. Roy, Saffar, Vaswani and Grangier,
    *Efficient Content-Based Sparse Attention with Routing Transformers*, TACL 2021.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.routing import routing_attention, routing_centroids
    >>> from attn_ref import softmax_attention
    >>> x = xp.reshape(xp.sin(xp.arange(24.0)), (8, 3))
    >>> mu = routing_centroids(2, 3, seed=0, xp=xp)
    >>> routing_attention(x, x, x, centroids=mu).shape
    (8, 3)
    >>> one = routing_attention(x, x, x, centroids=mu[:1, :])   # one cluster: softmax
    >>> bool(xp.max(xp.abs(one - softmax_attention(x, x, x))) < 1e-14)
    True
    """
    xp, batch, alignment, scale, wq, wk = prepare_routing(q, k, v, centroids, cluster_size, balanced,
                                                          causal, scale, xp)
    nq, nk = q.shape[-2], k.shape[-2]
    check_clusters(query_clusters, key_clusters, balanced, nq, nk, "routing_attention")
    if not balanced:
        refuse_routes(query_routes, key_routes, "routing_attention")
        mask = plain_routing_mask(xp, q, k, centroids, query_clusters, key_clusters)
        return softmax_attention(q, k, v, mask=mask, causal=alignment or False, scale=scale, xp=xp)
    qidx, qrank = route_tokens(xp, q, centroids, wq, batch, query_routes, "query_routes",
                               "routing_attention")
    kidx, _ = route_tokens(xp, k, centroids, wk, batch, key_routes, "key_routes",
                           "routing_attention")
    # Gather each cluster's w queries, keys and values: C dense w x w problems.
    qg, kg, vg = (gather_rows(xp, x, i, batch) for x, i in ((q, qidx), (k, kidx), (v, kidx)))
    mask = cluster_causal_mask(xp, qidx, kidx, alignment, nq, nk)
    out = softmax_attention(qg, kg, vg, mask=mask, scale=scale, xp=xp)
    return combine_clusters(xp, out, qrank, wq, average=True)


def routing_weights(q, k, /, *, centroids, cluster_size=None, balanced=True, causal=False, scale=None,
                    xp=None):
    """The implied ``(..., Nq, Nk)`` matrix of :func:`routing_attention`: its defining form.

    Balanced: ``W = (1 / n_i) sum_c P_c`` with ``P_c`` the softmax masked to the
    queries and keys cluster ``c`` chose (and causal), ``n_i`` the number of clusters
    that chose query ``i``. Builds ``(..., C, Nq, Nk)``: for diagnostics at moderate
    sizes. Plain: the softmax masked to same-cluster pairs.
    """
    xp, batch, alignment, scale, wq, wk = prepare_routing(q, k, k, centroids, cluster_size, balanced,
                                                          causal, scale, xp)
    if not balanced:
        mask = plain_routing_mask(xp, q, k, centroids)
        return attention_weights(q, k, mask=mask, causal=alignment or False, scale=scale, xp=xp)
    _, qrank = balanced_routes(xp, q, centroids, wq, batch)
    _, krank = balanced_routes(xp, k, centroids, wk, batch)
    inq, ink = qrank < wq, krank < wk  # (..., C, N): chosen by centroid c
    mask = xp.logical_and(inq[..., :, None], ink[..., None, :])
    c = centroids.shape[-2]
    qc = xp.broadcast_to(q[..., None, :, :], batch + (c,) + tuple(q.shape[-2:]))
    p = attention_weights(qc, k[..., None, :, :], mask=mask, causal=alignment or False, scale=scale,
                          xp=xp)
    count = xp.sum(xp.astype(inq, q.dtype), axis=-2)[..., None]
    return xp.sum(p, axis=-3) / xp.where(count > 0, count, xp.ones_like(count))


# ----------------------------------------------------------------------- registration

def _params(seed, nq, nk, d, dv, *, dtype, device, xp):
    c = max(1, min(nq, nk, 4))
    return {"centroids": routing_centroids(c, d, seed=seed, dtype=dtype, device=device, xp=xp)}


def _register():
    from .registry import Variant, register

    register(Variant(
        name="routing", fn=routing_attention, family="routing", exact=False, causal=True,
        vjp="attn_ref.grad.routing:routing_attention",
        time="O(N C d + N^2 d / C)", memory="O(N^2 / C)", params=_params, weights=routing_weights,
        summary="Routing Transformer, balanced: each of C = 4 unit centroids takes its "
                "N / C nearest queries and keys",
    ))


_register()
