"""The online softmax (Rabe & Staats 2021; Dao et al. 2022, FlashAttention): key blocks
with a running maximum and normaliser (:func:`attn_ref._common.online_step`), never more
than one ``block_q x block_k`` tile of logits. ``docs/online_softmax.md`` shows why the
recurrence is exact.
"""

from __future__ import annotations

import dataclasses

import array_api_compat

from .._checks import check_positive_int
from .._common import (
    add_into,
    batch_rows,
    finish_partial,
    is_lazy,
    mul_into,
    numpy_backed,
    online_step,
    owned_writeable,
    parallel_map,
    partial_lse,
    pool_helps,
    records_graph,
    row_groups,
    torch_cpu,
)
from .options import prepare_problem
from .tiles import dropout_scale, keep_tile, logit_dtype, tile_coverage, tile_logits, transposed_copy

__all__ = [
    "online_softmax_attention",
    "online_forward",
]

# From this many logits (all heads) on, a call on NumPy arrays with several heads runs
# contiguous groups of heads on a thread pool, at least one group per CPU (at most
# ``GROUP_TILE_LOGITS`` logits per tile each), BLAS held to one thread
# per worker (``online_forward``; :func:`attn_ref._common.parallel_map`). N = 4096, 8
# heads: 377 ms against 617 ms for one call on OpenBLAS's two threads (quiet 2-core
# machine, ``docs/comparison.md``). The threshold: under load 9-10 (``tools/targets.py
# softmax --pool-ns 64,128,256,512``, 8 heads, d = 64, interleaved medians of 5) the pool
# won from N = 128 (11.8 against 25.5 ms; 131K logits) and lost at N = 64 (1.10 against
# 0.41 ms: starting the threads costs about 1 ms); to be re-taken quiet.
POOL_MIN_LOGITS = 1 << 18
# The most logits one piece of the heads pool takes per tile (its heads times
# ``block_q x block_k``): one head's default 512 x 1024 tile, 2 MiB in float32. A piece of
# four heads (one per CPU at 8 heads) made 8 MiB tiles, which left the cache and which
# glibc's allocator returned to the system between tiles and faulted in again: N = 4096,
# 8 heads, d = 64, NumPy, medians of 5 interleaved calls under load 3.6-3.8 (2 CPUs), one
# head per piece took 377 against 449 ms wall, 0.64 against 0.80 s CPU, 6 against 23K page
# faults per call, the same bits (1024 x 1024 tiles of one head: 419 ms, 1036 faults).
# Unpooled NumPy calls (one CPU, a BLAS threadpoolctl cannot limit) run their groups
# one after another, for the same reason.
GROUP_TILE_LOGITS = 1 << 19
# On PyTorch's CPU tensors, which are never pooled (their operators run on every core),
# the heads still run in groups, one after another, of at most this many logits per
# tile: two heads at the default tiles, 4 MiB float32 arrays. An all-heads tile at 8
# heads is 16 MiB per array, which glibc's allocator hands back to the system between
# tiles: 128K page faults per call at N = 4096, 8 heads, d = 64 against 2K in groups of
# two heads, 532 against 647 ms (groups of one head: 552-608 ms, the operators too
# small for torch's two threads); medians of 7 interleaved calls under load 4-4.4, the
# same bits.
TORCH_TILE_LOGITS = 1 << 20


