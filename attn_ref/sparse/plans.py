"""Sparse attention patterns: who may attend whom, and attention that computes only that.

Two forms of every pattern, tested against each other:

* the **defining form**: a boolean ``(N, N)`` mask builder (``local_mask``,
  ``strided_mask``, ``fixed_mask``, ``global_mask``, ``longformer_mask``,
  ``bigbird_mask``, ``layout_mask``) handed to
  :func:`attn_ref.softmax.softmax_attention` as ``mask=`` ("dense masked softmax"), and
  the matching ``*_weights`` function giving the implied attention matrix;
* the **efficient form** (``block_sparse_attention``, ``local_attention``,
  ``longformer_attention``, ``bigbird_attention``, ``strided_attention``,
  ``fixed_attention``), which gathers only the key blocks a query block may see and
  never builds an ``(N, N)`` array. It equals the dense masked softmax up to rounding.
  Each is a plan of softmax partials over disjoint key sets, merged exactly; the
  VJPs in :mod:`attn_ref.grad.sparse` differentiate the same plans, just as sparsely.

Conventions
-----------
* Masks are ``(Nq, Nk)`` boolean arrays in the caller's namespace and device;
  True = may attend. Query ``i`` and key ``j`` are sequence positions.
* ``window`` is the reach **per side**, counted in attended keys: two-sided, query
  ``i`` sees ``j`` with ``|i - j| <= window * dilation`` and ``(i - j) % dilation == 0``;
  one-sided (causal) only ``0 <= i - j``. Window 0 is the diagonal; a window of
  ``N - 1`` or more is full attention. The dilated form is Longformer's (Beltagy et
  al. 2020): ``window`` keys per side at gaps of ``dilation``.
* A block layout is a host-side boolean ``(ceil(Nq/B), ceil(Nk/B))`` table (nested
  sequences of bools, or a concrete boolean array); entry ``(a, b)`` True means query
  block ``a`` may attend key block ``b``. It is a structural parameter, so a jitted
  caller keeps it static (a tuple of tuples is hashable). The last block may be
  ragged: positions past ``Nq``/``Nk`` are padding that never receives weight.
* Rows with no key to attend to return zeros, as in :mod:`attn_ref.softmax`.
* The efficient forms fold ``scale`` into ``q`` before the products, so finite input
  gives finite output while ``|scale| max|q| max|k| d`` is below the dtype's largest
  value; past it (``scale=1e308`` with unit-size ``q`` and ``k``) they can give NaN
  (``inf - inf`` in the row maximum), where the defining
  form :func:`attn_ref.softmax_attention` with the same mask stays finite.
* A block layout, like ``cu_seqlens``, is read on the host: it may come from any
  library (or be nested sequences), unlike the array arguments, which must share
  ``q``'s library.

Cost of the efficient forms
---------------------------
A query block of ``B`` rows that sees ``c`` key blocks costs ``O(B c B d)`` time and
``O(B c B)`` logits memory, so a layout with ``c`` active blocks per row costs
``O(N c B d)``: for a window ``w`` with ``B = w`` that is ``O(N w d)`` time and memory.
Query blocks are grouped by their number of active blocks and each group is one
gather and one batched matmul, so there is no Python loop over blocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import array_api_compat

from .._checks import (
    check_flag,
    check_nonnegative_int,
    check_positive_int,
    check_qkv,
    check_real,
    default_scale,
)
from .._common import (
    and_masks,
    causal_alignment,
    causal_offset,
    ceil_div,
    finish_partial,
    merge_partials,
    softmax_partial,
)
from ..softmax import attention_weights

__all__ = [
    "local_mask",
    "strided_mask",
    "fixed_mask",
    "global_mask",
    "longformer_mask",
    "bigbird_layout",
    "bigbird_mask",
    "layout_mask",
    "random_block_layout",
    "block_sparse_attention",
    "local_attention",
    "longformer_attention",
    "bigbird_attention",
    "strided_attention",
    "fixed_attention",
    "block_sparse_weights",
    "local_weights",
    "longformer_weights",
    "bigbird_weights",
    "strided_weights",
    "fixed_weights",
    # Named steps that attn_ref.grad differentiates.
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
    "scaled_queries",
    "plan_partial",
    "block_sparse_plan",
    "local_plan",
    "longformer_plan",
    "bigbird_plan",
    "strided_plan",
    "fixed_plan",
]

_STRIDED_PARTS = ("both", "local", "strided")
_FIXED_PARTS = ("both", "block", "summary")


# ---------------------------------------------------------------- predicates
# Each pattern is written once, as a predicate on broadcastable integer position
# arrays ``i`` (queries) and ``j`` (keys). The mask builders evaluate it on the full
# grid; the efficient forms evaluate it only on the gathered blocks.


def _local_pred(xp, i, j, reach, one_sided, dilation):
    diff = i - j
    ok = (diff >= 0) if one_sided else (diff >= -reach)
    ok = xp.logical_and(ok, diff <= reach)
    if dilation > 1:
        ok = xp.logical_and(ok, xp.remainder(diff, dilation) == 0)
    return ok


def _strided_pred(xp, i, j, stride, causal, part):
    diff = i - j
    local = xp.logical_and(diff >= (0 if causal else -stride), diff <= stride)
    strided = xp.remainder(diff, stride) == 0
    if causal:
        strided = xp.logical_and(strided, diff >= 0)
    return {"local": local, "strided": strided, "both": xp.logical_or(local, strided)}[part]


def _fixed_pred(xp, i, j, stride, summary, causal, part):
    block = xp.floor_divide(i, stride) == xp.floor_divide(j, stride)
    summ = xp.remainder(j, stride) >= stride - summary
    ok = {"block": block, "summary": summ, "both": xp.logical_or(block, summ)}[part]
    return xp.logical_and(ok, j <= i) if causal else ok


def _grid(xp, nq, nk, device):
    i = xp.arange(nq, dtype=xp.int64, device=device)[:, None]
    j = xp.arange(nk, dtype=xp.int64, device=device)[None, :]
    return i, j



# ---------------------------------------------------------------- argument checks


def _check_part(name, part, allowed):
    if part not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {part!r}")


def _check_global_tokens(global_tokens, n):
    if isinstance(global_tokens, (str, bytes)) or not isinstance(global_tokens, (Sequence, range)):
        raise TypeError(
            "global_tokens must be a sequence of token indices (a tuple or range), "
            f"got {type(global_tokens).__name__}"
        )
    out = []
    for t in global_tokens:
        t = check_nonnegative_int("global_tokens entry", t)
        if not t < n:
            raise ValueError(
                f"global_tokens must hold integer positions in [0, N) = [0, {n}), got {t!r}"
            )
        out.append(t)
    return tuple(sorted(set(out)))


def _check_window(window, dilation):
    check_nonnegative_int("window", window)
    check_positive_int("dilation", dilation)
    return window * dilation


def _is_flag(x):
    """A NumPy bool (or bool) as a layout entry, by the flag rule of :func:`check_flag`."""
    try:
        check_flag("layout entry", x)
    except TypeError:
        return False
    return True


def _layout_rows(layout, nbq, nbk, block_size, nq, nk):
    """Validate a block layout; return, per query block, the tuple of active key blocks."""
    want = (
        f"a boolean block layout of shape (ceil(Nq/block_size), ceil(Nk/block_size)) = "
        f"(ceil({nq}/{block_size}), ceil({nk}/{block_size})) = ({nbq}, {nbk})"
    )
    if array_api_compat.is_array_api_obj(layout):
        lxp = array_api_compat.array_namespace(layout)
        if layout.dtype != lxp.bool:
            raise TypeError(f"layout must be {want}, got an array of dtype {layout.dtype}")
        if tuple(layout.shape) != (nbq, nbk):
            raise ValueError(f"layout must be {want}, got shape {tuple(layout.shape)}")
        return tuple(tuple(b for b in range(nbk) if bool(layout[a, b])) for a in range(nbq))
    if isinstance(layout, (str, bytes)) or not isinstance(layout, Sequence):
        raise TypeError(f"layout must be {want}, got {type(layout).__name__}")
    rows = []
    for a, row in enumerate(layout):
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
            raise TypeError(f"layout must be {want}, got row {a} of type {type(row).__name__}")
        if len(row) != nbk:
            raise ValueError(f"layout must be {want}, got row {a} of length {len(row)}")
        for b, x in enumerate(row):
            ok = x in (0, 1) if isinstance(x, int) else _is_flag(x)
            if not ok:
                raise TypeError(f"layout must be {want}, got entry ({a}, {b}) = {x!r}")
        rows.append(tuple(b for b, x in enumerate(row) if x))
    if len(rows) != nbq:
        raise ValueError(f"layout must be {want}, got {len(rows)} rows")
    return tuple(rows)


def _banded_rows(nb, block_size, reach, one_sided):
    """Key blocks of a window of ``reach`` positions (per side) at block size B.

    Every row has the same length; slots that fall off either end are ``-1`` (an
    empty block), so a banded layout is one gather and one matmul.
    """
    lo = min(nb - 1, ceil_div(reach, block_size))
    hi = 0 if one_sided else min(nb - 1, (block_size - 1 + reach) // block_size)
    return tuple(
        tuple(b if 0 <= b < nb else -1 for b in range(a - lo, a + hi + 1)) for a in range(nb)
    )


# ---------------------------------------------------------------- mask builders


def local_mask(n, /, *, window, one_sided=False, dilation=1, xp, device=None):
    """Sliding-window mask: query ``i`` sees key ``j`` within ``window`` steps.

    Parameters
    ----------
    n : int
        Sequence length.
    window : int
        Keys per side (``>= 0``); see the module docstring.
    one_sided : bool
        Only the past and the present (``0 <= i - j``): a causal sliding window.
    dilation : int
        Gap between attended keys (``>= 1``); the reach is ``window * dilation``.
    xp : namespace
        Array namespace to build the mask in (required).
    device : optional
        Device of the mask.

    Returns
    -------
    bool array, shape (n, n)

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.sparse import local_mask
    >>> m = local_mask(5, window=1, xp=xp)
    >>> [int(xp.sum(xp.astype(m[i, :], xp.int64))) for i in range(5)]
    [2, 3, 3, 3, 2]
    """
    check_nonnegative_int("n", n)
    reach = _check_window(window, dilation)
    i, j = _grid(xp, n, n, device)
    return _local_pred(xp, i, j, reach, bool(one_sided), dilation)


def strided_mask(n, /, *, stride, causal=True, part="both", xp, device=None):
    """The strided pattern of the Sparse Transformer (Child et al. 2019).

    ``A1(i) = {j : 0 <= i - j <= stride}`` (the previous ``stride`` positions and
    ``i`` itself) and ``A2(i) = {j : (i - j) mod stride = 0}``; the paper gives each to
    a different head, ``part="both"`` is their union (one head attending both). With
    ``causal=False`` both parts look both ways: ``|i - j| <= stride``.

    Parameters
    ----------
    n : int
    stride : int
        ``l`` in the paper, ``>= 1``; ``sqrt(N)`` gives ``O(N sqrt(N))`` pairs.
    causal : bool
    part : {"both", "local", "strided"}
    xp, device
        As in :func:`local_mask`.

    Returns
    -------
    bool array, shape (n, n)
    """
    check_nonnegative_int("n", n)
    check_positive_int("stride", stride)
    _check_part("part", part, _STRIDED_PARTS)
    i, j = _grid(xp, n, n, device)
    return _strided_pred(xp, i, j, stride, bool(causal), part)


def fixed_mask(n, /, *, stride, summary=1, causal=True, part="both", xp, device=None):
    """The fixed pattern of the Sparse Transformer (Child et al. 2019).

    ``A1(i) = {j : floor(j / l) = floor(i / l)}`` (the block of ``stride = l``
    positions holding ``i``) and ``A2(i) = {j : j mod l >= l - c}`` (the last
    ``summary = c`` positions of every block, which summarise it). ``causal=True``
    keeps ``j <= i`` in both.

    Parameters
    ----------
    n : int
    stride : int
        Block length ``l >= 1``.
    summary : int
        ``c`` with ``1 <= c <= stride``.
    causal : bool
    part : {"both", "block", "summary"}
    xp, device
        As in :func:`local_mask`.

    Returns
    -------
    bool array, shape (n, n)
    """
    check_nonnegative_int("n", n)
    check_positive_int("stride", stride)
    _check_summary(summary, stride)
    _check_part("part", part, _FIXED_PARTS)
    i, j = _grid(xp, n, n, device)
    return _fixed_pred(xp, i, j, stride, summary, bool(causal), part)


def _check_summary(summary, stride):
    check_positive_int("summary", summary)
    if summary > stride:
        raise ValueError(f"summary must be at most stride = {stride}, got {summary}")


def _global_vector(xp, tokens, n, device):
    g = [False] * n
    for t in tokens:
        g[t] = True
    return xp.asarray(g, dtype=xp.bool, device=device)


def global_mask(n, /, *, global_tokens, xp, device=None):
    """Longformer's symmetric global attention: global tokens see and are seen by all.

    ``mask[i, j]`` is True when ``i`` or ``j`` is in ``global_tokens``.

    Parameters
    ----------
    n : int
    global_tokens : sequence of int
        Positions in ``[0, n)``; duplicates are ignored.
    xp, device
        As in :func:`local_mask`.

    Returns
    -------
    bool array, shape (n, n)
    """
    check_nonnegative_int("n", n)
    tokens = _check_global_tokens(global_tokens, n)
    g = _global_vector(xp, tokens, n, device)
    return xp.logical_or(g[:, None], g[None, :])


def longformer_mask(n, /, *, window, global_tokens, dilation=1, xp, device=None):
    """Longformer (Beltagy et al. 2020): a two-sided (dilated) window plus global tokens.

    The union of :func:`local_mask` and :func:`global_mask`; see those for the
    parameters.
    """
    local = local_mask(n, window=window, dilation=dilation, xp=xp, device=device)
    return xp.logical_or(local, global_mask(n, global_tokens=global_tokens, xp=xp, device=device))


def bigbird_layout(num_blocks, /, *, window=1, global_blocks=1, random_blocks=1, seed=0):
    """BigBird's block layout (Zaheer et al. 2020, ITC form), built on the host.

    Query block ``a`` sees key blocks ``b`` with ``|a - b| <= window`` (sliding
    blocks), the first ``global_blocks`` blocks (global columns), and
    ``random_blocks`` further blocks drawn without replacement from the rest; the first
    ``global_blocks`` query blocks see every block (global rows). The draw is a
    function of ``seed`` only (through :func:`attn_ref.random.permutation`).

    Returns
    -------
    tuple of tuples of bool, shape (num_blocks, num_blocks)
        Hashable, so it can be a static argument of a jitted function.

    Examples
    --------
    >>> from attn_ref.sparse import bigbird_layout
    >>> lay = bigbird_layout(4, window=0, global_blocks=1, random_blocks=0)
    >>> [[int(x) for x in row] for row in lay]
    [[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]]
    """
    from ..random import permutation

    check_nonnegative_int("num_blocks", num_blocks)
    check_nonnegative_int("window", window)
    check_nonnegative_int("global_blocks", global_blocks)
    check_nonnegative_int("random_blocks", random_blocks)
    nb = num_blocks
    # One permutation of all (a, b) cells ranks the candidates of every row.
    rank = permutation(nb * nb, seed=seed) if random_blocks and nb else []
    rows = []
    for a in range(nb):
        if a < global_blocks:
            rows.append((True,) * nb)
            continue
        active = [abs(a - b) <= window or b < global_blocks for b in range(nb)]
        if random_blocks:
            rest = sorted((b for b in range(nb) if not active[b]), key=lambda b: rank[a * nb + b])
            for b in rest[:random_blocks]:
                active[b] = True
        rows.append(tuple(active))
    return tuple(rows)


def layout_mask(layout, block_size, /, *, nq=None, nk=None, xp, device=None):
    """Expand a block layout into the element mask it stands for.

    Parameters
    ----------
    layout : nested sequences of bool or bool array, shape (ceil(nq/B), ceil(nk/B))
    block_size : int
        ``B >= 1``.
    nq, nk : int, optional
        Sequence lengths; default ``B`` times the layout's number of rows / columns.
    xp, device
        As in :func:`local_mask`.

    Returns
    -------
    bool array, shape (nq, nk)
    """
    check_positive_int("block_size", block_size)
    nbq, nbk = _layout_shape(layout)
    nq = nbq * block_size if nq is None else check_nonnegative_int("nq", nq)
    nk = nbk * block_size if nk is None else check_nonnegative_int("nk", nk)
    rows = _layout_rows(layout, ceil_div(nq, block_size), ceil_div(nk, block_size), block_size, nq, nk)
    return _rows_mask(xp, rows, block_size, nq, nk, device)


def _layout_shape(layout):
    """(rows, columns) of a layout, as far as it has them; :func:`_layout_rows` checks the rest."""
    if array_api_compat.is_array_api_obj(layout):
        shape = tuple(layout.shape)
    elif isinstance(layout, Sequence) and not isinstance(layout, (str, bytes)):
        first = layout[0] if len(layout) else ()
        shape = (len(layout), len(first) if isinstance(first, Sequence) else 0)
    else:
        raise TypeError(f"layout must be a boolean block layout, got {type(layout).__name__}")
    return (shape + (0, 0))[:2]


def _rows_mask(xp, rows, block_size, nq, nk, device):
    nbk = ceil_div(nk, block_size)
    table = xp.asarray([[b in set(r) for b in range(nbk)] for r in rows] or [[False] * nbk],
                       dtype=xp.bool, device=device)
    i, j = _grid(xp, nq, nk, device)
    rows_of = xp.take(table, xp.floor_divide(i[:, 0], block_size), axis=0)
    return xp.take(rows_of, xp.floor_divide(j[0, :], block_size), axis=1)


def bigbird_mask(n, /, *, block_size, window=1, global_blocks=1, random_blocks=1, seed=0, xp,
                 device=None):
    """The element mask of :func:`bigbird_layout` for a sequence of length ``n``.

    Blocks have ``block_size`` positions; the last one may be ragged.

    Returns
    -------
    bool array, shape (n, n)
    """
    check_nonnegative_int("n", n)
    check_positive_int("block_size", block_size)
    rows = _bigbird_rows(n, block_size, window, global_blocks, random_blocks, seed)
    return _rows_mask(xp, rows, block_size, n, n, device)


def _bigbird_rows(n, block_size, window, global_blocks, random_blocks, seed):
    nb = ceil_div(n, block_size)
    lay = bigbird_layout(nb, window=window, global_blocks=global_blocks,
                         random_blocks=random_blocks, seed=seed)
    return tuple(tuple(b for b, x in enumerate(row) if x) for row in lay)


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
    queries, keys and values and ``s (..., g, B, cnt B)`` the logits, ``-inf`` where
    not allowed; all four are None when ``cnt == 0``.
    """

    cnt: int
    ids: list
    flat: list
    index: Any
    qg: Any
    kg: Any
    vg: Any
    s: Any


