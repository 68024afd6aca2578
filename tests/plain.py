"""The plain references: every variant again, in NumPy float64 with loops and explicit
formulas, written from the papers and independently of attn_ref.

The family tests check attn_ref's efficient forms against these, and
``tests/test_variants.py`` checks every registered variant against :data:`PLAIN`, so
each family's definition lives here once. Each is short enough to read in a minute;
speed does not matter.
"""

import numpy as np

# The seeded random choices (initial centroids, BigBird's random blocks) are attn_ref's:
# the plain forms must make the same draws.
from attn_ref.random import permutation
from attn_ref.sparse import bigbird_layout

__all__ = [
    "PLAIN",
    "PHI",
    "bounds",
    "naive_attention",
    "naive_clustered",
    "naive_compressed",
    "naive_conv",
    "naive_expand",
    "naive_kmeans",
    "naive_linformer",
    "naive_means",
    "naive_nystrom",
    "naive_routing",
    "naive_dense_logits",
    "naive_synthesizer",
    "naive_lsh_buckets",
    "naive_reformer",
    "naive_sinkhorn",
    "naive_sinkhorn_attention",
    "np_favor",
    "np_linear",
    "np_performer",
    "np_recurrent",
    "pool_mask",
    "ref_fixed",
    "ref_global",
    "ref_layout",
    "ref_local",
    "ref_strided",
    "visible",
]


# ---------------------------------------------------------------- softmax


def naive_attention(q, k, v, *, mask=None, bias=None, causal=None, scale=None):
    """Plain NumPy float64 softmax attention, written independently of attn_ref.

    ``causal`` is None, "top-left" or "bottom-right"; rows with no allowed key are 0.
    Returns ``(output, weights)``.
    """
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    nq, nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1 / np.sqrt(d) if scale is None else scale
    s = np.einsum("...id,...jd->...ij", q, k) * scale
    if bias is not None:
        s = s + bias
    allowed = np.ones(s.shape, dtype=bool)
    if mask is not None:
        allowed = allowed & mask
    if causal is not None:
        off = 0 if causal == "top-left" else nk - nq
        allowed = allowed & (np.arange(nk)[None, :] <= np.arange(nq)[:, None] + off)
    s = np.where(allowed, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True) if nk else np.zeros(s.shape[:-1] + (1,))
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    den = p.sum(-1, keepdims=True)
    p = p / np.where(den > 0, den, 1.0)
    return p @ v, p


# ---------------------------------------------------------------- compressed


def naive_conv(x, w, s):
    """Loop form: block j = sum_t x[j s + t] @ w[t], rows past the end are zero; a new
    window starts while the previous one has not reached the end."""
    n, c = x.shape[-2], w.shape[-3]
    starts = [0]
    while starts[-1] + c < n and starts[-1] + s < n:
        starts.append(starts[-1] + s)
    out = []
    for j in range(len(starts)):
        acc = 0.0
        for t in range(c):
            if j * s + t < n:
                acc = acc + x[..., j * s + t, :][..., None, :] @ w[..., t, :, :]
        out.append(acc[..., 0, :])
    return np.stack(out, axis=-2)


def _compressed_blocks(qh, kh, vh, wk, wv, s, causal):
    kc, vc = naive_conv(kh, wk, s), naive_conv(vh, wv, s)
    nq, nk, c, m = qh.shape[-2], kh.shape[-2], wk.shape[-3], kc.shape[-2]
    mask = None
    if causal is not None:
        off = 0 if causal == "top-left" else nk - nq
        last = [min(j * s + c, nk) - 1 for j in range(m)]
        mask = np.array([[last[j] <= i + off for j in range(m)] for i in range(nq)])
    return naive_attention(qh, kc, vc, mask=mask)


def naive_compressed(qh, kh, vh, wk, wv, s, causal=None):
    """Memory-compressed attention: softmax over strided convolutions of keys and values."""
    return _compressed_blocks(qh, kh, vh, wk, wv, s, causal)[0]