def _folded_scale(xp, pb, dtype):
    """``scale`` when it can multiply ``q`` instead of each product ``q . k``, else None.

    Folding saves two full passes over every tile (the scaling and the clamp of
    :func:`attn_ref._common.scaled_logits`), and is exact up to rounding when no logit
    leaves the finite range, which ``|scale| max|q| max|k| d < finfo.max / 2`` proves
    (and ``|scale| max|q|`` below it too, so ``scale q`` is finite). ``scale q`` must
    not lose digits to subnormals either: its absolute error is at most
    ``smallest_normal`` per element, ``smallest_normal max|k| d`` per logit, which must
    stay below ``eps``. The two maxima are read on the host, an ``O(N d)`` pass; a lazy
    array (``jax.jit``, Dask) cannot be read and keeps the clamped path, as do the
    soft-cap, bias and ALiBi, which act on the scaled logits.
    """
    spec = pb.spec
    # A torch tensor that records a graph keeps the clamped path too: reading its maximum
    # back makes torch warn ('Converting a tensor with requires_grad=True to a scalar'),
    # as under autograd of (out, lse) in the oracle's gradient runs.
    if (spec.softcap is not None or spec.bias is not None or spec.alibi is not None
            or spec.scale == 1.0 or pb.q.shape[-1] == 0
            or is_lazy(pb.q, pb.k) or records_graph(pb.q) or records_graph(pb.k)):
        return None
    fi = xp.finfo(dtype)
    big, tiny, eps = float(fi.max), float(fi.smallest_normal), float(fi.eps)
    qmax = float(xp.max(xp.abs(pb.q)))
    kmax = float(xp.max(xp.abs(pb.k)))
    scale, d = abs(spec.scale), pb.q.shape[-1]
    # NaN fails every comparison: NaN or infinite input keeps the clamped path.
    safe = (scale * qmax < big / 2 and scale * qmax * kmax * d < big / 2
            and tiny * kmax * d < eps)
    return spec.scale if safe else None


def _query_block(xp, spec, q, kt, v, q0, block_k, dtype, ones_column):
    """``(out, lse)`` of the query rows ``q`` (the block's first is ``q0``) against all keys.

    ``ones_column``: ``v`` ends with a column of ones, so that ``P V`` carries the
    normaliser ``l`` in its last column.
    """
    q1, nk = q0 + q.shape[-2], spec.nk
    m = l = acc = None
    for k0 in range(0, nk, block_k):
        k1 = min(k0 + block_k, nk)
        if tile_coverage(spec, q0, q1, k0, k1) == "none":
            continue
        kt_j, v_j = kt[..., k0:k1], v[..., k0:k1, :]
        s = tile_logits(xp, q, kt_j, spec, q0, k0)[0]
        # Three passes over each tile: max, the shift (in place), exp; the row sums come
        # from P [V | 1] when ones_column.
        m, l, p, alpha = online_step(xp, m, l, s, with_sum=not ones_column,
                                     overwrite=owned_writeable(s))
        # The logits stay named until the next tile's exist (no ``del``): the allocator
        # then reuses their memory instead of returning it to the system and faulting it
        # in again (N = 4096, 8 heads, 512 x 1024 tiles, NumPy: 19K page faults per call
        # against 12K), at the same peak (three tiles: the last P, these logits, this P).
        # The normaliser counts dropped weights too (dropout acts after the softmax).
        p = keep_tile(xp, p, spec, q0, k0)
        pv = (p if p.dtype == v.dtype else xp.astype(p, v.dtype)) @ v_j
        if pv.dtype != dtype:
            pv = xp.astype(pv, dtype)
        # the first tile: 0 * 0 + pv is pv; then the same products and sums in the
        # accumulator's own array where it may be written
        acc = pv if alpha is None else add_into(mul_into(acc, alpha), pv)
    if m is None:  # every key hidden: no tile visited
        shape = tuple(q.shape[:-2]) + (q.shape[-2], 1)
        device = array_api_compat.device(q)
        m = xp.full(shape, -xp.inf, dtype=dtype, device=device)
        l = xp.zeros(shape, dtype=dtype, device=device)
        acc = xp.zeros(tuple(q.shape[:-2]) + (q.shape[-2], v.shape[-1]), dtype=dtype, device=device)
    if ones_column:
        dv = v.shape[-1] - 1
        acc, l = acc[..., :dv], acc[..., dv:]
    return finish_partial(xp, l, acc), partial_lse(xp, m, l)[..., 0]


def _query_blocks(xp, spec, q, kt, v, block_q, block_k, dtype, out_dtype, ones_column):
    """``(out, lse)`` of all query rows, one query block after another."""
    outs, lses = [], []
    for q0 in range(0, spec.nq, block_q):
        q1 = min(q0 + block_q, spec.nq)
        out, lse = _query_block(xp, spec, q[..., q0:q1, :], kt, v, q0, block_k, dtype, ones_column)
        outs.append(out if out.dtype == out_dtype else xp.astype(out, out_dtype))
        lses.append(lse)
    return _join(xp, outs, -2), _join(xp, lses, -1)


