"""Gradients of the recurrent linear attentions: retention, GLA, SSD, DeltaNet, Gated DeltaNet.

Every variant of :mod:`attn_ref.recurrent` is one recurrence over a state
``S_t (dk, dv)`` (fla's K x V layout) read out by the queries::

    P_t = D_t S_{t-1}                        decay  (D_t = gamma, exp(g_t), diag(exp(g_t)) or 1)
    u_t = beta_t (v_t - k_t P_t)             delta rule; u_t = v_t without it
    S_t = P_t + k_t^T u_t                    write
    o_t = scale q_t S_t                      read (the current token included)

The VJP runs the same recurrence backwards in time. With ``dS_t`` the cotangent of
``S_t`` collected from every later step (``dS_T`` = ``dfinal_state`` or zero)::

    dS_t  += scale q_t^T do_t                dq_t = scale do_t S_t^T
    dk_t   = u_t dS_t^T                      du_t = k_t dS_t          dP_t = dS_t
    delta rule:  r_t = v_t - k_t P_t:
        dv_t = beta_t du_t                   dbeta_t = <du_t, r_t>
        dk_t -= beta_t du_t P_t^T            dP_t -= beta_t k_t^T du_t
    otherwise:   dv_t = du_t
    decay:  dS_{t-1} = D_t dP_t,  dg_t = exp(g_t) * sum_v(dP_t * S_{t-1})  (summed over
            dk too for a scalar decay)

so ``dS_{t-1} = D_t (I - beta_t k_t^T k_t) dS_t + scale q_{t-1}^T do_{t-1}``: the adjoint of
the delta rule's Householder-like factor is its transpose, which is itself (it is
symmetric), applied on the left in the K x V layout. The gradient of the initial state
is ``dS_0`` after the last (earliest) step. Gates are differentiated in log space: the
forward takes ``g = log(alpha)``, and ``d/dg = alpha d/dalpha`` needs no division by an
``alpha`` that may underflow to zero. The derivation is in ``docs/recurrent_backward.md``.

With ``cu_seqlens`` the packed sequences are differentiated one after another, each
from its own initial state: no cotangent crosses a boundary, and the initial state's
gradient is per sequence.

Two implementations. The token loop above (``form="recurrent"``): ``O(T dk dv)`` time
per leading index (a few times the forward's multiply-adds) and ``O(T dk dv)`` extra
memory for the saved states, in ``T`` Python steps of array operations vectorised over
the leading dimensions; it is the defining form the other is tested against. The other
forms take a chunked backward, ``chunk_size`` steps at a time, carrying only the states
at chunk boundaries and their cotangents. For the decay variants (retention, GLA, SSD)
the backward of a decayed linear attention is a decayed linear attention run from the
end, so it chunks as the forward does (intra-chunk decay matrices from differences of
cumulative log gates, masked before ``exp``), and the log gates' gradient is the
reverse cumulative sum of ``q dq - k dk``. For the delta rules each chunk's WY/UT
transform is recomputed from the state entering it and run backwards (a back
substitution through the unit-triangular system; the log decays through the decay
matrix, ``exp(b)``, ``exp(B - b)`` and ``exp(B)``). Inputs in float16/bfloat16 are differentiated with
float32 states (as fla's kernels keep them) and the gradients cast back to each input's
dtype.
"""

from __future__ import annotations

import math

import array_api_compat

from .._checks import check_flag
from ..recurrent.common import (
    check_cu_seqlens,
    check_inputs,
    check_state,
    check_step_input,
    decayed_scores,
    forward_substitution,
)
from ..recurrent.decay import retention_log_decay
from ..recurrent.delta import L2NORM_EPS
from ._common import check_cotangent, unbroadcast

__all__ = ["retention", "gated_linear_attention", "ssd", "delta_rule", "gated_delta_rule"]

# The forms of the forward (FORMS) compute one function, so they have one VJP; the form
# only chooses how the backward runs (the token loop for "recurrent").


# ---------------------------------------------------------------- input checks


