"""Gradients of the reduced variants: pooled keys/values, query reduction, Nystromformer,
clustered attention.

Each forward is softmax attention (or a product of row softmaxes) around segment means,
so each VJP composes the VJPs of those steps:

* segment means ``y_j = mean_{p in j} x_p``: ``dx_p = dy_j / |j|`` (``segment_expand``
  of the scaled cotangent); copying back to segments (``segment_expand``): ``dy_j =
  sum_{p in j} dx_p``;
* the softmax attention VJP of :mod:`attn_ref.grad.softmax` and the row-softmax VJP;
* Nystromformer's iterative pseudo-inverse, differentiated through every iteration
  ``Z' = Z (13 I - AZ (15 I - AZ (7 I - AZ))) / 4`` and through its initialisation
  ``Z_0 = A^T / (||A||_1 ||A||_inf)``, norms per matrix or (``pinv_init="global"``)
  maxima over the batch (the norms' maxima pass their gradient to the maximising
  column/row, over the batch for the global one, split evenly between exact ties); the exact
  ``xp.linalg.pinv`` (``pinv_iterations=None``) by the pseudo-inverse's derivative
  (Golub & Pereyra 1973), valid where the rank is locally constant;
* clustered attention: the k-means assignment is piecewise constant in ``q``, so it is
  held constant; gradients flow through the centroids (means of their members' queries)
  and, for ``topk``, through the exact softmax on the selected keys (the selection is
  held constant too).
"""

from __future__ import annotations

import array_api_compat

from .._checks import check_qkv
from ..random import permutation
from ..reduced import (
    assign_clusters,
    check_assignments,
    check_pinv_init,
    check_topk_keys,
    front_padded_sizes,
    gather_rows,
    landmark_means,
    nystrom_kernels,
    pinv_norms,
    prepare_clustered,
    prepare_nystrom,
    prepare_pooled,
    prepare_query_reduced,
    segment_expand,
    segment_means,
    segment_sizes,
    topk_parts,
)
from ._common import check_cotangent, softmax_vjp, transpose, unbroadcast
from .softmax import softmax_attention

__all__ = [
    "clustered_attention",
    "pooled_attention",
    "query_reduced_attention",
    "nystrom_attention",
    "iterative_pinv_vjp",
    "pinv_vjp",
    "segment_means_vjp",
    "front_padded_means_vjp",
]


def segment_means_vjp(xp, dy, n):
    """Cotangent of ``x (..., n, e)`` for ``y = segment_means(x, m)`` given ``dy (..., m, e)``."""
    m = dy.shape[-2]
    inv = xp.asarray([1.0 / s for s in segment_sizes(n, m)], dtype=dy.dtype,
                     device=array_api_compat.device(dy))
    return segment_expand(dy * inv[:, None], n, xp=xp)


def front_padded_means_vjp(xp, dy, n):
    """Cotangent of ``x (..., n, e)`` for ``y = front_padded_means(x, m)``: ``dy_j / |j|``
    copied to the real rows of segment ``j``."""
    m, e, lead = dy.shape[-2], dy.shape[-1], tuple(dy.shape[:-2])
    sizes = front_padded_sizes(n, m)
    size, pad = sizes[-1], sizes[-1] - sizes[0]
    inv = xp.asarray([1.0 / c for c in sizes], dtype=dy.dtype, device=array_api_compat.device(dy))
    rows = xp.broadcast_to((dy * inv[:, None])[..., None, :], lead + (m, size, e))
    return xp.reshape(rows, lead + (m * size, e))[..., pad:, :]


def _landmark_vjp(xp, dy, n, segments):
    return (front_padded_means_vjp(xp, dy, n) if segments == "front-padded"
            else segment_means_vjp(xp, dy, n))


def _segment_sums(xp, dx, m):
    """Cotangent of ``y (..., m, e)`` for ``x = segment_expand(y, n)``: the sum over each segment."""
    n = dx.shape[-2]
    sizes = xp.asarray([float(s) for s in segment_sizes(n, m)], dtype=dx.dtype,
                       device=array_api_compat.device(dx))
    return segment_means(dx, m, xp=xp) * sizes[:, None]


