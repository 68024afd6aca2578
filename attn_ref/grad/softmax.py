"""Gradients of exact softmax attention: one-shot, and blockwise from the saved log-sum-exp.

With logits ``S = scale Q K^T + B`` (masked entries ``-inf``), ``P = softmax(S)`` and
``O = P V``, the cotangent ``dO`` of the output gives::

    dV = P^T dO          dP = dO V^T          D = rowsum(dO * O) = rowsum(P * dP)
    dS = P * (dP - D)    dQ = scale dS K      dK = scale dS^T Q      dB = dS

:func:`softmax_attention` materialises ``P`` (``O(Nq Nk)`` memory).
:func:`online_softmax_attention` is the FlashAttention-2 backward (Dao 2023): it
never holds more than one ``block_q x block_k`` tile, recomputing ``P`` per tile as
``exp(S - lse)`` from the log-sum-exp that :func:`online_softmax_forward` saves.

The log-sum-exp is an output too (FlashAttention's ``softmax_lse``, what ring attention
and split-KV merges combine partial results with), and a cotangent ``dlse`` of it adds
``d lse_i / dS_ij = P_ij`` to the logits' cotangent::

    dS = P * (dP - D + dlse)    (dlse broadcast along the keys)

that is, ``D`` becomes ``rowsum(dO * O) - dlse``; ``dV`` is unchanged (``lse`` does not
depend on ``V``), and ``dQ``, ``dK``, ``dB`` follow from ``dS`` as above.

The options of the forward are differentiated through as the forward applies them:
soft-capping ``S = c tanh(S0 / c)`` multiplies ``dS`` by ``1 - tanh^2(S0 / c)``; ALiBi
and ``bias`` are additive (``dB = dS``; the slopes are not differentiated); a dropout
keep-mask ``K`` with rate ``p`` gives ``dV = (P K / (1 - p))^T dO`` and
``dP = (dO V^T) K / (1 - p)``, and ``rowsum(dO * O)`` is still the softmax VJP's row
term; grouped-query attention (``gqa=True``) sums ``dK``, ``dV`` over each group of
query heads; per-sequence lengths and windows mask like ``mask``.

Masked entries have ``P = 0`` and so ``dS = 0``: gradients never leak through a mask
or a causal boundary, and a query row with no key to attend to (output zero) gives
zero gradients, not NaN. Its ``lse`` is ``+inf`` (as in FlashAttention), so the
recomputed ``P`` of that row is ``exp(-inf) = 0``, and the ``dlse`` of that row
contributes nothing, whatever its value (an infinite or NaN one included).
"""

from __future__ import annotations

import array_api_compat

from .._checks import check_positive_int
from .._common import scaled_logits
from ..softmax.online import online_forward
from ..softmax.options import group_heads, prepare_problem
from ..softmax.tiles import (
    dropout_scale,
    keep_tile,
    logit_dtype,
    row_max,
    tile_coverage,
    tile_logits,
    transposed_copy,
)
from ..softmax.varlen import packed_layout, unpack_index
from ._common import check_cotangent, through_clamp, transpose, unbroadcast

__all__ = ["softmax_attention", "online_softmax_attention", "online_softmax_forward", "varlen_attention"]


def _problem(q, k, v, opts, xp):
    return prepare_problem(q, k, v, xp=xp, **opts)


def _grouped_cotangent(pb, x, name, last, dtype=None):
    """Check ``x`` (shape ``batch + (Nq, last)``, ``q``'s dtype unless ``dtype`` is given)
    and view it like the grouped queries."""
    xp = pb.xp
    x = check_cotangent(xp, x, pb.batch + (pb.spec.nq,) + ((last,) if last is not None else ()),
                        pb.q, name=name, dtype=dtype)
    if not pb.grouped:
        return x
    hkv, g = pb.q.shape[-4], pb.q.shape[-3]
    if last is None:
        return xp.reshape(x, tuple(x.shape[:-2]) + (hkv, g, x.shape[-1]))
    return group_heads(xp, x, hkv, g)


