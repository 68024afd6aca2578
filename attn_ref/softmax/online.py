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
    batch_rows,
    finish_partial,
    is_lazy,
    online_step,
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

# Below this many logits (all heads) one thread does the whole call: a pool costs more
# than it saves on small problems.
POOL_MIN_LOGITS = 1 << 22


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


def _split_heads(pb):
    """The number of leading batch rows the call can be cut along (q, k, v of one batch
    shape, no per-pair array in the spec), else 1."""
    spec = pb.spec
    arrays = (spec.mask, spec.bias, spec.alibi, spec.len_q, spec.len_k, spec.keep)
    if any(a is not None for a in arrays):
        return 1
    return batch_rows((pb.q, pb.k, pb.v))


def _query_block(xp, spec, q, kt, v, q0, block_k, dtype):
    """``(out, lse)`` of the query rows ``q`` (the tile's first is ``q0``) against all keys."""
    q1, nk = q0 + q.shape[-2], spec.nk
    m = l = acc = None
    for k0 in range(0, nk, block_k):
        k1 = min(k0 + block_k, nk)
        if tile_coverage(spec, q0, q1, k0, k1) == "none":
            continue
        s, _ = tile_logits(xp, q, kt[..., k0:k1], spec, q0, k0)
        # The normaliser counts dropped weights too (dropout acts after the softmax).
        m, l, p, alpha = online_step(xp, m, l, s)
        pv = keep_tile(xp, p, spec, q0, k0)
        pv = (pv if pv.dtype == v.dtype else xp.astype(pv, v.dtype)) @ v[..., k0:k1, :]
        if alpha is None:  # the first tile: 0 * 0 + pv is pv
            acc = pv if pv.dtype == dtype else xp.astype(pv, dtype)
        else:
            acc = acc * alpha + pv
    if m is None:  # every key hidden: no tile visited
        shape = tuple(q.shape[:-2]) + (q1 - q0, 1)
        device = array_api_compat.device(q)
        m = xp.full(shape, -xp.inf, dtype=dtype, device=device)
        l = xp.zeros(shape, dtype=dtype, device=device)
        acc = xp.zeros(tuple(q.shape[:-2]) + (q1 - q0, v.shape[-1]), dtype=dtype, device=device)
    return finish_partial(xp, l, acc), partial_lse(xp, m, l)[..., 0]


def online_forward(pb, block_q, block_k):
    """The online-softmax recurrence over key blocks: ``(out, lse)`` in the grouped shapes
    ``batch_g + (Nq, dv)`` and ``batch_g + (Nq,)``.

    ``lse`` is the log-sum-exp of each row's masked logits (before dropout), ``+inf`` for
    a row with no key to attend to, so that the backward's ``exp(S - lse)`` is 0 there.
    The forward discards it (a few ``O(Nq)`` operations). ``out`` has q's dtype; ``lse``
    and the running statistics are in :func:`logit_dtype` (float32 for float16).

    The query blocks (and, without per-pair arrays in the spec, the heads) are
    independent problems; a large call runs them on a thread pool (NumPy's ufuncs and
    BLAS, PyTorch's operators release the GIL). Every block is computed by the same
    operations whichever thread runs it, and the blocks are joined in order, so the
    result does not depend on the scheduling.
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
    lead = tuple(pb.batch_g)
    big = math.prod(lead) * nq * nk >= POOL_MIN_LOGITS and pool_helps(q)
    rows = _split_heads(pb) if big else 1
    if rows > 1:
        q, kt, v = (xp.reshape(x, (rows,) + tuple(x.shape[-2:])) for x in (q, kt, v))
    q_blocks = [(q0, min(q0 + block_q, nq)) for q0 in range(0, nq, block_q)]
    tasks = [(r, q0, q1) for r in range(rows) for q0, q1 in q_blocks]

    def run(task):
        r, q0, q1 = task
        if rows > 1:
            return _query_block(xp, spec, q[r:r + 1, q0:q1, :], kt[r:r + 1, ...], v[r:r + 1, ...],
                                q0, block_k, dtype)
        return _query_block(xp, spec, q[..., q0:q1, :], kt, v, q0, block_k, dtype)

    results = parallel_map(run, tasks, pooled=big)
    outs = [o if o.dtype == pb.q.dtype else xp.astype(o, pb.q.dtype) for o, _ in results]
    lses = [s for _, s in results]
    per_row = len(q_blocks)
    if rows > 1:
        outs = [_join(xp, outs[r * per_row:(r + 1) * per_row], -2) for r in range(rows)]
        lses = [_join(xp, lses[r * per_row:(r + 1) * per_row], -1) for r in range(rows)]
        out = xp.reshape(_join(xp, outs, 0), lead + (nq, dv))
        lse = xp.reshape(_join(xp, lses, 0), lead + (nq,))
    else:
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
        ``gqa=True`` the ``g`` query heads of a group share each key/value tile.

    Returns
    -------
    array, shape (..., Nq, dv)
        Equal to :func:`softmax_attention` up to rounding.

    Notes
    -----
    ``O(Nq Nk (d + dv))`` time; ``O(block_q block_k)`` extra memory per batch entry
    (per head and worker thread on the pooled path) plus ``O(Nq dv)`` for the output,
    never ``O(Nq Nk)``.

    Speed (``docs/comparison.md``, ``tools/targets.py softmax``): the scale multiplies
    ``q`` once instead of every tile when no logit can overflow (otherwise each tile's
    logits are clamped as in :func:`softmax_attention`), and a call with at least
    ``POOL_MIN_LOGITS`` logits runs its query blocks, and its heads when no mask, bias,
    ALiBi, lengths or dropout array is given, on a pool of one thread per CPU. The
    result does not depend on the thread scheduling. NumPy's BLAS starts threads of
    its own: ``OPENBLAS_NUM_THREADS=1`` avoids oversubscribing the cores.

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