def pooled_attention(q, k, v, do, /, *, num_segments, causal=False, scale=None, xp=None):
    """VJP of :func:`attn_ref.reduced.pooled_attention`: ``{"q", "k", "v"}``.

    Same cost as the forward, ``O(N m d)``.
    """
    xp, mask, scale = prepare_pooled(q, k, v, num_segments, causal, scale, xp)
    kp, vp = segment_means(k, num_segments, xp=xp), segment_means(v, num_segments, xp=xp)
    g = softmax_attention(q, kp, vp, do, mask=mask, scale=scale, xp=xp)
    return {"q": g["q"], "k": segment_means_vjp(xp, g["k"], k.shape[-2]),
            "v": segment_means_vjp(xp, g["v"], v.shape[-2])}


def query_reduced_attention(q, k, v, do, /, *, num_segments, expand=True, causal=False, scale=None,
                            xp=None):
    """VJP of :func:`attn_ref.reduced.query_reduced_attention`: ``{"q", "k", "v"}``.

    ``do`` has the forward output's shape: ``(..., Nq, dv)`` with ``expand=True``,
    ``(..., num_segments, dv)`` without.
    """
    xp, scale = prepare_query_reduced(q, k, v, num_segments, causal, scale, xp, "query_reduced_attention")
    qr = segment_means(q, num_segments, xp=xp)
    if expand:
        _, batch = check_qkv(q, k, v, xp=xp)
        do = check_cotangent(xp, do, batch + (q.shape[-2], v.shape[-1]), q)
        do = _segment_sums(xp, do, num_segments)
    g = softmax_attention(qr, k, v, do, scale=scale, xp=xp)
    return {"q": segment_means_vjp(xp, g["q"], q.shape[-2]), "k": g["k"], "v": g["v"]}


# ------------------------------------------------------------------ pseudo-inverses


def _max_vjp(xp, x, g, axis):
    """VJP of ``max(x, axis)`` (``axis=None``: over all of ``x``): ``g`` to the maximising
    entries, split evenly between ties."""
    m = xp.max(x, axis=axis, keepdims=True)
    hit = xp.astype(x == m, x.dtype)
    return hit * (xp.reshape(g, m.shape) / xp.sum(hit, axis=axis, keepdims=True))


def iterative_pinv_vjp(a, dz, /, *, iterations=6, pinv_init="matrix", xp=None):
    """VJP of :func:`attn_ref.reduced.iterative_pinv`: the cotangent of ``a`` given that of ``Z``.

    Replays the iteration, keeping each iterate (``iterations`` is small), then runs
    it backwards; the initialisation ``A^T / (||A||_1 ||A||_inf)`` is differentiated too.
    With ``pinv_init="global"`` its scale is one number for the batch, so every matrix's
    cotangent reaches the maximising column and row, wherever in the batch they are.
    """
    xp = array_api_compat.array_namespace(a) if xp is None else xp
    check_pinv_init(pinv_init)
    m = a.shape[-1]
    colsum, rowsum, norm1, norminf = pinv_norms(xp, a, pinv_init)
    axis = -1 if pinv_init == "matrix" else None
    raw = norm1 * norminf
    positive = raw > 0
    denom = xp.where(positive, raw, xp.ones_like(raw))
    eye = xp.eye(m, dtype=a.dtype, device=array_api_compat.device(a))
    zs = [transpose(xp, a) / denom[..., None, None]]
    for _ in range(iterations):
        b = a @ zs[-1]
        zs.append((zs[-1] @ (13 * eye - b @ (15 * eye - b @ (7 * eye - b)))) * 0.25)
    da = xp.zeros_like(a)
    for z in reversed(zs[:-1]):
        b = a @ z
        mm = 7 * eye - b
        t = 15 * eye - b @ mm
        w = 13 * eye - b @ t
        dw = transpose(xp, z) @ dz * 0.25
        dz_next = dz @ transpose(xp, w) * 0.25
        du = -dw
        db = du @ transpose(xp, t)
        dn = -(transpose(xp, b) @ du)
        db = db + dn @ transpose(xp, mm) - transpose(xp, b) @ dn
        da = da + db @ transpose(xp, z)
        dz = dz_next + transpose(xp, a) @ db
    # Z_0 = A^T / denom, denom = ||A||_1 ||A||_inf (held at 1 for a zero matrix).
    dz0 = dz
    da = da + transpose(xp, dz0) / denom[..., None, None]
    ddenom = -xp.sum(dz0 * transpose(xp, a), axis=(-2, -1)) / (denom * denom)
    if axis is None:  # one denominator for the batch: its cotangents add up
        ddenom = xp.sum(ddenom)
    ddenom = xp.where(positive, ddenom, xp.zeros_like(ddenom))
    dcol = _max_vjp(xp, colsum, ddenom * norminf, axis)  # (..., m): d/d column sums
    drow = _max_vjp(xp, rowsum, ddenom * norm1, axis)
    sign = xp.sign(a)
    return da + sign * (dcol[..., None, :] + drow[..., :, None])


