"""Decayed linear attention: retention (RetNet), gated linear attention (GLA), Mamba-2's SSD.

The three share one recurrence over a state ``S_t (..., dk, dv)``::

    S_t = diag(alpha_t) S_{t-1} + k_t^T v_t,        o_t = scale q_t S_t,

with the decay ``alpha_t = exp(a_t)`` given in log space: a constant per head
(retention, ``a = log gamma``), one value per step (SSD, ``a_t = g_t``) or one per key
dimension and step (GLA, ``a_t = g_t (dk,)``). The output includes the current token,
as in flash-linear-attention's naive references. Unrolled, with ``b_t = a_1 + ... + a_t``::

    o_i = scale sum_{j <= i} (q_i * exp(b_i - b_j)) . k_j  v_j  +  scale (q_i * exp(b_i)) S_0,

the masked, decay-weighted form of causal linear attention (``a = 0`` is exactly
:func:`attn_ref.linear.linear_from_features` with ``normalize=False``). Each function
computes it three ways (``form=``):

``"recurrent"``
    The definition, token by token: ``O(T dk dv)`` time, ``O(dk dv)`` state.
``"parallel"``
    The masked ``T x T`` matrix, ``O(T^2 dk)`` time (``O(T^2 (dk + dv))`` with per-key
    gates); built in blocks of 64 query rows so that exponents are summed from a nearby
    anchor (:func:`~attn_ref.recurrent.common.segment_sums`).
``"chunk"``
    Chunks of ``C`` steps: the masked matrix inside a chunk, the state passed between
    chunks. ``O(T C (dk + dv) + T dk dv)`` time, the form fast kernels use. Exact, not
    an approximation: the sum over ``j <= i`` is split into ``j`` in earlier chunks
    (all folded into the state at the chunk's start, decayed by ``exp(b_i - b_start)``)
    and ``j`` in the same chunk. The chunks are computed in batches; only the state's
    hand-over between them is sequential.

Every exponent is a sum of log decays between two positions at most a chunk (or 64 rows)
apart, masked to ``-inf`` before ``exp`` where ``j > i``: with ``a <= 0`` no ``exp`` ever
sees a positive argument, so no intermediate overflows however long ``T`` or strong the
decay. The one exception is checked: GLA's chunk form factors a chunk through a
reference point midway between its first and last running sums when the values show
that no exponent exceeds ``log(max) / 2`` of the dtype in magnitude (both factors then
stay within ``max^(+-1/2)`` times their input), and halves it otherwise
(:func:`~attn_ref.recurrent.common.decayed_scores`). See :doc:`/recurrent` for the
derivation.
"""

from __future__ import annotations

import math

import array_api_compat

from .._checks import check_array, check_real
from .._common import add_into, is_lazy, keep_freed_memory, mul_into, owned_writeable
from .common import (
    DECAY_LEAF,
    ChunkOutputs,
    causal_decay,
    check_cu_seqlens,
    check_inputs,
    check_state,
    check_step_input,
    chunk_states,
    decayed_scores,
    factor_span,
    finish,
    packed,
    row_major_transpose,
    scalar_decay_in_place,
    scalar_decay_matrix,
    segment_sums,
    to_chunks,
)

__all__ = [
    "retention",
    "retention_log_decay",
    "gated_linear_attention",
    "ssd",
    "retention_weights",
    "gated_linear_attention_weights",
    "ssd_weights",
    "decayed_weights",
]

# query rows per block of the parallel form (the anchor distance of its exponents)
ROW_BLOCK = 64
#: Elements of the in-chunk scores the chunk form computes at once (512 KiB of float32:
#: the temporaries stay in cache).
GROUP_ELEMENTS = 1 << 17


def _zeros_state(xp, q, v):
    return xp.zeros(tuple(q.shape[:-1])[:-1] + (q.shape[-1], v.shape[-1]), dtype=q.dtype,
                    device=_device(q))