class _Problem:
    """The checked inputs of one VJP call, in the working dtype, broadcast to ``batch``."""

    def __init__(self, fn, q, k, v, do, *, scale, initial_state, cu_seqlens, dfinal_state, form,
                 chunk_size, output_final_state, qk_l2norm, causal, xp):
        # The forward's own checks: the VJP takes exactly what the forward takes.
        inp = check_inputs(fn, q, k, v, scale=scale, form=form, chunk_size=chunk_size,
                           output_final_state=output_final_state, causal=causal, xp=xp)
        self.inp, self.xp, self.batch = inp, inp.xp, inp.batch
        self.form, self.chunk_size, self.scale = inp.form, inp.chunk_size, inp.scale
        self.qk_l2norm = check_flag("qk_l2norm", qk_l2norm)
        self.like, self.device = q, inp.device
        self.T, self.dk, self.dv = inp.T, inp.dk, inp.dv
        # Half-precision inputs are differentiated with float32 states, as fla keeps them.
        self.work = inp.wdt
        check_cotangent(self.xp, do, self.batch + (self.T, self.dv), q)
        cu = check_cu_seqlens(cu_seqlens, inp)
        self.varlen = cu is not None
        self.bounds = cu if self.varlen else [0, self.T]
        self.n_seq = len(self.bounds) - 1
        for name, s in (("initial_state", initial_state), ("dfinal_state", dfinal_state)):
            check_state(name, s, inp, self.n_seq if self.varlen else None, like=q)
        self.initial_state, self.dfinal_state = initial_state, dfinal_state
        self.q, self.k, self.v, self.do = inp.q, inp.k, inp.v, self.full(do)
        if self.qk_l2norm:
            # The recurrence sees the normalised q, k; their reciprocal norms are kept for
            # the normalisation's VJP.
            (self.q, self.rq), (self.k, self.rk) = _l2norm(self.xp, self.q), _l2norm(self.xp, self.k)

    def full(self, x, tail=None):
        """``x`` in the working dtype, broadcast to ``batch + tail`` (``tail``: x's own)."""
        xp = self.xp
        tail = tuple(x.shape[-2:]) if tail is None else tuple(tail)
        x = x if x.dtype == self.work else xp.astype(x, self.work)
        return xp.broadcast_to(x, self.batch + tail)

    def gate(self, name, x, tail, want):
        """A per-token array option (``g``, ``beta``) of shape ``(..., T) + tail``, checked
        as the forward checks it, in the working dtype and broadcast to ``batch``."""
        return check_step_input(name, x, self.inp, tail, want, like=self.like)

    def state(self, s, n):
        """Sequence ``n``'s slice of ``initial_state`` / ``dfinal_state``, shaped ``batch + (dk, dv)``."""
        xp = self.xp
        shape = self.batch + (self.dk, self.dv)
        if s is None:
            return xp.zeros(shape, dtype=self.work, device=self.device)
        s = s if s.dtype == self.work else xp.astype(s, self.work)
        if self.varlen:
            s = s[n:n + 1, ...]
        return xp.broadcast_to(s, shape)

    def grad(self, dx, x):
        """A gradient in ``x``'s shape (summed over broadcast dimensions) and dtype."""
        dx = unbroadcast(self.xp, dx, tuple(x.shape))
        return dx if dx.dtype == x.dtype else self.xp.astype(dx, x.dtype)


# ---------------------------------------------------------------- the reverse recurrence


def _vec_mat(xp, x, m):
    """``x (..., a) @ m (..., a, b) -> (..., b)``: a batch of row vectors times matrices."""
    return (x[..., None, :] @ m)[..., 0, :]


def _outer(x, y):
    return x[..., :, None] * y[..., None, :]


def _token_vjp(xp, pb, sl, s0, ds, lg, per_key, beta):
    """The reverse recurrence of one sequence ``sl`` (a slice of T), token by token.

    ``s0`` is the sequence's initial state, ``ds`` the cotangent of its final state.
    ``lg`` is None (no decay) or the log gates ``batch + (T, e)``, ``e = dk`` when
    ``per_key`` (GLA) else 1; ``beta`` None or ``batch + (T,)``. Returns ``dq, dk, dv``
    ``(..., L, d)``, ``dlg (..., L, e)`` and ``dbeta (..., L)`` (None when not used) and
    the cotangent of ``s0``. ``O(L dk dv)`` time and memory (the saved states).
    """
    q, k, v, do = (x[..., sl, :] for x in (pb.q, pb.k, pb.v, pb.do))
    a = None if lg is None else xp.exp(lg[..., sl, :])
    b = None if beta is None else beta[..., sl]
    n = q.shape[-2]

    def decay_of(t):
        # (..., e, 1): per key row, or one scalar, broadcast against S (..., dk, dv).
        return a[..., t, :, None]

    # Forward, saving S_{t-1} for every step: S_t of step t is S_{t-1} of step t + 1.
    states = [s0]
    for t in range(n):
        p = states[-1] if a is None else decay_of(t) * states[-1]
        u = v[..., t, :]
        if b is not None:
            u = b[..., t, None] * (u - _vec_mat(xp, k[..., t, :], p))
        states.append(p + _outer(k[..., t, :], u))

    dq, dk, dv, dlg, db = [None] * n, [None] * n, [None] * n, [None] * n, [None] * n
    for t in range(n - 1, -1, -1):
        s_prev, s_t = states[t], states[t + 1]
        q_t, k_t, v_t, do_t = q[..., t, :], k[..., t, :], v[..., t, :], do[..., t, :]
        ds = ds + pb.scale * _outer(q_t, do_t)
        dq[t] = pb.scale * _vec_mat(xp, do_t, xp.matrix_transpose(s_t))
        p = s_prev if a is None else decay_of(t) * s_prev
        if b is None:
            u = v_t
        else:
            r = v_t - _vec_mat(xp, k_t, p)
            u = b[..., t, None] * r
        dk_t = _vec_mat(xp, u, xp.matrix_transpose(ds))
        du = _vec_mat(xp, k_t, ds)
        dp = ds
        if b is None:
            dv[t] = du
        else:
            dr = b[..., t, None] * du
            dv[t] = dr
            db[t] = xp.sum(du * r, axis=-1)
            dk_t = dk_t - _vec_mat(xp, dr, xp.matrix_transpose(p))
            dp = dp - _outer(k_t, dr)
        dk[t] = dk_t
        if a is None:
            ds = dp
        else:
            # d/dg = alpha d/dalpha = rowsum(dP * alpha S_{t-1}) = rowsum(dP * P): no 1/alpha.
            w = dp * p
            dlg[t] = xp.sum(w, axis=-1) if per_key else xp.sum(w, axis=(-2, -1))[..., None]
            ds = decay_of(t) * dp

    def stacked(parts, like_shape, axis):
        if n == 0:
            return xp.zeros(like_shape, dtype=pb.work, device=pb.device)
        return xp.stack(parts, axis=axis)

    out = [stacked(dq, q.shape, -2), stacked(dk, k.shape, -2), stacked(dv, v.shape, -2)]
    out.append(None if a is None else stacked(dlg, a.shape, -2))
    out.append(None if b is None else stacked(db, b.shape, -1))
    return (*out, ds)