def pinv_vjp(a, z, dz, /, *, xp=None):
    """VJP of the exact pseudo-inverse ``Z = pinv(A)`` (locally constant rank)."""
    xp = array_api_compat.array_namespace(a) if xp is None else xp
    zt = transpose(xp, z)
    eye_m = xp.eye(a.shape[-2], dtype=a.dtype, device=array_api_compat.device(a))
    eye_n = xp.eye(a.shape[-1], dtype=a.dtype, device=array_api_compat.device(a))
    dzt = transpose(xp, dz)
    return (-(zt @ dz @ zt) + (eye_m - a @ z) @ dzt @ z @ zt
            + zt @ z @ dzt @ (eye_n - z @ a))


def nystrom_attention(q, k, v, do, /, *, num_landmarks, pinv_iterations=6, pinv_init="matrix",
                      segments="balanced", causal=False, scale=None, xp=None):
    """VJP of :func:`attn_ref.reduced.nystrom_attention`: ``{"q", "k", "v"}``.

    Differentiates through the landmarks (segment means), the three row softmaxes and
    the pseudo-inverse: through every step of the iterative one, or the exact one's
    derivative when ``pinv_iterations=None``. ``O(N m (d + dv) + iterations m^3)``.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import grad
    >>> x = xp.reshape(xp.sin(xp.arange(24.0)), (6, 4))
    >>> g = grad.nystrom_attention(x, x, x, x, num_landmarks=2)
    >>> g["q"].shape, g["k"].shape, g["v"].shape
    ((6, 4), (6, 4), (6, 4))
    """
    xp, scale = prepare_nystrom(q, k, v, num_landmarks, pinv_iterations, causal, scale, xp,
                                "nystrom_attention", pinv_init, segments)
    _, batch = check_qkv(q, k, v, xp=xp)
    do = check_cotangent(xp, do, batch + (q.shape[-2], v.shape[-1]), q)
    m = num_landmarks
    ql, kl = landmark_means(q, m, segments, xp=xp), landmark_means(k, m, segments, xp=xp)
    k1, k2, z, k3 = nystrom_kernels(xp, q, k, m, pinv_iterations, scale, pinv_init, segments)
    w3 = k3 @ v
    w2 = z @ w3
    # out = k1 @ w2
    dk1 = do @ transpose(xp, w2)
    dw2 = transpose(xp, k1) @ do
    dz = dw2 @ transpose(xp, w3)
    dw3 = transpose(xp, z) @ dw2
    dk3 = dw3 @ transpose(xp, v)
    dv = transpose(xp, k3) @ dw3
    if pinv_iterations is None:
        dk2 = pinv_vjp(k2, z, dz, xp=xp)
    else:
        dk2 = iterative_pinv_vjp(k2, dz, iterations=pinv_iterations, pinv_init=pinv_init, xp=xp)
    ds1, ds2, ds3 = softmax_vjp(xp, k1, dk1), softmax_vjp(xp, k2, dk2), softmax_vjp(xp, k3, dk3)
    # dS of the logits scale * (...)^T (...): every product gets the factor scale once, at
    # the end (a scaled copy of q could overflow where the logits do not).
    dkl = transpose(xp, ds1) @ q + transpose(xp, ds2) @ ql
    dql = ds2 @ kl + ds3 @ k
    dq = ds1 @ kl + _landmark_vjp(xp, dql, q.shape[-2], segments)
    dk = transpose(xp, ds3) @ ql + _landmark_vjp(xp, dkl, k.shape[-2], segments)
    if scale != 1.0:
        dq, dk = dq * scale, dk * scale
    return {"q": unbroadcast(xp, dq, q.shape), "k": unbroadcast(xp, dk, k.shape),
            "v": unbroadcast(xp, dv, v.shape)}


