"""Gradients of exact softmax attention: one-shot, and blockwise from the saved log-sum-exp.

With logits ``S = scale Q K^T + B`` (masked entries ``-inf``), ``P = softmax(S)`` and
``O = P V``, the cotangent ``dO`` of the output gives::

    dV = P^T dO          dP = dO V^T          D = rowsum(dO * O) = rowsum(P * dP)
    dS = P * (dP - D)    dQ = scale dS K      dK = scale dS^T Q      dB = dS

:func:`softmax_attention` materialises ``P`` (``O(Nq Nk)`` memory).
:func:`online_softmax_attention` is the FlashAttention-2 backward (Dao 2023): it
never holds more than one ``block_q x block_k`` tile, recomputing ``P`` per tile as
``exp(S - lse)`` from the log-sum-exp that :func:`online_softmax_forward` saves.

Masked entries have ``P = 0`` and so ``dS = 0``: gradients never leak through a mask
or a causal boundary, and a query row with no key to attend to (output zero) gives
zero gradients, not NaN. Its ``lse`` is ``+inf`` (as in FlashAttention), so the
recomputed ``P`` of that row is ``exp(-inf) = 0``.
"""

from __future__ import annotations

import array_api_compat

from .._checks import check_bias, check_mask, check_positive_int, check_qkv, default_scale
from ..softmax import TOP_LEFT, attention_weights, causal_alignment
from ._common import check_cotangent, softmax_vjp, transpose, unbroadcast

__all__ = ["softmax_attention", "online_softmax_attention", "online_softmax_forward"]


def _prepare(q, k, v, mask, bias, causal, scale, xp):
    xp, batch = check_qkv(q, k, v, xp=xp)
    nq, nk = q.shape[-2], k.shape[-2]
    mask = check_mask(xp, mask, batch, nq, nk)
    bias = check_bias(xp, bias, batch, nq, nk, q.dtype)
    return xp, batch, nq, nk, mask, bias, causal_alignment(causal), default_scale(q.shape[-1], scale)


def _row_major(xp, x):
    """A fresh row-major copy of ``x``: NumPy's stacked matmul only calls BLAS on those."""
    return xp.reshape(xp.reshape(x, (-1,)), x.shape)


def _offset(alignment, nq, nk):
    # Query i may see key j iff j <= i + offset.
    return 0 if alignment == TOP_LEFT else nk - nq


def _coverage(alignment, nq, nk, q0, q1, k0, k1):
    """Is the causal tile ``[q0, q1) x [k0, k1)`` fully visible, fully hidden or mixed?"""
    if alignment is None:
        return "all"
    off = _offset(alignment, nq, nk)
    if k1 - 1 <= q0 + off:
        return "all"
    if k0 > q1 - 1 + off:
        return "none"
    return "partial"


def _tile(x, q0, q1, k0, k1):
    """Slice a ``(..., Nq|1, Nk|1)`` broadcastable array to one tile."""
    rows = slice(q0, q1) if x.shape[-2] != 1 else slice(None)
    cols = slice(k0, k1) if x.shape[-1] != 1 else slice(None)
    return x[..., rows, cols]


def _tile_logits(xp, qs, kt, mask, bias, alignment, nq, nk, q0, k0):
    """Logits ``qs @ kt + bias`` of one tile (scale already in ``qs``), ``-inf`` where not allowed."""
    q1, k1 = q0 + qs.shape[-2], k0 + kt.shape[-1]
    s = qs @ kt
    if bias is not None:
        s = s + _tile(bias, q0, q1, k0, k1)
    allowed = None if mask is None else _tile(mask, q0, q1, k0, k1)
    if _coverage(alignment, nq, nk, q0, q1, k0, k1) != "all":
        device = array_api_compat.device(qs)
        qi = xp.arange(q0, q1, device=device)
        kj = xp.arange(k0, k1, device=device)
        causal = kj[None, :] <= (qi[:, None] + _offset(alignment, nq, nk))
        allowed = causal if allowed is None else xp.logical_and(allowed, causal)
    return s if allowed is None else xp.where(allowed, s, -xp.inf)


def _cotangent(xp, q, v, do, batch):
    return check_cotangent(xp, do, batch + (q.shape[-2], v.shape[-1]), q.dtype)


def _finish(xp, q, k, v, bias, bias_dtype, dq, dk, dv, dbias):
    out = {
        "q": unbroadcast(xp, dq, q.shape),
        "k": unbroadcast(xp, dk, k.shape),
        "v": unbroadcast(xp, dv, v.shape),
    }
    if bias is not None:
        db = unbroadcast(xp, dbias, bias.shape)
        out["bias"] = db if db.dtype == bias_dtype else xp.astype(db, bias_dtype)
    return out