def block_groups(xp, q, k, v, part, nk):
    """The gathers of a :class:`Blocks` part: one :class:`_BlockGroup` per row length.

    Query blocks are grouped by their number of active key blocks and each group is
    one gather and one batched matmul. The forward and the VJP both iterate over
    this, so they see the same logits. ``q`` is already scaled; padded key positions
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
        s = qg @ xp.matrix_transpose(kg)  # (..., g, B, cnt*B)
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


def _block_partials(xp, q, k, v, part, nk, batch):
    """Partials of every query position over the key blocks of its block (a :class:`Blocks`)."""
    B, dv = part.block_size, v.shape[-1]
    device = array_api_compat.device(q)
    parts, order = [], []
    for grp in block_groups(xp, q, k, v, part, nk):
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


def class_logits(xp, q, k, v, part, n):
    """A :class:`Classes` part: ``(qc, kc, vc, s)`` in class layout, ``s (..., l, C, C)``."""
    stride = part.stride
    C = ceil_div(n, stride)
    device = array_api_compat.device(q)
    qc, kc, vc = (to_classes(xp, x, stride, C) for x in (q, k, v))
    s = qc @ xp.matrix_transpose(kc)  # (..., l, C, C)
    t = xp.arange(C, dtype=xp.int64, device=device)
    r = xp.arange(stride, dtype=xp.int64, device=device)
    gap = t[:, None] - t[None, :]
    ok = (gap >= 2) if part.one_sided else (xp.abs(gap) >= 2)
    ok = xp.logical_and(ok[None, :, :], (t[None, None, :] * stride + r[:, None, None]) < n)
    return qc, kc, vc, xp.where(ok, s, -xp.inf)


def column_logits(xp, q, k, v, part, n):
    """A :class:`Columns` part: ``(kc, vc, s)`` for the summary keys, ``s (..., N, |cols|)``."""
    device = array_api_compat.device(q)
    jc = xp.asarray(part.cols, dtype=xp.int64, device=device)
    kc, vc = xp.take(k, jc, axis=-2), xp.take(v, jc, axis=-2)
    s = q @ xp.matrix_transpose(kc)  # (..., N, |cols|)
    i, _ = _grid(xp, n, 0, device)
    j = jc[None, :]
    # Summary keys of the query's own block are in the block part already.
    ok = xp.floor_divide(i, part.stride) != xp.floor_divide(j, part.stride)
    if part.causal:
        ok = xp.logical_and(ok, j <= i)
    return kc, vc, xp.where(ok, s, -xp.inf)


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
    """Fixed summary part: key columns ``cols`` outside the query's own block of ``stride``."""

    stride: int
    cols: tuple
    causal: bool