def _lloyd(xp, q, num_clusters, iterations, seed, assignments=None):
    """:func:`attn_ref.reduced.kmeans` on ``q``, keeping each step's one-hot assignment.

    Returns ``(centroids, idx, onehot, steps, first)``: the final centroids, assignment
    indices and one-hot assignment, one ``(onehot, has_members, safe_counts)`` per
    Lloyd step, and the seeded initial rows. ``assignments`` overrides assignments as
    :func:`attn_ref.reduced.kmeans`'s does.
    """
    n = q.shape[-2]
    first = xp.asarray(permutation(n, seed=seed)[:num_clusters], device=array_api_compat.device(q))
    centroids = xp.take(q, first, axis=q.ndim - 2)
    steps = []

    def forced(t):
        return None if assignments is None else assignments[..., t, :]

    for t in range(iterations):
        _, onehot = assign_clusters(xp, q, centroids, forced(t))
        counts = xp.sum(onehot, axis=-2)[..., None]
        has = counts > 0
        safe = xp.where(has, counts, xp.ones_like(counts))
        steps.append((onehot, has, safe))
        centroids = xp.where(has, (transpose(xp, onehot) @ q) / safe, centroids)
    idx, onehot = assign_clusters(xp, q, centroids, forced(iterations))
    return centroids, idx, onehot, steps, first


def _lloyd_vjp(xp, dc, steps, first, q):
    """Cotangent of ``q`` from that of the final centroids, assignments held constant.

    A centroid is the mean of its members in the last step that gave it members, and
    before any such step the row of ``q`` the seed chose.
    """
    n = q.shape[-2]
    device = array_api_compat.device(q)
    dq = None
    zero = xp.zeros((), dtype=q.dtype, device=device)
    for onehot, has, safe in reversed(steps):
        piece = onehot @ xp.where(has, dc / safe, zero)
        dq = piece if dq is None else dq + piece
        dc = xp.where(has, zero, dc)
    pick = xp.astype(xp.arange(n, device=device)[None, :] == first[:, None], q.dtype)
    piece = transpose(xp, pick) @ dc
    return piece if dq is None else dq + piece


def _scatter_to_keys(xp, hit, x):
    """``sum_{c, s} hit[c, s, j] x[c, s, :]``: rows ``x (..., C, t, e)`` added to the keys they came from.

    ``hit (..., C, t, Nk)`` is the one-hot of each row's key index (the array API has no
    scatter-add, so it is a matmul with the one-hot).
    """
    lead = tuple(x.shape[:-3])
    c, t, e, nk = x.shape[-3], x.shape[-2], x.shape[-1], hit.shape[-1]
    hit = xp.reshape(xp.broadcast_to(hit, lead + (c, t, nk)), lead + (c * t, nk))
    return transpose(xp, hit) @ xp.reshape(x, lead + (c * t, e))


def _by_cluster(xp, onehot, w, x):
    """``sum_i onehot[i, c] w[i, s] x[i, :]``, shape ``(..., C, t, e)``: member terms summed per cluster."""
    lead = tuple(w.shape[:-2])
    n, t, e = w.shape[-2], w.shape[-1], x.shape[-1]
    terms = xp.reshape(w[..., :, None] * x[..., None, :], lead + (n, t * e))
    out = transpose(xp, onehot) @ terms
    return xp.reshape(out, tuple(out.shape[:-2]) + (onehot.shape[-1], t, e))


def _topk_vjp(xp, q, k, v, do, centroids, idx, onehot, topk, scale, batch, topk_keys=None):
    """Cotangents ``(dcentroids, dq, dk, dv)`` (batch shape) of improved clustered attention.

    With ``T_c`` the centroid's top-k keys (held constant), ``p_c = softmax(scale c K^T)``
    and ``p_i`` each member's softmax over ``T_c``, the forward is
    ``o_i = mass_c sum_{j in T_c} p_ij v_j + sum_{j not in T_c} p_cj v_j`` with
    ``mass_c = sum_{j in T_c} p_cj``.
    """
    p_top, keys_idx, mass, pc, order = topk_parts(xp, q, k, centroids, idx, onehot, topk, scale,
                                                  batch, topk_keys)
    nk = k.shape[-2]
    k_top, v_top = gather_rows(xp, k, keys_idx, batch), gather_rows(xp, v, keys_idx, batch)
    top_out = (p_top[..., None, :] @ v_top)[..., 0, :]
    hit = xp.astype(order[..., None] == xp.arange(nk, device=array_api_compat.device(q)), q.dtype)
    sel = xp.sum(hit, axis=-2)  # (..., C, Nk): 1 on the top-k keys (an argsort has no repeats)
    # The members' exact softmax over the selected keys.
    dtop = mass * do
    ds_top = softmax_vjp(xp, p_top, (v_top @ dtop[..., :, None])[..., 0])
    dq = scale * (ds_top[..., None, :] @ k_top)[..., 0, :]
    dk = _scatter_to_keys(xp, hit, _by_cluster(xp, onehot, ds_top, q * scale))
    dv = _scatter_to_keys(xp, hit, _by_cluster(xp, onehot, p_top, dtop))
    # The centroid's row: its mass on the selected keys, its weights on the others.
    dmass = transpose(xp, onehot) @ xp.sum(do * top_out, axis=-1, keepdims=True)
    drest = transpose(xp, onehot) @ do
    rest = 1 - sel
    dv = dv + transpose(xp, rest * pc) @ drest
    dsc = softmax_vjp(xp, pc, dmass * sel + rest * (drest @ transpose(xp, v)))
    dc = scale * (dsc @ k)
    dk = dk + scale * (transpose(xp, dsc) @ centroids)
    return dc, dq, dk, dv


