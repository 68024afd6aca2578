"""The delta rule: DeltaNet and Gated DeltaNet.

The state ``S (..., dk, dv)`` is a linear map from keys to values, and each step takes
one gradient step of the regression loss ``||k_t S - v_t||^2 / 2`` with step size
``beta_t`` (after decaying by ``alpha_t = exp(g_t)`` in the gated rule)::

    S_t = alpha_t S_{t-1} + beta_t k_t^T (v_t - alpha_t k_t S_{t-1}),    o_t = scale q_t S_t.

With ``u_t = beta_t (v_t - alpha_t k_t S_{t-1})`` (the corrected value that is written),
``S_t = sum_{s <= t} exp(b_t - b_s) k_s^T u_s`` (``b`` the running sum of ``g``), so the
``u`` solve the unit lower-triangular system

    (I + tril(diag(beta) (K K^T * D), -1)) U = diag(beta) (V - exp(b) * K S_0),

with ``D_ts = exp(b_t - b_s)``; then ``O = scale (tril(Q K^T) * D) U + scale exp(b) * Q S_0``.
The three forms (``form=``):

``"recurrent"``
    The definition, token by token: ``O(T dk dv)`` time.
``"parallel"``
    The ``T x T`` system above solved at once: ``O(T^3)`` time, ``O(T^2)`` memory. The
    implied attention matrix is ``scale (tril(Q K^T) * D) (I + L)^{-1} diag(beta)``.
``"chunk"``
    The WY/UT form (Yang et al. 2024): in each chunk of ``C`` steps,
    ``T_c = (I + L_c)^{-1} diag(beta)`` (a ``C x C`` solve), ``W = T_c (exp(b) * K)``
    and ``U = T_c V``; the corrected values are ``U - W S`` given the state ``S`` at the
    chunk's start, which is then passed on. ``O(T C (C + dk + dv) + T dk dv)`` time.

Decay exponents are differences of running sums within a chunk (or 64 rows), masked to
``-inf`` before ``exp`` (:func:`~attn_ref.recurrent.common.causal_decay`). ``beta`` is
not range-checked: the recurrence is defined for any ``beta`` (fla allows ``(0, 2)`` for
negative eigenvalues); ``(0, 1)`` keeps ``I - beta k^T k`` a contraction for unit ``k``.
"""

from __future__ import annotations

import math

import array_api_compat

from .._checks import check_flag
from .._common import add_into, is_lazy, keep_freed_memory, mul_into, owned_writeable
from .common import (
    ChunkOutputs,
    causal_decay,
    check_cu_seqlens,
    check_inputs,
    check_state,
    check_step_input,
    finish,
    packed,
    row_major_transpose,
    scalar_decay_matrix,
    segment_sums,
    to_chunks,
    unit_lower_inverse,
)

__all__ = [
    "delta_rule",
    "gated_delta_rule",
    "delta_rule_weights",
    "gated_delta_rule_weights",
    "l2_normalize",
    "L2NORM_EPS",
]

#: fla's ``l2norm``: ``x / sqrt(sum(x^2) + eps)`` with this ``eps``.
L2NORM_EPS = 1e-6
# query rows per block when building the parallel form's decay matrix
ROW_BLOCK = 64
#: Elements of the ``c x c`` matrices the chunk form computes at once (512 KiB of
#: float32: the temporaries stay in cache).
GROUP_ELEMENTS = 1 << 17


def l2_normalize(x, /, *, eps=L2NORM_EPS, xp=None):
    """``x / sqrt(sum(x^2, -1) + eps)``: fla's ``use_qk_l2norm_in_kernel`` normalisation."""
    xp = array_api_compat.array_namespace(x) if xp is None else xp
    return x / _l2_norm(xp, x, eps)


def _l2_norm(xp, x, eps=L2NORM_EPS):
    # vecdot: one pass, where x * x and a sum took two and a temporary (half the time
    # on NumPy, (8, 4, 64, 64) float32 rows, measured)
    return xp.sqrt(xp.vecdot(x, x)[..., None] + eps)


def _zeros_state(xp, k, v):
    return xp.zeros(tuple(k.shape[:-2]) + (k.shape[-1], v.shape[-1]), dtype=k.dtype,
                    device=array_api_compat.device(k))


def _tril(xp, n, m, offset, device):
    return xp.arange(m, device=device)[None, :] <= xp.arange(n, device=device)[:, None] + offset