def _decayed_products(xp, g, q, k, b):
    """``((G * E) K, (G * E)^T Q)`` with ``E[t, s, e] = exp(b_te - b_se)`` per key dimension.

    ``g (..., c, c)`` is causal (zero above the diagonal), ``q, k (..., c, dk)``, ``b
    (..., c, dk)`` running sums of log gates. Computed as
    :func:`attn_ref.recurrent.common.decayed_scores` computes the scores: the block of
    rows ``m..c`` against columns ``0..m`` through the reference point ``r = b_{m-1}``,
    ``exp(b_t - r) (G_ts (k_s exp(r - b_s)))`` (both exponents ``<= 0``), the diagonal
    halves recursively and batched; ``O(c dk log c)`` exponentials, GEMM work.
    """
    mt = xp.matrix_transpose
    c, d = q.shape[-2], q.shape[-1]
    if c == 1:
        return g * k, g * q
    if c % 2:
        # An odd block: the last row pairwise (its exponents b_last - b_s <= 0), the rest halved.
        dq, dk = _decayed_products(xp, g[..., :-1, :-1], q[..., :-1, :], k[..., :-1, :],
                                   b[..., :-1, :])
        e = xp.exp(b[..., -1:, :] - b)
        row = g[..., -1:, :]
        pad = xp.zeros(tuple(dk.shape[:-2]) + (1, d), dtype=dk.dtype, device=array_api_compat.device(dk))
        return (xp.concat([dq, row @ (k * e)], axis=-2),
                xp.concat([dk, pad], axis=-2) + mt(row) * (q[..., -1:, :] * e))
    m = c // 2
    ref = b[..., m - 1:m, :]
    e_hi, e_lo = xp.exp(b[..., m:, :] - ref), xp.exp(ref - b[..., :m, :])
    g_low = g[..., m:, :m]
    dq_hi = e_hi * (g_low @ (k[..., :m, :] * e_lo))
    dk_lo = e_lo * (mt(g_low) @ (q[..., m:, :] * e_hi))
    half = tuple(q.shape[:-2]) + (2, m)
    dq_d, dk_d = _decayed_products(
        xp, xp.stack([g[..., :m, :m], g[..., m:, m:]], axis=-3), xp.reshape(q, half + (d,)),
        xp.reshape(k, half + (d,)), xp.reshape(b, half + (d,)))
    full = tuple(q.shape)
    zero = xp.zeros_like(dq_hi)
    return (xp.reshape(dq_d, full) + xp.concat([zero, dq_hi], axis=-2),
            xp.reshape(dk_d, full) + xp.concat([dk_lo, zero], axis=-2))