def _compressed_weights(qh, kh, vh, wk, wv, s, causal=None):
    """(output, weights) when each value tap is a scalar: key j s + t gets p_j w_t."""
    out, p = _compressed_blocks(qh, kh, vh, wk, wv, s, causal)
    nk, c = kh.shape[-2], wv.shape[-3]
    w = np.zeros(p.shape[:-1] + (nk,))
    for j in range(p.shape[-1]):
        for t in range(c):
            if j * s + t < nk:
                w[..., j * s + t] += p[..., j] * wv[t, 0, 0]
    return out, w


# ---------------------------------------------------------------- low rank


def naive_linformer(qh, kh, vh, e, f):
    """Independent NumPy form: project keys and values, then plain softmax attention."""
    out, p = naive_attention(qh, e @ kh, f @ vh)
    return out, p @ f


# ---------------------------------------------------------------- linear attention

PHI = {
    "elu+1": lambda x: np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0))),
    "relu": lambda x: np.maximum(x, 0.0),
    "identity": lambda x: x,
}


def visible(nq, nk, causal):
    """Which keys each query sees: all, or up to its causal offset."""
    if not causal:
        return np.ones((nq, nk), dtype=bool)
    off = 0 if causal in (True, "top-left") else nk - nq
    return np.arange(nk)[None, :] <= np.arange(nq)[:, None] + off


def np_linear(q, k, v, *, feature_map="elu+1", causal=False, scale=1.0, normalize=True, eps=1e-6):
    """Plain NumPy float64 linear attention in the quadratic order, written independently.

    Returns ``(output, weights)``; the denominator rule is the documented one.
    """
    phi = PHI[feature_map] if isinstance(feature_map, str) else feature_map
    a = scale * np.einsum("...if,...jf->...ij", phi(q), phi(k))
    a = a * visible(q.shape[-2], k.shape[-2], causal)
    if normalize:
        den = a.sum(-1, keepdims=True)
        den = np.where(np.abs(den) < eps, np.where(den < 0, -eps, eps), den)
        a = a / den
    return a @ v, a


# ---------------------------------------------------------------- Performer


def np_favor(x, w, kernel="positive"):
    """Plain NumPy float64 FAVOR features, unstabilised, written independently."""
    u = x @ w.T
    sq = (x * x).sum(-1, keepdims=True) / 2
    if kernel == "positive":
        return np.exp(u - sq) / np.sqrt(len(w))
    return np.exp(sq) * np.concatenate([np.sin(u), np.cos(u)], axis=-1) / np.sqrt(len(w))


def np_performer(q, k, v, w, *, kernel="positive", causal=False, scale=None):
    """The Performer estimate in the quadratic order, NumPy float64; returns (out, weights)."""
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    a = np_favor(q * np.sqrt(scale), w, kernel) @ np.swapaxes(np_favor(k * np.sqrt(scale), w, kernel), -1, -2)
    nq, nk = a.shape[-2:]
    if causal:
        off = 0 if causal in (True, "top-left") else nk - nq
        a = a * (np.arange(nk)[None, :] <= np.arange(nq)[:, None] + off)
    den = a.sum(-1, keepdims=True)
    a = a / np.where(den == 0, 1.0, den)
    return a @ v, a


# ---------------------------------------------------------------- reduced: segments, landmarks, clusters


def bounds(n, m):
    """``m`` segments of ``n`` positions, the longer ones first: ``[(start, end), ...]``."""
    c, r = divmod(n, m)
    sizes = [c + 1] * r + [c] * (m - r)
    ends = np.cumsum(sizes)
    return list(zip(ends - sizes, ends))


def naive_means(x, m):
    return np.stack([x[..., a:b, :].mean(-2) for a, b in bounds(x.shape[-2], m)], axis=-2)


def naive_expand(y, n):
    return np.concatenate([np.repeat(y[..., j:j + 1, :], b - a, axis=-2)
                           for j, (a, b) in enumerate(bounds(n, y.shape[-2]))], axis=-2)


def pool_mask(nq, nk, m, causal):
    """A query sees a pooled segment once it has seen the segment's last key."""
    if causal is False:
        return None
    off = 0 if causal == "top-left" else nk - nq
    last = [b - 1 for _, b in bounds(nk, m)]
    return np.array([[last[j] <= i + off for j in range(m)] for i in range(nq)])