def _zeros_like_inputs(xp, q, k, v, bias, bias_dtype, batch):
    device = array_api_compat.device(q)
    z = lambda shape, dt=q.dtype: xp.zeros(shape, dtype=dt, device=device)  # noqa: E731
    out = {"q": z(q.shape), "k": z(k.shape), "v": z(v.shape)}
    if bias is not None:
        out["bias"] = z(bias.shape, bias_dtype)
    return out


def softmax_attention(q, k, v, do, /, *, mask=None, bias=None, causal=False, scale=None, xp=None):
    """VJP of :func:`attn_ref.softmax_attention`: the gradients of ``<do, O>``.

    Parameters
    ----------
    q, k, v : arrays, shapes (..., Nq, d), (..., Nk, d), (..., Nk, dv)
    do : array, shape (..., Nq, dv)
        Cotangent of the output, in the broadcast batch shape of the output.
    mask, bias, causal, scale, xp
        As in :func:`attn_ref.softmax_attention` (they are not differentiated, except
        ``bias``).

    Returns
    -------
    dict
        ``{"q": dq, "k": dk, "v": dv}`` plus ``"bias": dbias`` when a bias was given,
        each of the shape (and, for ``bias``, the dtype) of that input: gradients of
        broadcast inputs are summed over the broadcast dimensions.

    Notes
    -----
    ``O(Nq Nk (d + dv))`` time, ``O(Nq Nk)`` extra memory. Rows with no key to attend
    to contribute nothing: their ``dq`` row is zero.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import grad
    >>> q = k = xp.asarray([[0.0, 0.0], [0.0, 0.0]])
    >>> v = xp.asarray([[1.0], [3.0]])
    >>> g = grad.softmax_attention(q, k, v, xp.ones((2, 1)))
    >>> g["v"][:, 0]    # each output is the mean of v: each v row gets 1/2 + 1/2
    Array([1., 1.], dtype=array_api_strict.float64)
    """
    bias_dtype = None if bias is None else bias.dtype
    xp, batch, nq, nk, mask, bias, alignment, scale = _prepare(q, k, v, mask, bias, causal, scale, xp)
    do = _cotangent(xp, q, v, do, batch)
    if nq == 0 or nk == 0:
        return _zeros_like_inputs(xp, q, k, v, bias, bias_dtype, batch)
    p = attention_weights(q, k, mask=mask, bias=bias, causal=alignment or False, scale=scale, xp=xp)
    dv = transpose(xp, p) @ do
    ds = softmax_vjp(xp, p, do @ transpose(xp, v))
    dq = (ds @ k) * scale
    dk = (transpose(xp, ds) @ q) * scale
    return _finish(xp, q, k, v, bias, bias_dtype, dq, dk, dv, ds)


def online_softmax_forward(
    q, k, v, /, *, mask=None, bias=None, causal=False, scale=None, block_q=512, block_k=1024, xp=None,
):
    """:func:`attn_ref.online_softmax_attention` that also returns the row log-sum-exp.

    Returns
    -------
    out : array, shape (..., Nq, dv)
        The attention output.
    lse : array, shape (..., Nq)
        ``log(sum_j exp(S_ij))`` of the masked logits ``S = scale Q K^T + bias``;
        ``+inf`` for a row with no key to attend to (FlashAttention's convention), so
        that ``exp(S - lse)`` is 0 on that row.

    Notes
    -----
    Same recurrence, cost and tiling as :func:`attn_ref.online_softmax_attention`;
    ``O(block_q block_k)`` extra memory per batch entry.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.grad import online_softmax_forward
    >>> x = xp.zeros((3, 2))
    >>> out, lse = online_softmax_forward(x, x, x)
    >>> float(lse[0]) == float(xp.log(xp.asarray(3.0)))
    True
    """
    xp, batch, nq, nk, mask, bias, alignment, scale = _prepare(q, k, v, mask, bias, causal, scale, xp)
    check_positive_int("block_q", block_q)
    check_positive_int("block_k", block_k)
    device = array_api_compat.device(q)
    dv = v.shape[-1]
    if nq == 0 or nk == 0:
        return (xp.zeros(batch + (nq, dv), dtype=q.dtype, device=device),
                xp.full(batch + (nq,), xp.inf, dtype=q.dtype, device=device))
    qs = q * scale
    kt = _row_major(xp, xp.matrix_transpose(k))
    outs, lses = [], []
    for q0 in range(0, nq, block_q):
        q1 = min(q0 + block_q, nq)
        shape = batch + (q1 - q0, 1)
        m = xp.full(shape, -xp.inf, dtype=q.dtype, device=device)
        l = xp.zeros(shape, dtype=q.dtype, device=device)
        acc = xp.zeros(batch + (q1 - q0, dv), dtype=q.dtype, device=device)
        for k0 in range(0, nk, block_k):
            k1 = min(k0 + block_k, nk)
            if _coverage(alignment, nq, nk, q0, q1, k0, k1) == "none":
                continue
            s = _tile_logits(xp, qs[..., q0:q1, :], kt[..., k0:k1], mask, bias, alignment, nq, nk, q0, k0)
            m_new = xp.maximum(m, xp.max(s, axis=-1, keepdims=True))
            m_safe = xp.where(m_new == -xp.inf, xp.zeros_like(m_new), m_new)
            p = xp.exp(s - m_safe)
            alpha = xp.exp(m - m_safe)
            l = l * alpha + xp.sum(p, axis=-1, keepdims=True)
            acc = acc * alpha + p @ v[..., k0:k1, :]
            m = m_new
        empty = l == 0
        outs.append(acc / xp.where(empty, xp.ones_like(l), l))
        m_safe = xp.where(empty, xp.zeros_like(m), m)
        lse = xp.where(empty, xp.full_like(l, xp.inf), m_safe + xp.log(xp.where(empty, xp.ones_like(l), l)))
        lses.append(lse[..., 0])
    if len(outs) == 1:
        return outs[0], lses[0]
    return xp.concat(outs, axis=-2), xp.concat(lses, axis=-1)


