"""Linear attention's fast forms: the linear order block by block, causal chunk by chunk.

:func:`linear_attention` and the engine it shares with Performer
(:func:`linear_from_features`, :func:`linear_from_row_maps`): the linear order, "sum
then interact", ``block_size`` rows at a time, so the features exist for one block
only; non-causal, every key block is folded into the summary ``phi(K)^T [V, 1] = [S,
z]`` and every query block reads it; causal, the problem is aligned to a square
top-left one and walked block by block with the chunked form inside each block
(:func:`chunked_values`). On NumPy a large call with several heads runs groups of
heads on a thread pool. Same function as the defining forms of
:mod:`attn_ref.linear.reference`, to rounding.
"""

from __future__ import annotations

import math

import array_api_compat

from .._checks import broadcast_batch, check_qkv, namespace
from .._common import (
    TOP_LEFT,
    add_into,
    batch_rows,
    causal_offset,
    ceil_div,
    is_lazy,
    keep_freed_memory,
    mul_into,
    owned_writeable,
    parallel_map,
    pool_helps,
    row_groups,
)
from ..softmax.tiles import logit_dtype, transposed_copy
from .options import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CHUNK_SIZE,
    DEFAULT_EPS,
    check_engine_options,
    check_scale,
    feature_pair,
)
from .reference import causal_visible, hide, quadratic_order, readout, safe_denominator

__all__ = [
    "linear_attention",
    "linear_from_features",
    "linear_from_row_maps",
    "pad_rows",
    "causal_plan",
    "align_square",
    "with_ones",
    "split_num_den",
    "chunked_values",
]

# From this many rows (all heads, queries plus keys) a call on NumPy arrays with several
# heads splits them among the CPUs, contiguous groups on :func:`attn_ref._common.parallel_map`'s
# pool (the block loop's GEMM chunks, GEMM_ROWS, are one-thread products, so without the
# pool the second core idles; BLAS is not held to one thread here, see ``_engine``).
# 8 heads, d = 64: on the quiet 2-core machine the pool took 197 against 246 ms at
# N = 65536 non-causal, before BLAS was held to one thread in it (the lead's measurement,
# ``docs/comparison.md``); under load 8-10 it lost wall time at N = 16384-65536 (N = 65536:
# 969 against 816 ms at the same CPU time in one run, 1484 against 741 ms at twice the
# CPU time in another; why is not settled) and gained at N = 4096 (44.7 against 58.3 ms,
# ``tools/targets.py linear --pool-ns 1024,4096,16384``), lost at 1024 (9.9 against 4.3
# ms: starting the pool costs about 1 ms); those ran with BLAS held to one thread. As
# now (BLAS as it is), load 3.8-3.9: 0-20% slower than no pool at N = 1024-65536
# (65536: 342 against 287 ms). Kept on for the quiet re-take, the condition of the
# lead's gain; set it to 1 << 62 to switch the pool off.
POOL_MIN_ROWS = 1 << 16
# Rows per GEMM of the non-causal block loop: a block's fold and read are taken as
# products of GEMM_ROWS-row chunks (a batch of small GEMMs), not one product over the
# block. Each chunk's GEMM (GEMM_ROWS x d' x (dv + 1) = 532K multiply-adds at 128 x 64 x 65)
# stays below 1M, where OpenBLAS (NumPy's BLAS here, SkylakeX kernels) runs its small-matrix
# kernel: one thread, no packing. One GEMM over a 512-row block (2.1M) takes its threaded
# path instead, whose two threads synchronise per call: at N = 65536, 8 heads, d = 64 that
# was slower than one thread even on the quiet machine (the fold GEMM 127 ms against 62 ms
# for the read) and 4-10x slower than one thread on a loaded one (``docs/comparison.md``,
# "The fold GEMM was OpenBLAS's threading"). The causal chunks (64 x 64 x 65) were always
# below the limit. Wider features (Performer's d' = 256) take fewer rows per chunk, for the
# same GEMM size (:func:`_gemm_rows`).
GEMM_ROWS = 128