def _recurrent(xp, q, k, v, g, beta, s, scale):
    s = _zeros_state(xp, k, v) if s is None else s
    outs = []
    for t in range(q.shape[-2]):
        if g is not None:
            s = xp.exp(g[..., t, None, None]) * s
        kt = k[..., t, None, :]  # (..., 1, dk)
        u = beta[..., t, None, None] * (v[..., t, None, :] - kt @ s)  # (..., 1, dv)
        s = s + xp.matrix_transpose(kt) @ u
        outs.append((q[..., t, None, :] @ s)[..., 0, :])
    if not outs:
        return xp.zeros_like(v), s
    return scale * xp.stack(outs, axis=-2), s


def _decay_matrix(xp, g, T):
    """``D (..., T, T)``: ``exp(b_i - b_j)`` for ``j <= i``, 0 above; all ones without gates."""
    if g is None:
        return None
    a = g[..., None]
    rows = []
    for r0 in range(0, T, ROW_BLOCK):
        r1 = min(r0 + ROW_BLOCK, T)
        _, diff, _ = segment_sums(xp, a, r0, r1)
        d = causal_decay(xp, diff, r0)[..., 0]
        pad = xp.zeros(tuple(d.shape[:-1]) + (T - r1,), dtype=d.dtype,
                       device=array_api_compat.device(d))
        rows.append(xp.concat([d, pad], axis=-1))
    return xp.concat(rows, axis=-2)


def _prefix_decay(xp, g, T):
    """``(exp(b_t), exp(b_T - b_t))`` as ``(..., T, 1)`` columns, or ones without gates."""
    if g is None:
        return None, None
    a = g[..., None]
    p, _, _ = segment_sums(xp, a, 0, T)  # b_t (a short sum where it matters: near t = 0)
    _, diff, _ = segment_sums(xp, a, T - 1, T)
    return xp.exp(p), xp.exp(diff[..., 0, :, :])


def _system(xp, k, beta, d):
    """``I + tril(diag(beta) (K K^T * D), -1)``: unit lower triangular."""
    n = k.shape[-2]
    dev = array_api_compat.device(k)
    kk = k @ xp.matrix_transpose(k)
    if d is not None:
        kk = kk * d
    strict = _tril(xp, n, n, -1, dev)
    low = xp.where(strict, beta[..., :, None] * kk, xp.zeros_like(kk))
    return low + xp.eye(n, dtype=k.dtype, device=dev)


def _unit_lower_solve(xp, m, rhs):
    """``m^{-1} rhs`` for a unit lower-triangular ``m (..., n, n)``.

    ``xp.linalg.solve`` where the library has it for the dtype; NumPy's LAPACK has no
    long double (the oracle's golden dtype for float64 kernels), and there the system
    is solved by forward substitution, row by row, in the array's own precision.
    """
    try:
        return xp.linalg.solve(m, rhs)
    except TypeError:
        pass
    rows = []
    for i in range(m.shape[-1]):
        x = rhs[..., i, :]
        if i:
            x = x - (m[..., i, None, :i] @ xp.stack(rows, axis=-2))[..., 0, :]
        rows.append(x)
    return xp.stack(rows, axis=-2)


def _scores(xp, q, k, d):
    """``tril(Q K^T) * D`` (including the diagonal)."""
    n = q.shape[-2]
    s = q @ xp.matrix_transpose(k)
    if d is not None:
        return s * d  # D is already 0 above the diagonal
    return xp.where(_tril(xp, n, n, 0, array_api_compat.device(q)), s, xp.zeros_like(s))


def _parallel(xp, q, k, v, g, beta, s0, scale):
    T = q.shape[-2]
    if T == 0:
        return xp.zeros_like(v), _zeros_state(xp, k, v) if s0 is None else s0
    d = _decay_matrix(xp, g, T)
    head, tail = _prefix_decay(xp, g, T)
    rhs = v
    if s0 is not None:
        ks = k @ s0
        rhs = v - (ks if head is None else head * ks)
    u = _unit_lower_solve(xp, _system(xp, k, beta, d), beta[..., :, None] * rhs)
    o = _scores(xp, q, k, d) @ u
    s = _zeros_state(xp, k, v) if s0 is None else s0
    if s0 is not None:
        qs = q @ s0
        o = o + (qs if head is None else head * qs)
    if g is not None:
        s = xp.exp(xp.sum(g, axis=-1))[..., None, None] * s
        u = tail * u
    return scale * o, s + xp.matrix_transpose(k) @ u