class _Plan(NamedTuple):
    """A validated call: namespace, broadcast batch shape, lengths, scale and the parts."""

    xp: Any
    batch: tuple
    nq: int
    nk: int
    scale: float
    parts: tuple


def scaled_queries(plan, q):
    """``q * scale`` (``q`` itself when the scale is 1)."""
    return q * plan.scale if plan.scale != 1.0 else q


def plan_partial(plan, qs, k, v):
    """The merged partial ``(m, l, acc)`` of all parts, for the scaled queries ``qs``."""
    xp, n = plan.xp, plan.nq
    out = None
    for part in plan.parts:
        if isinstance(part, Blocks):
            p = _block_partials(xp, qs, k, v, part, plan.nk, plan.batch)
        elif isinstance(part, Classes):
            _, _, vc, s = class_logits(xp, qs, k, v, part, n)
            p = tuple(from_classes(xp, x, n) for x in _partial(xp, s, vc, plan.batch, 3))
        else:
            _, vc, s = column_logits(xp, qs, k, v, part, n)
            p = _partial(xp, s, vc, plan.batch, 2)
        out = p if out is None else merge_partials(xp, out, p)
    return out


def _attend(plan, q, k, v):
    if plan.nq == 0 or plan.nk == 0:
        return _empty(plan.xp, q, v, plan.batch)
    _, l, acc = plan_partial(plan, scaled_queries(plan, q), k, v)
    return finish_partial(plan.xp, l, acc)