def _intra_chunks(xp, qc, kt, vc):
    """``(phi(Q_c) phi(K_c)^T * M) V_c`` for every chunk, ``M`` the top-left causal mask
    (:func:`~attn_ref.linear.reference.hide`): ``qc (..., n, C, d')``, ``kt (..., n, d',
    C)`` (``phi(K_c)^T`` row-major), ``vc (..., n, C, dv)``.

    The future is hidden by a product with the 0/1 mask where that is exact, and the
    result checked afterwards. A finite entry above the diagonal times 0 is ``0`` (or
    ``-0``, which adds nothing), as the select gives; an ``inf`` or NaN there becomes
    NaN, which makes every column of its row of the product NaN, so one column's sum
    finds it (a non-finite entry below the diagonal makes that sum non-finite too).
    Only then is the block taken again with the select. The check reads ``1 / dv`` of
    what a sum of the ``C x C`` products would (``C / dv`` of the block's scores;
    before, one reduction over every score, and before that four over ``phi(Q)`` and
    ``phi(K)``). NumPy's ``where`` runs at a fifth of a product's rate: on a causal
    block of 512 rows, 8 heads, ``d' = C = 64``, one thread, 323 us for the select
    against 60 us for the product. The select always where the arrays are not this
    code's own to write (``owned_writeable``: lazy arrays whose values cannot be read,
    JAX's, and torch tensors recording a graph, whose value read back torch warns
    about).
    """
    a = qc @ kt
    if owned_writeable(a):
        vis = causal_visible(xp, a.shape[-2], a.shape[-1], TOP_LEFT, array_api_compat.device(a))
        out = mul_into(a, xp.astype(vis, a.dtype)) @ vc
        if math.isfinite(float(xp.sum(out[..., -1]))):
            return out
        a = qc @ kt  # the product overwrote a's entries above the diagonal
    return hide(xp, a, TOP_LEFT) @ vc


def pad_rows(xp, x, before, after, fill=0.0):
    """``x`` with ``before``/``after`` rows of ``fill`` (zeros by default) added on axis -2."""
    if before == 0 and after == 0:
        return x
    dev = array_api_compat.device(x)
    parts = []
    if before:
        parts.append(xp.full(tuple(x.shape[:-2]) + (before, x.shape[-1]), fill, dtype=x.dtype, device=dev))
    parts.append(x)
    if after:
        parts.append(xp.full(tuple(x.shape[:-2]) + (after, x.shape[-1]), fill, dtype=x.dtype, device=dev))
    return xp.concat(parts, axis=-2)


def causal_plan(nq, nk, alignment):
    """How :func:`align_square` pads: ``(P, P', keep, tail)`` (see there)."""
    off = causal_offset(alignment, nq, nk)
    p_q, p_k = max(off, 0), max(-off, 0)
    keep = max(min(nk, nq + p_q - p_k), 0)
    return p_q, p_k, keep, nq + p_q - p_k - keep


def align_square(xp, fq, fk, v, alignment):
    """Rewrite a causal problem with any ``Nq, Nk`` as a square top-left one of length ``L``.

    Query ``i`` moves to position ``i + P`` and key ``j`` to ``j + P'`` with
    ``P - P' = offset``, so ``j <= i + offset`` becomes the usual ``j' <= i'``. Padded
    rows carry zero features, which contribute nothing to any sum; keys no query can
    see are dropped. Returns ``(fq, fk, v, P)``; the outputs are rows ``P:P+Nq``.
    """
    p_q, p_k, keep, tail = causal_plan(fq.shape[-2], fk.shape[-2], alignment)
    fq = pad_rows(xp, fq, p_q, 0)
    fk, v = fk[..., :keep, :], v[..., :keep, :]
    return fq, pad_rows(xp, fk, p_k, tail), pad_rows(xp, v, p_k, tail), p_q


def with_ones(xp, v):
    """``[V, 1]``: a column of ones after the values, whose output is the denominator.

    ``phi(Q) phi(K)^T [V, 1] = [num, den]``, so one matrix product per term gives
    both, and the state ``phi(K)^T [V, 1] = [S, z]`` carries ``z`` as its last column.
    """
    ones = xp.ones(tuple(v.shape[:-1]) + (1,), dtype=v.dtype, device=array_api_compat.device(v))
    return xp.concat([v, ones], axis=-1)


def split_num_den(xp, out):
    """``(num, den)`` from an output ``[num, den]`` of values extended by :func:`with_ones`."""
    return out[..., :-1], out[..., -1:]