def _chunked_decay_vjp(xp, pb, sl, s0, ds, lg, per_key, chunk):
    """The VJP of a decay variant (no delta rule) on one sequence, ``chunk`` steps at a time.

    The same inputs and outputs as :func:`_token_vjp`. Within a chunk, with
    ``b_t = sum of lg`` from the chunk's start, the decay from key ``s`` to query ``t``
    is ``E[t, s] = exp(b_t - b_s)`` (``s <= t``; masked before the ``exp``, where the
    exponent would be positive); across chunks only the states at chunk boundaries
    (forward) and their cotangents (backward) are carried:

    * ``dv = scale (QK^T * E)^T dO + (K exp(B - b)) Lambda``,
    * ``dq = scale ((dO V^T) * E) K + scale exp(b) (dO S_prev^T)``,
    * ``dk = scale ((dO V^T) * E)^T Q + exp(B - b) (V Lambda^T)``,
    * ``Lambda_prev = exp(B) Lambda + scale (Q exp(b))^T dO``,

    (``B`` the chunk's total log decay, products with ``E`` elementwise per key for GLA)
    and the log gates' gradient is the reverse cumulative sum of ``q dq - k dk`` (plus
    ``rowsum(dS_T * S_T)``), see ``docs/recurrent_backward.md``. ``O(L C (dk + dv) + L dk dv)``
    time, ``O(C^2 + (L / C) dk dv)`` extra memory; for a per-key decay the products with
    ``E`` are taken by halving (:func:`_decayed_products`), GEMMs and ``O(L dk log C)``
    exponentials.
    """
    q, k, v, do = (x[..., sl, :] for x in (pb.q, pb.k, pb.v, pb.do))
    lg = lg[..., sl, :]
    n = q.shape[-2]
    mt = xp.matrix_transpose
    starts = list(range(0, n, chunk))
    neg_inf = xp.asarray(-math.inf, dtype=pb.work, device=pb.device)
    zero = xp.zeros((), dtype=pb.work, device=pb.device)

    def cut(x, r0):
        return x[..., r0:min(r0 + chunk, n), :]

    # Forward over chunks: the state entering each chunk, and S_T.
    s_in, s = [], s0
    for r0 in starts:
        b = xp.cumulative_sum(cut(lg, r0), axis=-2)
        s_in.append(s)
        s = xp.exp(b[..., -1, :])[..., :, None] * s + mt(cut(k, r0) * xp.exp(b[..., -1:, :] - b)) @ cut(v, r0)
    s_final, d_final = s, ds

    dq, dk, dv = [None] * len(starts), [None] * len(starts), [None] * len(starts)
    lam = ds
    for j in range(len(starts) - 1, -1, -1):
        r0 = starts[j]
        qc, kc, vc, doc = cut(q, r0), cut(k, r0), cut(v, r0), cut(do, r0)
        b = xp.cumulative_sum(cut(lg, r0), axis=-2)
        m = qc.shape[-2]
        causal = xp.arange(m, device=pb.device)[:, None] >= xp.arange(m, device=pb.device)[None, :]
        e_q, e_k = xp.exp(b), xp.exp(b[..., -1:, :] - b)
        g_ts = xp.where(causal, pb.scale * (doc @ mt(vc)), zero)  # (dO V^T) masked, scaled
        if per_key:
            # The decay differs per key dimension: the products with E by halving through
            # reference points (GEMMs, every exponent <= 0); the scores as the forward
            # computes them (factored whole where the chunk's decay fits, checked).
            a_ts = decayed_scores(xp, qc, kc, b)  # QK^T * E
            dq_in, dk_in = _decayed_products(xp, g_ts, qc, kc, b)
        else:
            # E[t, s] = exp(b_t - b_s) for s <= t, else exactly 0.
            e = xp.exp(xp.where(causal, b[..., :, None, 0] - b[..., None, :, 0], neg_inf))
            a_ts = (qc @ mt(kc)) * e
            dq_in = (g_ts * e) @ kc
            dk_in = mt(g_ts * e) @ qc
        dq[j] = dq_in + pb.scale * e_q * (doc @ mt(s_in[j]))
        dk[j] = dk_in + e_k * (vc @ mt(lam))
        dv[j] = pb.scale * mt(a_ts) @ doc + (kc * e_k) @ lam
        lam = xp.exp(b[..., -1, :])[..., :, None] * lam + pb.scale * mt(qc * e_q) @ doc
    if starts:
        dq, dk, dv = (xp.concat(x, axis=-2) for x in (dq, dk, dv))
    else:
        dq, dk, dv = (xp.zeros(x.shape, dtype=pb.work, device=pb.device) for x in (q, k, v))
    # The output depends on b_t = g_1 + ... + g_t only through q_t exp(b_t), k_t exp(-b_t)
    # and S_T = exp(b_T) (...): dL/db_t = q_t dq_t - k_t dk_t (+ rowsum(dS_T S_T) at T),
    # and dg_t = sum_{s >= t} dL/db_s.
    dlb = q * dq - k * dk
    dlg = xp.flip(xp.cumulative_sum(xp.flip(dlb, axis=-2), axis=-2), axis=-2)
    dlg = dlg + xp.sum(d_final * s_final, axis=-1)[..., None, :]
    if not per_key:
        dlg = xp.sum(dlg, axis=-1, keepdims=True)
    return dq, dk, dv, dlg, None, lam