def block_sparse_plan(q, k, v, *, layout, block_size, causal=False, scale=None, xp=None):
    """The checked inputs and parts of :func:`block_sparse_attention` (same arguments)."""
    xp, batch = check_qkv(q, k, v, xp=xp)
    check_positive_int("block_size", block_size)
    nq, nk = q.shape[-2], k.shape[-2]
    rows = _layout_rows(layout, ceil_div(nq, block_size), ceil_div(nk, block_size), block_size, nq, nk)
    alignment = causal_alignment(causal)
    scale = default_scale(q.shape[-1], scale)
    parts = (Blocks(rows, block_size, _causal_pred(xp, alignment, nq, nk)),)
    return _Plan(xp, batch, nq, nk, scale, parts if nq and nk else ())


def local_plan(q, k, v, *, window, causal=False, dilation=1, block_size=None, scale=None, xp=None):
    """The checked inputs and parts of :func:`local_attention` (same arguments)."""
    xp, batch = check_qkv(q, k, v, xp=xp, same_length=True)
    reach = _check_window(window, dilation)
    one_sided = causal_alignment(causal) is not None
    n = q.shape[-2]
    B = _local_block_size(block_size, reach, n)
    scale = default_scale(q.shape[-1], scale)
    if n == 0:
        return _Plan(xp, batch, n, n, scale, ())
    rows = _banded_rows(ceil_div(n, B), B, reach, one_sided)
    return _Plan(xp, batch, n, n, scale,
                 (Blocks(rows, B, _local_predicate(xp, reach, one_sided, dilation, B)),))