def _rows_of(xp, x, batch, rows):
    """A spec array ``x`` (pairwise: broadcasting against ``batch + (Nq, Nk)``) as
    ``(rows, a, b)`` or ``(1, a, b)`` over the flattened batch, or False when it cannot
    be cut by rows without a copy of its tiles (a mask over some of the batch axes)."""
    if x is None or not hasattr(x, "shape"):
        return x
    own = (1,) * (len(batch) + 2 - x.ndim) + tuple(x.shape[:-2])
    if all(n == 1 for n in own):
        return xp.reshape(x, (1,) + tuple(x.shape[-2:]))
    if own == tuple(batch):
        return xp.reshape(x, (rows,) + tuple(x.shape[-2:]))
    if tuple(x.shape[-2:]) == (1, 1):  # one number per head (ALiBi, lengths): copied whole
        return xp.reshape(xp.broadcast_to(x, tuple(batch) + (1, 1)), (rows, 1, 1))
    return False


_SPEC_ARRAYS = ("mask", "bias", "alibi", "len_q", "len_k", "keep")


def _head_groups(xp, spec, batch, rows, most):
    """``[(a, b, spec_ab)]``: contiguous ranges of the flattened batch rows, at least one
    per CPU and none longer than ``most`` rows, each with the spec arrays cut to it; None
    when an array cannot be cut."""
    flat = {}
    for name in _SPEC_ARRAYS:
        x = _rows_of(xp, getattr(spec, name), batch, rows)
        if x is False:
            return None
        flat[name] = x
    return [(a, b, dataclasses.replace(spec, **{
        name: (x if x is None or not hasattr(x, "shape") or x.shape[0] == 1 else x[a:b, ...])
        for name, x in flat.items()}))
        for a, b in row_groups(rows, most=most)]