def _chunked_delta_vjp(xp, pb, sl, s0, ds, lg, beta, chunk):
    """The VJP of the (gated) delta rule on one sequence, through the chunked WY/UT form.

    The same inputs and outputs as :func:`_token_vjp`. A forward pass over the chunks
    keeps only the state entering each chunk; the backward pass recomputes each chunk's
    UT transform from it (``M = I + tril(diag(beta) (K K^T * D), -1)``, ``U0 = M^{-1}
    diag(beta) V``, ``W = M^{-1} diag(beta) (exp(b) K)``, ``U = U0 - W S``) and runs it
    backwards, carrying ``Lambda``, the cotangent of the state leaving the chunk:

    * ``dA = scale dO U^T`` (causal), ``dU = scale A^T dO + (exp(B - b) K) Lambda``,
    * ``dQ = (dA * D) K + scale exp(b) (dO S^T)``, ``dK = (dA * D)^T Q + ...``,
    * through ``X = M^{-1} R``: ``dR = M^{-T} dX`` (a back substitution) and
      ``dM = -dR X^T`` on the strict lower triangle, for ``X = U0`` and ``W`` (whose
      cotangent is ``-dU S^T``),
    * ``Lambda_prev = exp(B) Lambda + scale (exp(b) Q)^T dO - W^T dU``,

    and the log decays through ``D``, ``exp(b)``, ``exp(B - b)`` and ``exp(B)``
    (``dL/db``, then a reverse cumulative sum in the chunk). See
    ``docs/recurrent_backward.md``. ``O(L C (C + dk + dv) + L dk dv)`` time per leading
    index, ``O(C^2 + (L / C) dk dv)`` extra memory, ``2 L / C`` Python steps.
    """
    mt = xp.matrix_transpose
    q, k, v, do = (x[..., sl, :] for x in (pb.q, pb.k, pb.v, pb.do))
    bt = beta[..., sl][..., None]  # (..., L, 1)
    a = None if lg is None else lg[..., sl, :]  # (..., L, 1)
    n, dv = q.shape[-2], v.shape[-1]
    starts = list(range(0, n, chunk))
    scale, dev = pb.scale, pb.device

    def zeros(x):
        return xp.zeros_like(x)

    def chunk_of(r0):
        """The S-independent quantities of the chunk starting at ``r0``."""
        r1 = min(r0 + chunk, n)
        c = r1 - r0
        x = {name: t[..., r0:r1, :] for name, t in (("q", q), ("k", k), ("v", v), ("do", do),
                                                    ("beta", bt))}
        x["lower"] = xp.arange(c, device=dev)[None, :] <= xp.arange(c, device=dev)[:, None]
        x["strict"] = xp.arange(c, device=dev)[None, :] < xp.arange(c, device=dev)[:, None]
        ones = xp.ones((c, c), dtype=pb.work, device=dev)
        if a is None:
            x["d"] = xp.where(x["lower"], ones, xp.zeros_like(ones))
            x["h"] = x["t"] = x["gamma"] = None
            kh = x["k"]
        else:
            b = xp.cumulative_sum(a[..., r0:r1, :], axis=-2)  # from the chunk's start
            diff = b - mt(b)
            x["d"] = xp.exp(xp.where(x["lower"], diff, xp.full_like(diff, -math.inf)))
            x["h"], x["t"] = xp.exp(b), xp.exp(b[..., -1:, :] - b)
            x["gamma"] = xp.exp(b[..., -1:, :])  # (..., 1, 1)
            kh = x["h"] * x["k"]
        x["kh"] = kh
        x["kk"] = x["k"] @ mt(x["k"])
        kkd = x["kk"] * x["d"]
        x["kkd"] = kkd
        x["m"] = xp.where(x["strict"], x["beta"] * kkd, xp.zeros_like(kkd)) + xp.eye(
            c, dtype=pb.work, device=dev)
        wu = forward_substitution(xp, x["m"], x["beta"] * xp.concat([x["v"], kh], axis=-1))
        x["u0"], x["w"] = wu[..., :dv], wu[..., dv:]
        x["kt"] = x["k"] if x["t"] is None else x["t"] * x["k"]
        return x

    # Forward: the state entering every chunk.
    s_in, s = [], s0
    for r0 in starts:
        x = chunk_of(r0)
        s_in.append(s)
        u = x["u0"] - x["w"] @ s
        s = (s if x["gamma"] is None else x["gamma"] * s) + mt(x["kt"]) @ u

    grads = {name: [None] * len(starts) for name in ("q", "k", "v", "beta", "g")}
    lam = ds
    for j in range(len(starts) - 1, -1, -1):
        x, s = chunk_of(starts[j]), s_in[j]
        qc, kc, vc, doc, bc, d, h = x["q"], x["k"], x["v"], x["do"], x["beta"], x["d"], x["h"]
        u = x["u0"] - x["w"] @ s
        qk = qc @ mt(kc)
        da = xp.where(x["lower"], scale * (doc @ mt(u)), zeros(qk))
        du = scale * mt(qk * d) @ doc + x["kt"] @ lam
        dad = da * d
        qs_t = doc @ mt(s)
        dq = dad @ kc + scale * (qs_t if h is None else h * qs_t)
        ul = u @ mt(lam)  # the cotangent of exp(B - b) K
        dk = mt(dad) @ qc + (ul if x["t"] is None else x["t"] * ul)
        qh = qc if h is None else h * qc
        lam_prev = scale * mt(qh) @ doc + (lam if x["gamma"] is None else x["gamma"] * lam) \
            - mt(x["w"]) @ du
        # Through X = M^{-1} R for X = [U0, W]: dR = M^{-T} dX (back substitution, as a
        # forward one on the reversed, transposed system), dM = -dR X^T (strict lower).
        dx = xp.concat([du, -(du @ mt(s))], axis=-1)
        rev = mt(xp.flip(x["m"], axis=(-2, -1)))
        dr = xp.flip(forward_substitution(xp, rev, xp.flip(dx, axis=-2)), axis=-2)
        drv, drk = dr[..., :dv], dr[..., dv:]
        dm = -(drv @ mt(x["u0"]) + drk @ mt(x["w"]))
        dm = xp.where(x["strict"], dm, zeros(dm))
        grads["v"][j] = bc * drv
        grads["beta"][j] = (xp.sum(drv * vc, axis=-1) + xp.sum(drk * x["kh"], axis=-1)
                            + xp.sum(dm * x["kkd"], axis=-1))
        dk = dk + bc * (drk if h is None else h * drk)
        gkk = bc * dm  # the cotangent of K K^T * D on the strict lower triangle
        gd = gkk * d
        dk = dk + gd @ kc + mt(gd) @ kc
        if a is not None:
            # dL/db_i through D_ij = exp(b_i - b_j) (row i +, column i -), exp(b_i),
            # exp(B - b_i) and exp(B), B = b_last; then dg = the reverse cumsum of dL/db.
            e = (da * qk + gkk * x["kk"]) * d
            db = xp.sum(e, axis=-1)[..., None] - xp.sum(e, axis=-2)[..., None]
            dh = scale * xp.sum(doc * (qc @ s), axis=-1)[..., None] + bc * xp.sum(
                drk * kc, axis=-1)[..., None]
            dt = xp.sum(kc * ul, axis=-1)[..., None] * x["t"]
            db = db + dh * h - dt
            db_last = xp.sum(dt, axis=-2, keepdims=True) + x["gamma"] * xp.sum(
                lam * s, axis=(-2, -1))[..., None, None]
            db = xp.concat([db[..., :-1, :], db[..., -1:, :] + db_last], axis=-2)
            grads["g"][j] = xp.flip(xp.cumulative_sum(xp.flip(db, axis=-2), axis=-2), axis=-2)
        grads["q"][j], grads["k"][j] = dq, dk
        lam = lam_prev

    def joined(name, like, axis):
        if not starts:
            return xp.zeros(like.shape, dtype=pb.work, device=pb.device)
        return xp.concat(grads[name], axis=axis)

    dlg = None if a is None else joined("g", a, -2)
    return (joined("q", q, -2), joined("k", k, -2), joined("v", v, -2), dlg,
            joined("beta", bt[..., 0], -1), lam)