def chunked_values(xp, fq, fk, v, chunk_size, state=None):
    """Top-left causal ``phi(Q) phi(K)^T V`` (masked) of square inputs, chunk by chunk.

    Per chunk ``c``: ``phi(Q_c) S_{c-1} + (phi(Q_c) phi(K_c)^T * M) V_c`` with the
    lower-triangular mask ``M`` and the exclusive prefix sum ``S_{c-1}`` of the chunk
    states ``phi(K_c)^T V_c``, taken over all chunks at once (:func:`_exclusive_prefix`)
    starting from ``state`` (the summary ``(..., d', dv)`` of earlier keys; zero if
    None). A ragged tail is padded with zero features. Returns the output
    ``(..., N, dv)`` and the summary of ``state`` and all these keys. Extra memory
    ``O(N C + (N / C) d' dv)``.
    """
    n = fq.shape[-2]
    c = min(chunk_size, n)
    n_chunks = ceil_div(n, c)
    pad = n_chunks * c - n
    fq, fk, v = (pad_rows(xp, x, 0, pad) for x in (fq, fk, v))
    qc, kc, vc = (xp.reshape(x, tuple(x.shape[:-2]) + (n_chunks, c, x.shape[-1])) for x in (fq, fk, v))
    # phi(K_c)^T once in row-major order serves both products that need it: NumPy's
    # stacked matmul is several times slower on a transposed view (N = 65536, 8 heads,
    # C = 64, one thread: phi(Q_c) phi(K_c)^T 109 ms on the view, 49 ms + 21 ms for
    # the copy).
    kt = transposed_copy(xp, kc)
    s = kt @ vc  # (..., n_chunks, d', dv)
    prefix = _exclusive_prefix(xp, s, state)
    out = add_into(qc @ prefix[..., :-1, :, :], _intra_chunks(xp, qc, kt, vc))
    out = xp.reshape(out, tuple(out.shape[:-3]) + (n_chunks * c, out.shape[-1]))
    return out[..., :n, :], prefix[..., -1, :, :]


def _exclusive_prefix(xp, s, state):
    """``P_c = state + sum_{c' < c} s_c'``, ``c = 0 .. n``: shape ``(..., n + 1, d', dv)``.

    Taken as one product with the ``(n + 1) x n`` strictly lower-triangular matrix of
    ones rather than ``cumulative_sum`` over the chunk axis: the same sums, but a
    matrix product over ``d' dv`` columns at once, where NumPy's cumulative sum walks
    the short chunk axis element by element (5x slower here). The future still
    cannot reach the past: its chunks meet exact zeros, which leave every earlier
    sum bit-for-bit unchanged (as long as they are finite, as in the masked
    intra-chunk product).
    """
    n, d1, d2 = s.shape[-3], s.shape[-2], s.shape[-1]
    rows = xp.arange(n + 1, device=array_api_compat.device(s))
    lower = xp.astype(rows[:, None] > rows[None, :n], s.dtype)
    flat = xp.reshape(s, tuple(s.shape[:-3]) + (n, d1 * d2))
    prefix = xp.reshape(lower @ flat, tuple(s.shape[:-3]) + (n + 1, d1, d2))
    return prefix if state is None else add_into(prefix, state[..., None, :, :])


def _feature_rows(xp, phi, x, lo, hi, n):
    """``phi`` of rows ``lo:hi`` of ``x`` (``n`` rows); rows outside ``[0, n)`` get zero features.

    Zero features are what padding must carry: they add nothing to ``S`` or ``z``.
    Returns None when no row of the range is real.
    """
    a, b = max(lo, 0), min(hi, n)
    if a >= b:
        return None
    return pad_rows(xp, phi(x[..., a:b, :]), a - lo, hi - b)


def _value_rows(xp, v, lo, hi, n):
    a, b = max(lo, 0), min(hi, n)
    return pad_rows(xp, v[..., a:b, :], a - lo, hi - b)


def _fold(xp, state, fk, v1):
    """``state + phi(K)^T [V, 1]``: the summary with one more block of keys folded in
    (in place when the library allows: ``state`` is always this code's own array)."""
    ds = xp.matrix_transpose(fk) @ v1
    return ds if state is None else add_into(state, ds)