def _device(x):
    return array_api_compat.device(x)


def _decay_rows(s, alpha):
    """``diag(alpha) S``: ``alpha (..., e)`` with ``e`` = 1 (scalar) or ``dk``."""
    return alpha[..., :, None] * s


def _recurrent(xp, q, k, v, a, s, scale):
    s = _zeros_state(xp, q, v) if s is None else s
    outs = []
    for t in range(q.shape[-2]):
        s = _decay_rows(s, xp.exp(a[..., t, :])) + k[..., t, :, None] * v[..., t, None, :]
        outs.append((q[..., t, None, :] @ s)[..., 0, :])
    if not outs:
        return xp.zeros_like(v), s
    return scale * xp.stack(outs, axis=-2), s


def _scores(xp, q, k, d):
    """``sum_c q_ic k_jc D_ijc`` for ``D (..., n, m, e)``: a product when ``e`` is 1."""
    if d.shape[-1] == 1:
        return (q @ xp.matrix_transpose(k)) * d[..., 0]
    return xp.sum(q[..., :, None, :] * k[..., None, :, :] * d, axis=-1)


def _row_blocks(T):
    return [(r0, min(r0 + ROW_BLOCK, T)) for r0 in range(0, T, ROW_BLOCK)]


def _parallel(xp, q, k, v, a, s0, scale):
    T = q.shape[-2]
    outs = []
    for r0, r1 in _row_blocks(T):
        p, diff, after = segment_sums(xp, a, r0, r1)
        o = _scores(xp, q[..., r0:r1, :], k[..., :r1, :], causal_decay(xp, diff, r0)) @ v[..., :r1, :]
        if s0 is not None:
            o = o + (q[..., r0:r1, :] * xp.exp(after + p)) @ s0
        outs.append(o)
    o = scale * xp.concat(outs, axis=-2) if outs else xp.zeros_like(v)
    # S_T = exp(b_T) S_0 + sum_j (k_j * exp(b_T - b_j))^T v_j, exponents from the last row.
    s = _zeros_state(xp, q, v) if s0 is None else s0
    if T:
        p, diff, after = segment_sums(xp, a, T - 1, T)
        to_end = diff[..., 0, :, :]  # b_T - b_j, j = 0 .. T - 1, all <= 0 for a <= 0
        s = _decay_rows(s, xp.exp(after + p)[..., 0, :]) + \
            xp.matrix_transpose(k * xp.exp(to_end)) @ v
    return o, s


def _chunk(xp, q, k, v, a, s, scale, chunk, constant=False):
    # The whole chunks at once, then the last partial one (T need not be a multiple of C).
    T = q.shape[-2]
    s = _zeros_state(xp, q, v) if s is None else s
    # the groups' temporaries reused from group to group, not faulted in again (glibc trims
    # the heap's free top once it passes its first thresholds): a fresh process's GLA at
    # T = 16384, 8 heads, d = 64, 114-115 -> 101-103 ms of CPU a call, 9168 -> 528 faults
    keep_freed_memory(v)
    full = T - T % chunk
    outs = []
    for c0, c1, c in ((0, full, chunk), (full, T, T - full)):
        if c1 > c0:
            o, s = _chunks(xp, q[..., c0:c1, :], k[..., c0:c1, :], v[..., c0:c1, :],
                           a[..., c0:c1, :], s, c, scale, constant)
            outs.append(o)
    if not outs:
        return xp.zeros_like(v), s
    return (outs[0] if len(outs) == 1 else xp.concat(outs, axis=-2)), s