def _l2norm(xp, x):
    """fla's ``l2norm``: ``x / sqrt(sum(x^2) + eps)`` and the reciprocal norm."""
    eps = xp.asarray(L2NORM_EPS, dtype=x.dtype, device=array_api_compat.device(x))
    rstd = 1.0 / xp.sqrt(xp.sum(x * x, axis=-1, keepdims=True) + eps)
    return x * rstd, rstd


def _l2norm_vjp(xp, y, rstd, dy):
    """``dx = rstd (dy - y <y, dy>)`` for ``y = x rstd``, ``rstd = (|x|^2 + eps)^(-1/2)``."""
    return rstd * (dy - y * xp.sum(y * dy, axis=-1, keepdims=True))


def _run(pb, *, lg=None, per_key=False, beta=None):
    """The VJP of the recurrence over every sequence of ``pb``.

    ``lg``: None or the log gates ``batch + (T, e)`` (``e = dk`` when ``per_key``, else
    1). Every variant takes the chunked backward unless ``form="recurrent"``. Returns
    ``dq, dk, dv`` (``batch + (T, d)``), ``dlg`` (like ``lg``) and ``dbeta``
    (``batch + (T,)``) or None, and the initial state's cotangent (``batch + (dk, dv)``,
    or ``(n_seq, ...)`` with ``cu_seqlens``).
    """
    xp = pb.xp
    chunked = pb.form != "recurrent" and (lg is not None or beta is not None)
    parts = [[] for _ in range(5)]
    ds0 = []
    for i in range(pb.n_seq):
        sl = slice(pb.bounds[i], pb.bounds[i + 1])
        s0, dst = pb.state(pb.initial_state, i), pb.state(pb.dfinal_state, i)
        if chunked and beta is not None:
            *grads, ds = _chunked_delta_vjp(xp, pb, sl, s0, dst, lg, beta, pb.chunk_size)
        elif chunked:
            *grads, ds = _chunked_decay_vjp(xp, pb, sl, s0, dst, lg, per_key, pb.chunk_size)
        else:
            *grads, ds = _token_vjp(xp, pb, sl, s0, dst, lg, per_key, beta)
        for lst, x in zip(parts, grads):
            lst.append(x)
        ds0.append(ds)
    dq, dk, dv, dlg = (None if p[0] is None else xp.concat(p, axis=-2) for p in parts[:4])
    db = None if parts[4][0] is None else xp.concat(parts[4], axis=-1)
    if pb.qk_l2norm:
        dq, dk = _l2norm_vjp(xp, pb.q, pb.rq, dq), _l2norm_vjp(xp, pb.k, pb.rk, dk)
    # With cu_seqlens each sequence's state lives at batch index 0 (a batch of one).
    d0 = xp.concat(ds0, axis=0) if pb.varlen else ds0[0]
    return dq, dk, dv, dlg, db, d0


def _result(pb, q, k, v, dq, dk, dv, d0, initial_state):
    out = {"q": pb.grad(dq, q), "k": pb.grad(dk, k), "v": pb.grad(dv, v)}
    if initial_state is not None:
        out["initial_state"] = pb.grad(d0, initial_state)
    return out


def _log_gamma(pb, gamma):
    """Retention's decay as log gates ``batch + (T, 1)``, as the forward reads ``gamma``."""
    return retention_log_decay(pb.inp, gamma, pb.like)


# ---------------------------------------------------------------- public VJPs

_COMMON_DOC = """
    q, k, v : arrays, shapes (..., T, dk), (..., T, dk), (..., T, dv)
    do : array, shape (..., T, dv)
        Cotangent of the output ``o``; the dtype, library and device of ``q``.
    scale : float, optional
        Read-out scale, ``dk ** -0.5`` by default.
    initial_state : array, optional
        ``S_0``, shape (..., dk, dv); with ``cu_seqlens``, (n_seq, ..., dk, dv), one per
        sequence (fla's ``(N, H, K, V)`` for ``q (1, H, T, K)``). Its gradient is returned
        when it is given.
    output_final_state : bool
        Accepted so that the forward's options can be passed unchanged; the final state's
        cotangent is ``dfinal_state``.
    cu_seqlens : 1-D integer array or sequence of ints, optional
        ``[0, t1, ..., T]``: packed sequences along ``T`` of a batch of one; the state
        resets to each sequence's initial state at its start, so no gradient crosses a
        boundary. Read on the host (under ``jax.jit`` pass a tuple).
    form, chunk_size
        The forward's form and chunk size. Every form computes the same function, so they
        choose only how the backward runs: ``"recurrent"``, the token loop; ``"chunk"``
        and ``"parallel"``, the chunked backward in chunks of ``chunk_size``.
    dfinal_state : array, optional
        Cotangent of the final state ``S_T`` (shape of ``initial_state``); zero if None.
    causal : True
        Causal by construction; ``True`` or either alignment (the same for ``T x T``).
    xp : namespace, optional"""

