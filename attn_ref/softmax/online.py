"""The online softmax (Rabe & Staats 2021; Dao et al. 2022, FlashAttention): key blocks
with a running maximum and normaliser (:func:`attn_ref._common.online_step`), never more
than one ``block_q x block_k`` tile of logits. ``docs/online_softmax.md`` shows why the
recurrence is exact.
"""

from __future__ import annotations

import dataclasses
import math

import array_api_compat

from .._checks import check_positive_int
from .._common import (
    add_into,
    cpu_count,
    finish_partial,
    is_lazy,
    mul_into,
    online_step,
    owned_writeable,
    parallel_map,
    partial_lse,
    pool_helps,
)
from .options import prepare_problem
from .tiles import dropout_scale, keep_tile, logit_dtype, tile_coverage, tile_logits, transposed_copy

__all__ = [
    "online_softmax_attention",
    "online_forward",
]

# From this many logits (all heads) on, a NumPy call runs its elementwise passes on a
# thread pool (``online_forward``). Off by default: at N = 4096, 8 heads, on the shared
# 2-core machine (load average 4.5, ``tools/targets.py softmax --reps 3``) the pooled form
# took 8.05 s against 1.79 s without the pool, OpenBLAS's own threads being the ones
# that keep the GEMMs fast. Set it (e.g. ``1 << 22``) to use the pool, with BLAS on one
# thread for instance (1.01 s in that run).
POOL_MIN_LOGITS = float("inf")


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
    if (spec.softcap is not None or spec.bias is not None or spec.alibi is not None
            or spec.scale == 1.0 or pb.q.shape[-1] == 0
            or is_lazy(pb.q, pb.k)):
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


