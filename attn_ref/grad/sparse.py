"""Gradients of the sparse attention patterns, as sparse as their forwards.

Every efficient form of :mod:`attn_ref.sparse` is softmax attention restricted to a
set of allowed pairs, computed as softmax partials over a few disjoint key sets per
query ("parts": gathered key blocks, residue classes of the strided pattern, the
summary columns of the fixed pattern) and merged exactly. Its VJP is the masked
softmax VJP of :mod:`attn_ref.grad.softmax` restricted to the same pairs, and is
computed part by part with the forward's own gathers:

1. the forward is rerun for the merged row maximum ``m`` and normaliser ``l``, giving
   the output ``O`` and the row log-sum-exp ``L = m + log l`` (``+inf`` on a row with
   no allowed key), and ``D = rowsum(dO * O)`` once;
2. per part, the logits ``S`` of the gathered pairs are recomputed and
   ``P = exp(S - L)`` - exactly the attention weights of those pairs, since ``L``
   normalises over every part;
3. ``dV = P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - D)``, ``dQ = scale dS K`` and
   ``dK = scale dS^T Q`` on the gathered tiles; the key-side cotangents are summed
   back to the keys they were gathered from.

The scatter back is the VJP of the gather: a key block gathered by ``c`` query blocks
receives the sum of its ``c`` tiles, found through the transposed gather structure
(key blocks grouped by how often they were gathered, one ``take`` and one sum per
group), so nothing is updated in place and nothing ``N x N`` is built. The residue
class layout of the strided pattern is a reshape, whose VJP is the inverse reshape;
the summary columns of the fixed pattern are distinct positions, put back by one
``take`` from a table with a zero row.

Masked pairs have ``P = 0`` and so ``dS = 0``: gradients never cross the pattern, and
a query with no allowed key gets zero gradients, never NaN.
"""

from __future__ import annotations

import array_api_compat

from .._common import ceil_div, finish_partial, partial_lse
from ..sparse import plans
from ._common import check_cotangent, through_clamp, transpose, unbroadcast

__all__ = [
    "block_sparse_attention",
    "local_attention",
    "longformer_attention",
    "bigbird_attention",
    "strided_attention",
    "fixed_attention",
]


def _blocks_vjp(xp, plan, part, q, k, v, do, lse, dcoef):
    """``(dS K, dS^T Q, dV)`` of a :class:`attn_ref.sparse.Blocks` part: ``dQ`` and ``dK``
    before the factor ``scale``."""
    B, nbq = part.block_size, len(part.rows)
    nbk = ceil_div(plan.nk, B)
    device, dtype = array_api_compat.device(q), q.dtype
    d, dv = q.shape[-1], v.shape[-1]
    dob = plans.pad_blocks(xp, do, B, nbq)
    lseb = plans.pad_blocks(xp, lse, B, nbq, xp.inf)  # padded query rows: P = 0
    db = plans.pad_blocks(xp, dcoef, B, nbq)
    dq, order, dks, dvs, slots = [], [], [], [], []
    for grp in plans.block_groups(xp, q, k, v, part, plan.nk, plan.scale):
        g = len(grp.ids)
        order.extend(grp.ids)
        if grp.s is None:
            dq.append(xp.zeros(plan.batch + (g, B, d), dtype=dtype, device=device))
            continue
        do_g, lse_g, d_g = ((x if g == nbq else xp.take(x, grp.index, axis=-3)) for x in (dob, lseb, db))
        p = xp.exp(grp.s - lse_g)  # (..., g, B, cnt B)
        dp = do_g @ transpose(xp, grp.vg)
        ds = through_clamp(xp, p * (dp - d_g), grp.s)
        dq.append(ds @ grp.kg)
        lead = tuple(ds.shape[:-3]) + (g * grp.cnt, B)
        dks.append(xp.reshape(transpose(xp, ds) @ grp.qg, lead + (d,)))
        dvs.append(xp.reshape(transpose(xp, p) @ do_g, lead + (dv,)))
        slots.extend(grp.flat)
    dk = _scatter_blocks(xp, dks, slots, nbk, B, plan.nk, plan.batch, d, dtype, device)
    dv = _scatter_blocks(xp, dvs, slots, nbk, B, plan.nk, plan.batch, dv, dtype, device)
    return plans.ungroup_blocks(xp, dq, order, plan.nq), dk, dv