def _finish(pb, q, k, v, bias, bias_dtype, dq, dk, dv, dbias):
    """Reduce grouped, broadcast gradients to the inputs' shapes."""
    xp = pb.xp
    out = {
        "q": xp.reshape(unbroadcast(xp, dq, pb.q.shape), q.shape),
        "k": xp.reshape(unbroadcast(xp, dk, pb.k.shape), k.shape),
        "v": xp.reshape(unbroadcast(xp, dv, pb.v.shape), v.shape),
    }
    if bias is not None:
        db = unbroadcast(xp, pb.ungroup(dbias), bias.shape)
        out["bias"] = db if db.dtype == bias_dtype else xp.astype(db, bias_dtype)
    return out


def _zeros(pb, q, k, v, bias, bias_dtype):
    xp, device = pb.xp, array_api_compat.device(q)
    out = {n: xp.zeros(x.shape, dtype=x.dtype, device=device) for n, x in (("q", q), ("k", k), ("v", v))}
    if bias is not None:
        out["bias"] = xp.zeros(bias.shape, dtype=bias_dtype, device=device)
    return out


def _lse_cotangent(pb, dlse):
    """Check ``dlse`` (shape ``batch + (Nq,)``, the lse's dtype: ``q``'s, float32 for a
    narrower one) and view it like the grouped queries, as a column ``(..., Nq, 1)`` in
    ``q``'s dtype (the one ``dS`` is formed in); None stays None."""
    if dlse is None:
        return None
    xp = pb.xp
    dlse = _grouped_cotangent(pb, dlse, "dlse", None, dtype=logit_dtype(xp, pb.q.dtype))
    dlse = dlse[..., None]
    return dlse if dlse.dtype == pb.q.dtype else xp.astype(dlse, pb.q.dtype)


def _softcap_vjp(xp, spec, ds, s0):
    """``dS0`` from ``dS`` through ``S = c tanh(S0 / c)`` (``s0``: the scaled raw logits)."""
    if spec.softcap is None:
        return ds
    t = xp.tanh(s0 / spec.softcap)
    return ds * (1 - t * t)


_OPTIONS = """
    mask, bias, causal, scale, window, chunk, softcap, alibi_slopes, dropout_p, dropout_mask,
    seqlens_q, seqlens_k, gqa, xp
        As in :func:`attn_ref.softmax_attention`. Only ``bias`` among them is
        differentiated."""