_COST_DECAY = """
    Notes
    -----
    Chunked (``form="chunk"`` or ``"parallel"``): ``O(T C (dk + dv) + T dk dv)`` time per
    leading index with ``C = chunk_size``, ``O(C^2 + (T / C) dk dv)`` extra memory
    (GLA's per-key decay by halving, ``O(T dk log C)`` exponentials), ``T / C`` Python
    steps. Token
    loop (``form="recurrent"``): ``O(T dk dv)`` time and memory, ``T`` Python steps.
    Derivation: ``docs/recurrent_backward.md``."""

_COST_DELTA = """
    Notes
    -----
    Chunked (``form="chunk"`` or ``"parallel"``, the WY/UT form recomputed per chunk):
    ``O(T C (C + dk + dv) + T dk dv)`` time per leading index with ``C = chunk_size``,
    ``O(C^2 + (T / C) dk dv)`` extra memory, ``2 T / C`` Python steps. Token loop
    (``form="recurrent"``): ``O(T dk dv)`` time and memory (the saved states), ``T``
    Python steps. Derivation: ``docs/recurrent_backward.md``."""


def _doc(cost):
    """Fill the shared parameter descriptions and the cost notes into a docstring."""
    def fill(fn):
        fn.__doc__ = fn.__doc__.replace("    {common}", _COMMON_DOC.strip("\n")).replace(
            "    {cost}", cost.strip("\n"))
        return fn
    return fill


@_doc(_COST_DECAY)
def retention(q, k, v, do, /, *, gamma, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, form="chunk", chunk_size=64, dfinal_state=None, causal=True, xp=None):
    """VJP of retention (RetNet, Sun et al. 2023): ``S_t = gamma S_{t-1} + k_t^T v_t``,
    ``o_t = scale q_t S_t``.

    Parameters
    ----------
    gamma : float or array, shape q.shape[:-2]
        The fixed decay in (0, 1] (1: causal linear attention), per head if an array;
        not differentiated.
    {common}

    Returns
    -------
    dict
        ``{"q", "k", "v"}`` and ``"initial_state"`` if given, each shaped like its input.

    {cost}

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.grad.recurrent import retention
    >>> x = xp.reshape(xp.sin(xp.arange(12.0)), (4, 3))
    >>> grads = retention(x, x, x, x, gamma=0.9)
    >>> sorted(grads), grads["k"].shape
    (['k', 'q', 'v'], (4, 3))
    """
    pb = _Problem("retention", q, k, v, do, scale=scale, initial_state=initial_state,
                  cu_seqlens=cu_seqlens, dfinal_state=dfinal_state, form=form, chunk_size=chunk_size,
                  output_final_state=output_final_state, qk_l2norm=False, causal=causal, xp=xp)
    dq, dk, dv, _, _, d0 = _run(pb, lg=_log_gamma(pb, gamma))
    return _result(pb, q, k, v, dq, dk, dv, d0, initial_state)


@_doc(_COST_DECAY)
def gated_linear_attention(q, k, v, do, /, *, g, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, form="chunk", chunk_size=64, dfinal_state=None, causal=True,
                           xp=None):
    """VJP of gated linear attention (GLA, Yang et al. 2024):
    ``S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t``, ``o_t = scale q_t S_t``.

    Parameters
    ----------
    g : array, shape (..., T, dk)
        Log gates (<= 0), one per key dimension and token; differentiated in log space.
    {common}

    Returns
    -------
    dict
        ``{"q", "k", "v", "g"}`` and ``"initial_state"`` if given, each shaped like its
        input.

    {cost}

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.grad.recurrent import gated_linear_attention
    >>> x = xp.reshape(xp.sin(xp.arange(12.0)), (4, 3))
    >>> grads = gated_linear_attention(x, x, x, x, g=-x * x)
    >>> grads["g"].shape
    (4, 3)
    """
    pb = _Problem("gated_linear_attention", q, k, v, do, scale=scale, initial_state=initial_state,
                  cu_seqlens=cu_seqlens, dfinal_state=dfinal_state, form=form, chunk_size=chunk_size,
                  output_final_state=output_final_state, qk_l2norm=False, causal=causal, xp=xp)
    lg = pb.gate("g", g, (pb.dk,), "(..., T, dk)")
    dq, dk, dv, dlg, _, d0 = _run(pb, lg=lg, per_key=True)
    out = _result(pb, q, k, v, dq, dk, dv, d0, initial_state)
    out["g"] = pb.grad(dlg, g)
    return out