def _scatter_blocks(xp, pieces, slots, nbk, B, n, batch, c, dtype, device):
    """Sum gathered key-block cotangents ``(..., E, B, c)`` back into the ``nbk`` blocks.

    ``slots[e]`` is the key block that gathered tile ``e`` came from (``nbk``: an
    empty slot, dropped). Blocks are grouped by how many tiles they receive; each
    group is one ``take`` and one sum. Returns ``(..., n, c)``.
    """
    received: list[list[int]] = [[] for _ in range(nbk)]
    for e, b in enumerate(slots):
        if b < nbk:
            received[b].append(e)
    by_count: dict[int, list[int]] = {}
    for b, es in enumerate(received):
        by_count.setdefault(len(es), []).append(b)
    x = None
    if pieces:
        x = pieces[0] if len(pieces) == 1 else xp.concat(pieces, axis=-3)
    out, order = [], []
    for cnt, blocks in by_count.items():
        order.extend(blocks)
        if cnt == 0:
            out.append(xp.zeros(batch + (len(blocks), B, c), dtype=dtype, device=device))
            continue
        idx = xp.asarray([e for b in blocks for e in received[b]], dtype=xp.int64, device=device)
        t = xp.take(x, idx, axis=-3)
        t = xp.reshape(t, tuple(t.shape[:-3]) + (len(blocks), cnt, B, c))
        out.append(xp.sum(t, axis=-3))
    return plans.ungroup_blocks(xp, out, order, n)


def _classes_vjp(xp, plan, part, q, k, v, do, lse, dcoef):
    """``(dS K, dS^T Q, dV)`` of the strided pattern's residue-class part."""
    n, stride = plan.nq, part.stride
    C = ceil_div(n, stride)
    qc, kc, vc, s = plans.class_logits(xp, q, k, v, part, n, plan.scale)
    doc, dc = (plans.to_classes(xp, x, stride, C) for x in (do, dcoef))
    p = xp.exp(s - plans.to_classes(xp, lse, stride, C, xp.inf))  # (..., l, C, C)
    ds = through_clamp(xp, p * (doc @ transpose(xp, vc) - dc), s)
    # The class layout is a zero-padded reshape: its VJP reshapes back and drops the padding.
    return tuple(plans.from_classes(xp, x, n)
                 for x in (ds @ kc, transpose(xp, ds) @ qc, transpose(xp, p) @ doc))


def _columns_vjp(xp, plan, part, q, k, v, do, lse, dcoef):
    """``(dS K, dS^T Q, dV)`` of the fixed pattern's summary-column part."""
    n, cols = plan.nq, part.cols
    device = array_api_compat.device(q)
    kc, vc, s = plans.column_logits(xp, q, k, v, part, n, plan.scale)
    p = xp.exp(s - lse)  # (..., N, |cols|)
    ds = through_clamp(xp, p * (do @ transpose(xp, vc) - dcoef), s)
    where = {j: t for t, j in enumerate(cols)}
    # Row |cols| is zero: positions that are not summary columns get nothing.
    idx = xp.asarray([where.get(j, len(cols)) for j in range(n)], dtype=xp.int64, device=device)

    def put_back(g):
        z = xp.zeros(tuple(g.shape[:-2]) + (1, g.shape[-1]), dtype=g.dtype, device=device)
        return xp.take(xp.concat([g, z], axis=-2), idx, axis=-2)

    return ds @ kc, put_back(transpose(xp, ds) @ q), put_back(transpose(xp, p) @ do)


_PART_VJPS = {plans.Blocks: _blocks_vjp, plans.Classes: _classes_vjp, plans.Columns: _columns_vjp}