def softmax_attention(q, k, v, do, /, *, mask=None, bias=None, causal=False, scale=None, window=None,
                      chunk=None, softcap=None, alibi_slopes=None, dropout_p=0.0, dropout_mask=None,
                      seqlens_q=None, seqlens_k=None, gqa=False, dlse=None, xp=None):
    """VJP of :func:`attn_ref.softmax_attention`: the gradients of ``<do, O>``, plus
    ``<dlse, lse>`` when ``dlse`` is given.

    Parameters
    ----------
    q, k, v : arrays, shapes (..., Nq, d), (..., Nk, d), (..., Nk, dv)
    do : array, shape (..., Nq, dv)
        Cotangent of the output, in the (broadcast) batch shape of the output.
    mask, bias, causal, scale, window, chunk, softcap, alibi_slopes, dropout_p, dropout_mask,
    seqlens_q, seqlens_k, gqa, xp
        As in :func:`attn_ref.softmax_attention`. Only ``bias`` among them is
        differentiated.
    dlse : array, shape (..., Nq), optional
        Cotangent of the row log-sum-exp that :func:`online_softmax_forward` returns
        (FlashAttention's ``softmax_lse``), in the lse's dtype: ``q``'s, float32 for
        float16 and bfloat16. Adds ``dlse_i P_ij`` to ``dS``; a row with no key to
        attend to ignores its entry.

    Returns
    -------
    dict
        ``{"q": dq, "k": dk, "v": dv}`` plus ``"bias": dbias`` when a bias was given,
        each of the shape (and, for ``bias``, the dtype) of that input: gradients of
        broadcast inputs are summed over the broadcast dimensions, those of grouped
        keys and values over their query-head group.

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
    pb = _problem(q, k, v, dict(mask=mask, bias=bias, causal=causal, scale=scale, window=window, chunk=chunk,
                                softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                                dropout_mask=dropout_mask, seqlens_q=seqlens_q, seqlens_k=seqlens_k,
                                gqa=gqa), xp)
    xp, spec = pb.xp, pb.spec
    do = _grouped_cotangent(pb, do, "do", v.shape[-1])
    dlse = _lse_cotangent(pb, dlse)
    if spec.nq == 0 or spec.nk == 0:
        return _zeros(pb, q, k, v, bias, bias_dtype)
    kt = xp.matrix_transpose(pb.k)
    s, _ = tile_logits(xp, pb.q, kt, spec, 0, 0)
    p = xp.exp(s - row_max(xp, s))
    denom = xp.sum(p, axis=-1, keepdims=True)
    p = p / xp.where(denom > 0, denom, xp.ones_like(denom))
    p = p if p.dtype == pb.q.dtype else xp.astype(p, pb.q.dtype)  # float16: logits in float32
    drop = dropout_scale(spec)
    pd = keep_tile(xp, p, spec, 0, 0)
    if drop != 1.0:
        pd = pd * drop
    dv = transpose(xp, pd) @ do
    dp = keep_tile(xp, do @ transpose(xp, pb.v), spec, 0, 0)
    if drop != 1.0:
        dp = dp * drop
    dcoef = xp.sum(p * dp, axis=-1, keepdims=True)
    if dlse is not None:
        # d lse_i / dS_ij = P_ij: the lse's cotangent joins the row term. A row with no
        # key (denominator 0) has P = 0, and its dlse is dropped so that an inf or NaN
        # there cannot make 0 * inf.
        dcoef = dcoef - xp.where(denom > 0, dlse, xp.zeros_like(dlse))
    ds = through_clamp(xp, p * (dp - dcoef), s)
    ds0 = _softcap_vjp(xp, spec, ds, scaled_logits(xp, pb.q @ kt, spec.scale)
                       if spec.softcap is not None else None)
    dq = (ds0 @ pb.k) * spec.scale
    dk = (transpose(xp, ds0) @ pb.q) * spec.scale
    return _finish(pb, q, k, v, bias, bias_dtype, dq, dk, dv, ds)


def online_softmax_forward(
    q, k, v, /, *, mask=None, bias=None, causal=False, scale=None, window=None, chunk=None, softcap=None,
    alibi_slopes=None, dropout_p=0.0, dropout_mask=None, seqlens_q=None, seqlens_k=None, gqa=False,
    block_q=512, block_k=1024, xp=None,
):
    """:func:`attn_ref.online_softmax_attention` that also returns the row log-sum-exp.

    Returns
    -------
    out : array, shape (..., Nq, dv)
        The attention output.
    lse : array, shape (..., Nq)
        ``log(sum_j exp(S_ij))`` of the masked logits ``S`` (scaled, soft-capped, plus
        bias and ALiBi; before dropout); ``+inf`` for a row with no key to attend to
        (FlashAttention's convention), so that ``exp(S - lse)`` is 0 on that row. In
        ``q``'s dtype, except float32 for float16 and bfloat16 ``q`` (the dtype the logits
        are computed in, as FlashAttention's ``softmax_lse``): finite wherever the logits are.

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
    pb = _problem(q, k, v, dict(mask=mask, bias=bias, causal=causal, scale=scale, window=window, chunk=chunk,
                                softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                                dropout_mask=dropout_mask, seqlens_q=seqlens_q, seqlens_k=seqlens_k,
                                gqa=gqa), xp)
    check_positive_int("block_q", block_q)
    check_positive_int("block_k", block_k)
    # lse stays in the logits' dtype: float32 for float16 and bfloat16 input (as
    # FlashAttention's softmax_lse), where a logit near 65504 plus log(Nk) is past float16.
    out, lse = online_forward(pb, block_q, block_k)
    lse = pb.ungroup(lse[..., None])[..., 0] if pb.grouped else lse
    return pb.ungroup(out), lse


def _bias_piece(xp, ds, bias):
    """Sum a tile's ``dS`` over the dimensions along which the (grouped) ``bias`` broadcasts."""
    g = unbroadcast(xp, ds, tuple(bias.shape[:-2]) + tuple(ds.shape[-2:]))
    axes = tuple(a for a in (-2, -1) if bias.shape[a] == 1)
    return xp.sum(g, axis=axes, keepdims=True) if axes else g


def online_softmax_attention(
    q, k, v, do, /, *, mask=None, bias=None, causal=False, scale=None, window=None, chunk=None, softcap=None,
    alibi_slopes=None, dropout_p=0.0, dropout_mask=None, seqlens_q=None, seqlens_k=None, gqa=False,
    block_q=512, block_k=1024, out=None, lse=None, dlse=None, xp=None,
):
    """Blockwise VJP of :func:`attn_ref.online_softmax_attention` (FlashAttention-2 backward).

    For each key block ``j`` and query block ``i`` (tiles that causal masking or a
    window hide entirely are skipped)::

        P_ij = exp(S_ij - lse_i)           (recomputed from q, k, bias, mask, ...)
        dV_j += (P_ij K_ij / (1-p))^T dO_i dP_ij = (dO_i V_j^T) K_ij / (1-p)
        dS_ij = P_ij * (dP_ij - D_i)       with D = rowsum(dO * O) - dlse, computed once
        dQ_i += scale dS_ij K_j            dK_j += scale dS_ij^T Q_i

    (``K_ij``: the dropout keep-mask tile, 1 without dropout; soft-capping multiplies
    ``dS`` by ``1 - tanh^2`` of the tile's capped logits before ``dQ``, ``dK``.)

    Parameters
    ----------
    q, k, v, do, mask, bias, causal, scale, window, chunk, softcap, alibi_slopes, dropout_p,
    dropout_mask, seqlens_q, seqlens_k, gqa, xp
        As in :func:`softmax_attention`.
    block_q, block_k : int
        Tile sizes; sequence lengths need not be multiples of them.
    out, lse : arrays, shapes (..., Nq, dv) and (..., Nq), optional
        The forward's output and log-sum-exp from :func:`online_softmax_forward`
        (what a training step saves). When omitted they are recomputed with that
        function and the same tiling. Give both or neither.
    dlse : array, shape (..., Nq), optional
        Cotangent of the forward's ``lse``, as in :func:`softmax_attention`.

    Returns
    -------
    dict
        As :func:`softmax_attention`; equal to it up to rounding.

    Notes
    -----
    ``O(Nq Nk (d + dv))`` time (five matrix products per tile, 2.5x the forward's);
    ``O(block_q block_k)`` extra memory per batch entry for the tile plus ``O(N d)`` for
    transposed copies and the gradients - never ``O(Nq Nk)``, except ``dbias`` when
    ``bias`` itself is ``(Nq, Nk)``.

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
    pb = _problem(q, k, v, dict(mask=mask, bias=bias, causal=causal, scale=scale, window=window, chunk=chunk,
                                softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                                dropout_mask=dropout_mask, seqlens_q=seqlens_q, seqlens_k=seqlens_k,
                                gqa=gqa), xp)
    xp, spec = pb.xp, pb.spec
    check_positive_int("block_q", block_q)
    check_positive_int("block_k", block_k)
    do = _grouped_cotangent(pb, do, "do", v.shape[-1])
    dlse = _lse_cotangent(pb, dlse)
    if (out is None) != (lse is None):
        raise ValueError("give both out and lse (from online_softmax_forward) or neither")
    if out is None:
        out, lse = online_forward(pb, block_q, block_k)
    else:
        out = _grouped_cotangent(pb, out, "out", v.shape[-1])
        lse = _grouped_cotangent(pb, lse, "lse", None, dtype=logit_dtype(xp, pb.q.dtype))
    nq, nk = spec.nq, spec.nk
    if nq == 0 or nk == 0:
        return _zeros(pb, q, k, v, bias, bias_dtype)
    device, dtype = array_api_compat.device(pb.q), pb.q.dtype
    drop = dropout_scale(spec)
    # Every matrix product below takes row-major operands (NumPy's stacked matmul only
    # calls BLAS on those): the transposed ones are copied once here, O(N d), and dK, dV
    # are accumulated transposed, dK_j^T += Q_i^T dS_ij, dV_j^T += dO_i^T P_ij. The scale
    # multiplies dQ and dK once at the end, never q: scale * q may overflow where the
    # logits (tile_logits scales the products) do not.
    kt, vt = transposed_copy(xp, pb.k), transposed_copy(xp, pb.v)
    qt, dot = transposed_copy(xp, pb.q), transposed_copy(xp, do)
    # D_i = rowsum(dO_i * O_i) equals rowsum(P_i * dP_i): the softmax VJP's row term.
    dcoef = xp.sum(do * out, axis=-1, keepdims=True)
    lse = lse[..., None]
    if dlse is not None:
        # d lse_i / dS_ij = P_ij: dS = P * (dP - D + dlse). Rows with no key (lse = +inf,
        # P = 0) drop their dlse, so that an inf or NaN there cannot make 0 * inf.
        live = lse < xp.inf
        dcoef = dcoef - xp.where(live, dlse, xp.zeros_like(dlse))
    qblocks = [(q0, min(q0 + block_q, nq)) for q0 in range(0, nq, block_q)]
    kblocks = [(k0, min(k0 + block_k, nk)) for k0 in range(0, nk, block_k)]
    dq = [None] * len(qblocks)
    dkt, dvt = [], []
    sb = spec.bias
    bias_rows = None if sb is None else (1 if sb.shape[-2] == 1 else len(qblocks))
    bias_cols = None if sb is None else (1 if sb.shape[-1] == 1 else len(kblocks))
    db = {}
    for j, (k0, k1) in enumerate(kblocks):
        kb, ktb, vtb = pb.k[..., k0:k1, :], kt[..., k0:k1], vt[..., k0:k1]
        dkt_j = dvt_j = None
        for i, (q0, q1) in enumerate(qblocks):
            if tile_coverage(spec, q0, q1, k0, k1) == "none":
                continue
            qb = pb.q[..., q0:q1, :]
            s, _ = tile_logits(xp, qb, ktb, spec, q0, k0)
            # exp(S - lse) is P exactly: the forward's normaliser is in lse.
            p = xp.exp(s - lse[..., q0:q1, :])
            p = p if p.dtype == dtype else xp.astype(p, dtype)  # float16: logits in float32
            pd = keep_tile(xp, p, spec, q0, k0)
            dp = keep_tile(xp, do[..., q0:q1, :] @ vtb, spec, q0, k0)
            if drop != 1.0:
                pd, dp = pd * drop, dp * drop
            ds = through_clamp(xp, p * (dp - dcoef[..., q0:q1, :]), s)
            ds0 = _softcap_vjp(xp, spec, ds, scaled_logits(xp, qb @ ktb, spec.scale)
                               if spec.softcap is not None else None)
            dvt_ij = dot[..., q0:q1] @ pd
            dkt_ij = qt[..., q0:q1] @ ds0
            dq_ij = ds0 @ kb
            dvt_j = dvt_ij if dvt_j is None else dvt_j + dvt_ij
            dkt_j = dkt_ij if dkt_j is None else dkt_j + dkt_ij
            dq[i] = dq_ij if dq[i] is None else dq[i] + dq_ij
            if sb is not None:
                key = (i if bias_rows > 1 else 0, j if bias_cols > 1 else 0)
                piece = _bias_piece(xp, ds, sb)
                db[key] = piece if key not in db else db[key] + piece
        # Tiles hidden by causal masking or a window leave whole key blocks untouched.
        dkt.append(xp.zeros(pb.batch_g + (pb.q.shape[-1], k1 - k0), dtype=dtype, device=device)
                   if dkt_j is None else dkt_j)
        dvt.append(xp.zeros(pb.batch_g + (pb.v.shape[-1], k1 - k0), dtype=dtype, device=device)
                   if dvt_j is None else dvt_j)
    dq = [xp.zeros(pb.batch_g + (q1 - q0, pb.q.shape[-1]), dtype=dtype, device=device) if g is None else g
          for g, (q0, q1) in zip(dq, qblocks)]

    def cat(xs, axis):
        return xs[0] if len(xs) == 1 else xp.concat(xs, axis=axis)

    dbias = None
    if sb is not None:
        lead = tuple(sb.shape[:-2])
        rows = []
        for i in range(bias_rows):
            r = 1 if sb.shape[-2] == 1 else qblocks[i][1] - qblocks[i][0]
            cols = []
            for j in range(bias_cols):
                c = 1 if sb.shape[-1] == 1 else kblocks[j][1] - kblocks[j][0]
                cols.append(db.get((i, j), xp.zeros(lead + (r, c), dtype=dtype, device=device)))
            rows.append(cat(cols, -1))
        dbias = cat(rows, -2)
        if pb.grouped and dbias.ndim >= 4:
            # The grouped bias view (..., Hkv|1, g|1, ., .) back to per-query-head.
            dbias = xp.reshape(dbias, tuple(dbias.shape[:-4]) + (dbias.shape[-4] * dbias.shape[-3],)
                               + tuple(dbias.shape[-2:]))
        dbias = unbroadcast(xp, dbias, bias.shape) if dbias.ndim >= bias.ndim else dbias
        dbias = dbias if dbias.dtype == bias_dtype else xp.astype(dbias, bias_dtype)
    g = _finish(pb, q, k, v, None, None, cat(dq, -2) * spec.scale, transpose(xp, cat(dkt, -1)) * spec.scale,
                transpose(xp, cat(dvt, -1)), None)
    if bias is not None:
        g["bias"] = xp.reshape(dbias, bias.shape)
    return g


def varlen_attention(q, k, v, do, /, *, cu_seqlens_q, cu_seqlens_k, causal=False, scale=None,
                     window=None, chunk=None, softcap=None, alibi_slopes=None, dropout_p=0.0,
                     dropout_mask=None, online=False, block_q=512, block_k=1024, xp=None):
    """VJP of :func:`attn_ref.varlen_attention` (packed variable-length batches).

    ``q (total_q, Hq, d)``, ``k (total_k, Hkv, d)``, ``v (total_k, Hkv, dv)`` and
    ``do (total_q, Hq, dv)``; returns ``{"q", "k", "v"}`` in the packed shapes. The
    sequences are unpacked to a padded batch exactly as the forward does, differentiated
    with :func:`softmax_attention` (or blockwise with ``online=True``) with per-sequence
    lengths, and the gradients of the real rows are packed back: no gradient crosses a
    sequence boundary.
    """
    xp = array_api_compat.array_namespace(q, k, v) if xp is None else xp
    cq, ck, lq, lk = packed_layout(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                   extra=(("do", do, "(total_q, Hq, dv)"),))
    device = array_api_compat.device(q)
    nb = len(cq) - 1
    wq, wk = max(lq, default=0), max(lk, default=0)
    if q.shape[0] == 0 or k.shape[0] == 0:
        return {n: xp.zeros(x.shape, dtype=x.dtype, device=device) for n, x in (("q", q), ("k", k), ("v", v))}

    def unpack(x, offsets, width):
        idx = xp.asarray(unpack_index(offsets, width), dtype=xp.int64, device=device)
        x = xp.reshape(xp.take(x, idx, axis=0), (nb, width) + tuple(x.shape[1:]))
        return xp.permute_dims(x, (0, 2, 1, 3))

    def pack(x, lens, width):
        x = xp.reshape(xp.permute_dims(x, (0, 2, 1, 3)), (nb * width,) + (x.shape[1], x.shape[3]))
        rows = [b * width + i for b in range(nb) for i in range(lens[b])]
        return xp.take(x, xp.asarray(rows, dtype=xp.int64, device=device), axis=0)

    kw = dict(causal=causal, scale=scale, window=window, chunk=chunk, softcap=softcap,
              alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_mask=dropout_mask,
              seqlens_q=xp.asarray(lq, dtype=xp.int64, device=device),
              seqlens_k=xp.asarray(lk, dtype=xp.int64, device=device), gqa=True, xp=xp)
    args = (unpack(q, cq, wq), unpack(k, ck, wk), unpack(v, ck, wk), unpack(do, cq, wq))
    if online:
        g = online_softmax_attention(*args, block_q=block_q, block_k=block_k, **kw)
    else:
        g = softmax_attention(*args, **kw)
    # Padding slots repeat a real row, but they are masked, so their gradients are zero
    # and keeping only the real rows is the exact VJP of the unpacking gather.
    return {"q": pack(g["q"], lq, wq), "k": pack(g["k"], lk, wk), "v": pack(g["v"], lk, wk)}