def online_forward(pb, block_q, block_k):
    """The online-softmax recurrence over key blocks: ``(out, lse)`` in the grouped shapes
    ``batch_g + (Nq, dv)`` and ``batch_g + (Nq,)``.

    ``lse`` is the log-sum-exp of each row's masked logits (before dropout), ``+inf`` for
    a row with no key to attend to, so that the backward's ``exp(S - lse)`` is 0 there.
    The forward discards it (a few ``O(Nq)`` operations). ``out`` has q's dtype; ``lse``
    and the running statistics are in :func:`logit_dtype` (float32 for float16).

    Per tile, all heads at once (or a group of them, below): the logits GEMM, the row
    maximum, the shift (in place) and ``exp``, and the ``P V`` GEMM, on NumPy with an
    extra column of ones that gives the row sums (``[V | 1]``: no separate pass for
    them), so three passes over each tile besides the GEMMs'
    (:func:`attn_ref._common.online_step`); other libraries take the row sums as a
    fourth pass, cheaper there than a 65th GEMM column. The sum is also a separate pass
    with dropout (the normaliser counts the dropped weights) and when ``P`` is rounded
    to a narrower ``V`` (float16) before the product.

    A large call (``POOL_MIN_LOGITS``) on eager NumPy arrays with several heads
    (:func:`attn_ref._common.pool_helps`) runs contiguous groups of heads, at least one
    per CPU and each small enough that its tiles stay near one head's
    (``GROUP_TILE_LOGITS``), each a whole call of the query-block loop on its rows, on a
    thread pool whose workers' GEMMs run on one BLAS thread each: the heads are
    independent, so the cores share nothing but the memory bus, where BLAS's own
    threads would synchronise on every tile's GEMM and leave the exponentials on one
    core. Set up (the transposed
    keys, the folded scale, ``[V | 1]``) happens once for all heads, so each head takes
    the same operations whichever group and thread computes it: the result does not
    depend on the number of CPUs nor on the scheduling, and equals the unpooled call's
    bit for bit. Spec arrays (mask, bias, ALiBi, lengths, dropout) are cut with the
    heads when their batch is the whole batch or all ones, or when they hold one number
    per head; a mask or bias over some of the batch axes (and a grouped-query batch,
    whose ``k`` and ``v`` broadcast over the group) runs unpooled.
    """
    xp, spec = pb.xp, pb.spec
    nq, nk, dv = spec.nq, spec.nk, pb.v.shape[-1]
    device = array_api_compat.device(pb.q)
    dtype = logit_dtype(xp, pb.q.dtype)
    if nq == 0 or nk == 0:
        return pb.zeros(dv), xp.full(pb.batch_g + (nq,), xp.inf, dtype=dtype, device=device)
    q, kt = pb.q, transposed_copy(xp, pb.k)
    if q.dtype != dtype:
        q, kt = xp.astype(q, dtype), xp.astype(kt, dtype)
    folded = _folded_scale(xp, pb, dtype)
    if folded is not None:
        q, spec = q * folded, dataclasses.replace(spec, scale=1.0)
    v = pb.v
    # P V's extra column of ones sums P's rows: not with dropout (the sum is taken
    # before the keep-mask) nor when P is rounded to V's narrower dtype first; and only
    # on NumPy, where one (512 x 1024) @ (1024 x 65) product took 0.72 ms against 0.68 +
    # 0.09 ms for 64 columns and a row-sum pass (one BLAS thread). PyTorch's GEMM pays
    # for a 65th column as for a partial tile of them: an (8, 512, 1024) tile's product
    # took 4.42 ms against 3.58 + 0.11 ms (the whole call, in groups of two heads: 488
    # against 532 ms, medians of 7 interleaved, load 4-4.4); GPU GEMMs tile their
    # columns too, so other libraries take the row sums.
    ones_column = spec.keep is None and v.dtype == dtype and numpy_backed(v)
    if ones_column:
        ones = xp.ones(tuple(v.shape[:-1]) + (1,), dtype=v.dtype, device=device)
        v = xp.concat((v, ones), axis=-1)
    rows = batch_rows((q, kt, v))
    groups = None
    tile = min(block_q, nq) * min(block_k, nk)
    pooled = rows > 1 and rows * nq * nk >= POOL_MIN_LOGITS and pool_helps(q, kt, v)
    # the most logits per tile of a group of heads on the CPU; None: all heads at once
    most = (GROUP_TILE_LOGITS if all(numpy_backed(x) for x in (q, kt, v))
            else TORCH_TILE_LOGITS if all(torch_cpu(x) for x in (q, kt, v)) else None)
    if rows > 1 and most is not None and (pooled or rows * tile > most):
        groups = _head_groups(xp, spec, pb.batch_g, rows, max(1, most // tile))
    if groups is None:
        out, lse = _query_blocks(xp, spec, q, kt, v, block_q, block_k, dtype, pb.q.dtype, ones_column)
    else:
        # The heads are independent problems: contiguous groups of them, taken by the
        # workers in turn (or one after another, unpooled), each the same operations as
        # the whole call's on its rows.
        flat = [xp.reshape(x, (rows,) + tuple(x.shape[-2:])) for x in (q, kt, v)]

        def run(group):
            a, b, spec_ab = group
            return _query_blocks(xp, spec_ab, *(x[a:b, ...] for x in flat), block_q, block_k,
                                 dtype, pb.q.dtype, ones_column)

        parts = parallel_map(run, groups, pooled=pooled)
        out = xp.reshape(_join(xp, [o for o, _ in parts], 0), pb.batch_g + (nq, dv))
        lse = xp.reshape(_join(xp, [lse for _, lse in parts], 0), pb.batch_g + (nq,))
    drop = dropout_scale(spec)
    return (out * drop if drop != 1.0 else out), lse


def _join(xp, parts, axis):
    return parts[0] if len(parts) == 1 else xp.concat(parts, axis=axis)


def online_softmax_attention(
    q, k, v, /, *, mask=None, bias=None, causal=False, scale=None, window=None, chunk=None, softcap=None,
    alibi_slopes=None, dropout_p=0.0, dropout_mask=None, seqlens_q=None, seqlens_k=None,
    gqa=False, block_q=512, block_k=1024, xp=None,
):
    """Exact softmax attention by the online-softmax recurrence over key blocks.

    For each query block, key/value blocks are visited in order while carrying the
    running row maximum ``m``, normaliser ``l`` and unnormalised output ``acc``::

        m' = max(m, rowmax(S_j));  a = exp(m - m')
        l' = a l + rowsum(exp(S_j - m'));  acc' = a acc + (exp(S_j - m') * keep_j) V_j

    and the output is ``acc / l`` (times ``1 / (1 - dropout_p)`` with dropout). This is
    the algorithm of Rabe & Staats (2021) and FlashAttention (Dao et al. 2022); it is
    exact, not an approximation.

    Parameters
    ----------
    q, k, v, mask, bias, causal, scale, window, chunk, softcap, alibi_slopes, dropout_p, \
dropout_mask, seqlens_q, seqlens_k, gqa, xp
        As in :func:`softmax_attention`.
    block_q, block_k : int
        Tile sizes. Sequence lengths need not be multiples of them. Tiles that the
        causal mask or the window hide entirely are skipped (bounds that depend on
        ``seqlens_q``/``seqlens_k`` are only known at run time and skip nothing). With
        ``gqa=True`` the ``g`` query heads of a group share each key/value tile. The default
        512 x 1024 was faster than 1024 x 1024 on the quiet 2-core machine (N = 4096,
        8 heads, ``tools/targets.py softmax --tiles``, one interleaved run: torch tensors
        645 against 943 ms, NumPy 647 against 741 ms): an all-heads 1024 x 1024 float32
        tile is 32 MiB, more than the cache; under heavy load the larger tile had won.

    Returns
    -------
    array, shape (..., Nq, dv)
        Equal to :func:`softmax_attention` up to rounding.

    Notes
    -----
    ``O(Nq Nk (d + dv))`` time; ``O(block_q block_k)`` extra memory per batch entry
    (the logits and ``P`` of one tile) plus ``O(Nq dv)`` for the output and
    ``O(Nk (d + dv))`` for the transposed keys and ``[V | 1]``, never ``O(Nq Nk)``.

    Speed (``docs/comparison.md``, ``tools/targets.py softmax``): the scale multiplies
    ``q`` once instead of every tile when no logit can overflow (otherwise each tile's
    logits are clamped as in :func:`softmax_attention`). Each ``(..., block_q,
    block_k)`` tile costs its two GEMMs and three passes: the row maximum, the shift by
    it (in place) and ``exp``; on NumPy the row sums come out of the ``P V`` GEMM as an
    extra column (``[V | 1]``), elsewhere from a row-sum pass. On NumPy a call with at
    least ``POOL_MIN_LOGITS`` logits and several heads runs groups of heads (one head
    each at the default tiles) on a thread pool of one worker per CPU, with BLAS held to
    one thread per worker for the duration (process-wide: see
    :func:`attn_ref._common.blas_one_thread`); the result is the unpooled call's, bit
    for bit (``online_forward``). Unpooled, NumPy arrays and PyTorch's CPU tensors run
    their heads in groups one after another, at most ``GROUP_TILE_LOGITS`` and
    ``TORCH_TILE_LOGITS`` logits per tile (one and two heads at the default tiles):
    all heads' tiles at once are arrays the allocator hands back to the system between
    tiles. The same bits as all heads at once; other libraries run all heads' tiles at
    once.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import online_softmax_attention, softmax_attention
    >>> x = xp.reshape(xp.sin(xp.arange(30.0)), (5, 6))
    >>> a = online_softmax_attention(x, x, x, causal=True, block_q=2, block_k=3)
    >>> bool(xp.max(xp.abs(a - softmax_attention(x, x, x, causal=True))) < 1e-14)
    True
    >>> a = online_softmax_attention(x, x, x, window=(2, 1), softcap=5.0, block_q=2, block_k=2)
    >>> b = softmax_attention(x, x, x, window=(2, 1), softcap=5.0)
    >>> bool(xp.max(xp.abs(a - b)) < 1e-14)
    True
    """
    pb = prepare_problem(q, k, v, mask=mask, bias=bias, causal=causal, scale=scale, window=window,
                         chunk=chunk, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                         dropout_mask=dropout_mask, seqlens_q=seqlens_q, seqlens_k=seqlens_k, gqa=gqa, xp=xp)
    check_positive_int("block_q", block_q)
    check_positive_int("block_k", block_k)
    out, _ = online_forward(pb, block_q, block_k)
    return pb.ungroup(out)