def _chunks(xp, q, k, v, a, s, c, scale, constant):
    """The chunk form on ``n`` whole chunks of ``c`` steps (``T = n c``).

    Batched over groups of chunks whose ``c x c`` scores fill about
    :data:`GROUP_ELEMENTS` (one batch of every chunk would make each temporary a trip
    through main memory): per group, the in-chunk scores
    (:func:`~attn_ref.recurrent.common.decayed_scores`), each chunk's contribution to
    the state and the read of the state entering each chunk are batched GEMMs; the
    hand-overs ``S <- exp(B) S + dS`` between chunks are the only sequential steps
    (:func:`~attn_ref.recurrent.common.chunk_states`; a scan of depth ``log2 n`` over
    all chunks, one group, when the arrays are lazy).

    ``constant``: the log decay is the same at every step (retention), so every chunk
    has the same running sums ``b``, decay matrix and scalings: they are computed once
    (``c^2`` exponentials per head instead of ``c^2`` per chunk), with ``scale`` folded
    into the two that multiply the output. Otherwise ``scale`` multiplies each group's
    ``q`` (in cache): a pass over the whole output afterwards would cost a trip through
    main memory and a fresh array's page faults.

    GLA's per-dimension decay is factored per chunk when it fits (``_factored_chunks``:
    one exponential per gate element gives the scores' factors and both scalings),
    else its scores are halved (:func:`~attn_ref.recurrent.common.decayed_scores`).

    Every GEMM is untransposed: ``K^T`` is copied row-major once per group
    (:func:`~attn_ref.recurrent.common.row_major_transpose`) and scaled in place by
    ``exp(B - b)`` for the state's update. A scalar decay is multiplied into the scores
    in place (:func:`~attn_ref.recurrent.common.scalar_decay_in_place`), and at
    ``c = 64 * 2^j`` both ``c x c`` products skip the blocks above the diagonal
    (``_causal_block_rows``). Where the library allows writes
    (``attn_ref._common.owned_writeable``), products go into the arrays this loop
    made and the groups' outputs into one array; elsewhere (JAX) they are new arrays
    and a concatenation. See :doc:`/recurrent` (Cost).
    """
    mt = xp.matrix_transpose
    qc, kc, vc, ac = (to_chunks(xp, x, c) for x in (q, k, v, a))
    n = qc.shape[-3]
    per = max(1, GROUP_ELEMENTS // (math.prod(qc.shape[:-3]) * c * max(c, qc.shape[-1])))
    if is_lazy(q):
        # One group: a compiler schedules the memory itself, and the hand-over between
        # groups would be a sequential chain again (see chunk_states).
        per = n

    # GLA's running sums of (c, dk) gates as one GEMM with the lower-triangular ones:
    # NumPy's cumulative sum along a non-last axis ran at a third of its rate (measured).
    ones = xp.astype(xp.arange(c)[None, :] <= xp.arange(c)[:, None], a.dtype) \
        if a.shape[-1] > 1 else None

    def gates(a_g):
        # b_i - b_start, anchored at each chunk's start
        b = xp.cumulative_sum(a_g, axis=-2) if ones is None else ones @ a_g
        last = b[..., -1:, :]  # the chunk's total log decay B
        # exp(b) scales q (the read of the entering state), exp(B - b) scales k (its
        # contribution to the next one), exp(B) the state itself: all exponents <= 0.
        return b, xp.exp(b), xp.exp(last - b), xp.exp(last[..., 0, :])[..., :, None]

    if constant:
        b, head, tail, decay = gates(ac[..., :1, :, :])
        dmat, head, tail = scale * scalar_decay_matrix(xp, b), scale * head, mt(tail)
    out, inplace = ChunkOutputs(xp, tuple(qc.shape[:-1]) + (vc.shape[-1],)), False
    span = None if is_lazy(q) else factor_span(xp, q.dtype)
    for g0 in range(0, n, per):
        g1 = min(g0 + per, n)
        cut = (..., slice(g0, g1), slice(None), slice(None))
        qg, kg, vg = qc[cut], kc[cut], vc[cut]
        factored = None
        if ones is not None and span is not None:
            factored = _factored_chunks(xp, qg, kg, ones @ ac[cut], span)
        if factored is not None:
            scores, read_q, kt, decay = factored
            if g0 == 0:
                inplace = owned_writeable(kt)
            entering, s = chunk_states(xp, decay, kt @ vg, s)
            # scale on the group's output, in place and in cache
            o = mul_into(add_into(scores @ vg, read_q @ entering), scale)
            out.add(o, g0, g1, inplace)
            continue
        if not constant:
            # scale on q here, in cache, rather than a pass over the whole output after
            qg = scale * qg
        # K^T of the group in row-major order: Q K^T and (K^T * exp(B - b)) V are then
        # untransposed GEMMs (row_major_transpose), and the copy is ours to scale in place.
        kt = row_major_transpose(xp, kg)
        if g0 == 0:
            inplace = owned_writeable(kt)
        if constant:
            scores = mul_into(qg @ kt, dmat)
        else:
            b, head, tail, decay = gates(ac[cut])
            tail = mt(tail)
            if b.shape[-1] == 1 and inplace and _block_rows_fit(c):
                scores = None
                o = _causal_block_rows(xp, qg, kt, vg, b)
            elif b.shape[-1] == 1 and inplace:
                scores = scalar_decay_in_place(xp, qg @ kt, b)
            elif b.shape[-1] == 1:
                scores = (qg @ kt) * scalar_decay_matrix(xp, b)
            else:
                scores = decayed_scores(xp, qg, kg, b)
        entering, s = chunk_states(xp, decay, mul_into(kt, tail) @ vg, s)
        if scores is not None:
            o = scores @ vg
        # a scalar decay scales rows: after the product, in place (no scaled copy of q)
        read = mul_into(qg @ entering, head) if head.shape[-1] == 1 else (qg * head) @ entering
        o = add_into(o, read)
        out.add(o, g0, g1, inplace)
    return out.joined(), s


def _factored_chunks(xp, q, k, b, span):
    """GLA's in-chunk scores, the read operand ``q * exp(b)``, the update operand
    ``(k * exp(B - b))^T`` (row-major) and the hand-over decay ``exp(B)`` of a group of
    chunks, all from one exponential per element: or None if a chunk decays by more
    than ``2 span`` in some dimension.

    Every chunk is factored through the reference point ``r`` midway between its first
    and last running sums (per dimension), ``e = exp(b - r)``: the scores are
    ``(q * e) (k / e)^T`` masked (:func:`~attn_ref.recurrent.common.decayed_scores`
    with its block factored whole), ``q * exp(b) = (q * e) exp(r)`` and
    ``k * exp(B - b) = (k / e) exp(B - r)``. ``|b - r| <= span`` is checked on the
    values: with ``span`` from :func:`~attn_ref.recurrent.common.factor_span` no factor
    leaves ``[max^(-1/2), max^(1/2)]`` times its input. ``c dk`` exponentials per chunk
    instead of the halving's ``c dk log2 c`` and the two scalings' ``2 c dk``; fla's
    gates (``logsigmoid(randn)``) decay a 64-step chunk by about 51, at most 73 in the
    benchmark's draw (float32's limit is 88.7). See :doc:`/recurrent` (Cost).
    """
    c = q.shape[-2]
    dev = array_api_compat.device(q)
    mt = xp.matrix_transpose
    last = b[..., -1:, :]
    r = (b[..., :1, :] + last) / 2
    # the per-chunk factors, before b is overwritten: exp(r), exp(B - r), exp(B)
    e_r, e_last, decay = xp.exp(r), xp.exp(last - r), xp.exp(last[..., 0, :])[..., :, None]
    dn = add_into(b, -r)  # b - r, in b's place where it may be: b is ours
    # compared as arrays: float() of a tensor that records gradients warns in torch
    if bool(xp.max(dn) > span) or bool(xp.min(dn) < -span):
        return None
    e = xp.exp(dn)
    # (k exp(r - b))^T: K^T copied row-major (row_major_transpose), divided in place
    kt = row_major_transpose(xp, k)
    kt = kt / mt(e) if not owned_writeable(kt) else _div_into(kt, mt(e))
    qe = mul_into(e, q)  # q exp(b - r), in e's place
    keep = xp.arange(c, device=dev)[None, :] <= xp.arange(c, device=dev)[:, None]
    # a select, not a product with 0/1: above the diagonal the entries are finite but
    # not bounded by q . k
    scores = xp.where(keep, qe @ kt, 0.0)
    read_q = mul_into(qe, e_r)
    kt = mul_into(kt, mt(e_last))
    return scores, read_q, kt, decay


def _div_into(x, y):
    x /= y
    return x


def _block_rows_fit(c):
    # C = DECAY_LEAF * 2^j, j >= 1: the halving of scalar_decay_in_place then splits at
    # block-row boundaries, so it reads only blocks _causal_block_rows wrote.
    j = c // DECAY_LEAF
    return c % DECAY_LEAF == 0 and j > 1 and j & (j - 1) == 0


def _causal_block_rows(xp, q, kt, v, b):
    """``(Q K^T * D) V`` for a chunk of ``C = 64 * 2^j`` steps, without the blocks above
    the diagonal: rows in blocks of ``L =`` :data:`DECAY_LEAF`, block row ``I`` against
    the keys ``0 .. (I + 1) L`` in both GEMMs, the decay multiplied in place
    (:func:`~attn_ref.recurrent.common.scalar_decay_in_place`). ``(C/L + 1) / (2 C/L)``
    of the two whole ``C x C`` products (5/8 at Mamba-2's ``C = 256``), each block row
    one GEMM batched over heads and chunks. ``kt`` is ``K^T`` row-major (untransposed
    GEMMs on its column slices).
    """
    c, lead = q.shape[-2], tuple(q.shape[:-2])
    dev = array_api_compat.device(q)
    rows = [(r0, r0 + DECAY_LEAF) for r0 in range(0, c, DECAY_LEAF)]
    scores = xp.empty(lead + (c, c), dtype=q.dtype, device=dev)
    for r0, r1 in rows:
        scores[..., r0:r1, :r1] = q[..., r0:r1, :] @ kt[..., :r1]
    scalar_decay_in_place(xp, scores, b, upper=False)
    o = xp.empty(lead + (c, v.shape[-1]), dtype=q.dtype, device=dev)
    for r0, r1 in rows:
        o[..., r0:r1, :] = scores[..., r0:r1, :r1] @ v[..., :r1, :]
    return o



def _run(inp, a, s0, constant):
    xp, form = inp.xp, inp.form

    def one(q, k, v, steps, s):
        if form == "recurrent":
            return _recurrent(xp, q, k, v, steps["a"], s, inp.scale)
        if form == "parallel":
            return _parallel(xp, q, k, v, steps["a"], s, inp.scale)
        return _chunk(xp, q, k, v, steps["a"], s, inp.scale, inp.chunk_size, constant)

    return one


def _decayed(inp, q, a, initial_state, cu_seqlens, constant=False):
    cu = check_cu_seqlens(cu_seqlens, inp)
    s0 = check_state("initial_state", initial_state, inp, None if cu is None else len(cu) - 1,
                     like=q)
    o, s = packed(_run(inp, a, s0, constant), inp, {"a": a}, s0, cu)
    return finish(inp, o, s)


def decayed_weights(q, k, a, /, *, scale):
    """The implied ``(..., T, T)`` matrix of :func:`decayed_attention` (zero initial state).

    ``W_ij = scale sum_c q_ic k_jc exp(b_ic - b_jc)`` for ``j <= i``, 0 above the diagonal.
    """
    xp = array_api_compat.array_namespace(q, k, a)
    T = q.shape[-2]
    rows = []
    for r0, r1 in _row_blocks(T):
        _, diff, _ = segment_sums(xp, a, r0, r1)
        w = _scores(xp, q[..., r0:r1, :], k[..., :r1, :], causal_decay(xp, diff, r0))
        pad = xp.zeros(tuple(w.shape[:-1]) + (T - r1,), dtype=w.dtype, device=_device(w))
        rows.append(xp.concat([w, pad], axis=-1))
    if not rows:
        return xp.zeros(tuple(q.shape[:-1]) + (0,), dtype=q.dtype, device=_device(q))
    return scale * xp.concat(rows, axis=-2)


# ------------------------------------------------------------------------------ variants

_COMMON_DOC = """
    q : array, shape (..., T, dk)
    k : array, shape (..., T, dk)
    v : array, shape (..., T, dv)
    scale : float, optional
        Multiplies ``q``; default ``dk ** -0.5``.
    initial_state : array, optional
        ``S_0``, shape ``(..., dk, dv)``; with ``cu_seqlens`` ``(n_seq, *rest, dk, dv)``
        (one per packed sequence, see :mod:`attn_ref.recurrent.common`). Default zeros.
    output_final_state : bool
        Also return ``S_T`` (per sequence with ``cu_seqlens``).
    cu_seqlens : sequence of int or 1-D integer array, optional
        ``[0, t_1, ..., T]``: packed sequences along ``T``; ``q`` is then ``(1, *rest, T,
        dk)``. The state restarts at each boundary.
    form : {"chunk", "parallel", "recurrent"}
        How to compute it (the same function; see the module docstring).
    chunk_size : int
        ``C`` of the chunk form; ``T`` need not be a multiple.
    causal : True
        These are causal by construction; ``True`` (or either alignment, the same for
        ``Nq == Nk``) is accepted for the generic callers, ``False`` is a ``ValueError``.

    Returns
    -------
    o : array, shape (..., T, dv)
        In the input dtype (float16/bfloat16 inputs are computed in float32).
    S_T : array, shape (..., dk, dv)
        Only with ``output_final_state=True``: ``(o, S_T)``, in the working dtype.
"""


def _documented(fn):
    """Put the parameters every function of this module shares into ``fn``'s docstring."""
    fn.__doc__ = fn.__doc__.replace("    <common parameters>\n", _COMMON_DOC.lstrip("\n"))
    return fn


def _gate_inputs(fn, q, k, v, scale, form, chunk_size, output_final_state, causal, xp):
    return check_inputs(fn, q, k, v, scale=scale, form=form, chunk_size=chunk_size,
                        output_final_state=output_final_state, causal=causal, xp=xp)


def retention_log_decay(inp, gamma, q):
    """Retention's decay as log gates ``batch + (T, 1)``: ``gamma`` in (0, 1], a Python
    float or an array of the leading shape of ``q`` (one decay per head); ``q`` names the
    library and device an array ``gamma`` must share; ``inp`` as
    :func:`attn_ref.recurrent.common.check_inputs` returns it."""
    xp = inp.xp
    full = inp.batch + (inp.T, 1)
    if not array_api_compat.is_array_api_obj(gamma):
        g = check_real("gamma", gamma, "a decay in (0, 1]")
        if not 0.0 < g <= 1.0:
            raise ValueError(f"gamma must be a decay in (0, 1], got gamma={gamma!r}")
        return xp.full(full, math.log(g), dtype=inp.wdt, device=inp.device)
    check_array("gamma", gamma, like=q)
    lead = tuple(gamma.shape)
    if len(lead) > len(inp.batch) or any(
            n not in (1, m) for n, m in zip(lead[::-1], inp.batch[::-1])):
        raise ValueError(f"gamma must be a float or an array of the leading shape of q, k, v "
                         f"{inp.batch} (one decay per head), got shape {lead}")
    g = gamma if gamma.dtype == inp.wdt else xp.astype(gamma, inp.wdt)
    return xp.broadcast_to(xp.log(g)[..., None, None], full)


@_documented
def retention(q, k, v, /, *, gamma, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, form="chunk", chunk_size=64, causal=True, xp=None):
    """Retention (RetNet): linear attention with a fixed decay ``gamma`` per head.

    ``S_t = gamma S_{t-1} + k_t^T v_t``, ``o_t = scale q_t S_t``; equivalently
    ``O = scale (Q K^T * D) V`` with ``D_ij = gamma^(i - j)`` for ``j <= i``.

    Parameters
    ----------
    gamma : float or array
        The decay, in ``(0, 1]``: a Python float, or an array broadcastable to the
        leading shape of ``q`` (one per head; RetNet uses ``1 - 2^(-5 - h)``). Array
        values are not checked (so the function traces under ``jax.jit``).
    <common parameters>

    Notes
    -----
    Chunk form ``O(T C dk + T dk dv)`` time, ``O(C^2 + dk dv)`` extra memory per head.
    Sun et al., *Retentive Network: A Successor to Transformer for Large Language Models*,
    2023. RetNet's group norm and swish gate are layers around this, not part of it.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.recurrent import retention
    >>> x = xp.reshape(xp.sin(xp.arange(40.0)), (10, 4))
    >>> a = retention(x, x, x, gamma=0.9, chunk_size=3)
    >>> b = retention(x, x, x, gamma=0.9, form="recurrent")
    >>> bool(xp.max(xp.abs(a - b)) < 1e-13)
    True
    """
    inp = _gate_inputs("retention", q, k, v, scale, form, chunk_size, output_final_state, causal,
                       xp)
    return _decayed(inp, q, retention_log_decay(inp, gamma, q), initial_state, cu_seqlens,
                    constant=True)


def retention_weights(q, k, /, *, gamma, scale=None, form="chunk", chunk_size=64, causal=True, xp=None):
    """The implied ``(..., T, T)`` matrix of :func:`retention` with a zero initial state."""
    inp = _gate_inputs("retention_weights", q, k, k[..., :1], scale, "chunk", 1, False, causal,
                       xp)
    w = decayed_weights(inp.q, inp.k, retention_log_decay(inp, gamma, q), scale=inp.scale)
    return w if w.dtype == inp.dtype else inp.xp.astype(w, inp.dtype)


@_documented
def gated_linear_attention(q, k, v, /, *, g, scale=None, initial_state=None,
                           output_final_state=False, cu_seqlens=None, form="chunk", chunk_size=64,
                           causal=True, xp=None):
    """Gated linear attention (GLA): a data-dependent decay per key dimension.

    ``S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t``, ``o_t = scale q_t S_t``.

    Parameters
    ----------
    g : array, shape (..., T, dk)
        Log gates (``<= 0``; fla's GLA uses ``logsigmoid(x) / 16``), leading dims
        broadcastable to those of ``q``. fla's ``gk``.
    <common parameters>

    Notes
    -----
    Chunk form ``O(T C (dk + dv) + T dk dv)`` time and ``O(T dk)`` exponentials: the
    per-dimension decay does not factor out of ``q . k`` but through a reference point
    per chunk and dimension, ``(q exp(b - r)) (k exp(r - b))^T``, when the chunk's decay
    fits the float range (``log(max)``: 88.7 in float32; fla's gates decay 64 steps by
    about 51); otherwise the intra-chunk scores are computed by halving through
    reference points (:func:`~attn_ref.recurrent.common.decayed_scores`), GEMMs whose
    exponents are all ``<= 0``, ``O(T dk log C)`` exponentials. ``O(C^2 + dk dv)``
    extra memory per head.
    Yang et al., *Gated Linear Attention Transformers with Hardware-Efficient Training*,
    ICML 2024.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.recurrent import gated_linear_attention
    >>> x = xp.reshape(xp.sin(xp.arange(40.0)), (10, 4))
    >>> g = -xp.abs(xp.reshape(xp.cos(xp.arange(40.0)), (10, 4)))
    >>> a = gated_linear_attention(x, x, x, g=g, chunk_size=4)
    >>> b = gated_linear_attention(x, x, x, g=g, form="parallel")
    >>> bool(xp.max(xp.abs(a - b)) < 1e-13)
    True
    """
    inp = _gate_inputs("gated_linear_attention", q, k, v, scale, form, chunk_size,
                       output_final_state, causal, xp)
    a = check_step_input("g", g, inp, (inp.dk,), "(..., T, dk)", like=q)
    return _decayed(inp, q, a, initial_state, cu_seqlens)


def gated_linear_attention_weights(q, k, /, *, g, scale=None, form="chunk", chunk_size=64,
                                   causal=True, xp=None):
    """The implied ``(..., T, T)`` matrix of :func:`gated_linear_attention` (zero initial state)."""
    inp = _gate_inputs("gated_linear_attention_weights", q, k, k[..., :1], scale, "chunk", 1,
                       False, causal, xp)
    a = check_step_input("g", g, inp, (inp.dk,), "(..., T, dk)", like=q)
    w = decayed_weights(inp.q, inp.k, a, scale=inp.scale)
    return w if w.dtype == inp.dtype else inp.xp.astype(w, inp.dtype)


@_documented
def ssd(q, k, v, /, *, g, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, form="chunk", chunk_size=64, causal=True, xp=None):
    """Mamba-2's state space duality (SSD): a data-dependent scalar decay per step.

    ``S_t = exp(g_t) S_{t-1} + k_t^T v_t``, ``o_t = scale q_t S_t`` (fla's simple GLA).

    In Mamba-2's names (Dao & Gu 2024, per head): ``q = C``, ``k = B``, ``v = X * dt``
    (the input scaled by its step size), ``g = A * dt`` (``A < 0``), ``scale = 1``, and
    the state is ``h^T`` (Mamba-2's ``(P, N)`` state is ``(dv, dk)``). The skip term
    ``D * X`` and the output gate are outside the SSD. See :doc:`/recurrent`.

    Parameters
    ----------
    g : array, shape (..., T)
        Log decays (``<= 0``), leading dims broadcastable to those of ``q``.
    <common parameters>

    Notes
    -----
    Chunk form ``O(T C (dk + dv) + T dk dv)`` time, ``O(C^2 + dk dv)`` extra memory per
    head. Dao & Gu, *Transformers are SSMs: Generalized Models and Efficient Algorithms
    Through Structured State Space Duality*, ICML 2024.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.recurrent import ssd
    >>> x = xp.reshape(xp.sin(xp.arange(40.0)), (10, 4))
    >>> g = -xp.abs(xp.cos(xp.arange(10.0)))
    >>> o, s = ssd(x, x, x, g=g, output_final_state=True)
    >>> o.shape, s.shape
    ((10, 4), (4, 4))
    """
    inp = _gate_inputs("ssd", q, k, v, scale, form, chunk_size, output_final_state, causal, xp)
    a = check_step_input("g", g, inp, (), "(..., T)", like=q)
    return _decayed(inp, q, a[..., None], initial_state, cu_seqlens)


def ssd_weights(q, k, /, *, g, scale=None, form="chunk", chunk_size=64, causal=True, xp=None):
    """The implied ``(..., T, T)`` matrix of :func:`ssd` (zero initial state)."""
    inp = _gate_inputs("ssd_weights", q, k, k[..., :1], scale, "chunk", 1, False, causal, xp)
    a = check_step_input("g", g, inp, (), "(..., T)", like=q)
    w = decayed_weights(inp.q, inp.k, a[..., None], scale=inp.scale)
    return w if w.dtype == inp.dtype else inp.xp.astype(w, inp.dtype)
