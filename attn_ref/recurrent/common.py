"""Input checks, working precision, packed sequences and states shared by the recurrent forms.

Every function of :mod:`attn_ref.recurrent` takes ``q (..., T, dk)``, ``k (..., T, dk)``,
``v (..., T, dv)`` and carries a state ``S (..., dk, dv)`` (flash-linear-attention's
``K x V`` layout). The helpers here check those inputs and the per-step ones (gates,
``beta``), choose the precision the state is accumulated in, and run a single-sequence
form over packed variable-length sequences (``cu_seqlens``).

Packed sequences
----------------
``cu_seqlens = [0, t_1, ..., T]`` cuts the ``T`` axis into ``n_seq`` sequences that are
processed independently: the state restarts from that sequence's initial state at each
boundary. As in flash-linear-attention, whose kernels take ``q (1, T, H, K)`` with
``cu_seqlens``, the first leading dimension is the packing axis and must be 1: ``q`` is
``(1, *rest, T, dk)`` and the initial and final states are ``(n_seq, *rest, dk, dv)``
(fla's ``(N, H, K, V)``). ``cu_seqlens`` is read on the host (the boundaries decide the
loop), so a call with it cannot be traced by ``jax.jit``.

Precision
---------
float16 and bfloat16 inputs are computed in float32: the state sums up to ``T`` outer
products and the cumulative log-gates are sums of up to ``T`` terms, which half precision
cannot hold (bfloat16 has 8 significant bits). The output is cast back to the input dtype;
the final state is returned in float32, as fla's kernels return it.
"""

from __future__ import annotations

import math

import array_api_compat

from .._checks import (
    broadcast_batch,
    check_array,
    check_flag,
    check_positive_int,
    check_qkv,
    default_scale,
    is_integer,
)
from .._common import add_into, is_lazy, owned_writeable

__all__ = [
    "FORMS",
    "Inputs",
    "working_dtype",
    "check_inputs",
    "check_step_input",
    "check_state",
    "check_cu_seqlens",
    "packed",
    "finish",
    "segment_sums",
    "causal_decay",
    "to_chunks",
    "ChunkOutputs",
    "from_chunks",
    "row_major_transpose",
    "scalar_decay_matrix",
    "scalar_decay_in_place",
    "factor_span",
    "decayed_scores",
    "forward_substitution",
    "unit_lower_inverse",
    "chunk_states",
]

#: The three forms of every variant, in the order of the docs.
FORMS = ("recurrent", "parallel", "chunk")


def working_dtype(xp, dtype):
    """float32 for float16/bfloat16 inputs (see the module docstring), else ``dtype``."""
    low = [getattr(xp, name) for name in ("float16", "bfloat16") if hasattr(xp, name)]
    return xp.float32 if any(dtype == t for t in low) else dtype


