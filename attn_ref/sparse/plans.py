"""Plans of the sparse family's efficient forms: gathered key blocks, residue classes and
summary columns, merged exactly (the forward and the blockwise backward share them).

Cost of the efficient forms
---------------------------
A query block of ``B`` rows that sees ``c`` key blocks costs ``O(B c B d)`` time and
``O(B c B)`` logits memory, so a layout with ``c`` active blocks per row costs
``O(N c B d)``: for a window ``w`` with ``B = w`` that is ``O(N w d)`` time and memory.
Query blocks are grouped by their number of active blocks and each group is one
gather and one batched matmul, so there is no Python loop over blocks.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import array_api_compat

from .._checks import check_positive_int, check_qkv, default_scale
from .._common import (
    and_masks,
    causal_alignment,
    causal_offset,
    ceil_div,
    finish_partial,
    merge_partials,
    scaled_logits,
    softmax_partial,
)
from ..softmax.tiles import logit_dtype
from .masks import (
    banded_rows,
    bigbird_rows,
    check_global_tokens,
    check_sparse_window,
    check_summary,
    global_vector,
    layout_rows,
    local_pred,
    position_grid,
)

__all__ = [
    "pad_blocks",
    "block_groups",
    "ungroup_blocks",
    "to_classes",
    "from_classes",
    "class_logits",
    "column_logits",
    "Blocks",
    "Classes",
    "Columns",
    "plan_partial",
    "block_sparse_plan",
    "local_plan",
    "longformer_plan",
    "bigbird_plan",
    "strided_plan",
    "fixed_plan",
    "attend_plan",
]


# ---------------------------------------------------------------- the block kernel
# Each part gives a softmax partial (m, l, acc) (attn_ref._common) over its keys; the
# parts' key sets are disjoint, so the partials merge exactly.


def _partial(xp, s, v, batch, core):
    """Partial of logits ``s`` (-inf where not allowed) against values ``v``.

    ``core`` is the number of trailing non-batch axes of ``s``; ``m`` and ``l`` are
    broadcast to the full batch so that partials concatenate and merge.
    """
    m, l, acc = softmax_partial(xp, s, v)
    shape = batch + tuple(m.shape[m.ndim - core:])
    return xp.broadcast_to(m, shape), xp.broadcast_to(l, shape), acc


def pad_blocks(xp, x, block_size, nblocks, fill=0.0):
    """``(..., n, c)`` -> ``(..., nblocks, B, c)``, padding the ragged tail with ``fill``."""
    pad = nblocks * block_size - x.shape[-2]
    if pad:
        z = xp.full(tuple(x.shape[:-2]) + (pad, x.shape[-1]), fill, dtype=x.dtype,
                    device=array_api_compat.device(x))
        x = xp.concat([x, z], axis=-2)
    return xp.reshape(x, tuple(x.shape[:-2]) + (nblocks, block_size, x.shape[-1]))


class _BlockGroup(NamedTuple):
    """The query blocks ``ids`` that each see ``cnt`` key blocks, gathered.

    ``flat`` lists their key blocks row by row (``nbk``, one past the last block, for
    an empty slot); ``index`` is ``ids`` as an index array. ``qg (..., g, B, d)``,
    ``kg (..., g, cnt B, d)`` and ``vg (..., g, cnt B, dv)`` are the gathered (scaled)
    queries, keys and values and ``s (..., g, B, cnt B)`` the scaled logits, ``-inf``
    where not allowed; all four are None when ``cnt == 0``.
    """

    cnt: int
    ids: list
    flat: list
    index: Any
    qg: Any
    kg: Any
    vg: Any
    s: Any


def block_groups(xp, q, k, v, part, nk, scale):
    """The gathers of a :class:`Blocks` part: one :class:`_BlockGroup` per row length.

    Query blocks are grouped by their number of active key blocks and each group is
    one gather and one batched matmul. The forward and the VJP both iterate over
    this, so they see the same logits, ``scale q k^T`` (:func:`scaled_logits`); padded key positions
    are always excluded; a row entry of ``-1`` is an empty slot that gathers an
    all-padding block.
    """
    B, rows, predicate = part.block_size, part.rows, part.predicate
    device = array_api_compat.device(q)
    nbq, nbk = len(rows), ceil_div(nk, B)
    d, dv = q.shape[-1], v.shape[-1]
    empty_slots = any(b < 0 for r in rows for b in r)
    # Empty slots point at one extra block past the end, which is all padding.
    nbk_alloc = nbk + 1 if empty_slots else nbk
    qb, kb, vb = (pad_blocks(xp, x, B, nb) for x, nb in ((q, nbq), (k, nbk_alloc), (v, nbk_alloc)))
    groups: dict[int, list[int]] = {}
    for a, r in enumerate(rows):
        groups.setdefault(len(r), []).append(a)
    offs = xp.arange(B, dtype=xp.int64, device=device)
    for cnt, ids in groups.items():
        g = len(ids)
        ida = xp.asarray(ids, dtype=xp.int64, device=device)
        if cnt == 0:
            yield _BlockGroup(cnt, ids, [], ida, None, None, None, None)
            continue
        flat = [b if b >= 0 else nbk for a in ids for b in rows[a]]
        fi = xp.asarray(flat, dtype=xp.int64, device=device)
        qg = qb if g == nbq else xp.take(qb, ida, axis=-3)
        kg = xp.reshape(xp.take(kb, fi, axis=-3), tuple(kb.shape[:-3]) + (g, cnt * B, d))
        vg = xp.reshape(xp.take(vb, fi, axis=-3), tuple(vb.shape[:-3]) + (g, cnt * B, dv))
        s = scaled_logits(xp, qg @ xp.matrix_transpose(kg), scale)  # (..., g, B, cnt*B)
        qpos = (ida[:, None] * B + offs[None, :])[:, :, None]
        kpos = xp.reshape(xp.reshape(fi, (g, cnt))[:, :, None] * B + offs, (g, 1, cnt * B))
        allowed = (kpos < nk) if (nk % B or empty_slots) else None
        if predicate is not None:
            allowed = and_masks(xp, allowed, predicate(qpos, kpos))
        if allowed is not None:
            s = xp.where(allowed, s, -xp.inf)
        yield _BlockGroup(cnt, ids, flat, ida, qg, kg, vg, s)


def ungroup_blocks(xp, pieces, order, n):
    """Per-group ``(..., g, B, c)`` pieces for query blocks ``order`` -> ``(..., n, c)``."""
    x = pieces[0] if len(pieces) == 1 else xp.concat(pieces, axis=-3)
    nb = len(order)
    if order != list(range(nb)):
        inverse = [0] * nb
        for pos, a in enumerate(order):
            inverse[a] = pos
        x = xp.take(x, xp.asarray(inverse, dtype=xp.int64, device=array_api_compat.device(x)), axis=-3)
    return xp.reshape(x, tuple(x.shape[:-3]) + (nb * x.shape[-2], x.shape[-1]))[..., :n, :]


def _block_partials(xp, q, k, v, part, nk, batch, scale):
    """Partials of every query position over the key blocks of its block (a :class:`Blocks`)."""
    B, dv = part.block_size, v.shape[-1]
    device = array_api_compat.device(q)
    parts, order = [], []
    for grp in block_groups(xp, q, k, v, part, nk, scale):
        order.extend(grp.ids)
        g = len(grp.ids)
        if grp.s is None:
            parts.append((
                xp.full(batch + (g, B, 1), -xp.inf, dtype=q.dtype, device=device),
                xp.zeros(batch + (g, B, 1), dtype=q.dtype, device=device),
                xp.zeros(batch + (g, B, dv), dtype=q.dtype, device=device),
            ))
            continue
        parts.append(_partial(xp, grp.s, grp.vg, batch, 3))
    return tuple(ungroup_blocks(xp, [p[t] for p in parts], order, q.shape[-2]) for t in range(3))


def to_classes(xp, x, stride, nclasses, fill=0.0):
    """``(..., n, c)`` -> ``(..., stride, C, c)``: row ``r``, column ``t`` is position ``t l + r``."""
    xb = pad_blocks(xp, x, stride, nclasses, fill)  # (..., C, l, c)
    nd = xb.ndim
    return xp.permute_dims(xb, tuple(range(nd - 3)) + (nd - 2, nd - 3, nd - 1))


def from_classes(xp, x, n):
    """Inverse of :func:`to_classes`: ``(..., l, C, c)`` back to ``(..., n, c)``."""
    nd = x.ndim
    x = xp.permute_dims(x, tuple(range(nd - 3)) + (nd - 2, nd - 3, nd - 1))
    return xp.reshape(x, tuple(x.shape[:-3]) + (x.shape[-3] * x.shape[-2], x.shape[-1]))[..., :n, :]


def class_logits(xp, q, k, v, part, n, scale):
    """A :class:`Classes` part: ``(qc, kc, vc, s)`` in class layout, ``s (..., l, C, C)``
    the scaled logits."""
    stride = part.stride
    C = ceil_div(n, stride)
    device = array_api_compat.device(q)
    qc, kc, vc = (to_classes(xp, x, stride, C) for x in (q, k, v))
    s = scaled_logits(xp, qc @ xp.matrix_transpose(kc), scale)  # (..., l, C, C)
    t = xp.arange(C, dtype=xp.int64, device=device)
    r = xp.arange(stride, dtype=xp.int64, device=device)
    gap = t[:, None] - t[None, :]
    ok = (gap >= 2) if part.one_sided else (xp.abs(gap) >= 2)
    ok = xp.logical_and(ok[None, :, :], (t[None, None, :] * stride + r[:, None, None]) < n)
    return qc, kc, vc, xp.where(ok, s, -xp.inf)


def column_logits(xp, q, k, v, part, n, scale):
    """A :class:`Columns` part: ``(kc, vc, s)`` for its key columns, ``s (..., N, |cols|)``
    the scaled logits."""
    device = array_api_compat.device(q)
    jc = xp.asarray(part.cols, dtype=xp.int64, device=device)
    kc, vc = xp.take(k, jc, axis=-2), xp.take(v, jc, axis=-2)
    s = scaled_logits(xp, q @ xp.matrix_transpose(kc), scale)  # (..., N, |cols|)
    if part.predicate is None:
        return kc, vc, s
    i, _ = position_grid(xp, n, 0, device)
    return kc, vc, xp.where(part.predicate(i, jc[None, :]), s, -xp.inf)


def _causal_pred(xp, alignment, nq, nk):
    if alignment is None:
        return None
    off = causal_offset(alignment, nq, nk)
    return lambda i, j: j <= i + off


def _combine(xp, *preds):
    preds = [p for p in preds if p is not None]
    if not preds:
        return None
    if len(preds) == 1:
        return preds[0]

    def both(i, j):
        out = preds[0](i, j)
        for p in preds[1:]:
            out = xp.logical_and(out, p(i, j))
        return out

    return both


def _empty(xp, q, v, batch):
    return xp.zeros(batch + (q.shape[-2], v.shape[-1]), dtype=q.dtype,
                    device=array_api_compat.device(q))


# ---------------------------------------------------------------- plans
# Every efficient form is a plan: a few disjoint key sets ("parts") per query, each
# one softmax partial, merged exactly. The forward evaluates the plan; the VJPs in
# attn_ref.grad.sparse differentiate the same plan part by part, so the gathers and
# the masks are written once.


class Blocks(NamedTuple):
    """Query block ``a`` sees key blocks ``rows[a]`` (``-1``: empty slot); ``predicate`` refines."""

    rows: tuple
    block_size: int
    predicate: Any


class Classes(NamedTuple):
    """Strided far part: within each residue class mod ``stride``, offsets of 2+ strides."""

    stride: int
    one_sided: bool


class Columns(NamedTuple):
    """Key columns ``cols`` that every query sees where ``predicate(i, j)`` holds (None:
    all): the fixed pattern's summary keys, Longformer's global keys, BigBird's global
    blocks.

    One matrix product of all queries with the columns, where a :class:`Blocks` part
    would gather them into every query block: under autograd that gather's backward sums
    a column's ``dK``, ``dV`` over the blocks in the input's dtype (Longformer at window
    2, N = 1000, bfloat16: 1000 roundings, a global key's ``dV`` 7 % off); here a single
    product, as the kernels that compute global attention apart do.
    """

    cols: tuple
    predicate: Any


class _Plan(NamedTuple):
    """A validated call: namespace, broadcast batch shape, lengths, scale and the parts."""

    xp: Any
    batch: tuple
    nq: int
    nk: int
    scale: float
    parts: tuple


def plan_partial(plan, q, k, v):
    """The merged partial ``(m, l, acc)`` of all parts (the logits ``plan.scale q k^T``)."""
    xp, n = plan.xp, plan.nq
    out = None
    for part in plan.parts:
        if isinstance(part, Blocks):
            p = _block_partials(xp, q, k, v, part, plan.nk, plan.batch, plan.scale)
        elif isinstance(part, Classes):
            _, _, vc, s = class_logits(xp, q, k, v, part, n, plan.scale)
            p = tuple(from_classes(xp, x, n) for x in _partial(xp, s, vc, plan.batch, 3))
        else:
            _, vc, s = column_logits(xp, q, k, v, part, n, plan.scale)
            p = _partial(xp, s, vc, plan.batch, 2)
        out = p if out is None else merge_partials(xp, out, p)
    return out


def attend_plan(plan, q, k, v):
    """The output of a plan of the efficient forms: its parts merged, normalised.

    float16 and bfloat16 inputs are computed in float32 and the output rounded once to
    their dtype, as the dense softmax's logits and statistics
    (:func:`attn_ref.softmax.tiles.logit_dtype`), linear attention and Performer are: in
    the dtype the logits, exponentials, row sums and the merges of the parts' partials
    each rounded, and on small cases the output's RMS error reached 1.5x a plain
    fp32-accumulating implementation's (BigBird, ``scale:b1h1-q16k16-d8-scale0.3`` in
    float16 on torch: 3.0e-4 against 2.0e-4, the oracle's bound 1.5x).
    """
    if plan.nq == 0 or plan.nk == 0:
        return _empty(plan.xp, q, v, plan.batch)
    xp, dtype = plan.xp, q.dtype
    work = logit_dtype(xp, dtype)
    if work != dtype:
        q, k, v = (xp.astype(x, work) for x in (q, k, v))
    _, l, acc = plan_partial(plan, q, k, v)
    out = finish_partial(xp, l, acc)
    return out if work == dtype else xp.astype(out, dtype)


def block_sparse_plan(q, k, v, *, layout, block_size, causal=False, scale=None, xp=None):
    """The checked inputs and parts of :func:`block_sparse_attention` (same arguments)."""
    xp, batch = check_qkv(q, k, v, xp=xp)
    check_positive_int("block_size", block_size)
    nq, nk = q.shape[-2], k.shape[-2]
    rows = layout_rows(layout, ceil_div(nq, block_size), ceil_div(nk, block_size), block_size, nq, nk)
    alignment = causal_alignment(causal)
    scale = default_scale(q.shape[-1], scale)
    parts = (Blocks(rows, block_size, _causal_pred(xp, alignment, nq, nk)),)
    return _Plan(xp, batch, nq, nk, scale, parts if nq and nk else ())


def local_plan(q, k, v, *, window, causal=False, dilation=1, block_size=None, scale=None, xp=None):
    """The checked inputs and parts of :func:`local_attention` (same arguments)."""
    xp, batch = check_qkv(q, k, v, xp=xp, same_length=True)
    reach = check_sparse_window(window, dilation)
    one_sided = causal_alignment(causal) is not None
    n = q.shape[-2]
    B = _local_block_size(block_size, reach, n)
    scale = default_scale(q.shape[-1], scale)
    if n == 0:
        return _Plan(xp, batch, n, n, scale, ())
    rows = banded_rows(ceil_div(n, B), B, reach, one_sided)
    return _Plan(xp, batch, n, n, scale,
                 (Blocks(rows, B, _local_predicate(xp, reach, one_sided, dilation, B)),))


def longformer_plan(q, k, v, *, window, global_tokens, causal=False, dilation=1, block_size=None,
                    scale=None, xp=None):
    """The checked inputs and parts of :func:`longformer_attention` (same arguments)."""
    xp, batch = check_qkv(q, k, v, xp=xp, same_length=True)
    reach = check_sparse_window(window, dilation)
    n = q.shape[-2]
    tokens = check_global_tokens(global_tokens, n)
    alignment = causal_alignment(causal)
    B = _local_block_size(block_size, reach, n)
    scale = default_scale(q.shape[-1], scale)
    if n == 0:
        return _Plan(xp, batch, n, n, scale, ())
    nb = ceil_div(n, B)
    gblocks = {t // B for t in tokens}
    # A global query's block gathers every block; the others their band, and see the
    # global keys outside it as columns (Columns: one product, not a gather per block).
    rows = [tuple(range(nb)) if a in gblocks else r
            for a, r in enumerate(banded_rows(nb, B, reach, False))]
    # Pad the ordinary rows to one length so that they form a single gather.
    width = max((len(r) for a, r in enumerate(rows) if a not in gblocks), default=0)
    rows = tuple(r if a in gblocks else r + (-1,) * (width - len(r)) for a, r in enumerate(rows))
    # Covers the padding and the empty-slot block past the end.
    gvec = global_vector(xp, tokens, (nb + 1) * B, array_api_compat.device(q))

    def local(i, j):
        return local_pred(xp, i, j, reach, False, dilation)

    def band(i, j):  # a global query sees every key here, the others their window
        return xp.logical_or(local(i, j), _lookup(xp, gvec, i))

    def columns(i, j):  # the global keys, for the other queries, outside their window
        return xp.logical_and(xp.logical_not(_lookup(xp, gvec, i)), xp.logical_not(local(i, j)))

    causal_pred = _causal_pred(xp, alignment, n, n)
    parts = (Blocks(rows, B, _combine(xp, band, causal_pred)),)
    if len(tokens) and len(gblocks) < nb:
        parts += (Columns(tokens, _combine(xp, columns, causal_pred)),)
    return _Plan(xp, batch, n, n, scale, parts)


def _lookup(xp, table, i):
    """``table[i]`` for an integer position array ``i`` of any shape."""
    return xp.reshape(xp.take(table, xp.reshape(i, (-1,)), axis=0), i.shape)


def bigbird_plan(q, k, v, *, block_size, window=1, global_blocks=1, random_blocks=1, seed=0,
                 last_global_blocks=0, causal=False, scale=None, xp=None):
    """The checked inputs and parts of :func:`bigbird_attention` (same arguments)."""
    xp, batch = check_qkv(q, k, v, xp=xp, same_length=True)
    check_positive_int("block_size", block_size)
    n = q.shape[-2]
    rows = bigbird_rows(n, block_size, window, global_blocks, random_blocks, seed, last_global_blocks)
    alignment = causal_alignment(causal)
    scale = default_scale(q.shape[-1], scale)
    if not n:
        return _Plan(xp, batch, n, n, scale, ())
    nb = len(rows)
    # the global blocks (rows and columns, bigbird_layout): a global query block gathers
    # every block; the others see the global keys as columns (Columns: one product, not
    # a gather per block) and gather their window and random blocks
    glob = {b for b in range(nb) if b < global_blocks or b >= nb - last_global_blocks}
    causal_pred = _causal_pred(xp, alignment, n, n)
    if not glob or len(glob) == nb:
        return _Plan(xp, batch, n, n, scale, (Blocks(rows, block_size, causal_pred),))
    rows = tuple(r if a in glob else tuple(b for b in r if b not in glob) for a, r in enumerate(rows))
    cols = tuple(j for b in sorted(glob) for j in range(b * block_size, min((b + 1) * block_size, n)))
    gvec = global_vector(xp, cols, (nb + 1) * block_size, array_api_compat.device(q))

    def others(i, j):  # the queries outside the global blocks
        return xp.logical_not(_lookup(xp, gvec, i))

    parts = (Blocks(rows, block_size, causal_pred), Columns(cols, _combine(xp, others, causal_pred)))
    return _Plan(xp, batch, n, n, scale, parts)


def strided_plan(q, k, v, *, stride, causal=True, scale=None, xp=None):
    """The checked inputs and parts of :func:`strided_attention` (same arguments)."""
    xp, batch = check_qkv(q, k, v, xp=xp, same_length=True)
    check_positive_int("stride", stride)
    one_sided = causal_alignment(causal) is not None
    n = q.shape[-2]
    scale = default_scale(q.shape[-1], scale)
    if n == 0:
        return _Plan(xp, batch, n, n, scale, ())
    B = min(stride, n)
    rows = banded_rows(ceil_div(n, B), B, stride, one_sided)
    parts = (Blocks(rows, B, _local_predicate(xp, stride, one_sided, 1, B)),)
    if ceil_div(n, stride) >= 3:  # else no offset of two strides or more fits
        parts += (Classes(stride, one_sided),)
    return _Plan(xp, batch, n, n, scale, parts)


def fixed_plan(q, k, v, *, stride, summary=1, causal=True, scale=None, xp=None):
    """The checked inputs and parts of :func:`fixed_attention` (same arguments)."""
    xp, batch = check_qkv(q, k, v, xp=xp, same_length=True)
    check_positive_int("stride", stride)
    check_summary(summary, stride)
    alignment = causal_alignment(causal)
    n = q.shape[-2]
    scale = default_scale(q.shape[-1], scale)
    if n == 0:
        return _Plan(xp, batch, n, n, scale, ())
    nb = ceil_div(n, stride)
    parts = (Blocks(tuple((a,) for a in range(nb)), stride, _causal_pred(xp, alignment, n, n)),)
    cols = tuple(j for j in range(n) if j % stride >= stride - summary)

    def outside(i, j):  # summary keys of the query's own block are in the block part
        return xp.floor_divide(i, stride) != xp.floor_divide(j, stride)

    if nb >= 2 and cols:
        parts += (Columns(cols, _combine(xp, outside, _causal_pred(xp, alignment, n, n))),)
    return _Plan(xp, batch, n, n, scale, parts)


def _local_block_size(block_size, reach, n):
    if block_size is None:
        # B = r/2 gathers 2.5 r keys per query (5 blocks) against 3 r at B = r, and the
        # smaller tiles stay in cache: about 1.7x faster on NumPy at r = 256.
        return max(1, min(reach // 2, n))
    return check_positive_int("block_size", block_size)


def _local_predicate(xp, reach, one_sided, dilation, block_size):
    def pred(i, j):
        return local_pred(xp, i, j, reach, one_sided, dilation)

    # With B >= reach the banded blocks may still hold keys beyond the window; only a
    # diagonal-only two-sided window of B = 1 needs no element test at all.
    return None if (reach == 0 and block_size == 1) else pred