def naive_nystrom(qh, kh, vh, m, iterations, pinv_init="matrix"):
    """Nystromformer with segment-mean landmarks; ``iterations=None`` takes the exact pinv.

    ``pinv_init="global"`` starts the iteration as HuggingFace's ``iterative_inv`` with
    ``init_option="original"``: ``Z_0 = K2^T / max`` of every column sum in the batch.
    """
    qs = qh / np.sqrt(qh.shape[-1])
    ql, kl = naive_means(qs, m), naive_means(kh, m)
    k1 = naive_attention(qs, kl, vh[..., :m, :], scale=1.0)[1]
    k2 = naive_attention(ql, kl, vh[..., :m, :], scale=1.0)[1]
    k3 = naive_attention(ql, kh, vh, scale=1.0)[1]
    if iterations is None:
        z = np.linalg.pinv(k2)
    else:
        # Razavi et al. written out, Z_0 = A^T / (||A||_1 ||A||_inf) per matrix.
        norm = np.abs(k2).sum(-2).max(-1) * np.abs(k2).sum(-1).max(-1)
        if pinv_init == "global":
            norm = np.full(k2.shape[:-2], k2.sum(-2).max())
        z, eye = np.swapaxes(k2, -1, -2) / norm[..., None, None], np.eye(m)
        for _ in range(iterations):
            az = k2 @ z
            z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    w = k1 @ z @ k3
    return w @ vh, w


def naive_kmeans(x, c, iterations, seed, forced=None):
    """One 2-D ``x (N, d)``: Lloyd's algorithm with explicit distances and loops.
    ``forced (iterations + 1, N)``: at step ``t``, row ``i`` goes to ``forced[t, i]``
    where that is not -1."""
    cent = x[permutation(x.shape[0], seed=seed)[:c]].copy()
    for _ in range(iterations + 1):
        assign = np.argmin(((x[:, None, :] - cent[None]) ** 2).sum(-1), axis=-1)
        if forced is not None:
            assign = np.where(forced[_] != -1, forced[_], assign)
        if _ == iterations:
            break
        for j in range(c):
            if np.any(assign == j):
                cent[j] = x[assign == j].mean(0)
    return cent, assign


def naive_clustered(qh, kh, vh, c, iterations, seed, topk, topk_keys=None, assignments=None):
    """Clustered attention, and with ``topk`` the improved form; returns (out, weights).
    ``topk_keys (..., c, topk)``: each centroid's selected keys instead of its top-k;
    ``assignments (..., iterations + 1, Nq)``: forced k-means assignments (-1: nearest)."""
    out = np.zeros(qh.shape[:-1] + (vh.shape[-1],))
    weights = np.zeros(qh.shape[:-1] + (kh.shape[-2],))
    for idx in np.ndindex(qh.shape[:-2]):
        q, k, v = qh[idx], kh[idx], vh[idx]
        forced = None if assignments is None else \
            np.broadcast_to(assignments, qh.shape[:-2] + (iterations + 1, qh.shape[-2]))[idx]
        cent, assign = naive_kmeans(q, c, iterations, seed, forced)
        _, pc = naive_attention(cent, k, v)
        for i in range(q.shape[0]):
            row = pc[assign[i]].copy()
            if topk is not None:
                top = np.argsort(-row, kind="stable")[:topk] if topk_keys is None else \
                    np.broadcast_to(topk_keys, qh.shape[:-2] + (c, topk))[idx][assign[i]]
                _, pi = naive_attention(q[i:i + 1], k[top], v[top])
                row[top] = row[top].sum() * pi[0]
            weights[idx + (i,)] = row
            out[idx + (i,)] = row @ v
    return out, weights


# ---------------------------------------------------------------- routing