def _vjp(plan, q, k, v, do):
    xp = plan.xp
    do = check_cotangent(xp, do, plan.batch + (plan.nq, v.shape[-1]), q)
    device = array_api_compat.device(q)
    if plan.nq == 0 or plan.nk == 0:
        return {n: xp.zeros(x.shape, dtype=x.dtype, device=device) for n, x in (("q", q), ("k", k), ("v", v))}
    m, l, acc = plans.plan_partial(plan, q, k, v)
    out = finish_partial(xp, l, acc)
    lse = partial_lse(xp, m, l)  # over every part: +inf on rows with no allowed key
    dcoef = xp.sum(do * out, axis=-1, keepdims=True)  # D = rowsum(dO * O) = rowsum(P * dP)
    dq = dk = dv = None
    for part in plan.parts:
        a, b, c = _PART_VJPS[type(part)](xp, plan, part, q, k, v, do, lse, dcoef)
        dq, dk, dv = (a, b, c) if dq is None else (dq + a, dk + b, dv + c)
    # dS = d(logits); the logits are scale * q k^T, and the scale is applied to the
    # products, never to q or k, whose scaled copies may overflow where the logits do not.
    if plan.scale != 1.0:
        dq, dk = dq * plan.scale, dk * plan.scale
    return {"q": unbroadcast(xp, dq, q.shape), "k": unbroadcast(xp, dk, k.shape),
            "v": unbroadcast(xp, dv, v.shape)}


def block_sparse_attention(q, k, v, do, /, *, layout, block_size, causal=False, scale=None, xp=None):
    """VJP of :func:`attn_ref.sparse.block_sparse_attention`: the gradients of ``<do, O>``.

    Parameters
    ----------
    q : array, shape (..., Nq, d)
    k : array, shape (..., Nk, d)
    v : array, shape (..., Nk, dv)
    do : array, shape (..., Nq, dv)
        Cotangent of the output, in the output's (broadcast) batch shape.
    layout, block_size, causal, scale, xp
        As in :func:`attn_ref.sparse.block_sparse_attention`; not differentiated.

    Returns
    -------
    dict
        ``{"q": dq, "k": dk, "v": dv}``, each of the shape of that input: gradients of
        inputs broadcast over batch dimensions are summed over them. Equal, up to
        rounding, to :func:`attn_ref.grad.softmax_attention` with ``mask=layout_mask(...)``.

    Notes
    -----
    The forward's gathers are rerun for ``m``, ``l`` (the row log-sum-exp), then each
    gathered tile gives its share of ``dQ`` and its key blocks' shares of ``dK``,
    ``dV``, summed back per key block: ``O(nnz(layout) B^2 (d + dv))`` time, about 3.5
    times the forward, and ``O(nnz(layout) B (B + d + dv))`` memory (times the batch),
    never ``O(Nq Nk)``. A query block with no active key block gets ``dq = 0``.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import grad
    >>> from attn_ref.sparse import layout_mask
    >>> x = xp.reshape(xp.sin(xp.arange(35.0)), (7, 5))
    >>> lay = ((True, False), (True, True))
    >>> a = grad.block_sparse_attention(x, x, x, x, layout=lay, block_size=4)
    >>> b = grad.softmax_attention(x, x, x, x, mask=layout_mask(lay, 4, nq=7, nk=7, xp=xp))
    >>> all(bool(xp.max(xp.abs(a[n] - b[n])) < 1e-13) for n in "qkv")
    True
    """
    plan = plans.block_sparse_plan(q, k, v, layout=layout, block_size=block_size, causal=causal,
                                 scale=scale, xp=xp)
    return _vjp(plan, q, k, v, do)


def local_attention(q, k, v, do, /, *, window, causal=False, dilation=1, block_size=None, scale=None,
                    xp=None):
    """VJP of :func:`attn_ref.sparse.local_attention` (sliding window): gradients of ``<do, O>``.

    Parameters
    ----------
    q, k : array, shape (..., N, d)
    v : array, shape (..., N, dv)
    do : array, shape (..., N, dv)
        Cotangent of the output.
    window, causal, dilation, block_size, scale, xp
        As in :func:`attn_ref.sparse.local_attention`; not differentiated.

    Returns
    -------
    dict
        ``{"q": dq, "k": dk, "v": dv}``, each of the shape of that input (summed over
        the batch dimensions it was broadcast along). Equal, up to rounding, to
        :func:`attn_ref.grad.softmax_attention` with ``mask=local_mask(...)``.

    Notes
    -----
    ``O(N r (d + dv))`` time and ``O(N r)`` memory for the reach ``r = window *
    dilation`` (the forward's gathers, rerun, and their transposes), never ``O(N^2)``.
    Sliding-window attention as in Longformer (Beltagy et al. 2020).

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import grad
    >>> from attn_ref.sparse import local_mask
    >>> x = xp.reshape(xp.cos(xp.arange(40.0)), (10, 4))
    >>> a = grad.local_attention(x, x, x, x, window=2, causal=True)
    >>> b = grad.softmax_attention(x, x, x, x, mask=local_mask(10, window=2, one_sided=True, xp=xp))
    >>> all(bool(xp.max(xp.abs(a[n] - b[n])) < 1e-13) for n in "qkv")
    True
    """
    plan = plans.local_plan(q, k, v, window=window, causal=causal, dilation=dilation,
                          block_size=block_size, scale=scale, xp=xp)
    return _vjp(plan, q, k, v, do)