def _bias_piece(xp, ds, bias, batch):
    """Sum a tile's ``dS`` over the dimensions along which ``bias`` broadcasts."""
    g = unbroadcast(xp, ds, tuple(bias.shape[:-2]) + tuple(ds.shape[-2:]))
    axes = tuple(a for a in (-2, -1) if bias.shape[a] == 1)
    return xp.sum(g, axis=axes, keepdims=True) if axes else g


def online_softmax_attention(
    q, k, v, do, /, *, mask=None, bias=None, causal=False, scale=None, block_q=512, block_k=1024,
    out=None, lse=None, xp=None,
):
    """Blockwise VJP of :func:`attn_ref.online_softmax_attention` (FlashAttention-2 backward).

    For each key block ``j`` and query block ``i`` (causal tiles wholly in the future
    are skipped)::

        P_ij = exp(S_ij - lse_i)           (recomputed, S_ij from q, k, bias, mask)
        dV_j += P_ij^T dO_i                dP_ij = dO_i V_j^T
        dS_ij = P_ij * (dP_ij - D_i)       with D = rowsum(dO * O), computed once
        dQ_i += scale dS_ij K_j            dK_j += scale dS_ij^T Q_i

    Parameters
    ----------
    q, k, v, do, mask, bias, causal, scale, xp
        As in :func:`softmax_attention`.
    block_q, block_k : int
        Tile sizes; sequence lengths need not be multiples of them.
    out, lse : arrays, shapes (..., Nq, dv) and (..., Nq), optional
        The forward's output and log-sum-exp from :func:`online_softmax_forward`
        (what a training step saves). When omitted they are recomputed with that
        function and the same tiling. Give both or neither.

    Returns
    -------
    dict
        As :func:`softmax_attention`; equal to it up to rounding.

    Notes
    -----
    ``O(Nq Nk (d + dv))`` time (about 2.5x the forward's matrix products);
    ``O(block_q block_k)`` extra memory per batch entry for the tile, plus the
    gradients themselves - never ``O(Nq Nk)``, except ``dbias`` when ``bias`` itself
    is ``(Nq, Nk)``.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import grad
    >>> x = xp.reshape(xp.sin(xp.arange(30.0)), (5, 6))
    >>> a = grad.online_softmax_attention(x, x, x, x, causal=True, block_q=2, block_k=3)
    >>> b = grad.softmax_attention(x, x, x, x, causal=True)
    >>> all(bool(xp.max(xp.abs(a[n] - b[n])) < 1e-13) for n in "qkv")
    True
    """
    bias_dtype = None if bias is None else bias.dtype
    xp, batch, nq, nk, mask, bias, alignment, scale = _prepare(q, k, v, mask, bias, causal, scale, xp)
    check_positive_int("block_q", block_q)
    check_positive_int("block_k", block_k)
    do = _cotangent(xp, q, v, do, batch)
    if (out is None) != (lse is None):
        raise ValueError("give both out and lse (from online_softmax_forward) or neither")
    if out is None:
        out, lse = online_softmax_forward(q, k, v, mask=mask, bias=bias, causal=alignment or False,
                                          scale=scale, block_q=block_q, block_k=block_k, xp=xp)
    else:
        out = check_cotangent(xp, out, batch + (nq, v.shape[-1]), q.dtype, name="out")
        lse = check_cotangent(xp, lse, batch + (nq,), q.dtype, name="lse")
    if nq == 0 or nk == 0:
        return _zeros_like_inputs(xp, q, k, v, bias, bias_dtype, batch)
    device = array_api_compat.device(q)

    qs = q * scale
    # Every matrix product below takes row-major operands (see _row_major): the
    # transposed ones are copied once here, O(N d), and dK, dV are accumulated
    # transposed, dK_j^T += (scale Q_i)^T dS_ij and dV_j^T += dO_i^T P_ij.
    kt = _row_major(xp, transpose(xp, k))
    vt = _row_major(xp, transpose(xp, v))
    qst = _row_major(xp, transpose(xp, qs))
    dot = _row_major(xp, transpose(xp, do))
    # D_i = rowsum(dO_i * O_i) equals rowsum(P_i * dP_i): the softmax VJP's row term.
    dcoef = xp.sum(do * out, axis=-1, keepdims=True)
    lse = lse[..., None]
    qblocks = [(q0, min(q0 + block_q, nq)) for q0 in range(0, nq, block_q)]
    kblocks = [(k0, min(k0 + block_k, nk)) for k0 in range(0, nk, block_k)]
    dq = [None] * len(qblocks)
    dkt, dvt = [], []
    bias_rows = None if bias is None else (1 if bias.shape[-2] == 1 else len(qblocks))
    bias_cols = None if bias is None else (1 if bias.shape[-1] == 1 else len(kblocks))
    db = {}
    for j, (k0, k1) in enumerate(kblocks):
        kb, ktb, vtb = k[..., k0:k1, :], kt[..., k0:k1], vt[..., k0:k1]
        dkt_j = dvt_j = None
        for i, (q0, q1) in enumerate(qblocks):
            if _coverage(alignment, nq, nk, q0, q1, k0, k1) == "none":
                continue
            s = _tile_logits(xp, qs[..., q0:q1, :], ktb, mask, bias, alignment, nq, nk, q0, k0)
            # Row-wise exp(S - lse) is P exactly: the forward's normaliser is in lse.
            p = xp.exp(s - lse[..., q0:q1, :])
            ds = p * (do[..., q0:q1, :] @ vtb - dcoef[..., q0:q1, :])
            dvt_ij = dot[..., q0:q1] @ p
            dkt_ij = qst[..., q0:q1] @ ds
            dq_ij = ds @ kb
            dvt_j = dvt_ij if dvt_j is None else dvt_j + dvt_ij
            dkt_j = dkt_ij if dkt_j is None else dkt_j + dkt_ij
            dq[i] = dq_ij if dq[i] is None else dq[i] + dq_ij
            if bias is not None:
                key = (i if bias_rows > 1 else 0, j if bias_cols > 1 else 0)
                piece = _bias_piece(xp, ds, bias, batch)
                db[key] = piece if key not in db else db[key] + piece
        # Causal tiles wholly in the future leave whole key blocks without a contribution.
        dkt.append(xp.zeros(batch + (q.shape[-1], k1 - k0), dtype=q.dtype, device=device)
                   if dkt_j is None else dkt_j)
        dvt.append(xp.zeros(batch + (v.shape[-1], k1 - k0), dtype=q.dtype, device=device)
                   if dvt_j is None else dvt_j)
    dq = [xp.zeros(batch + (q1 - q0, q.shape[-1]), dtype=q.dtype, device=device) if g is None else g
          for g, (q0, q1) in zip(dq, qblocks)]
    cat = lambda xs, axis: xs[0] if len(xs) == 1 else xp.concat(xs, axis=axis)  # noqa: E731
    dbias = None
    if bias is not None:
        lead = tuple(bias.shape[:-2])
        rows = []
        for i in range(bias_rows):
            r = 1 if bias.shape[-2] == 1 else qblocks[i][1] - qblocks[i][0]
            cols = []
            for j in range(bias_cols):
                c = 1 if bias.shape[-1] == 1 else kblocks[j][1] - kblocks[j][0]
                cols.append(db.get((i, j), xp.zeros(lead + (r, c), dtype=q.dtype, device=device)))
            rows.append(cat(cols, -1))
        dbias = cat(rows, -2)
    dk = transpose(xp, cat(dkt, -1))
    dv = transpose(xp, cat(dvt, -1))
    return _finish(xp, q, k, v, bias, bias_dtype, cat(dq, -2) * scale, dk, dv, dbias)