def naive_routing(qh, kh, vh, centroids, causal=None, cluster_size=None, balanced=True,
                  query_routes=None, key_routes=None, query_clusters=None, key_clusters=None):
    """Routing Transformer attention with loops: per batch entry, per cluster, per query.

    Balanced: centroid c takes the w tokens of largest mu_c . x / |x| (ties: lower
    index), or the tokens ``query_routes[..., c, :]`` (``key_routes``) when given; each
    query averages its clusters' softmax outputs. Plain: each token to the centroid
    nearest (Euclidean) to x / |x|, or ``query_clusters[..., i]`` (``key_clusters``)
    where that is not -1. Returns (out, weights).
    """
    out = np.zeros(qh.shape[:-1] + (vh.shape[-1],))
    weights = np.zeros(qh.shape[:-1] + (kh.shape[-2],))
    nq, nk = qh.shape[-2], kh.shape[-2]
    off = 0 if causal in (None, "top-left") else nk - nq
    for idx in np.ndindex(qh.shape[:-2]):
        q, k, v = qh[idx], kh[idx], vh[idx]
        mu = centroids[idx[-centroids.ndim + 2:]] if centroids.ndim > 2 else centroids
        c = mu.shape[0]

        def unit(x):
            n = np.linalg.norm(x, axis=-1, keepdims=True)
            return x / np.where(n > 0, n, 1.0)

        def allowed(i, j):
            return causal is None or j <= i + off

        if not balanced:
            near = [np.argmin(((unit(x)[:, None, :] - mu[None]) ** 2).sum(-1), axis=-1) for x in (q, k)]
            for t, (given, x) in enumerate(((query_clusters, qh), (key_clusters, kh))):
                if given is not None:
                    given = np.broadcast_to(given, x.shape[:-1])[idx]
                    near[t] = np.where(given != -1, given, near[t])
            for i in range(nq):
                keys = [j for j in range(nk) if near[1][j] == near[0][i] and allowed(i, j)]
                if keys:
                    _, p = naive_attention(q[i:i + 1], k[keys], v[keys])
                    weights[idx + (i,)][keys] = p[0]
            out[idx] = weights[idx] @ v
            continue
        wq = min(cluster_size or -(-nq // c), nq)
        wk = min(cluster_size or -(-nk // c), nk)
        count = np.zeros(nq)
        for cl in range(c):
            qs = np.argsort(-(unit(q) @ mu[cl]), kind="stable")[:wq] if query_routes is None \
                else np.broadcast_to(query_routes, qh.shape[:-2] + query_routes.shape[-2:])[idx][cl]
            ks = np.argsort(-(unit(k) @ mu[cl]), kind="stable")[:wk] if key_routes is None \
                else np.broadcast_to(key_routes, kh.shape[:-2] + key_routes.shape[-2:])[idx][cl]
            for i in qs:
                count[i] += 1
                keys = [j for j in ks if allowed(i, j)]
                if keys:
                    _, p = naive_attention(q[i:i + 1], k[keys], v[keys])
                    weights[idx + (i,)][keys] += p[0]
        weights[idx] /= np.maximum(count, 1)[:, None]
        out[idx] = weights[idx] @ v
    return out, weights


# ---------------------------------------------------------------- Synthesizer


def naive_dense_logits(x, w1, b1, w2, b2):
    """B_i = W2^T relu(W1^T x_i + b1) + b2, one token row at a time."""
    out = np.zeros(x.shape[:-1] + (w2.shape[1],))
    for idx in np.ndindex(x.shape[:-1]):
        hidden = np.maximum(w1.T @ x[idx] + b1, 0.0)
        out[idx] = w2.T @ hidden + b2
    return out


def naive_synthesizer(q, k, v, logits, alpha=1.0, causal=None, scale=None):
    """softmax over keys of alpha B_ij + (1 - alpha) scale q_i . k_j, entry by entry;
    returns (out, weights)."""
    nq, nk = q.shape[-2], k.shape[-2]
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], logits.shape[:-2])
    off = 0 if causal in (None, "top-left") else nk - nq
    w = np.zeros(batch + (nq, nk))
    for idx in np.ndindex(batch):
        qb, kb = np.broadcast_to(q, batch + q.shape[-2:])[idx], np.broadcast_to(k, batch + k.shape[-2:])[idx]
        lb = np.broadcast_to(logits, batch + (nq, nk))[idx]
        for i in range(nq):
            keys = [j for j in range(nk) if causal is None or j <= i + off]
            if not keys:
                continue
            s = np.array([alpha * lb[i, j] + (1 - alpha) * scale * (qb[i] @ kb[j]) for j in keys])
            e = np.exp(s - s.max())
            w[idx + (i,)][keys] = e / e.sum()
    return w @ v, w


# ---------------------------------------------------------------- sparse patterns
# Written from the set definitions with Python loops.


def ref_local(n, w, one_sided=False, dil=1):
    m = np.zeros((n, n), bool)
    for i in range(n):
        for t in range(-w, w + 1):
            j = i - t * dil
            if 0 <= j < n and (t >= 0 or not one_sided):
                m[i, j] = True
    return m


def ref_strided(n, l, causal=True, part="both"):
    m = np.zeros((n, n), bool)
    for i in range(n):
        for j in range(n):
            if causal and j > i:
                continue
            a1 = abs(i - j) <= l  # {max(0, i - l), ..., i} when causal
            a2 = (i - j) % l == 0
            m[i, j] = {"local": a1, "strided": a2, "both": a1 or a2}[part]
    return m


def ref_fixed(n, l, c, causal=True, part="both"):
    m = np.zeros((n, n), bool)
    for i in range(n):
        for j in range(n):
            if causal and j > i:
                continue
            a1 = j // l == i // l
            a2 = j % l in range(l - c, l)
            m[i, j] = {"block": a1, "summary": a2, "both": a1 or a2}[part]
    return m


def ref_global(n, tokens):
    m = np.zeros((n, n), bool)
    for t in tokens:
        m[t, :] = True
        m[:, t] = True
    return m


def ref_layout(layout, b, nq, nk):
    m = np.zeros((nq, nk), bool)
    for a, row in enumerate(layout):
        for c, on in enumerate(row):
            if on:
                m[a * b:(a + 1) * b, c * b:(c + 1) * b] = True
    return m


# ---------------------------------------------------------------- hashing: Reformer LSH


def naive_lsh_buckets(x, rotations):
    """h_r(x) = argmax([x R_r, -x R_r]) for every round r: (H, N) from x (N, d)."""
    n_hashes = rotations.shape[1]
    out = np.zeros((n_hashes, x.shape[0]), dtype=int)
    for r in range(n_hashes):
        for j in range(x.shape[0]):
            u = x[j] @ rotations[:, r, :]
            out[r, j] = int(np.argmax(np.concatenate([u, -u])))
    return out


def _reformer_one(q, k, v, rotations, chunk_size, causal, self_logit):
    """The paper's rounds, one head: per round a softmax over the window (chunk and the
    chunk before it, cyclically; a slot per occurrence), each pair's logit lowered by the
    log of how often it is found in all rounds, the rounds weighted by their log-sum-exp."""
    n, d = q.shape
    scale = 1 / np.sqrt(d) if d else 1.0
    buckets = naive_lsh_buckets(k, rotations)
    n_hashes, n_chunks = buckets.shape[0], -(-n // chunk_size)
    windows = []  # windows[r][i]: the key positions (with repeats) query i sees in round r
    for r in range(n_hashes):
        ranked = sorted(range(n), key=lambda j: (buckets[r, j], j))
        chunks = [ranked[a:a + chunk_size] for a in range(0, n, chunk_size)]
        where = {j: t // chunk_size for t, j in enumerate(ranked)}
        windows.append([chunks[where[i]] + chunks[(where[i] - 1) % n_chunks] for i in range(n)])
    outs, lses, parts = [], [], []
    for r in range(n_hashes):
        o_r, l_r, w_r = np.zeros((n, v.shape[1])), np.zeros(n), np.zeros((n, n))
        for i in range(n):
            keys = [j for j in windows[r][i] if not (causal and j > i)]
            logits = []
            for j in keys:
                s = self_logit if (i == j and self_logit is not None) else scale * (q[i] @ k[j])
                found = sum(w.count(j) for w in (windows[t][i] for t in range(n_hashes)))
                logits.append(s - np.log(found))
            logits = np.array(logits)
            top = logits.max()
            e = np.exp(logits - top)
            l_r[i] = top + np.log(e.sum())
            for j, ej in zip(keys, e):
                w_r[i, j] += ej / e.sum()
            o_r[i] = w_r[i] @ v
        outs.append(o_r)
        lses.append(l_r)
        parts.append(w_r)
    lses = np.array(lses)
    wts = np.exp(lses - lses.max(axis=0))
    wts = wts / wts.sum(axis=0)
    out = sum(wts[r][:, None] * outs[r] for r in range(n_hashes))
    return out, sum(wts[r][:, None] * parts[r] for r in range(n_hashes))


def naive_reformer(q, k, v, rotations, chunk_size, causal=False, self_logit=-5e4):
    """Reformer LSH attention by loops over batch, rounds and queries: (out, weights)."""
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    q, k, v = (np.broadcast_to(x, batch + x.shape[-2:]) for x in (q, k, v))
    out = np.zeros(batch + (q.shape[-2], v.shape[-1]))
    w = np.zeros(batch + (q.shape[-2], k.shape[-2]))
    for b in np.ndindex(*batch):
        out[b], w[b] = _reformer_one(q[b], k[b], v[b], rotations, chunk_size, causal, self_logit)
    return out, w


# ---------------------------------------------------------------- sorting: Sparse Sinkhorn


def naive_sinkhorn(r, n_iters, temperature, causal=False):
    """P = exp(X) after n_iters row-then-column normalisations of X = R / temperature in
    log space, entry by entry; entries off the causal support (j >= i) stay at zero."""
    nb = r.shape[-1]
    ok = np.array([[(j < i) if causal else True for j in range(nb)] for i in range(nb)])
    x = np.where(ok, r / temperature, -np.inf)

    def normalise(x, axis):
        out = x.copy()
        for line in range(nb):
            sl = (line, slice(None)) if axis == 1 else (slice(None), line)
            vals = x[sl]
            if np.any(np.isfinite(vals)):
                top = np.max(vals)
                out[sl] = vals - (top + np.log(np.sum(np.exp(vals - top))))
        return out

    for _ in range(n_iters):
        x = normalise(normalise(x, 1), 0)
    return np.exp(x)


def naive_sinkhorn_attention(q, k, v, r, block_size, n_iters=8, temperature=0.75, causal=False):
    """Block by block: keys = own block and sum_j P_ij block_j; one softmax. (out, weights)."""
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], r.shape[:-2])
    q, k, v = (np.broadcast_to(x, batch + x.shape[-2:]) for x in (q, k, v))
    r = np.broadcast_to(r, batch + r.shape[-2:])
    n, d, b = q.shape[-2], q.shape[-1], block_size
    scale = 1 / np.sqrt(d) if d else 1.0
    out = np.zeros(batch + (n, v.shape[-1]))
    w = np.zeros(batch + (n, n))
    for idx in np.ndindex(*batch):
        p = naive_sinkhorn(r[idx], n_iters, temperature, causal)
        for blk in range(n // b):
            own = list(range(blk * b, blk * b + b))
            ks = sum(p[blk, j] * k[idx][j * b:j * b + b] for j in range(n // b))
            vs = sum(p[blk, j] * v[idx][j * b:j * b + b] for j in range(n // b))
            for i in own:
                logits, vals, where = [], [], []
                for j in own:
                    if not causal or j <= i:
                        logits.append(scale * q[idx][i] @ k[idx][j])
                        vals.append(v[idx][j])
                        where.append([(j, 1.0)])
                if not causal or blk > 0:
                    for t2 in range(b):
                        logits.append(scale * q[idx][i] @ ks[t2])
                        vals.append(vs[t2])
                        where.append([(jb * b + t2, p[blk, jb]) for jb in range(n // b)])
                e = np.exp(np.array(logits) - max(logits))
                a = e / e.sum()
                out[idx][i] = a @ np.array(vals)
                for aj, spots in zip(a, where):
                    for j, f in spots:
                        w[idx][i, j] += aj * f
    return out, w


# ---------------------------------------------------------------- every registered variant
# PLAIN[name](q, k, v, causal, **extra) -> (output, weights) for the registry's variant
# ``name`` called as ``fn(q, k, v, causal=causal, **extra)``: q, k, v and the array
# entries of ``extra`` are float64 NumPy, ``causal`` is a bool.


def _tl(causal):
    return "top-left" if causal else None


def _bigbird(q, k, v, causal, *, block_size, window, global_blocks, random_blocks, seed):
    n = q.shape[-2]
    lay = bigbird_layout(-(-n // block_size), window=window, global_blocks=global_blocks,
                         random_blocks=random_blocks, seed=seed)
    return naive_attention(q, k, v, mask=ref_layout(lay, block_size, n, n), causal=_tl(causal))


def _pooled(q, k, v, causal, *, num_segments):
    nk, m = k.shape[-2], num_segments
    out, p = naive_attention(q, naive_means(k, m), naive_means(v, m),
                             mask=pool_mask(q.shape[-2], nk, m, _tl(causal) or False))
    # A segment's weight is shared equally by its keys.
    return out, np.concatenate([np.repeat(p[..., j:j + 1] / (b - a), b - a, axis=-1)
                                for j, (a, b) in enumerate(bounds(nk, m))], axis=-1)


def _query_reduced(q, k, v, causal, *, num_segments):
    n = q.shape[-2]
    out, p = naive_attention(naive_means(q, num_segments), k, v)
    return naive_expand(out, n), naive_expand(p, n)


# ---------------------------------------------------------------- recurrent (issue 18)


def np_recurrent(q, k, v, *, alpha=None, beta=None, scale=None, s0=None):
    """The recurrence of every variant of ``attn_ref.recurrent``, token by token.

    ``alpha (..., T, dk|1)`` multiplies the state's rows before step ``t`` (None: 1);
    ``beta (..., T)`` turns the write into the delta rule (None: add ``k_t^T v_t``)::

        S = alpha_t * S;  u = v_t - k_t S (delta: beta_t (v_t - k_t S));  S += k_t^T u;
        o_t = scale q_t S

    Returns ``(o, S_T)``, NumPy float64, loops over time and explicit sums.
    """
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    T, dk, dv = q.shape[-2], q.shape[-1], v.shape[-1]
    scale = 1 / np.sqrt(dk) if scale is None else scale
    S = np.zeros(lead + (dk, dv)) if s0 is None else np.array(s0, dtype=np.float64)
    o = np.zeros(lead + (T, dv))
    for t in range(T):
        if alpha is not None:
            S = np.asarray(alpha)[..., t, :, None] * S
        kt, vt = k[..., t, :], v[..., t, :]
        pred = np.einsum("...c,...ce->...e", kt, S)
        u = vt if beta is None else np.asarray(beta)[..., t, None] * (vt - pred)
        S = S + kt[..., :, None] * u[..., None, :]
        o[..., t, :] = scale * np.einsum("...c,...ce->...e", q[..., t, :], S)
    return o, S


def _recurrent_plain(q, k, v, **kw):
    """``(out, weights)``: the weights are the loop's output for ``v`` = the identity
    (the output is linear in ``v`` with a zero initial state)."""
    T = q.shape[-2]
    eye = np.broadcast_to(np.eye(T), np.broadcast_shapes(q.shape[:-2], k.shape[:-2]) + (T, T))
    return np_recurrent(q, k, v, **kw)[0], np_recurrent(q, k, eye, **kw)[0]


def _unit(x):
    x = np.asarray(x, dtype=np.float64)
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)  # fla's l2norm


def _retention(q, k, v, causal, *, gamma, chunk_size):
    T = q.shape[-2]
    g = np.asarray(gamma, dtype=np.float64)[..., None, None]  # per head, constant in time
    return _recurrent_plain(q, k, v, alpha=np.broadcast_to(g, g.shape[:-2] + (T, 1)))


def _deltanet(q, k, v, causal, *, beta, chunk_size, qk_l2norm, g=None):
    if qk_l2norm:
        q, k = _unit(q), _unit(k)
    alpha = None if g is None else np.exp(np.asarray(g))[..., None]
    return _recurrent_plain(q, k, v, alpha=alpha, beta=beta)


PLAIN = {
    "softmax": lambda q, k, v, causal: naive_attention(q, k, v, causal=_tl(causal)),
    "online_softmax": lambda q, k, v, causal, block_q, block_k: naive_attention(q, k, v, causal=_tl(causal)),
    "linear": lambda q, k, v, causal, feature_map, order, chunk_size, block_size: np_linear(
        q, k, v, feature_map=feature_map, causal=causal),
    "performer": lambda q, k, v, causal, projection, kernel, chunk_size: np_performer(
        q, k, v, projection, kernel=kernel, causal=causal),
    "linformer": lambda q, k, v, causal, e_proj, f_proj: naive_linformer(q, k, v, e_proj, f_proj),
    "compressed": lambda q, k, v, causal, k_weight, v_weight, stride: _compressed_weights(
        q, k, v, k_weight, v_weight, stride, _tl(causal)),
    "pooled": _pooled,
    "query_reduced": _query_reduced,
    "nystrom": lambda q, k, v, causal, num_landmarks: naive_nystrom(q, k, v, num_landmarks, 6),
    "clustered": lambda q, k, v, causal, num_clusters, seed: naive_clustered(
        q, k, v, num_clusters, 10, seed, None),
    "clustered_topk": lambda q, k, v, causal, num_clusters, seed, topk: naive_clustered(
        q, k, v, num_clusters, 10, seed, topk),
    "routing": lambda q, k, v, causal, centroids: naive_routing(q, k, v, centroids, _tl(causal)),
    "synthesizer_dense": lambda q, k, v, causal, w1, b1, w2, b2: naive_synthesizer(
        q, k, v, naive_dense_logits(q, w1, b1, w2, b2), causal=_tl(causal)),
    "synthesizer_random": lambda q, k, v, causal, r: naive_synthesizer(q, k, v, r, causal=_tl(causal)),
    "synthesizer_random_mix": lambda q, k, v, causal, r, alpha: naive_synthesizer(
        q, k, v, r, alpha, causal=_tl(causal)),
    "block_sparse": lambda q, k, v, causal, block_size, layout: naive_attention(
        q, k, v, mask=ref_layout(layout, block_size, q.shape[-2], k.shape[-2]), causal=_tl(causal)),
    "local": lambda q, k, v, causal, window: naive_attention(
        q, k, v, mask=ref_local(q.shape[-2], window, one_sided=causal)),
    "longformer": lambda q, k, v, causal, window, global_tokens: naive_attention(
        q, k, v, mask=ref_local(q.shape[-2], window) | ref_global(q.shape[-2], global_tokens),
        causal=_tl(causal)),
    "bigbird": _bigbird,
    "strided": lambda q, k, v, causal, stride: naive_attention(
        q, k, v, mask=ref_strided(q.shape[-2], stride, causal)),
    "fixed": lambda q, k, v, causal, stride, summary: naive_attention(
        q, k, v, mask=ref_fixed(q.shape[-2], stride, summary, causal)),
    "reformer": lambda q, k, v, causal, rotations, chunk_size: naive_reformer(
        q, k, v, rotations, chunk_size, causal=bool(causal)),
    "sinkhorn": lambda q, k, v, causal, sort_logits, block_size, n_iters, temperature: (
        naive_sinkhorn_attention(q, k, v, sort_logits, block_size, n_iters, temperature,
                                 causal=bool(causal))),
    "retention": _retention,
    "gla": lambda q, k, v, causal, g, chunk_size: _recurrent_plain(q, k, v, alpha=np.exp(g)),
    "ssd": lambda q, k, v, causal, g, chunk_size: _recurrent_plain(
        q, k, v, alpha=np.exp(g)[..., None]),
    "deltanet": _deltanet,
    "gated_deltanet": _deltanet,
}