def longformer_attention(q, k, v, do, /, *, window, global_tokens, causal=False, dilation=1,
                         block_size=None, scale=None, xp=None):
    """VJP of :func:`attn_ref.sparse.longformer_attention` (Beltagy et al. 2020).

    Parameters
    ----------
    q, k : array, shape (..., N, d)
    v : array, shape (..., N, dv)
    do : array, shape (..., N, dv)
        Cotangent of the output.
    window, global_tokens, causal, dilation, block_size, scale, xp
        As in :func:`attn_ref.sparse.longformer_attention`; not differentiated.

    Returns
    -------
    dict
        ``{"q": dq, "k": dk, "v": dv}``, each of the shape of that input (summed over
        the batch dimensions it was broadcast along). Equal, up to rounding, to
        :func:`attn_ref.grad.softmax_attention` with ``mask=longformer_mask(...)``.

    Notes
    -----
    Same gathers as the forward: ``O(N (w + g B) (d + dv))`` time for ``g`` global
    tokens; the key blocks holding global tokens receive a tile from every query
    block, summed back in one ``take`` per group of equally often gathered blocks.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import grad
    >>> from attn_ref.sparse import longformer_mask
    >>> x = xp.reshape(xp.sin(xp.arange(36.0)), (9, 4))
    >>> a = grad.longformer_attention(x, x, x, x, window=1, global_tokens=(4,))
    >>> mask = longformer_mask(9, window=1, global_tokens=(4,), xp=xp)
    >>> b = grad.softmax_attention(x, x, x, x, mask=mask)
    >>> all(bool(xp.max(xp.abs(a[n] - b[n])) < 1e-13) for n in "qkv")
    True
    """
    plan = plans.longformer_plan(q, k, v, window=window, global_tokens=global_tokens, causal=causal,
                               dilation=dilation, block_size=block_size, scale=scale, xp=xp)
    return _vjp(plan, q, k, v, do)


def bigbird_attention(q, k, v, do, /, *, block_size, window=1, global_blocks=1, random_blocks=1,
                      seed=0, last_global_blocks=0, causal=False, scale=None, xp=None):
    """VJP of :func:`attn_ref.sparse.bigbird_attention` (Zaheer et al. 2020).

    Parameters
    ----------
    q, k : array, shape (..., N, d)
    v : array, shape (..., N, dv)
    do : array, shape (..., N, dv)
        Cotangent of the output.
    block_size, window, global_blocks, random_blocks, seed, last_global_blocks, causal, scale, xp
        As in :func:`attn_ref.sparse.bigbird_attention`; not differentiated (the
        random blocks are the same seeded draw as the forward's).

    Returns
    -------
    dict
        ``{"q": dq, "k": dk, "v": dv}``, each of the shape of that input (summed over
        the batch dimensions it was broadcast along). Equal, up to rounding, to
        :func:`attn_ref.grad.softmax_attention` with ``mask=bigbird_mask(...)``.

    Notes
    -----
    ``O(N B (2 window + 1 + global_blocks + random_blocks) (d + dv))`` time for the
    ordinary rows plus ``O(global_blocks B N (d + dv))`` for the global rows, as the
    forward.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import grad
    >>> from attn_ref.sparse import bigbird_mask
    >>> x = xp.reshape(xp.sin(xp.arange(44.0)), (11, 4))
    >>> a = grad.bigbird_attention(x, x, x, x, block_size=3, window=0, random_blocks=1, seed=2)
    >>> mask = bigbird_mask(11, block_size=3, window=0, random_blocks=1, seed=2, xp=xp)
    >>> b = grad.softmax_attention(x, x, x, x, mask=mask)
    >>> all(bool(xp.max(xp.abs(a[n] - b[n])) < 1e-13) for n in "qkv")
    True
    """
    plan = plans.bigbird_plan(q, k, v, block_size=block_size, window=window, global_blocks=global_blocks,
                            random_blocks=random_blocks, seed=seed, last_global_blocks=last_global_blocks,
                            causal=causal, scale=scale, xp=xp)
    return _vjp(plan, q, k, v, do)