def _chunk(xp, q, k, v, g, beta, s, scale, chunk, l2norm=False):
    # The whole chunks in batches, then the last partial one (T need not be a multiple of C).
    T = q.shape[-2]
    s = _zeros_state(xp, k, v) if s is None else s
    # the groups' temporaries reused from group to group, not faulted in again: a fresh
    # process's DeltaNet at T = 16384, 8 heads, d = 64, 3664-4080 -> 528 page faults a call
    keep_freed_memory(v)
    full = T - T % chunk
    outs = []
    for c0, c1, c in ((0, full, chunk), (full, T, T - full)):
        if c1 > c0:
            gc = None if g is None else g[..., c0:c1]
            o, s = _chunks(xp, q[..., c0:c1, :], k[..., c0:c1, :], v[..., c0:c1, :], gc,
                           beta[..., c0:c1], s, c, scale, l2norm)
            outs.append(o)
    if not outs:
        return xp.zeros_like(v), s
    return (outs[0] if len(outs) == 1 else xp.concat(outs, axis=-2)), s


def _chunks(xp, q, k, v, g, beta, s, c, scale, l2norm):
    """The WY/UT chunk form on ``n`` whole chunks of ``c`` steps (``T = n c``).

    Batched over groups of chunks (about :data:`GROUP_ELEMENTS` elements of ``c x c``
    matrices at once): the decay matrices, ``K K^T``, ``Q K^T``, the UT transform
    ``T_c = (I + L)^{-1} diag(beta)`` (the inverse by doubling,
    :func:`~attn_ref.recurrent.common.unit_lower_inverse`), ``U = T_c V``,
    ``W = T_c (exp(b) K)`` and the outputs. Sequential over the chunks: only
    ``U - W S``, the values written given the state entering the chunk, and the
    state's hand-over (on lazy arrays, one group and a scan of depth ``log2 n``
    instead: :func:`_affine_hand_over`).

    ``scale`` (and with ``l2norm`` the normalisation of ``q`` and ``k``,
    :func:`l2_normalize`) is applied to each group's rows as it is read, in cache: a
    pass over the whole of ``q``, ``k`` or the output would cost a trip through main
    memory and a fresh array's page faults. Products with masks, decays and ``beta``
    are written into the group's own fresh arrays where the library allows it.
    """
    mt = xp.matrix_transpose
    dev = array_api_compat.device(q)
    qc, kc, vc = (to_chunks(xp, x, c) for x in (q, k, v))
    bc = to_chunks(xp, beta[..., None], c)  # (..., n, c, 1)
    ac = None if g is None else to_chunks(xp, g[..., None], c)
    n, dv = qc.shape[-3], vc.shape[-1]
    per = max(1, GROUP_ELEMENTS // (math.prod(qc.shape[:-3]) * c * c))
    lazy = is_lazy(q)
    if lazy:
        per = n  # one group: a compiler schedules the memory itself
    # the causal mask (diagonal included) as 0 / 1, to multiply Q K^T by
    lower = xp.astype(_tril(xp, c, c, 0, dev), q.dtype)
    out, inplace = ChunkOutputs(xp, tuple(qc.shape[:-1]) + (dv,)), False
    for g0 in range(0, n, per):
        g1 = min(g0 + per, n)
        cut = (..., slice(g0, g1), slice(None), slice(None))
        qg, kg, vg, bg = qc[cut], kc[cut], vc[cut], bc[cut]
        if l2norm:  # the scale goes with q's normalisation, one pass over q
            qg, kg = qg * (scale / _l2_norm(xp, qg)), kg / _l2_norm(xp, kg)
        else:
            qg = scale * qg
        # K^T in row-major order: K K^T, Q K^T and the state's update are untransposed
        # GEMMs (common.row_major_transpose), and the copy is ours to scale in place.
        kt = row_major_transpose(xp, kg)
        if g0 == 0:
            inplace = owned_writeable(kt)
        kk, qk = kg @ kt, qg @ kt
        if ac is None:
            qk = mul_into(qk, lower)
            kd = kg
        else:
            b = xp.cumulative_sum(ac[cut], axis=-2)  # (..., per, c, 1), from the chunk's start
            d = scalar_decay_matrix(xp, b)  # exp(b_i - b_j), j <= i: masked before exp
            kk, qk = mul_into(kk, d), mul_into(qk, d)
            head, tail = xp.exp(b), xp.exp(b[..., -1:, :] - b)
            decay = xp.exp(b[..., -1:, :])  # (..., per, 1, 1)
            kd = head * kg
            kt = mul_into(kt, mt(tail))  # (e^{B - b} K)^T, the state's update
        # The UT transform T_c = (I + L)^{-1} diag(beta), L the strict lower part of
        # diag(beta) (K K^T * D): the inverse reads only that part of beta * kk.
        tc = unit_lower_inverse(xp, mul_into(kk, bg))
        tc = mul_into(tc, mt(bg))
        u_c, w_c = tc @ vg, tc @ kd
        if lazy:
            us, entering, s = _affine_hand_over(xp, u_c, w_c, kt, None if ac is None else decay, s)
        else:
            us, entering = [], []
            for i in range(g1 - g0):
                entering.append(s)
                # the values written in chunk i, U - W S (into u_c's rows where it may be:
                # then u_c is the stack of them)
                if inplace:
                    u_c[..., i, :, :] -= w_c[..., i, :, :] @ s
                    u = u_c[..., i, :, :]
                else:
                    u = u_c[..., i, :, :] - w_c[..., i, :, :] @ s
                    us.append(u)
                upd = kt[..., i, :, :] @ u
                s = s + upd if ac is None else decay[..., i, :, :] * s + upd
            us = u_c if inplace else xp.stack(us, axis=-3)
            entering = xp.stack(entering, axis=-3)
        qs = qg @ entering
        o = qk @ us
        read = qs if ac is None else mul_into(qs, head)
        o = add_into(o, read)
        out.add(o, g0, g1, inplace)
    return out.joined(), s



def _affine_hand_over(xp, u_c, w_c, kt, decay, s):
    """The hand-over for lazy graphs (``jax.jit``): a scan of depth ``log2 n`` over chunks.

    ``U = U_c - W S`` and ``S' = e^B S + K_t U`` (``K_t = (e^{B - b} K)^T``; ``e^B = 1``
    without gates) make each chunk an affine map of the state entering it,
    ``S' = M S + N`` with ``M = e^B I - K_t W`` and ``N = K_t U_c``, computed for every
    chunk at once. Their running compositions come from a Hillis-Steele scan: step
    ``m = 1, 2, 4, ...`` composes each map with the one ``m`` chunks back,
    ``N_i <- M_i N_{i-m} + N_i`` and ``M_i <- M_i M_{i-m}``, after which the state after
    chunk ``i`` is ``M_i S_0 + N_i``; the values written, ``U_c - W S``, are one batched
    GEMM afterwards. The loop of :func:`_chunks` is ``n`` links through GEMMs and, with
    gates, an elementwise chain that XLA fuses into every fusion reading one of its links
    (Gated DeltaNet at ``T = 1000``, 62 chunks of 16: 4064 multiplies in the compiled
    HLO, against 159 here); its ``2n`` GEMMs are also what XLA spends its compile time
    on. ``O(n log n)`` GEMMs of ``dk x dk`` by ``dk x (dk + dv)``, more work than the
    loop's ``2n`` of ``C x dk`` by ``dk x dv``: eager arrays keep the loop. Returns
    ``(U (..., n, C, dv), entering states (..., n, dk, dv), S_n)``.
    """
    n, dk = u_c.shape[-3], kt.shape[-2]
    eye = xp.eye(dk, dtype=kt.dtype, device=array_api_compat.device(kt))
    m, x = (eye if decay is None else decay * eye) - kt @ w_c, kt @ u_c
    shift = 1
    while shift < n:
        x = xp.concat([x[..., :shift, :, :], m[..., shift:, :, :] @ x[..., :-shift, :, :]
                       + x[..., shift:, :, :]], axis=-3)
        m = xp.concat([m[..., :shift, :, :], m[..., shift:, :, :] @ m[..., :-shift, :, :]],
                      axis=-3)
        shift *= 2
    after = m @ s[..., None, :, :] + x
    entering = xp.concat([s[..., None, :, :], after[..., :-1, :, :]], axis=-3)
    return u_c - w_c @ entering, entering, after[..., -1, :, :]


def _delta(fn, q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens, form,
           chunk_size, qk_l2norm, causal, xp):
    inp = check_inputs(fn, q, k, v, scale=scale, form=form, chunk_size=chunk_size,
                       output_final_state=output_final_state, causal=causal, xp=xp)
    xp = inp.xp
    l2norm = check_flag("qk_l2norm", qk_l2norm)
    if l2norm and inp.form != "chunk":  # the chunk form normalises group by group
        inp.q, inp.k = l2_normalize(inp.q, xp=xp), l2_normalize(inp.k, xp=xp)
    steps = {"beta": check_step_input("beta", beta, inp, (), "(..., T)", like=q)}
    if g is not None:
        steps["g"] = check_step_input("g", g, inp, (), "(..., T)", like=q)
    cu = check_cu_seqlens(cu_seqlens, inp)
    s0 = check_state("initial_state", initial_state, inp, None if cu is None else len(cu) - 1,
                     like=q)

    def one(q, k, v, st, s):
        args = (xp, q, k, v, st.get("g"), st["beta"], s, inp.scale)
        if inp.form == "recurrent":
            return _recurrent(*args)
        if inp.form == "parallel":
            return _parallel(*args)
        return _chunk(*args, inp.chunk_size, l2norm)

    o, s = packed(one, inp, steps, s0, cu)
    return finish(inp, o, s)


def _weights(fn, q, k, g, beta, *, scale, qk_l2norm, causal, xp):
    inp = check_inputs(fn, q, k, k[..., :1], scale=scale, form="chunk", chunk_size=1,
                       output_final_state=False, causal=causal, xp=xp)
    xp = inp.xp
    qq, kk = inp.q, inp.k
    if check_flag("qk_l2norm", qk_l2norm):
        qq, kk = l2_normalize(qq, xp=xp), l2_normalize(kk, xp=xp)
    b = check_step_input("beta", beta, inp, (), "(..., T)", like=q)
    a = None if g is None else check_step_input("g", g, inp, (), "(..., T)", like=q)
    T = inp.T
    if T == 0:
        return xp.zeros(inp.batch + (0, 0), dtype=inp.dtype, device=inp.device)
    d = _decay_matrix(xp, a, T)
    eye = xp.eye(T, dtype=inp.wdt, device=inp.device)
    t = _unit_lower_solve(xp, _system(xp, kk, b, d), b[..., :, None] * eye)
    w = inp.scale * (_scores(xp, qq, kk, d) @ t)
    return w if w.dtype == inp.dtype else xp.astype(w, inp.dtype)


_DOC = """
    q : array, shape (..., T, dk)
    k : array, shape (..., T, dk)
    v : array, shape (..., T, dv)
    scale : float, optional
        Multiplies ``q``; default ``dk ** -0.5``.
    initial_state : array, optional
        ``S_0``, shape ``(..., dk, dv)``; with ``cu_seqlens`` ``(n_seq, *rest, dk, dv)``.
    output_final_state : bool
        Also return ``S_T`` (per sequence with ``cu_seqlens``).
    cu_seqlens : sequence of int or 1-D integer array, optional
        ``[0, t_1, ..., T]``: packed sequences along ``T`` (``q`` is ``(1, *rest, T, dk)``);
        the state restarts at each boundary.
    form : {"chunk", "parallel", "recurrent"}
    chunk_size : int
        ``C`` of the chunk form; ``T`` need not be a multiple.
    qk_l2norm : bool
        Normalise ``q`` and ``k`` to unit length first (:func:`l2_normalize`; fla's
        ``use_qk_l2norm_in_kernel``, which DeltaNet layers use). Default False: the
        function takes ``q`` and ``k`` as given.
    causal : True
        Causal by construction; ``False`` is a ``ValueError``.

    Returns
    -------
    o : array, shape (..., T, dv)
        In the input dtype (float16/bfloat16 are computed in float32).
    S_T : array, shape (..., dk, dv)
        Only with ``output_final_state=True``: ``(o, S_T)``, in the working dtype.
"""


def _documented(fn):
    """Put the parameters every function of this module shares into ``fn``'s docstring."""
    fn.__doc__ = fn.__doc__.replace("    <common parameters>\n", _DOC.lstrip("\n"))
    return fn


@_documented
def delta_rule(q, k, v, /, *, beta, scale=None, initial_state=None, output_final_state=False,
               cu_seqlens=None, form="chunk", chunk_size=64, qk_l2norm=False, causal=True,
               xp=None):
    """DeltaNet: linear attention whose state is updated by the delta rule.

    ``S_t = S_{t-1} + beta_t k_t^T (v_t - k_t S_{t-1})``, ``o_t = scale q_t S_t``: the
    state moves its prediction for ``k_t`` a fraction ``beta_t`` of the way to ``v_t``.

    Parameters
    ----------
    beta : array, shape (..., T)
        Step sizes (``(0, 1)``, fla's tests draw ``sigmoid``), leading dims broadcastable
        to those of ``q``.
    <common parameters>

    Notes
    -----
    Chunk form ``O(T C (C + dk + dv) + T dk dv)`` time, ``O(C^2 + dk dv)`` extra memory
    per head. Schlag et al., *Linear Transformers Are Secretly Fast Weight Programmers*,
    ICML 2021; Yang et al., *Parallelizing Linear Transformers with the Delta Rule over
    Sequence Length*, NeurIPS 2024 (the chunked WY form).

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.recurrent import delta_rule
    >>> x = xp.reshape(xp.sin(xp.arange(40.0)), (10, 4))
    >>> beta = 0.5 + 0.4 * xp.cos(xp.arange(10.0))
    >>> a = delta_rule(x, x, x, beta=beta, chunk_size=3)
    >>> b = delta_rule(x, x, x, beta=beta, form="recurrent")
    >>> bool(xp.max(xp.abs(a - b)) < 1e-12)
    True
    """
    return _delta("delta_rule", q, k, v, None, beta, scale=scale, initial_state=initial_state,
                  output_final_state=output_final_state, cu_seqlens=cu_seqlens, form=form,
                  chunk_size=chunk_size, qk_l2norm=qk_l2norm, causal=causal, xp=xp)


@_documented
def gated_delta_rule(q, k, v, /, *, g, beta, scale=None, initial_state=None,
                     output_final_state=False, cu_seqlens=None, form="chunk", chunk_size=64,
                     qk_l2norm=False, causal=True, xp=None):
    """Gated DeltaNet: the delta rule after a scalar decay ``exp(g_t)``.

    ``S_t = exp(g_t) S_{t-1} + beta_t k_t^T (v_t - k_t exp(g_t) S_{t-1})``,
    ``o_t = scale q_t S_t`` (fla's ``naive_recurrent_gated_delta_rule``).

    Parameters
    ----------
    g : array, shape (..., T)
        Log decays (``<= 0``), leading dims broadcastable to those of ``q``.
    beta : array, shape (..., T)
        Step sizes in ``(0, 1)``.
    <common parameters>

    Notes
    -----
    Chunk form ``O(T C (C + dk + dv) + T dk dv)`` time, ``O(C^2 + dk dv)`` extra memory
    per head. Yang, Kautz & Hatamizadeh, *Gated Delta Networks: Improving Mamba2 with
    Delta Rule*, ICLR 2025.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.recurrent import gated_delta_rule
    >>> x = xp.reshape(xp.sin(xp.arange(40.0)), (10, 4))
    >>> beta = 0.5 + 0.4 * xp.cos(xp.arange(10.0))
    >>> g = -0.1 * xp.arange(10.0) / 10
    >>> a = gated_delta_rule(x, x, x, g=g, beta=beta, form="parallel")
    >>> b = gated_delta_rule(x, x, x, g=g, beta=beta, form="recurrent")
    >>> bool(xp.max(xp.abs(a - b)) < 1e-12)
    True
    """
    return _delta("gated_delta_rule", q, k, v, g, beta, scale=scale, initial_state=initial_state,
                  output_final_state=output_final_state, cu_seqlens=cu_seqlens, form=form,
                  chunk_size=chunk_size, qk_l2norm=qk_l2norm, causal=causal, xp=xp)


def delta_rule_weights(q, k, /, *, beta, scale=None, qk_l2norm=False, form="chunk", chunk_size=64,
                       causal=True, xp=None):
    """The implied ``(..., T, T)`` matrix of :func:`delta_rule` (zero initial state):
    ``scale tril(Q K^T) (I + tril(diag(beta) K K^T, -1))^{-1} diag(beta)``. ``O(T^3)``."""
    return _weights("delta_rule_weights", q, k, None, beta, scale=scale, qk_l2norm=qk_l2norm,
                    causal=causal, xp=xp)


def gated_delta_rule_weights(q, k, /, *, g, beta, scale=None, qk_l2norm=False, form="chunk",
                             chunk_size=64, causal=True, xp=None):
    """The implied ``(..., T, T)`` matrix of :func:`gated_delta_rule` (zero initial state)."""
    return _weights("gated_delta_rule_weights", q, k, g, beta, scale=scale, qk_l2norm=qk_l2norm,
                    causal=causal, xp=xp)