def _row_parts(rows, count):
    """``count`` near-equal ``[a, b)`` ranges covering ``range(rows)`` (fewer if rows < count)."""
    count = max(1, min(count, rows))
    cuts = [rows * i // count for i in range(count + 1)]
    return [(a, b) for a, b in zip(cuts, cuts[1:])]


def _query_block(xp, spec, q, kt, v, q0, block_k, dtype, parts, ones_column):
    """``(out, lse)`` of the query rows ``q`` (the block's first is ``q0``) against all keys.

    ``parts`` cut the block's rows into ranges whose elementwise work runs on
    :func:`parallel_map`'s pool when there are several; the two GEMMs of each tile run
    in this thread, where the library's own threads (BLAS's) have the cores to
    themselves. ``ones_column``: ``v`` ends with a column of ones, so that ``P V``
    carries the normaliser ``l`` in its last column.
    """
    q1, nk = q0 + q.shape[-2], spec.nk
    state = [(None, None, None) for _ in parts]  # (m, l, acc) per part
    for k0 in range(0, nk, block_k):
        k1 = min(k0 + block_k, nk)
        if tile_coverage(spec, q0, q1, k0, k1) == "none":
            continue
        kt_j, v_j = kt[..., k0:k1], v[..., k0:k1, :]
        work = [(tile_logits(xp, q[..., a:b, :], kt_j, spec, q0 + a, k0)[0], m, l)
                for (a, b), (m, l, _) in zip(parts, state)]
        # Three passes over each tile: max, the shift (in place), exp; the row sums come
        # from P [V | 1] when ones_column.
        steps = parallel_map(lambda sml: online_step(xp, sml[1], sml[2], sml[0],
                                                     with_sum=not ones_column,
                                                     overwrite=owned_writeable(sml[0])),
                             work, pooled=len(parts) > 1)
        # The logits stay named until the next tile's exist (no ``del``): the allocator
        # then reuses their memory instead of returning it to the system and faulting it
        # in again (N = 4096, 8 heads, 512 x 1024 tiles, NumPy: 19K page faults per call
        # against 12K), at the same peak (three tiles: the last P, these logits, this P).
        new_state = []
        for (a, _), (_, _, acc), (m_new, l, p, alpha) in zip(parts, state, steps):
            # The normaliser counts dropped weights too (dropout acts after the softmax).
            p = keep_tile(xp, p, spec, q0 + a, k0)
            pv = (p if p.dtype == v.dtype else xp.astype(p, v.dtype)) @ v_j
            if pv.dtype != dtype:
                pv = xp.astype(pv, dtype)
            # the first tile: 0 * 0 + pv is pv; then the same products and sums in the
            # accumulator's own array where it may be written
            acc = pv if alpha is None else add_into(mul_into(acc, alpha), pv)
            new_state.append((m_new, l, acc))
        state = new_state
    outs, lses = [], []
    for (a, b), (m, l, acc) in zip(parts, state):
        if m is None:  # every key hidden: no tile visited
            shape = tuple(q.shape[:-2]) + (b - a, 1)
            device = array_api_compat.device(q)
            m = xp.full(shape, -xp.inf, dtype=dtype, device=device)
            l = xp.zeros(shape, dtype=dtype, device=device)
            acc = xp.zeros(tuple(q.shape[:-2]) + (b - a, v.shape[-1]), dtype=dtype, device=device)
        if ones_column:
            dv = v.shape[-1] - 1
            acc, l = acc[..., :dv], acc[..., dv:]
        outs.append(finish_partial(xp, l, acc))
        lses.append(partial_lse(xp, m, l)[..., 0])
    return _join(xp, outs, -2), _join(xp, lses, -1)


def online_forward(pb, block_q, block_k):
    """The online-softmax recurrence over key blocks: ``(out, lse)`` in the grouped shapes
    ``batch_g + (Nq, dv)`` and ``batch_g + (Nq,)``.

    ``lse`` is the log-sum-exp of each row's masked logits (before dropout), ``+inf`` for
    a row with no key to attend to, so that the backward's ``exp(S - lse)`` is 0 there.
    The forward discards it (a few ``O(Nq)`` operations). ``out`` has q's dtype; ``lse``
    and the running statistics are in :func:`logit_dtype` (float32 for float16).

    Per tile, all heads at once: the logits GEMM, the row maximum, the shift (in place)
    and ``exp``, and the ``P V`` GEMM, whose extra column of ones gives the row sums
    (``[V | 1]``: no separate pass for them), so three passes over each tile besides
    the GEMMs' (:func:`attn_ref._common.online_step`). The sum stays a separate pass
    with dropout (the normaliser counts the dropped weights) and when ``P`` is rounded
    to a narrower ``V`` (float16) before the product.

    A large call on arrays whose library does not thread its elementwise operations
    (:func:`attn_ref._common.pool_helps`: NumPy) cuts each query block into one row
    range per CPU and runs the elementwise steps of the ranges on a thread pool, while
    the GEMMs stay in the calling thread with BLAS's own threads: the two kinds of
    thread never compete for the cores. Each range is computed by the same operations
    whichever thread runs it, so the result does not depend on the scheduling and
    repeats bit for bit; the cut follows the number of CPUs, and a GEMM over fewer rows
    may round differently, so two machines may differ in the last bits.
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
    # before the keep-mask) nor when P is rounded to V's narrower dtype first.
    ones_column = spec.keep is None and v.dtype == dtype
    if ones_column:
        ones = xp.ones(tuple(v.shape[:-1]) + (1,), dtype=v.dtype, device=device)
        v = xp.concat((v, ones), axis=-1)
    big = math.prod(tuple(pb.batch_g)) * nq * nk >= POOL_MIN_LOGITS and pool_helps(q)
    outs, lses = [], []
    for q0 in range(0, nq, block_q):
        q1 = min(q0 + block_q, nq)
        parts = _row_parts(q1 - q0, cpu_count() if big else 1)
        out, lse = _query_block(xp, spec, q[..., q0:q1, :], kt, v, q0, block_k, dtype, parts,
                                ones_column)
        outs.append(out if out.dtype == pb.q.dtype else xp.astype(out, pb.q.dtype))
        lses.append(lse)
    out, lse = _join(xp, outs, -2), _join(xp, lses, -1)
    drop = dropout_scale(spec)
    return (out * drop if drop != 1.0 else out), lse


def _join(xp, parts, axis):
    return parts[0] if len(parts) == 1 else xp.concat(parts, axis=axis)


def online_softmax_attention(
    q, k, v, /, *, mask=None, bias=None, causal=False, scale=None, window=None, softcap=None,
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
    q, k, v, mask, bias, causal, scale, window, softcap, alibi_slopes, dropout_p, \
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
    it (in place) and ``exp``; the row sums come out of the ``P V`` GEMM as an extra
    column (``[V | 1]``). Tiles of all heads at once keep the GEMMs large enough for the
    library's threads. On NumPy (one thread per ufunc) a call with at least
    ``POOL_MIN_LOGITS`` logits (off by default: slower than BLAS's own threads in every
    run measured) runs those three passes for one row range per CPU on a thread pool,
    while the GEMMs stay in the calling thread; the result does not depend on the
    thread scheduling (``online_forward``).

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
                         softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                         dropout_mask=dropout_mask, seqlens_q=seqlens_q, seqlens_k=seqlens_k, gqa=gqa, xp=xp)
    check_positive_int("block_q", block_q)
    check_positive_int("block_k", block_k)
    out, _ = online_forward(pb, block_q, block_k)
    return pb.ungroup(out)