def longformer_plan(q, k, v, *, window, global_tokens, causal=False, dilation=1, block_size=None,
                    scale=None, xp=None):
    """The checked inputs and parts of :func:`longformer_attention` (same arguments)."""
    xp, batch = check_qkv(q, k, v, xp=xp, same_length=True)
    reach = _check_window(window, dilation)
    n = q.shape[-2]
    tokens = _check_global_tokens(global_tokens, n)
    alignment = causal_alignment(causal)
    B = _local_block_size(block_size, reach, n)
    scale = default_scale(q.shape[-1], scale)
    if n == 0:
        return _Plan(xp, batch, n, n, scale, ())
    nb = ceil_div(n, B)
    gblocks = {t // B for t in tokens}
    rows = [
        tuple(range(nb)) if a in gblocks else r + tuple(sorted(gblocks - set(r)))
        for a, r in enumerate(_banded_rows(nb, B, reach, False))
    ]
    # Pad the ordinary rows to one length so that they form a single gather.
    width = max((len(r) for a, r in enumerate(rows) if a not in gblocks), default=0)
    rows = tuple(r if a in gblocks else r + (-1,) * (width - len(r)) for a, r in enumerate(rows))
    # Covers the padding and the empty-slot block past the end.
    gvec = _global_vector(xp, tokens, (nb + 1) * B, array_api_compat.device(q))

    def pattern(i, j):
        local = _local_pred(xp, i, j, reach, False, dilation)
        gi = xp.reshape(xp.take(gvec, xp.reshape(i, (-1,)), axis=0), i.shape)
        gj = xp.reshape(xp.take(gvec, xp.reshape(j, (-1,)), axis=0), j.shape)
        return xp.logical_or(local, xp.logical_or(gi, gj))

    pred = _combine(xp, pattern, _causal_pred(xp, alignment, n, n))
    return _Plan(xp, batch, n, n, scale, (Blocks(rows, B, pred),))


def bigbird_plan(q, k, v, *, block_size, window=1, global_blocks=1, random_blocks=1, seed=0,
                 causal=False, scale=None, xp=None):
    """The checked inputs and parts of :func:`bigbird_attention` (same arguments)."""
    xp, batch = check_qkv(q, k, v, xp=xp, same_length=True)
    check_positive_int("block_size", block_size)
    n = q.shape[-2]
    rows = _bigbird_rows(n, block_size, window, global_blocks, random_blocks, seed)
    alignment = causal_alignment(causal)
    scale = default_scale(q.shape[-1], scale)
    parts = (Blocks(rows, block_size, _causal_pred(xp, alignment, n, n)),)
    return _Plan(xp, batch, n, n, scale, parts if n else ())


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
    rows = _banded_rows(ceil_div(n, B), B, stride, one_sided)
    parts = (Blocks(rows, B, _local_predicate(xp, stride, one_sided, 1, B)),)
    if ceil_div(n, stride) >= 3:  # else no offset of two strides or more fits
        parts += (Classes(stride, one_sided),)
    return _Plan(xp, batch, n, n, scale, parts)


def fixed_plan(q, k, v, *, stride, summary=1, causal=True, scale=None, xp=None):
    """The checked inputs and parts of :func:`fixed_attention` (same arguments)."""
    xp, batch = check_qkv(q, k, v, xp=xp, same_length=True)
    check_positive_int("stride", stride)
    _check_summary(summary, stride)
    alignment = causal_alignment(causal)
    n = q.shape[-2]
    scale = default_scale(q.shape[-1], scale)
    if n == 0:
        return _Plan(xp, batch, n, n, scale, ())
    nb = ceil_div(n, stride)
    parts = (Blocks(tuple((a,) for a in range(nb)), stride, _causal_pred(xp, alignment, n, n)),)
    cols = tuple(j for j in range(n) if j % stride >= stride - summary)
    if nb >= 2 and cols:
        parts += (Columns(stride, cols, alignment is not None),)
    return _Plan(xp, batch, n, n, scale, parts)


# ---------------------------------------------------------------- efficient forms


def block_sparse_attention(q, k, v, /, *, layout, block_size, causal=False, scale=None, xp=None):
    """Softmax attention restricted to the active blocks of a block layout.

    Equal to ``softmax_attention(q, k, v, mask=layout_mask(layout, block_size), ...)``,
    but only active blocks are gathered and multiplied.

    Parameters
    ----------
    q : array, shape (..., Nq, d)
    k : array, shape (..., Nk, d)
    v : array, shape (..., Nk, dv)
    layout : nested sequences of bool or bool array, shape (ceil(Nq/B), ceil(Nk/B))
        Host-side structure (see the module docstring); static under ``jax.jit``.
    block_size : int
        ``B >= 1``; ``Nq`` and ``Nk`` need not be multiples of it.
    causal : {False, True, "top-left", "bottom-right"}
        Also applied element-wise, as in :func:`attn_ref.softmax.softmax_attention`.
    scale : float, optional
        Logit scale, default ``1/sqrt(d)``.
    xp : namespace, optional

    Returns
    -------
    array, shape (..., Nq, dv)

    Notes
    -----
    ``O(nnz(layout) B^2 (d + dv))`` time and ``O(nnz(layout) B^2)`` memory for the
    logits (times the batch), ``nnz`` being the number of active blocks. A full layout
    is ordinary softmax attention; a banded layout of ``c`` blocks per row is
    ``O(N c B d)``.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import softmax_attention
    >>> from attn_ref.sparse import block_sparse_attention, layout_mask
    >>> x = xp.reshape(xp.sin(xp.arange(35.0)), (7, 5))
    >>> lay = ((True, False), (True, True))
    >>> a = block_sparse_attention(x, x, x, layout=lay, block_size=4)
    >>> b = softmax_attention(x, x, x, mask=layout_mask(lay, 4, nq=7, nk=7, xp=xp))
    >>> bool(xp.max(xp.abs(a - b)) < 1e-14)
    True
    """
    plan = block_sparse_plan(q, k, v, layout=layout, block_size=block_size, causal=causal,
                             scale=scale, xp=xp)
    return _attend(plan, q, k, v)


def _local_block_size(block_size, reach, n):
    if block_size is None:
        # B = r/2 gathers 2.5 r keys per query (5 blocks) against 3 r at B = r, and the
        # smaller tiles stay in cache: about 1.7x faster on NumPy at r = 256.
        return max(1, min(reach // 2, n))
    return check_positive_int("block_size", block_size)


def local_attention(q, k, v, /, *, window, causal=False, dilation=1, block_size=None, scale=None,
                    xp=None):
    """Sliding-window (local) attention in ``O(N w d)`` time and memory.

    Equal to ``softmax_attention(q, k, v, mask=local_mask(N, window=window,
    one_sided=causal, dilation=dilation))``: query ``i`` attends the ``window``
    positions on each side (only the past with ``causal``), at gaps of ``dilation``.
    Used by Image Transformer, Longformer, Mistral; ``window >= N - 1`` is full
    attention.

    Parameters
    ----------
    q, k : array, shape (..., N, d)
    v : array, shape (..., N, dv)
        Self-attention: ``q`` and ``k`` have the same length.
    window : int
        Keys per side, ``>= 0``.
    causal : {False, True, "top-left", "bottom-right"}
        Any causal value gives the one-sided window (the alignments agree for
        ``Nq == Nk``).
    dilation : int
        ``>= 1``.
    block_size : int, optional
        Tile size, default ``window * dilation // 2`` (at least 1, at most ``N``).
    scale, xp
        As in :func:`block_sparse_attention`.

    Returns
    -------
    array, shape (..., N, dv)

    Notes
    -----
    With the default ``B = r / 2`` (``r = window * dilation``) every query block
    gathers 5 key blocks (3 when causal), about ``2.5 r`` keys per query:
    ``O(N r (d + dv))`` time, ``O(N r)`` logits memory, never an ``(N, N)`` array.
    Dilation keeps the reach ``r`` and so costs ``dilation`` times the keys actually
    attended.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import softmax_attention
    >>> from attn_ref.sparse import local_attention, local_mask
    >>> x = xp.reshape(xp.cos(xp.arange(40.0)), (10, 4))
    >>> a = local_attention(x, x, x, window=2, causal=True)
    >>> b = softmax_attention(x, x, x, mask=local_mask(10, window=2, one_sided=True, xp=xp))
    >>> bool(xp.max(xp.abs(a - b)) < 1e-14)
    True
    """
    plan = local_plan(q, k, v, window=window, causal=causal, dilation=dilation, block_size=block_size,
                      scale=scale, xp=xp)
    return _attend(plan, q, k, v)


def _local_predicate(xp, reach, one_sided, dilation, block_size):
    def pred(i, j):
        return _local_pred(xp, i, j, reach, one_sided, dilation)

    # With B >= reach the banded blocks may still hold keys beyond the window; only a
    # diagonal-only two-sided window of B = 1 needs no element test at all.
    return None if (reach == 0 and block_size == 1) else pred


def longformer_attention(q, k, v, /, *, window, global_tokens, causal=False, dilation=1,
                         block_size=None, scale=None, xp=None):
    """Longformer attention (Beltagy et al. 2020): a sliding window plus global tokens.

    Equal to dense masked softmax with :func:`longformer_mask` (and the causal mask
    when ``causal``). Global tokens attend every position and every position attends
    them (symmetric); the paper's separate projections for global attention are the
    caller's business (pass different ``q``/``k``).

    Parameters
    ----------
    q, k : array, shape (..., N, d)
    v : array, shape (..., N, dv)
    window : int
        Keys per side of the sliding window.
    global_tokens : sequence of int
        Positions in ``[0, N)``.
    causal : {False, True, "top-left", "bottom-right"}
        Intersects the pattern with the causal mask (global tokens then see only
        their past); Longformer itself is bidirectional.
    dilation, block_size, scale, xp
        As in :func:`local_attention`.

    Returns
    -------
    array, shape (..., N, dv)

    Notes
    -----
    Query blocks holding a global token gather every key block; the others gather
    their window and the blocks holding global tokens: ``O(N (w + g B) d)`` time for
    ``g`` global tokens.
    """
    plan = longformer_plan(q, k, v, window=window, global_tokens=global_tokens, causal=causal,
                           dilation=dilation, block_size=block_size, scale=scale, xp=xp)
    return _attend(plan, q, k, v)


def bigbird_attention(q, k, v, /, *, block_size, window=1, global_blocks=1, random_blocks=1, seed=0,
                      causal=False, scale=None, xp=None):
    """BigBird attention (Zaheer et al. 2020): sliding, global and random blocks.

    Block-sparse attention with :func:`bigbird_layout`; equal to dense masked softmax
    with :func:`bigbird_mask`.

    Parameters
    ----------
    q, k : array, shape (..., N, d)
    v : array, shape (..., N, dv)
    block_size : int
        ``B >= 1``; ``N`` need not be a multiple.
    window, global_blocks, random_blocks, seed
        As in :func:`bigbird_layout` (counted in blocks).
    causal : {False, True, "top-left", "bottom-right"}
        Intersects the pattern with the causal mask.
    scale, xp
        As in :func:`block_sparse_attention`.

    Returns
    -------
    array, shape (..., N, dv)

    Notes
    -----
    ``O(N B (2 window + 1 + global_blocks + random_blocks) d)`` time for the ordinary
    rows plus ``O(global_blocks B N d)`` for the global rows.
    """
    plan = bigbird_plan(q, k, v, block_size=block_size, window=window, global_blocks=global_blocks,
                        random_blocks=random_blocks, seed=seed, causal=causal, scale=scale, xp=xp)
    return _attend(plan, q, k, v)


def strided_attention(q, k, v, /, *, stride, causal=True, scale=None, xp=None):
    """Strided Sparse Transformer attention (Child et al. 2019), one head over both parts.

    Equal to dense masked softmax with :func:`strided_mask` (``part="both"``). The
    local part is :func:`local_attention` with window ``stride``; the strided part
    attends within each residue class ``{r, r + l, r + 2l, ...}`` (offsets of two or
    more strides; one stride is already local), and the two softmax partials are
    merged exactly.

    Parameters
    ----------
    q, k : array, shape (..., N, d)
    v : array, shape (..., N, dv)
    stride : int
        ``l >= 1``.
    causal : bool or {"top-left", "bottom-right"}
        The paper's autoregressive pattern (default); False looks both ways.
    scale, xp
        As in :func:`block_sparse_attention`.

    Returns
    -------
    array, shape (..., N, dv)

    Notes
    -----
    ``O(N (l + N/l) d)`` time and ``O(N l + N^2/l)`` memory: ``O(N sqrt(N) d)`` at
    ``l = sqrt(N)``.
    """
    return _attend(strided_plan(q, k, v, stride=stride, causal=causal, scale=scale, xp=xp), q, k, v)


def fixed_attention(q, k, v, /, *, stride, summary=1, causal=True, scale=None, xp=None):
    """Fixed Sparse Transformer attention (Child et al. 2019), one head over both parts.

    Equal to dense masked softmax with :func:`fixed_mask` (``part="both"``): each
    query attends its own block of ``stride`` positions and the last ``summary``
    positions of every other block; the two softmax partials are merged exactly.

    Parameters
    ----------
    q, k : array, shape (..., N, d)
    v : array, shape (..., N, dv)
    stride : int
        Block length ``l >= 1``.
    summary : int
        ``1 <= c <= l`` summary positions per block.
    causal : bool or {"top-left", "bottom-right"}
        The paper's autoregressive pattern (default).
    scale, xp
        As in :func:`block_sparse_attention`.

    Returns
    -------
    array, shape (..., N, dv)

    Notes
    -----
    ``O(N (l + c N / l) d)`` time and ``O(N (l + c N / l))`` memory.
    """
    plan = fixed_plan(q, k, v, stride=stride, summary=summary, causal=causal, scale=scale, xp=xp)
    return _attend(plan, q, k, v)


# ---------------------------------------------------------------- implied matrices


def _weights(q, k, mask, causal, scale, xp):
    return attention_weights(q, k, mask=mask, causal=causal, scale=scale, xp=xp)


def _ns_device(q, k, xp):
    xp, _ = check_qkv(q, k, k, xp=xp)
    return xp, array_api_compat.device(q)


def block_sparse_weights(q, k, /, *, layout, block_size, causal=False, scale=None, xp=None):
    """The attention matrix implied by :func:`block_sparse_attention`, ``(..., Nq, Nk)``."""
    xp, device = _ns_device(q, k, xp)
    mask = layout_mask(layout, block_size, nq=q.shape[-2], nk=k.shape[-2], xp=xp, device=device)
    return _weights(q, k, mask, causal, scale, xp)


def local_weights(q, k, /, *, window, causal=False, dilation=1, block_size=None, scale=None,
                  xp=None):
    """The attention matrix implied by :func:`local_attention`, ``(..., N, N)``.

    ``block_size`` is accepted (and ignored) so the options of the efficient form
    can be passed unchanged.
    """
    xp, device = _ns_device(q, k, xp)
    one_sided = causal_alignment(causal) is not None
    mask = local_mask(q.shape[-2], window=window, one_sided=one_sided, dilation=dilation, xp=xp,
                      device=device)
    return _weights(q, k, mask, False, scale, xp)


def longformer_weights(q, k, /, *, window, global_tokens, causal=False, dilation=1, block_size=None,
                       scale=None, xp=None):
    """The attention matrix implied by :func:`longformer_attention`, ``(..., N, N)``."""
    xp, device = _ns_device(q, k, xp)
    mask = longformer_mask(q.shape[-2], window=window, global_tokens=global_tokens,
                           dilation=dilation, xp=xp, device=device)
    return _weights(q, k, mask, causal, scale, xp)


def bigbird_weights(q, k, /, *, block_size, window=1, global_blocks=1, random_blocks=1, seed=0,
                    causal=False, scale=None, xp=None):
    """The attention matrix implied by :func:`bigbird_attention`, ``(..., N, N)``."""
    xp, device = _ns_device(q, k, xp)
    mask = bigbird_mask(q.shape[-2], block_size=block_size, window=window,
                        global_blocks=global_blocks, random_blocks=random_blocks, seed=seed, xp=xp,
                        device=device)
    return _weights(q, k, mask, causal, scale, xp)


def strided_weights(q, k, /, *, stride, causal=True, scale=None, xp=None):
    """The attention matrix implied by :func:`strided_attention`, ``(..., N, N)``."""
    xp, device = _ns_device(q, k, xp)
    mask = strided_mask(q.shape[-2], stride=stride, causal=causal_alignment(causal) is not None,
                        xp=xp, device=device)
    return _weights(q, k, mask, False, scale, xp)


def fixed_weights(q, k, /, *, stride, summary=1, causal=True, scale=None, xp=None):
    """The attention matrix implied by :func:`fixed_attention`, ``(..., N, N)``."""
    xp, device = _ns_device(q, k, xp)
    mask = fixed_mask(q.shape[-2], stride=stride, summary=summary,
                      causal=causal_alignment(causal) is not None, xp=xp, device=device)
    return _weights(q, k, mask, False, scale, xp)


# ---------------------------------------------------------------- registration


def random_block_layout(num_q_blocks, num_k_blocks, /, *, density=0.5, seed=0):
    """A seeded random block layout with every diagonal block active (host tuples).

    Used to exercise :func:`block_sparse_attention` generically; ``density`` is the
    fraction of off-diagonal blocks made active.
    """
    from ..random import permutation

    check_nonnegative_int("num_q_blocks", num_q_blocks)
    check_nonnegative_int("num_k_blocks", num_k_blocks)
    if not 0.0 <= check_real("density", density, "a number in [0, 1]") <= 1.0:
        raise ValueError(f"density must be a number in [0, 1], got {density!r}")
    cells = num_q_blocks * num_k_blocks
    rank = permutation(cells, seed=seed)
    cut = math.floor(density * cells)
    return tuple(
        tuple(a == b or rank[a * num_k_blocks + b] < cut for b in range(num_k_blocks))
        for a in range(num_q_blocks)
    )



def _block_sparse_params(seed, nq, nk, d, dv, *, dtype, device, xp):
    B = 4
    return {"block_size": B, "layout": random_block_layout(ceil_div(nq, B), ceil_div(nk, B), seed=seed)}


def _bigbird_params(seed, nq, nk, d, dv, *, dtype, device, xp):
    return {"seed": seed}


def _register():
    from ..registry import Variant, register

    register(Variant(
        name="block_sparse", fn=block_sparse_attention, family="sparse", exact=False, causal=True,
        time="O(nnz B^2 d)", memory="O(nnz B^2)", params=_block_sparse_params,
        weights=block_sparse_weights,
        summary="softmax over the active blocks of a block layout (gather, then softmax)",
    ))
    register(Variant(
        name="local", fn=local_attention, family="sparse", exact=False, causal=True,
        time="O(N w d)", memory="O(N w)", weights=local_weights, self_attention=True,
        options={"window": 3}, summary="sliding window of w keys per side (one-sided if causal)",
    ))
    register(Variant(
        name="longformer", fn=longformer_attention, family="sparse", exact=False, causal=True,
        time="O(N (w + g B) d)", memory="O(N (w + g B))", weights=longformer_weights,
        self_attention=True, options={"window": 2, "global_tokens": (0,)},
        summary="sliding window plus symmetric global tokens (Beltagy et al. 2020)",
    ))
    register(Variant(
        name="bigbird", fn=bigbird_attention, family="sparse", exact=False, causal=True,
        time="O(N B (2w + 1 + g + r) d)", memory="O(N B (2w + 1 + g + r))",
        params=_bigbird_params, weights=bigbird_weights, self_attention=True,
        options={"block_size": 4, "window": 1, "global_blocks": 1, "random_blocks": 1},
        summary="sliding, global and seeded random blocks (Zaheer et al. 2020)",
    ))
    register(Variant(
        name="strided", fn=strided_attention, family="sparse", exact=False, causal=True,
        time="O(N (l + N/l) d)", memory="O(N (l + N/l))", weights=strided_weights,
        self_attention=True, options={"stride": 4},
        summary="Sparse Transformer strided pattern, both parts in one head",
    ))
    register(Variant(
        name="fixed", fn=fixed_attention, family="sparse", exact=False, causal=True,
        time="O(N (l + c N/l) d)", memory="O(N (l + c N/l))", weights=fixed_weights,
        self_attention=True, options={"stride": 4, "summary": 1},
        summary="Sparse Transformer fixed pattern, both parts in one head",
    ))


_register()