def _row_chunks(xp, x, rows):
    """``x (..., B, n)`` as ``(..., B / rows, rows, n)`` (``rows`` divides ``B``)."""
    return xp.reshape(x, tuple(x.shape[:-2]) + (x.shape[-2] // rows, rows, x.shape[-1]))


def _gemm_rows(n, d_prime, dv1):
    """Rows per chunk of a block of ``n`` rows with ``d'`` features and ``dv + 1`` value
    columns: :data:`GEMM_ROWS` at ``d' = 64``, ``dv = 64``, halved until a chunk's GEMM is no
    larger than that one; None (one GEMM over the block) when they do not divide ``n`` into
    at least two chunks."""
    rows = GEMM_ROWS
    while rows > 1 and rows * d_prime * dv1 > GEMM_ROWS * 64 * 65:
        rows //= 2
    return rows if n > rows and n % rows == 0 else None


def _fold_transposed(xp, state_t, fk, v1):
    """``state_t + [V, 1]^T phi(K)``: the transposed summary ``[S, z]^T``, ``(..., dv + 1,
    d')``, with one more block of keys folded in, chunk by chunk (:func:`_gemm_rows`).

    The chunks' summaries are summed over the chunk axis: the same products as one
    GEMM over the block, added in another order. Transposed, because OpenBLAS runs
    ``[V, 1]^T phi(K)`` (a ``(dv + 1) x B`` left operand) faster than ``phi(K)^T [V, 1]``
    when a product does take its threaded path (a ragged last block)."""
    rows = _gemm_rows(fk.shape[-2], fk.shape[-1], v1.shape[-1])
    if rows is not None:
        ds = xp.sum(xp.matrix_transpose(_row_chunks(xp, v1, rows)) @ _row_chunks(xp, fk, rows), axis=-3)
    else:
        ds = xp.matrix_transpose(v1) @ fk
    return ds if state_t is None else add_into(state_t, ds)


def _read_summary(xp, fq, state):
    """``phi(Q) [S, z]`` of a block, ``(..., B, dv + 1)``, chunk by chunk (:func:`_gemm_rows`):
    each output row is the same dot products as in one GEMM over the block."""
    n = fq.shape[-2]
    rows = _gemm_rows(n, fq.shape[-1], state.shape[-1])
    if rows is None:
        return fq @ state
    out = _row_chunks(xp, fq, rows) @ state[..., None, :, :]
    return xp.reshape(out, tuple(out.shape[:-3]) + (n, out.shape[-1]))


def _read(xp, out, normalize, eps):
    """``(num, den)`` of a ``[num, den]`` block for :meth:`_Rows.put`: ``den`` is the
    safe denominator (:func:`readout`), None when ``normalize`` is off."""
    num, den = split_num_den(xp, out)
    return num, (safe_denominator(xp, den, eps) if normalize else None)


class _OnesColumn:
    """:func:`with_ones` of successive row blocks of ``v``, at most ``rows`` rows each.

    Where the library allows writes, every block is copied into one ``[V, 1]`` buffer
    made once (its ones column written once), instead of a fresh concatenation per
    block; else (JAX, lazy or autograd-recording arrays) :func:`with_ones` each time.
    The block returned is only valid until the next ``put``.
    """

    def __init__(self, xp, v, rows):
        self.xp, self.buf = xp, None
        if is_lazy(v) or (array_api_compat.is_torch_array(v) and v.requires_grad):
            return  # a copy into the buffer would be traced or recorded
        shape = tuple(v.shape[:-2]) + (rows, v.shape[-1] + 1)
        buf = xp.ones(shape, dtype=v.dtype, device=array_api_compat.device(v))
        self.buf = buf if owned_writeable(buf) else None

    def put(self, block):
        if self.buf is None:
            return with_ones(self.xp, block)
        n = block.shape[-2]
        self.buf[..., :n, :-1] = block
        return self.buf[..., :n, :]


class _Rows:
    """An output of ``n`` rows (axis -2), filled block by block in order.

    Where the library lets us write into an array we made (NumPy, PyTorch, CuPy,
    array-api-strict) each block goes straight into one preallocated output (``out``,
    when the caller made it: a heads group's rows of the pooled call's output); else
    (JAX, a lazy array) the blocks are kept and concatenated at the end. Writing in
    place saves a full pass: with ``concat`` every block is written to memory once as
    a block and again into the result (at N = 65536, 8 heads, ``d = 64``, 134 MB each
    way), and the result's fresh pages are touched a second time.
    """

    def __init__(self, xp, n, out=None):
        self.xp, self.n, self.parts, self.out = xp, n, [], out

    def put(self, lo, block, den=None):
        """Rows ``lo:lo + B`` of the output: ``block (..., B, dv)``, divided by ``den
        (..., B, 1)`` when given."""
        if (self.out is None and not self.parts and block.shape[-2] < self.n
                and array_api_compat.is_writeable_array(block) and not is_lazy(block)):
            shape = tuple(block.shape[:-2]) + (self.n, block.shape[-1])
            out = self.xp.empty(shape, dtype=block.dtype, device=array_api_compat.device(block))
            # Only into an array of the blocks' own type: the namespace makes its base
            # type, and a subclass whose operators round every result (the oracle's
            # float16 and bfloat16 baselines) would lose the rounding of the division
            # written in place below, and its type for what the caller does next.
            self.out = out if type(out) is type(block) else None
        if self.out is None:
            self.parts.append(block if den is None else block / den)
            return
        hi = lo + block.shape[-2]
        if den is not None and not owned_writeable(block):
            block = block / den  # autograd records the division
            den = None
        self.out[..., lo:hi, :] = block
        if den is not None:
            # Scaled where it lies: on the output's contiguous rows the division is about
            # a third faster than on the strided numerator columns of [num, den] (NumPy,
            # (8, 512, 64) float32 blocks, the same quotients). By the reciprocal, one
            # division per row: NumPy broadcasts a (B, 1) operand along rows of 64 at
            # a product's rate, but divides at a third of it ((4, 512, 64) float32 in
            # cache, one thread: 28.5 against 46.5 us). num * (1 / den) is num / den to
            # within one unit in the last place (|den| >= eps keeps 1 / den finite).
            rows = self.out[..., lo:hi, :]
            rows *= 1.0 / den

    def result(self):
        if self.out is not None:
            return self.out
        return self.xp.concat(self.parts, axis=-2) if len(self.parts) > 1 else self.parts[0]


def _stream(xp, q, k, v, phi_q, phi_k, batch, alignment, chunk_size, block_size, normalize, eps,
            out=None, blocks_per_pass=1):
    """The linear order, ``block_size`` rows at a time: ``batch + (Nq, dv)``, written into
    ``out`` when given (an array of that shape the caller made; :class:`_Rows`).

    Non-causal: every key block is folded into the summary ``phi(K)^T [V, 1] =
    [S, z]``, then every query block reads it. Causal: the problem is aligned to a
    square top-left one of length ``L`` (:func:`causal_plan`) and walked block by
    block; inside a block the chunked form runs vectorised over its chunks, its
    prefix sum starting from the summary of all earlier blocks. The feature maps see
    one block at a time, so ``phi(Q)``, ``phi(K)`` and the chunk states never exist
    for the whole sequence: extra memory ``O(B (C + d') + (B / C) d' dv)`` besides
    the output.

    ``blocks_per_pass`` (non-causal only): the feature maps, the ``[V, 1]`` copy, the
    denominators and the output's writes take that many blocks at a time, while every
    GEMM stays one block's: the same products, summed in the same order, so the same
    bits as one block at a time. A pooled group of heads takes as many rows per pass as
    the whole batch takes per block (:func:`_engine`), so its elementwise array calls
    are as large as the unpooled call's and half as many.
    """
    nq, nk = q.shape[-2], k.shape[-2]
    outs = _Rows(xp, nq, out)
    if alignment is None:
        step = block_size * blocks_per_pass
        state_t = None
        ones = _OnesColumn(xp, v, min(step, nk))
        for lo in range(0, nk, step):
            hi = min(lo + step, nk)  # out-of-bounds slice stops are not in the standard
            fk, v1 = phi_k(k[..., lo:hi, :]), ones.put(v[..., lo:hi, :])
            for a in range(0, hi - lo, block_size):
                b = min(a + block_size, hi - lo)
                state_t = _fold_transposed(xp, state_t, fk[..., a:b, :], v1[..., a:b, :])
        # [S, z] row-major again (d' (dv + 1) floats per head), the read's right operand.
        state = transposed_copy(xp, state_t)
        for lo in range(0, nq, step):
            hi = min(lo + step, nq)
            # Named, so that a block's arrays are freed only once the next block's exist.
            fq = phi_q(q[..., lo:hi, :])
            # One read of the pass where its GEMM row chunks are its blocks' (whole blocks
            # chunked alike, _gemm_rows); else block by block, for the same bits.
            whole = hi - lo == step and _gemm_rows(block_size, fq.shape[-1], state.shape[-1]) is not None
            width = step if whole else block_size
            for a in range(0, hi - lo, width):
                b = min(a + width, hi - lo)
                outs.put(lo + a, *_read(xp, _read_summary(xp, fq[..., a:b, :], state), normalize, eps))
        return outs.result()
    p_q, p_k, keep, tail = causal_plan(nq, nk, alignment)
    length = nq + p_q
    c = min(chunk_size, length)
    block = ceil_div(block_size, c) * c  # whole chunks per block
    state = None
    ones = _OnesColumn(xp, v, min(block, length))
    for lo in range(0, length, block):
        hi = min(lo + block, length)
        fk = _feature_rows(xp, phi_k, k, lo - p_k, hi - p_k, keep)
        v1 = ones.put(_value_rows(xp, v, lo - p_k, hi - p_k, keep)) if fk is not None else None
        fq = _feature_rows(xp, phi_q, q, lo - p_q, hi - p_q, nq)
        if fq is None:  # keys before the first query: only the summary grows
            if fk is not None:
                state = _fold(xp, state, fk, v1)
            continue
        if fk is not None:
            out, state = chunked_values(xp, fq, fk, v1, c, state)
        elif state is not None:
            out = fq @ state
        else:  # no key visible yet; zeros of the batch every other block has
            out = xp.zeros(batch + (hi - lo, v.shape[-1] + 1), dtype=v.dtype,
                           device=array_api_compat.device(v))
        outs.put(max(lo - p_q, 0), *_read(xp, out[..., max(p_q - lo, 0):, :], normalize, eps))
    return outs.result()


def _engine(xp, q, k, v, phi_q, phi_k, *, causal, order, chunk_size, block_size, normalize, eps,
            threads=True):
    """Shared by :func:`linear_attention` and :func:`linear_from_features`; options checked
    here. ``threads=False`` keeps a large call on one thread (a user's feature map is
    not promised to be thread-safe)."""
    alignment, normalize, eps = check_engine_options(causal, order, chunk_size, block_size, normalize, eps)
    nq, nk, dv = q.shape[-2], k.shape[-2], v.shape[-1]
    batch = broadcast_batch([("q", tuple(q.shape[:-2])), ("k", tuple(k.shape[:-2])),
                             ("v", tuple(v.shape[:-2]))])
    if nq == 0 or nk == 0:
        return xp.zeros(batch + (nq, dv), dtype=v.dtype, device=array_api_compat.device(v))
    if order == "quadratic":
        num, den = quadratic_order(xp, phi_q(q), phi_k(k), v, alignment)
        return readout(xp, num, den, normalize, eps)
    # The block loop's temporaries reused from block to block, not faulted in again each
    # time: causal, N = 65536, 8 heads, d = 64, 333-373 -> 248-258 ms a call (keep_freed_memory)
    keep_freed_memory(v)
    rows = batch_rows((q, k, v))
    pooled = threads and rows > 1 and rows * (nq + nk) >= POOL_MIN_ROWS and pool_helps(q, k, v)
    if not pooled:
        return _stream(xp, q, k, v, phi_q, phi_k, batch, alignment, chunk_size, block_size, normalize, eps)
    # The heads are independent problems: a few contiguous groups of them, one per CPU,
    # each the same computation as the batched call on its rows.
    flat = [xp.reshape(x, (rows,) + tuple(x.shape[-2:])) for x in (q, k, v)]
    # One output for all groups, each writing its own rows: the groups' outputs joined by
    # concat cost a pass over the whole output and its fresh pages (N = 65536, 8 heads,
    # d = 64: 128 MiB written twice).
    out = None
    if not (array_api_compat.is_torch_array(v) and v.requires_grad):
        out = xp.empty((rows, nq, dv), dtype=v.dtype, device=array_api_compat.device(v))
        # of v's own type only (see _Rows.put)
        out = out if owned_writeable(out) and type(out) is type(v) else None

    def run(group):
        a, b = group
        qi, ki, vi = (x[a:b, ...] for x in flat)
        # non-causal, the group's passes as large as the whole batch's blocks (see _stream)
        return _stream(xp, qi, ki, vi, phi_q, phi_k, (b - a,), alignment, chunk_size, block_size,
                       normalize, eps, None if out is None else out[a:b, ...],
                       blocks_per_pass=max(1, rows // (b - a)) if alignment is None else 1)

    # BLAS keeps its threads: the block loop's GEMMs are all small-matrix ones (one
    # thread each, GEMM_ROWS), and holding OpenBLAS to one thread made the pooled call
    # slower (N = 65536, 8 heads, non-causal, two interleaved runs under load 6-7,
    # medians of 5: 909 and 748 ms wall, 470 and 584 ms CPU, against 673 and 513 ms
    # wall, 330 and 332 ms CPU without the limit; no pool 640 and 592 ms). Not
    # understood: the same small GEMMs alone on two threads cost the same either way.
    outs = parallel_map(run, row_groups(rows), pooled=True, one_blas_thread=False)
    if out is None:
        out = outs[0] if len(outs) == 1 else xp.concat(outs, axis=0)
    return xp.reshape(out, batch + (nq, dv))


def linear_from_features(fq, fk, v, /, *, causal=False, order="linear", chunk_size=DEFAULT_CHUNK_SIZE,
                         block_size=DEFAULT_BLOCK_SIZE, normalize=True, eps=DEFAULT_EPS, xp=None):
    """Linear attention from precomputed features ``phi(Q)``, ``phi(K)``.

    The engine behind :func:`linear_attention` and :func:`attn_ref.performer_attention`.
    ``fq (..., Nq, d')`` should already carry the similarity scale. Options as in
    :func:`linear_attention`. Returns ``(..., Nq, dv)``.
    """
    xp = namespace(("fq", fq), ("fk", fk), ("v", v), xp=xp)
    if fq.shape[-1] != fk.shape[-1]:
        raise ValueError(f"fq (..., Nq, d') and fk (..., Nk, d') must have the same d', got "
                         f"{tuple(fq.shape)} and {tuple(fk.shape)}")
    return _engine(xp, fq, fk, v, lambda x: x, lambda x: x, causal=causal, order=order,
                   chunk_size=chunk_size, block_size=block_size, normalize=normalize, eps=eps)


def linear_from_row_maps(q, k, v, phi_q, phi_k, /, *, causal=False, order="linear",
                         chunk_size=DEFAULT_CHUNK_SIZE, block_size=DEFAULT_BLOCK_SIZE, normalize=True,
                         eps=DEFAULT_EPS, xp=None):
    """Linear attention with features made block by block: ``phi_q(q)``, ``phi_k(k)``.

    The same function as ``linear_from_features(phi_q(q), phi_k(k), v, ...)``, but the
    maps are applied to ``block_size`` rows at a time inside the engine, so the
    features never exist for the whole sequence (for Performer's ``m = 256`` features,
    four times the size of ``q``). ``phi_q``, ``phi_k``: row-wise maps
    ``(..., B, d) -> (..., B, d')`` written in the array API, the scale already in
    ``phi_q``. Options as in :func:`linear_attention`. Returns ``(..., Nq, dv)``.

    The call stays on the calling thread (no heads pool): a map may hold arrays shaped
    like the whole batch (Performer's key stabiliser, one per head), which a group of
    heads could not broadcast against.
    """
    xp = namespace(("q", q), ("k", k), ("v", v), xp=xp)
    return _engine(xp, q, k, v, phi_q, phi_k, causal=causal, order=order, chunk_size=chunk_size,
                   block_size=block_size, normalize=normalize, eps=eps, threads=False)



# ---------------------------------------------------------------- the public entry


def linear_attention(q, k, v, /, *, feature_map="elu+1", causal=False, order="linear",
                     chunk_size=DEFAULT_CHUNK_SIZE, block_size=DEFAULT_BLOCK_SIZE, scale=None,
                     normalize=True, eps=DEFAULT_EPS, xp=None):
    """Linear (kernelised) attention ``phi(Q) (phi(K)^T V) / phi(Q) sum_j phi(k_j)``.

    Parameters
    ----------
    q : array, shape (..., Nq, d)
    k : array, shape (..., Nk, d)
    v : array, shape (..., Nk, dv)
        Leading (batch, head) dimensions broadcast.
    feature_map : {"elu+1", "relu", "identity"} or callable
        ``phi``; see the module docstring.
    causal : {False, True, "top-left", "bottom-right"}
        Query ``i`` sees keys ``j <= i`` (top-left) or ``j <= i + Nk - Nq``.
    order : {"linear", "quadratic"}
        ``"linear"`` (default) sums the keys into ``S = phi(K)^T V`` first; with
        ``causal`` it runs the chunked form. ``"quadratic"`` forms
        ``phi(Q) phi(K)^T`` (masked) and multiplies by ``V``. Same function.
    chunk_size : int
        Chunk length ``C`` of the causal linear order. ``N`` need not be a multiple
        of it; ``chunk_size=1`` is the naive prefix sum over positions.
    block_size : int
        Rows of ``q``, ``k``, ``v`` the linear order takes at a time (rounded up to
        whole chunks when causal): the feature maps and chunk states exist for one
        block, never for the whole sequence. Any value gives the same function (to
        rounding); the default keeps a block of 8 heads in cache.
    scale : float, optional
        Multiplies the similarity ``phi(q) . phi(k)``; default 1.
    normalize : bool
        Divide by the denominator (default). ``False`` returns the unnormalised
        ``scale * phi(Q) phi(K)^T V`` (masked).
    eps : float
        Denominators with ``|den| < eps`` are replaced by ``+-eps`` (module docstring).
    xp : namespace, optional

    Returns
    -------
    array, shape (..., Nq, dv)
        Queries with no visible key (``Nk == 0``, causal bottom-right with
        ``Nq > Nk``) give zeros; ``Nq == 0`` gives ``(..., 0, dv)``.

    Notes
    -----
    Linear order: ``O(N d' dv)`` time, ``O(B d' + d' dv)`` extra memory per head
    besides the output (non-causal); causal chunked ``O(N (C + d') dv)`` time and
    ``O(B C + (B / C) d' dv)`` extra memory, ``B`` the block size. Quadratic order: ``O(Nq Nk (d' + dv))``
    time, ``O(Nq Nk)`` memory. Katharopoulos et al., "Transformers are RNNs" (ICML 2020).

    On NumPy arrays a linear-order call with several heads and at least ``POOL_MIN_ROWS``
    rows (queries plus keys, all heads) runs groups of heads on a thread pool, one per
    CPU (its GEMMs are small enough for OpenBLAS's one-thread kernel, so BLAS is left
    as it is); the result is the unpooled call's, bit for bit. A callable
    ``feature_map`` keeps the call on the calling thread.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import linear_attention
    >>> x = xp.reshape(xp.sin(xp.arange(40.0)), (8, 5))
    >>> a = linear_attention(x, x, x, causal=True, chunk_size=3)
    >>> b = linear_attention(x, x, x, causal=True, order="quadratic")
    >>> bool(xp.max(xp.abs(a - b)) < 1e-14)
    True
    """
    xp, _ = check_qkv(q, k, v, xp=xp)
    scale = check_scale(scale)
    work = logit_dtype(xp, q.dtype)
    if work != q.dtype:
        # float16 sums overflow at 65504 already for moderate inputs: the features and
        # sums run in float32, and the output goes back to q's dtype.
        out = linear_attention(*(xp.astype(x, work) for x in (q, k, v)), feature_map=feature_map,
                               causal=causal, order=order, chunk_size=chunk_size,
                               block_size=block_size, scale=scale, normalize=normalize, eps=eps, xp=xp)
        return xp.astype(out, q.dtype)
    phi_q, phi_k = feature_pair(xp, q, k, feature_map, scale)
    return _engine(xp, q, k, v, phi_q, phi_k, causal=causal, order=order, chunk_size=chunk_size,
                   block_size=block_size, normalize=normalize, eps=eps,
                   threads=isinstance(feature_map, str))