class Inputs:
    """The checked inputs of one call, in the working dtype (plain attributes)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def _check_causal(fn, causal):
    # Causal by construction: True and both alignments (equal when Nq == Nk) are the
    # only meaning these functions have; False is refused rather than ignored.
    if causal is True or causal in ("top-left", "bottom-right"):
        return
    raise ValueError(f"{fn} is causal by construction (a recurrence over time); causal must "
                     f"be True, 'top-left' or 'bottom-right', got causal={causal!r}")


def check_inputs(fn, q, k, v, *, scale, form, chunk_size, output_final_state, causal, xp):
    """Check ``q, k, v`` and the options every recurrent function shares.

    Returns an :class:`Inputs` with ``xp``, ``batch`` (broadcast leading shape), ``T``,
    ``dk``, ``dv``, ``dtype`` (the input dtype), ``wdt`` (the working dtype), ``scale``,
    ``form``, ``chunk_size``, ``output_final_state``, ``device`` and ``q, k, v``
    broadcast to ``batch`` and cast to ``wdt`` (new arrays; the inputs are untouched).
    """
    _check_causal(fn, causal)
    xp, batch = check_qkv(q, k, v, xp=xp, same_length=True)
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got form={form!r}")
    chunk_size = check_positive_int("chunk_size", chunk_size)
    output_final_state = check_flag("output_final_state", output_final_state)
    T, dk, dv = q.shape[-2], q.shape[-1], v.shape[-1]
    wdt = working_dtype(xp, q.dtype)

    def prep(x, tail):
        x = xp.broadcast_to(x, tuple(batch) + tail)
        return x if x.dtype == wdt else xp.astype(x, wdt)

    return Inputs(xp=xp, batch=tuple(batch), T=T, dk=dk, dv=dv, dtype=q.dtype, wdt=wdt,
                  scale=default_scale(dk, scale), form=form, chunk_size=chunk_size,
                  output_final_state=output_final_state, device=array_api_compat.device(q),
                  q=prep(q, (T, dk)), k=prep(k, (T, dk)), v=prep(v, (T, dv)))


def check_step_input(name, x, inp, tail, want, *, like):
    """A per-step input (a gate, ``beta``) of shape ``(..., T) + tail``.

    Its leading dimensions must broadcast to the leading shape of ``q, k, v`` without
    enlarging it (so a gate shared by every head is ``(T,)``). Returns it broadcast to
    ``batch + (T,) + tail`` in the working dtype.
    """
    xp = inp.xp
    check_array(name, x, like=like)
    full = inp.batch + (inp.T,) + tuple(tail)
    n = 1 + len(tail)
    shape = tuple(x.shape)
    lead = shape[:-n] if x.ndim >= n else None
    ok = lead is not None and shape[-n:] == full[-n:] and len(lead) <= len(inp.batch)
    if ok:
        try:
            ok = broadcast_batch([("batch", inp.batch), (name, lead)]) == inp.batch
        except ValueError:
            ok = False
    if not ok:
        raise ValueError(f"{name} must have shape {want} = {full} (leading dimensions "
                         f"broadcastable to those of q, k, v), got shape {shape}")
    x = xp.broadcast_to(x, full)
    return x if x.dtype == inp.wdt else xp.astype(x, inp.wdt)


def check_state(name, s, inp, n_seq, *, like):
    """``initial_state``: None, or ``batch + (dk, dv)`` (packed: ``(n_seq, *rest, dk, dv)``).

    Returns None or the state in the working dtype, shaped ``(n_seq, *rest, dk, dv)``
    when packed and ``batch + (dk, dv)`` otherwise.
    """
    if s is None:
        return None
    xp = inp.xp
    check_array(name, s, like=like)
    if n_seq is None:
        want, what = inp.batch + (inp.dk, inp.dv), "(..., dk, dv)"
    else:
        want, what = (n_seq,) + inp.batch[1:] + (inp.dk, inp.dv), "(n_seq, *rest, dk, dv)"
    if tuple(s.shape) != want:
        raise ValueError(f"{name} must have shape {what} = {want} (leading dims of q, k, v "
                         f"{inp.batch}, dk={inp.dk}, dv={inp.dv}), got shape {tuple(s.shape)}")
    return s if s.dtype == inp.wdt else xp.astype(s, inp.wdt)


def check_cu_seqlens(cu_seqlens, inp):
    """``cu_seqlens`` as a host list ``[0, t_1, ..., T]`` (strictly increasing), or None.

    Accepts a sequence of integers or a 1-D integer array of any library (read on the
    host). Packing needs a leading packing axis of size 1 (see the module docstring).
    """
    if cu_seqlens is None:
        return None
    if array_api_compat.is_array_api_obj(cu_seqlens):
        xp = array_api_compat.array_namespace(cu_seqlens)
        if cu_seqlens.ndim != 1 or not xp.isdtype(cu_seqlens.dtype, "integral"):
            raise TypeError(f"cu_seqlens must be a 1-D integer array [0, t_1, ..., T], got "
                            f"shape {tuple(cu_seqlens.shape)} and dtype {cu_seqlens.dtype}")
        values = [int(cu_seqlens[i]) for i in range(cu_seqlens.shape[0])]
    else:
        try:
            values = list(cu_seqlens)
        except TypeError:
            raise TypeError(f"cu_seqlens must be a sequence or 1-D integer array "
                            f"[0, t_1, ..., T], got {type(cu_seqlens).__name__}") from None
        if not all(is_integer(x) for x in values):
            raise TypeError(f"cu_seqlens must hold integers, got {values!r}")
        values = [int(x) for x in values]
    if len(values) < 2 or values[0] != 0 or values[-1] != inp.T:
        raise ValueError(f"cu_seqlens must start at 0 and end at T={inp.T} (the length of q, k, "
                         f"v), got {values}")
    if any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError(f"cu_seqlens must be strictly increasing (no empty sequence), got "
                         f"{values}")
    if not inp.batch or inp.batch[0] != 1:
        raise ValueError(f"with cu_seqlens, q, k and v must be (1, *rest, T, d) (a packing axis "
                         f"of size 1, as fla's B = 1), got leading dimensions {inp.batch}")
    return values


def packed(run, inp, steps, state, cu):
    """Run ``run(q, k, v, steps, state) -> (o, S_T)`` on each packed sequence.

    ``steps`` maps names to per-step arrays ``batch + (T, ...)``; ``state`` is None or
    the checked initial state. Without ``cu`` this is one call. With it, each sequence
    gets its slice of every input and its own initial state (row ``i`` of ``state``);
    outputs are concatenated along ``T`` and final states stacked along the packing axis.
    """
    if cu is None:
        return run(inp.q, inp.k, inp.v, steps, state)
    xp = inp.xp
    outs, finals = [], []
    nb = len(inp.batch)
    for i, (a, b) in enumerate(zip(cu, cu[1:])):
        def cut(x, a=a, b=b):
            return x[(slice(None),) * nb + (slice(a, b), ...)]
        s0 = None if state is None else state[i:i + 1, ...]
        o, s = run(cut(inp.q), cut(inp.k), cut(inp.v), {n: cut(x) for n, x in steps.items()}, s0)
        outs.append(o)
        finals.append(s)
    return xp.concat(outs, axis=-2), xp.concat(finals, axis=0)


def finish(inp, o, s):
    """The return value: ``o`` in the input dtype, and ``S_T`` when asked for."""
    xp = inp.xp
    o = o if o.dtype == inp.dtype else xp.astype(o, inp.dtype)
    return (o, s) if inp.output_final_state else o


def segment_sums(xp, a, r0, r1):
    """Exponents ``b_i - b_j = sum_{j < s <= i} a_s`` for rows ``r0 <= i < r1``, keys ``j < r1``.

    ``a (..., T, e)`` holds log decays and ``b`` their running sum. Both sides are
    summed from the anchor ``r0``: ``P_i = sum_{r0 <= s <= i} a_s`` for the rows and
    ``K_j = P_j`` (``j >= r0``) or ``-sum_{j < s < r0} a_s`` (``j < r0``) for the keys,
    and the result is ``P_i - K_j``. A global running sum would give the same value as
    the difference of two numbers of size ``|b_T|`` (``-20480`` for ``T = 4096`` steps of
    ``-5``), losing ``eps |b_T|`` of every exponent; anchored, a nearby pair is summed
    over the few steps between them.

    Returns ``(P, diff, after)``: ``P (..., r1 - r0, e)``, ``diff (..., r1 - r0, r1, e)``,
    and ``after = sum_{s < r0} a_s (..., 1, e)`` so that ``b_i = after + P_i``. Entries
    with ``j > i`` are finite (the decay from ``i`` to ``j``) and must be masked *before*
    any ``exp`` (see :func:`causal_decay`).
    """
    nb = a.ndim - 2
    rows = a[(slice(None),) * nb + (slice(r0, r1), slice(None))]
    p = xp.cumulative_sum(rows, axis=-2)
    if r0 > 0:
        before = a[(slice(None),) * nb + (slice(1, r0), slice(None))]
        # -sum_{j < s < r0} a_s for j = 0 .. r0 - 1: a reversed running sum, 0 for r0 - 1.
        rev = xp.flip(xp.cumulative_sum(xp.flip(before, axis=-2), axis=-2, include_initial=True),
                      axis=-2)
        keys = xp.concat([-rev, p], axis=-2)
        after = xp.sum(a[(slice(None),) * nb + (slice(0, r0), slice(None))], axis=-2,
                       keepdims=True)
    else:
        keys = p
        after = xp.zeros_like(p[..., :1, :])
    diff = p[..., :, None, :] - keys[..., None, :, :]
    return p, diff, after


def causal_decay(xp, diff, r0):
    """``exp(diff)`` where key ``j <= i`` (row ``i = r0 + row index``), exactly 0 elsewhere.

    The mask is applied to the exponent (``-inf``), never to the result: for ``j > i``
    the exponent is positive and can overflow to ``inf``, and ``inf * 0`` is NaN.
    """
    nr, nk = diff.shape[-3], diff.shape[-2]
    dev = array_api_compat.device(diff)
    i = xp.arange(r0, r0 + nr, device=dev)[:, None]
    j = xp.arange(nk, device=dev)[None, :]
    keep = (j <= i)[:, :, None]
    return xp.exp(xp.where(keep, diff, xp.full_like(diff, -xp.inf)))


def to_chunks(xp, x, c):
    """``(..., n c, e) -> (..., n, c, e)``: consecutive chunks of ``c`` steps as a batch axis."""
    return xp.reshape(x, tuple(x.shape[:-2]) + (x.shape[-2] // c, c, x.shape[-1]))


def from_chunks(xp, x):
    """``(..., n, c, e) -> (..., n c, e)``, the inverse of :func:`to_chunks`."""
    return xp.reshape(x, tuple(x.shape[:-3]) + (x.shape[-3] * x.shape[-2], x.shape[-1]))


class ChunkOutputs:
    """The outputs of a chunk form's groups of chunks, joined into ``(..., n C, e)``.

    Each group's ``(..., g, C, e)`` output is written into one array as it is made,
    while it is in cache: collected and concatenated, the groups would make a second
    trip through memory. Arrays that cannot be written (JAX; ``inplace`` False) are
    concatenated at the end, and a single group is taken as it is.

    Parameters
    ----------
    xp : namespace
    shape : tuple of int
        ``(..., n, C, e)``, the chunked output.
    """

    def __init__(self, xp, shape):
        self.xp, self.shape, self.out = xp, tuple(shape), None

    def add(self, o, g0, g1, inplace):
        """Chunks ``g0:g1`` of the output, ``o (..., g1 - g0, C, e)``."""
        if g0 == 0 and g1 == self.shape[-3]:
            self.out = o
        elif inplace:
            if self.out is None:
                self.out = self.xp.empty(self.shape, dtype=o.dtype,
                                         device=array_api_compat.device(o))
            self.out[..., g0:g1, :, :] = o
        else:
            self.out = (self.out or []) + [o]

    def joined(self):
        """The output ``(..., n C, e)``."""
        out = self.out
        return from_chunks(self.xp, self.xp.concat(out, axis=-3) if isinstance(out, list) else out)


def row_major_transpose(xp, x):
    """``matrix_transpose(x)`` as a fresh row-major array, so that ``a @ x^T`` is a plain GEMM.

    NumPy passes ``a @ matrix_transpose(x)`` to BLAS as a transposed operand, and
    OpenBLAS (0.3.31, single thread) ran those products of ``64 x 64`` blocks at about
    half the rate of untransposed ones: ``Q K^T`` over ``(8, 256, 64, 64)`` chunks took
    33.8 ms against 17.9 with ``K^T`` copied first (the copy is ``c d`` moves per block,
    the GEMM ``2 c^2 d`` flops; see :doc:`/recurrent`, Cost). A lazy array keeps the view:
    its compiler chooses the layouts.
    """
    t = xp.matrix_transpose(x)
    return t if is_lazy(x) else xp.reshape(t, tuple(t.shape), copy=True)


def scalar_decay_matrix(xp, b):
    """``exp(b_i - b_j)`` for ``j <= i``, exactly 0 above: ``b (..., c, 1)`` -> ``(..., c, c)``.

    ``b`` holds running sums of scalar log decays (any anchor). The mask is applied to
    the exponent (a scalar ``-inf``, no full temporary), never to the result: above the
    diagonal the exponent is positive and may overflow.
    """
    c = b.shape[-2]
    dev = array_api_compat.device(b)
    keep = xp.arange(c, device=dev)[None, :] <= xp.arange(c, device=dev)[:, None]
    # the mask added to the exponent, 0 or -inf, one (c, c) array broadcast: on NumPy a
    # select against a scalar over (8, 4, 64, 64) exponents took 1.8 times an add (measured)
    mask = xp.where(keep, xp.asarray(0.0, dtype=b.dtype, device=dev),
                    xp.asarray(-math.inf, dtype=b.dtype, device=dev))
    return xp.exp(add_into(b - xp.matrix_transpose(b), mask))


#: Diagonal blocks of at most this many steps take the pairwise decay matrix
#: (:func:`scalar_decay_in_place`).
DECAY_LEAF = 64


def scalar_decay_in_place(xp, s, b, lo=0, hi=None, *, upper=True):
    """``s *= exp(b_i - b_j)`` for ``j <= i``, ``s = 0`` above, on the block ``lo:hi``
    of ``s (..., c, c)``, in place (``s`` must be writeable), for running sums ``b (...,
    c, 1)`` of scalar log decays. ``upper=False`` leaves the upper quarters of halved
    blocks alone (a caller that never reads them need not have written them).

    The same as :func:`scalar_decay_matrix` (``c^2 / 2`` exponentials, all ``<= 0``)
    with fewer exponentials: a block of more than :data:`DECAY_LEAF` steps is halved,
    and its lower-left quarter, rows ``i >= m > j``, factors through the reference
    point ``r = b_{m-1}`` between them, ``exp(b_i - b_j) = exp(b_i - r) exp(r - b_j)``:
    two exponents ``<= 0`` (``b`` is non-increasing), ``c`` exponentials and ``c^2 / 4``
    products for the quarter instead of ``c^2 / 4`` exponentials (``exp`` costs about
    four products here). The two diagonal halves recurse; leaves take the pairwise
    matrix. At Mamba-2's ``C = 256``: 16384 exponentials per chunk instead of 65536.
    """
    hi = s.shape[-1] if hi is None else hi
    c = hi - lo
    if c <= DECAY_LEAF:
        s[..., lo:hi, lo:hi] *= scalar_decay_matrix(xp, b[..., lo:hi, :])
        return s
    m = lo + c // 2
    r = b[..., m - 1:m, :]
    s[..., m:hi, lo:m] *= xp.exp(b[..., m:hi, :] - r) * xp.matrix_transpose(
        xp.exp(r - b[..., lo:m, :]))
    if upper:
        s[..., lo:m, m:hi] = 0
    scalar_decay_in_place(xp, s, b, lo, m, upper=upper)
    return scalar_decay_in_place(xp, s, b, m, hi, upper=upper)


def factor_span(xp, dtype):
    """``log(max) / 2`` of ``dtype``: the widest decay (in log space) that one block may be
    factored through a single reference point (:func:`decayed_scores`). Both factors then
    lie within ``[max^(-1/2), max^(1/2)]`` times the input: about ``[7.7e-20, 1.3e19]``
    for float32 (span 44.4), ``[7.5e-155, 1.3e154]`` for float64 (span 354.9)."""
    return math.log(float(xp.finfo(dtype).max)) / 2


def decayed_scores(xp, q, k, b, *, span=None):
    """Causal decayed scores ``A_ij = sum_e q_ie k_je exp(b_ie - b_je)`` (``j <= i``, else 0).

    ``q, k (..., c, dk)`` and ``b (..., c, e)``: the running sums of the log decays
    from any anchor (only differences enter), ``e = 1`` (a scalar decay per step) or
    ``dk`` (GLA's per-key-dimension decay). Returns ``(..., c, c)``. Every exponent is
    ``b_i - b_j`` or a part of one with ``j <= i``, so it is ``<= 0`` for decays
    ``<= 0``: nothing overflows.

    A scalar decay factors out of the dot product: ``(Q K^T) * exp(b_i - b_j)``, one
    GEMM and ``c^2`` exponentials (masked to ``-inf`` above the diagonal before
    ``exp``). A per-dimension decay does not, and the pairwise ``(c, c, dk)`` form
    costs ``c^2 dk`` exponentials. Here it is computed by halving instead (the
    secondary chunking of flash-linear-attention's chunk GLA, applied recursively): the
    block of rows ``m..c`` against keys ``0..m`` factors through the reference point
    ``r = b_{m-1}`` between them,

        A_ij = (q_i * exp(b_i - r)) . (k_j * exp(r - b_j)),    i >= m > j,

    one GEMM whose two exponents are both ``<= 0`` (``b`` is non-increasing), and the
    two diagonal halves recurse (both halves of every chunk in one batch). Each of the
    ``log2 c`` levels takes ``c dk`` exponentials per chunk, ``O(c dk log c)`` in all
    instead of ``O(c^2 dk)``; the GEMMs add up to the causal half of ``Q K^T``.

    The halving stops at the first level whose blocks fit: every block of the batch
    is factored through a reference point ``r`` midway between its first and last
    running sums (per dimension) when ``|b - r| <= span`` throughout,

        A_ij = (q_i * exp(b_i - r)) . (k_j * exp(r - b_j)),    j <= i,

    one GEMM and ``2 c dk`` exponentials, masked after the product (a select: the
    entries above the diagonal are finite but unbounded by ``q . k``). Half of these
    exponents are positive, at most ``span``: with the default :func:`factor_span`
    neither factor leaves ``[max^(-1/2), max^(1/2)]`` times its input, so nothing
    overflows, and each term is the pairwise one up to the roundings of two
    exponentials of differences of running sums and two products, as the halving's.
    fla's gates (``logsigmoid(randn)``, about ``-0.8`` a step) decay a 64-step block by
    about 51, within float32's ``2 span = 88.7``: one level instead of six. ``span=0``
    always halves down to single steps; lazy arrays (``jax.jit``) always halve (the
    test reads values).
    See :doc:`/recurrent` (Cost).
    """
    c = q.shape[-2]
    dev = array_api_compat.device(q)
    if b.shape[-1] == 1:
        return (q @ xp.matrix_transpose(k)) * scalar_decay_matrix(xp, b)
    if c == 1:
        return xp.sum(q * k, axis=-1, keepdims=True)
    if span is None:
        span = factor_span(xp, b.dtype)
    if span > 0 and not is_lazy(q, k, b):
        # r midway between the block's first and last running sums, per dimension:
        # |b - r| is then half the block's decay for decays <= 0
        up = (b[..., :1, :] + b[..., -1:, :]) / 2 - b
        if float(xp.max(xp.abs(up))) <= span:
            a = (q * xp.exp(-up)) @ xp.matrix_transpose(k * xp.exp(up))
            keep = xp.arange(c, device=dev)[None, :] <= xp.arange(c, device=dev)[:, None]
            return xp.where(keep, a, 0.0)
    if c % 2:
        # An odd block: the last row pairwise (c dk exponentials), the rest halved.
        top = decayed_scores(xp, q[..., :-1, :], k[..., :-1, :], b[..., :-1, :], span=span)
        row = xp.sum(q[..., -1:, :] * k * xp.exp(b[..., -1:, :] - b), axis=-1)[..., None, :]
        pad = xp.zeros(tuple(top.shape[:-1]) + (1,), dtype=top.dtype, device=dev)
        return xp.concat([xp.concat([top, pad], axis=-1), row], axis=-2)
    m = c // 2
    ref = b[..., m - 1:m, :]
    low = (q[..., m:, :] * xp.exp(b[..., m:, :] - ref)) @ xp.matrix_transpose(
        k[..., :m, :] * xp.exp(ref - b[..., :m, :]))
    # Both halves of every block at once: (..., 2, m, d) -> their diagonal blocks.
    half = tuple(q.shape[:-2]) + (2, m)
    diag = decayed_scores(xp, xp.reshape(q, half + (q.shape[-1],)),
                          xp.reshape(k, half + (k.shape[-1],)),
                          xp.reshape(b, half + (b.shape[-1],)), span=span)
    zero = xp.zeros(tuple(low.shape), dtype=low.dtype, device=dev)
    return xp.concat([xp.concat([diag[..., 0, :, :], zero], axis=-1),
                      xp.concat([low, diag[..., 1, :, :]], axis=-1)], axis=-2)


def forward_substitution(xp, m, rhs):
    """``m^{-1} rhs`` for a unit lower-triangular ``m (..., c, c)``, blocked by halving.

    ``[A 0; C D] [x1; x2] = [r1; r2]`` gives ``x1 = A^{-1} r1`` and ``x2 = D^{-1} (r2 - C
    x1)``: forward substitution reordered so that its work (``c^2`` multiply-adds per
    column of ``rhs``, the least a triangular solve needs) is done by ``c - 1`` GEMMs,
    each batched over the leading dimensions, instead of ``c`` row steps or a general
    LU solve. Only matmul and concatenation: any dtype (NumPy's LAPACK has no long
    double) and any library.
    """
    c = m.shape[-1]
    if c == 1:
        return rhs
    h = c // 2
    x1 = forward_substitution(xp, m[..., :h, :h], rhs[..., :h, :])
    x2 = forward_substitution(xp, m[..., h:, h:], rhs[..., h:, :] - m[..., h:, :h] @ x1)
    return xp.concat([x1, x2], axis=-2)


def unit_lower_inverse(xp, m):
    """``(I + L)^{-1}`` for ``L`` the strictly lower triangle of ``m (..., c, c)``, by doubling.

    Only the strictly lower triangle of ``m`` is read (its diagonal and upper triangle
    may hold anything finite). The diagonal blocks of the inverse are built from size
    1 up, each level from the one below: for a diagonal block ``[A 0; C D]`` of size
    ``2h`` whose halves' inverses are known,

        [A 0; C D]^{-1} = [A^{-1} 0; -D^{-1} C A^{-1}  D^{-1}],

    two ``h x h`` GEMMs per block, batched over every block of every matrix at once:
    ``log2 c`` levels of about ten array calls each, ``c^3 / 3`` multiply-adds per
    matrix in all (the blocks are multiplied as dense ones; a triangular inverse needs
    ``c^3 / 6``). The blocks ``C`` are read in place, as the diagonal of a blocked view
    (``linalg.diagonal``), and each level's quarters are written into one fresh array
    where the library allows it (``owned_writeable``; a concatenation makes two more).
    Forward substitution (:func:`forward_substitution`) does ``c^2 / 2`` multiply-adds
    per right-hand column instead, the least work, but in
    ``c - 1`` GEMMs of mostly tiny blocks (one array call per block, one BLAS call per
    block and matrix): on ``(8, 256, 64, 64)`` float32 systems with a ``64 x 128``
    right-hand side, in groups of 2 to 32 chunks, the inverse and one GEMM took 63 to 91
    ms of CPU against 105 to 147 for the substitution (single-threaded OpenBLAS, load
    about 5; see :doc:`/recurrent`, Cost). As accurate on the delta rule's systems
    (``beta`` in (0, 1), unit keys): float64 and float32 chunk forms within 25% of the
    substitution's error against a long-double token loop; with unnormalised keys whose
    state grows to ``10^51`` up to twice its error (``5.1e-14`` against ``3.8e-14``).
    ``c`` that is not a power of two is padded with an identity block. Only matmul,
    views, ``linalg.diagonal`` and concatenation or item assignment: any real dtype
    (NumPy's long double too), any library.
    """
    c = m.shape[-1]
    p = 1 << (c - 1).bit_length() if c > 1 else 1
    lead = tuple(m.shape[:-2])
    nd = len(lead)
    dev = array_api_compat.device(m)
    if p != c:
        right = xp.zeros(lead + (c, p - c), dtype=m.dtype, device=dev)
        below = xp.zeros(lead + (p - c, p), dtype=m.dtype, device=dev)
        m = xp.concat([xp.concat([m, right], axis=-1), below], axis=-2)
    inv = xp.ones(lead + (p, 1, 1), dtype=m.dtype, device=dev)  # diagonal blocks of size 1
    # whether the levels' fresh arrays may be written, asked once, not per level: every
    # level's blocks are made from m (a graph recorded for m is recorded for them)
    writeable = owned_writeable(m)
    h = 1
    while h < p:
        nb = p // (2 * h)
        # m as (..., nb, 2h, nb, 2h) blocks; the diagonal blocks' lower-left quarters C.
        blocks = xp.permute_dims(xp.reshape(m, lead + (nb, 2 * h, nb, 2 * h)),
                                 tuple(range(nd)) + (nd + 1, nd + 3, nd, nd + 2))
        cb = xp.linalg.diagonal(blocks)[..., h:, :h, :]  # (..., h, h, nb)
        cb = xp.permute_dims(cb, tuple(range(nd)) + (nd + 2, nd, nd + 1))  # (..., nb, h, h)
        pair = xp.reshape(inv, lead + (nb, 2, h, h))
        a_inv, d_inv = pair[..., 0, :, :], pair[..., 1, :, :]
        # The diagonal of a unit triangular inverse is 1: at h = 1, -D^{-1} C A^{-1} = -C.
        low = -cb if h == 1 else -((d_inv @ cb) @ a_inv)
        if not writeable:
            zero = xp.zeros(tuple(low.shape), dtype=m.dtype, device=dev)
            inv = xp.concat([xp.concat([a_inv, zero], axis=-1), xp.concat([low, d_inv], axis=-1)],
                            axis=-2)
        else:
            # Quarters written into one fresh array: concatenating them makes two more.
            inv = xp.empty(lead + (nb, 2 * h, 2 * h), dtype=m.dtype, device=dev)
            inv[..., :h, :h] = a_inv
            inv[..., :h, h:] = 0
            inv[..., h:, :h] = low
            inv[..., h:, h:] = d_inv
        h *= 2
    inv = xp.reshape(inv, lead + (p, p))
    return inv if p == c else inv[..., :c, :c]


def chunk_states(xp, decay, inc, s, *, scan=None):
    """The states entering ``n`` consecutive chunks, and the state leaving the last.

    The hand-over ``S_{i+1} = decay_i S_i + inc_i`` with ``decay (..., n, e, 1)``, each
    chunk's total decay ``exp(B_i)`` per key dimension (``e = dk``) or scalar
    (``e = 1``; ``n = 1`` means the same for every chunk), ``inc (..., n, dk, dv)`` each
    chunk's own contribution and ``s (..., dk, dv)`` the state entering chunk 0.
    Returns ``(entering (..., n, dk, dv), S_n (..., dk, dv))``.

    Eager arrays run the loop: ``n`` steps, the least work. A lazy graph (``jax.jit``,
    Dask) gets a scan of depth ``log2 n`` (Hillis-Steele) instead, because XLA fuses an
    elementwise chain into every fusion that reads one of its links: the loop's
    ``n`` states compile to about ``n^2 / 2`` multiplies (62 chunks: 2026 for SSD), and
    the compile time grows with them. Step ``m = 1, 2, 4, ...`` folds in the chunk ``m``
    places back, ``X_i <- X_i + D_i X_{i-m}`` and ``D_i <- D_i D_{i-m}`` (slices and a
    concatenation): afterwards ``X_i = sum_{j <= i} (prod_{j < l <= i} decay_l) inc_j``
    and ``D_i = prod_{l <= i} decay_l``, so the state after chunk ``i`` is
    ``X_i + D_i s``. Every ``D`` is a product of decays ``<= 1``: nothing overflows.
    ``O(n log n)`` state updates (on NumPy at ``T = 16384``, 8 heads, ``d = C = 64``:
    105 ms against the loop's 16; see :doc:`/recurrent`, Cost). ``scan``: True or False
    chooses; None (default) scans lazy arrays only.
    """
    n = inc.shape[-3]
    if not (is_lazy(inc, decay, s) if scan is None else scan):
        entering = []
        for i in range(n):
            entering.append(s)
            s = decay[..., i if decay.shape[-3] > 1 else 0, :, :] * s + inc[..., i, :, :]
        return xp.stack(entering, axis=-3), s
    d = xp.broadcast_to(decay, tuple(inc.shape[:-3]) + (n,) + tuple(decay.shape[-2:]))
    x, m = inc, 1
    while m < n:
        x = xp.concat([x[..., :m, :, :], x[..., m:, :, :] + d[..., m:, :, :] * x[..., :-m, :, :]],
                      axis=-3)
        d = xp.concat([d[..., :m, :, :], d[..., m:, :, :] * d[..., :-m, :, :]], axis=-3)
        m *= 2
    after = x + d * s[..., None, :, :]
    return xp.concat([s[..., None, :, :], after[..., :-1, :, :]], axis=-3), after[..., -1, :, :]