def clustered_attention(q, k, v, do, /, *, num_clusters, iterations=10, topk=None, seed=0, causal=False,
                        scale=None, topk_keys=None, assignments=None, xp=None):
    """VJP of :func:`attn_ref.reduced.clustered_attention`: ``{"q", "k", "v"}``.

    The k-means assignments are piecewise constant in ``q`` and held constant (the
    derivative almost everywhere). Given them, every centroid is linear in ``q``: the
    mean of its members in the last Lloyd step that gave it members, and finally a row
    of ``q`` chosen by the seed. The VJP runs the Lloyd steps backwards through those
    means.

    With ``topk``, each cluster's selection of keys (the top-k of its centroid's
    softmax row) is piecewise constant too and held constant. Gradients flow through
    each member query's exact softmax over the selected keys (to ``q`` and to those
    keys and values), through the centroid's probability mass on them, which scales the
    members' outputs, and through the centroid's weights on the other keys (to the
    centroid, hence ``q``, and to ``k`` and ``v``); ``topk_keys`` fixes that selection
    as the forward's does, and ``assignments`` the k-means assignments. Sending the members' key and value
    gradients back to the selected keys takes an ``(..., C, topk, Nk)`` one-hot: cost
    ``O(Nq topk (d + dv) + C topk Nk (d + dv))`` on top of the forward's. Range: with
    ``topk``, the gradient is finite while ``|scale| max|q| max|k| d`` is below the
    dtype's largest value; past it (``scale=1e308``) the forward's logits are clamped and
    stay finite, but the clamped ties give this gradient an overflowing ``scale dS K``.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import grad
    >>> x = xp.reshape(xp.sin(xp.arange(24.0)), (6, 4))
    >>> a = grad.clustered_attention(x, x, x, x, num_clusters=6)   # C = N: softmax
    >>> b = grad.softmax_attention(x, x, x, x)
    >>> all(bool(xp.max(xp.abs(a[n] - b[n])) < 1e-12) for n in "qkv")
    True
    >>> c = grad.clustered_attention(x, x, x, x, num_clusters=2, topk=6)   # every key: softmax
    >>> all(bool(xp.max(xp.abs(c[n] - b[n])) < 1e-12) for n in "qkv")
    True
    """
    xp, batch, scale = prepare_clustered(q, k, v, num_clusters, iterations, topk, seed, causal, scale, xp,
                                         "clustered_attention")
    check_topk_keys(topk_keys, topk, num_clusters, k.shape[-2], "clustered_attention")
    do = check_cotangent(xp, do, batch + (q.shape[-2], v.shape[-1]), q)
    check_assignments(assignments, iterations, q.shape[-2], "clustered_attention")
    centroids, idx, onehot, steps, first = _lloyd(xp, q, num_clusters, iterations, seed,
                                                  assignments)
    if topk is None:
        g = softmax_attention(centroids, k, v, transpose(xp, onehot) @ do, scale=scale, xp=xp)
        return {"q": unbroadcast(xp, _lloyd_vjp(xp, g["q"], steps, first, q), q.shape),
                "k": g["k"], "v": g["v"]}
    dc, dq, dk, dv = _topk_vjp(xp, q, k, v, do, centroids, idx, onehot, topk, scale, batch, topk_keys)
    dq = unbroadcast(xp, dq, q.shape) + _lloyd_vjp(xp, unbroadcast(xp, dc, centroids.shape), steps,
                                                   first, q)
    return {"q": unbroadcast(xp, dq, q.shape), "k": unbroadcast(xp, dk, k.shape),
            "v": unbroadcast(xp, dv, v.shape)}