@_doc(_COST_DECAY)
def ssd(q, k, v, do, /, *, g, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
        form="chunk", chunk_size=64, dfinal_state=None, causal=True, xp=None):
    """VJP of Mamba-2's state-space duality (SSD, Dao & Gu 2024), a scalar decay per
    head and token: ``S_t = exp(g_t) S_{t-1} + k_t^T v_t``, ``o_t = scale q_t S_t``.

    In Mamba-2's names ``q = C``, ``k = B``, ``v = X dt`` and ``g = A dt``; the gradient
    of ``dt`` follows by the chain rule from ``v`` and ``g``.

    Parameters
    ----------
    g : array, shape (..., T)
        Log decay (<= 0); differentiated in log space.
    {common}

    Returns
    -------
    dict
        ``{"q", "k", "v", "g"}`` and ``"initial_state"`` if given, each shaped like its
        input.

    {cost}

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.grad.recurrent import ssd
    >>> x = xp.reshape(xp.sin(xp.arange(12.0)), (4, 3))
    >>> ssd(x, x, x, x, g=-xp.ones(4))["g"].shape
    (4,)
    """
    pb = _Problem("ssd", q, k, v, do, scale=scale, initial_state=initial_state,
                  cu_seqlens=cu_seqlens, dfinal_state=dfinal_state, form=form, chunk_size=chunk_size,
                  output_final_state=output_final_state, qk_l2norm=False, causal=causal, xp=xp)
    lg = pb.gate("g", g, (), "(..., T)")
    dq, dk, dv, dlg, _, d0 = _run(pb, lg=lg[..., None])
    out = _result(pb, q, k, v, dq, dk, dv, d0, initial_state)
    out["g"] = pb.grad(dlg[..., 0], g)
    return out


@_doc(_COST_DELTA)
def delta_rule(q, k, v, do, /, *, beta, scale=None, initial_state=None, output_final_state=False,
               cu_seqlens=None, form="chunk", chunk_size=64, qk_l2norm=False, dfinal_state=None,
               causal=True, xp=None):
    """VJP of the delta rule (DeltaNet, Schlag et al. 2021; Yang et al. 2024):
    ``S_t = S_{t-1} + beta_t k_t^T (v_t - k_t S_{t-1})``, ``o_t = scale q_t S_t``.

    Parameters
    ----------
    beta : array, shape (..., T)
        Writing strengths, in (0, 1) in fla's tests (any real value is differentiated).
    qk_l2norm : bool
        Normalise ``q`` and ``k`` as fla's ``use_qk_l2norm_in_kernel`` does,
        ``x / sqrt(sum(x^2) + 1e-6)``, and differentiate through it.
    {common}

    Returns
    -------
    dict
        ``{"q", "k", "v", "beta"}`` and ``"initial_state"`` if given, each shaped like
        its input.

    {cost}

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.grad.recurrent import delta_rule
    >>> x = xp.reshape(xp.sin(xp.arange(12.0)), (4, 3))
    >>> delta_rule(x, x, x, x, beta=xp.full(4, 0.5), qk_l2norm=True)["beta"].shape
    (4,)
    """
    pb = _Problem("delta_rule", q, k, v, do, scale=scale, initial_state=initial_state,
                  cu_seqlens=cu_seqlens, dfinal_state=dfinal_state, form=form, chunk_size=chunk_size,
                  output_final_state=output_final_state, qk_l2norm=qk_l2norm, causal=causal, xp=xp)
    b = pb.gate("beta", beta, (), "(..., T)")
    dq, dk, dv, _, db, d0 = _run(pb, beta=b)
    out = _result(pb, q, k, v, dq, dk, dv, d0, initial_state)
    out["beta"] = pb.grad(db, beta)
    return out


@_doc(_COST_DELTA)
def gated_delta_rule(q, k, v, do, /, *, g, beta, scale=None, initial_state=None, output_final_state=False,
                     cu_seqlens=None, form="chunk", chunk_size=64, qk_l2norm=False, dfinal_state=None,
                     causal=True, xp=None):
    """VJP of the gated delta rule (Gated DeltaNet, Yang et al. 2025):
    ``S_t = exp(g_t) S_{t-1} + beta_t k_t^T (v_t - k_t exp(g_t) S_{t-1})``,
    ``o_t = scale q_t S_t``.

    Parameters
    ----------
    g : array, shape (..., T)
        Log decay (<= 0), one per head and token; differentiated in log space.
    beta : array, shape (..., T)
        Writing strengths.
    qk_l2norm : bool
        As in :func:`delta_rule`.
    {common}

    Returns
    -------
    dict
        ``{"q", "k", "v", "g", "beta"}`` and ``"initial_state"`` if given, each shaped
        like its input.

    {cost}

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.grad.recurrent import gated_delta_rule
    >>> x = xp.reshape(xp.sin(xp.arange(12.0)), (4, 3))
    >>> grads = gated_delta_rule(x, x, x, x, g=-xp.ones(4), beta=xp.full(4, 0.5))
    >>> sorted(grads)
    ['beta', 'g', 'k', 'q', 'v']
    """
    pb = _Problem("gated_delta_rule", q, k, v, do, scale=scale, initial_state=initial_state,
                  cu_seqlens=cu_seqlens, dfinal_state=dfinal_state, form=form, chunk_size=chunk_size,
                  output_final_state=output_final_state, qk_l2norm=qk_l2norm, causal=causal, xp=xp)
    lg = pb.gate("g", g, (), "(..., T)")
    b = pb.gate("beta", beta, (), "(..., T)")
    dq, dk, dv, dlg, db, d0 = _run(pb, lg=lg[..., None], beta=b)
    out = _result(pb, q, k, v, dq, dk, dv, d0, initial_state)
    out["g"] = pb.grad(dlg[..., 0], g)
    out["beta"] = pb.grad(db, beta)
    return out