def strided_attention(q, k, v, do, /, *, stride, causal=True, scale=None, xp=None):
    """VJP of :func:`attn_ref.sparse.strided_attention` (Sparse Transformer, Child et al. 2019).

    Parameters
    ----------
    q, k : array, shape (..., N, d)
    v : array, shape (..., N, dv)
    do : array, shape (..., N, dv)
        Cotangent of the output.
    stride, causal, scale, xp
        As in :func:`attn_ref.sparse.strided_attention`; not differentiated.

    Returns
    -------
    dict
        ``{"q": dq, "k": dk, "v": dv}``, each of the shape of that input (summed over
        the batch dimensions it was broadcast along). Equal, up to rounding, to
        :func:`attn_ref.grad.softmax_attention` with ``mask=strided_mask(...)``.

    Notes
    -----
    The local part is differentiated like :func:`local_attention`, the strided part
    inside each residue class (a reshape, undone for the gradients):
    ``O(N (l + N/l) (d + dv))`` time and ``O(N l + N^2/l)`` memory, as the forward.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import grad
    >>> from attn_ref.sparse import strided_mask
    >>> x = xp.reshape(xp.sin(xp.arange(48.0)), (12, 4))
    >>> a = grad.strided_attention(x, x, x, x, stride=3)
    >>> b = grad.softmax_attention(x, x, x, x, mask=strided_mask(12, stride=3, xp=xp))
    >>> all(bool(xp.max(xp.abs(a[n] - b[n])) < 1e-13) for n in "qkv")
    True
    """
    plan = plans.strided_plan(q, k, v, stride=stride, causal=causal, scale=scale, xp=xp)
    return _vjp(plan, q, k, v, do)


def fixed_attention(q, k, v, do, /, *, stride, summary=1, causal=True, scale=None, xp=None):
    """VJP of :func:`attn_ref.sparse.fixed_attention` (Sparse Transformer, Child et al. 2019).

    Parameters
    ----------
    q, k : array, shape (..., N, d)
    v : array, shape (..., N, dv)
    do : array, shape (..., N, dv)
        Cotangent of the output.
    stride, summary, causal, scale, xp
        As in :func:`attn_ref.sparse.fixed_attention`; not differentiated.

    Returns
    -------
    dict
        ``{"q": dq, "k": dk, "v": dv}``, each of the shape of that input (summed over
        the batch dimensions it was broadcast along). Equal, up to rounding, to
        :func:`attn_ref.grad.softmax_attention` with ``mask=fixed_mask(...)``.

    Notes
    -----
    The own-block part is block-diagonal; the summary keys' gradients are put back
    at their positions: ``O(N (l + c N / l) (d + dv))`` time and
    ``O(N (l + c N / l))`` memory, as the forward.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import grad
    >>> from attn_ref.sparse import fixed_mask
    >>> x = xp.reshape(xp.sin(xp.arange(44.0)), (11, 4))
    >>> a = grad.fixed_attention(x, x, x, x, stride=4, summary=2)
    >>> b = grad.softmax_attention(x, x, x, x, mask=fixed_mask(11, stride=4, summary=2, xp=xp))
    >>> all(bool(xp.max(xp.abs(a[n] - b[n])) < 1e-13) for n in "qkv")
    True
    """
    plan = plans.fixed_plan(q, k, v, stride=stride, summary=summary, causal=causal, scale=scale, xp=xp)
    return _vjp(plan, q, k, v, do)
