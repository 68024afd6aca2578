"""Gradients of linear attention, in each of the forward's orders.

The forward (:mod:`attn_ref.linear`) is ``out = num / den`` with, for features
``Fq = scale phi(Q)`` and ``Fk = phi(K)``, ``num = Fq Fk^T V`` and ``den = rowsum(Fq Fk^T)``
(masked when causal). Its VJP is taken step by step, in the same order as the forward
so that the backward has the forward's cost:

* readout: ``dnum = dO / den``, ``dden = -rowsum(dO * out) / den`` (zero where the
  denominator was floored to ``+-eps``, a constant there);
* quadratic order: ``dA = dnum V^T + dden`` (masked), ``dV = A^T dnum``,
  ``dFq = dA Fk``, ``dFk = dA^T Fq``;
* linear order: with ``S = Fk^T V``, ``z = colsum Fk``: ``dFq = dnum S^T + dden z^T``,
  ``dS = Fq^T dnum``, ``dz = Fq^T dden``, ``dFk = V dS^T + dz``, ``dV = Fk dS``;
* causal chunked: the same per chunk, the exclusive prefix sum of chunk states
  turning into a reversed exclusive prefix sum of their cotangents (``dS_c`` collects
  ``dS_prev`` of every later chunk), plus the quadratic VJP of the masked
  intra-chunk block. ``O(N C + (N/C) d' dv)`` extra memory, like the forward.
* feature map: ``elu+1``: ``g * (1 if x > 0 else exp(x))``; ``relu``:
  ``g * (x > 0)``; ``identity``: ``g``. A callable feature map needs its VJP
  ``feature_map_vjp(x, g) -> dx``.
"""

from __future__ import annotations

import array_api_compat

from .._checks import check_qkv
from .._common import TOP_LEFT, causal_offset, ceil_div
from ..linear import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CHUNK_SIZE,
    DEFAULT_EPS,
    align_square,
    causal_visible,
    check_engine_options,
    check_feature_map,
    check_scale,
    chunked_values,
    features_qk,
    kv_state,
    pad_rows,
    quadratic_order,
    safe_denominator,
    split_num_den,
    state_readout,
    with_ones,
)
from ._common import check_cotangent, transpose, unbroadcast

__all__ = ["linear_attention", "linear_from_features", "feature_map_backward"]


def _linear_noncausal(xp, fq, fk, v):
    """Non-causal linear attention ``(num, den)``: the state ``(S, z)`` read out by ``fq``."""
    s, z = kv_state(xp, fk, v)
    return state_readout(xp, fq, s, z)


def _chunked_causal(xp, fq, fk, v, chunk_size):
    """Top-left causal linear attention of square ``(fq, fk, v)``: ``(num, den)``."""
    out, _ = chunked_values(xp, fq, fk, with_ones(xp, v), chunk_size)
    return split_num_den(xp, out)


def feature_map_backward(x, g, /, *, feature_map="elu+1", vjp=None, xp=None):
    """VJP of a feature map: the cotangent of ``x`` given ``g``, that of ``phi(x)``.

    ``vjp(x, g) -> dx`` is required for a callable ``feature_map`` (the array API
    cannot differentiate it) and ignored for the named maps.
    """
    xp = array_api_compat.array_namespace(x) if xp is None else xp
    feature_map = check_feature_map(feature_map)
    if callable(feature_map):
        if vjp is None:
            raise TypeError(
                "feature_map is a callable, so its derivative is unknown: pass "
                "feature_map_vjp=(x, g) -> dx, the VJP of the callable"
            )
        dx = vjp(x, g)
        if tuple(dx.shape) != tuple(x.shape):
            raise ValueError(
                f"feature_map_vjp must return the shape of its input x {tuple(x.shape)}, "
                f"got {tuple(dx.shape)}"
            )
        return dx
    zero = xp.zeros((), dtype=x.dtype, device=array_api_compat.device(x))
    if feature_map == "identity":
        return g
    if feature_map == "relu":
        return xp.where(x > zero, g, zero)
    # elu+1 = max(x, 0) + exp(min(x, 0)): derivative 1 for x > 0, exp(x) otherwise.
    return g * xp.where(x > zero, xp.ones_like(x), xp.exp(xp.minimum(x, zero)))


def readout_vjp(xp, num, den, do, normalize, eps):
    """``(dnum, dden)`` of ``out = num / den`` (:func:`attn_ref.linear.readout`); ``dden``
    is None without normalisation, zero where the denominator was floored."""
    if not normalize:
        return do, None
    sd = safe_denominator(xp, den, eps)
    dnum = do / sd
    dsd = -xp.sum(dnum * num, axis=-1, keepdims=True) / sd
    floored = xp.abs(den) < xp.full((), eps, dtype=den.dtype, device=array_api_compat.device(den))
    return dnum, xp.where(floored, xp.zeros_like(dsd), dsd)


def _quadratic_vjp(xp, fq, fk, v, dnum, dden, alignment):
    a = fq @ transpose(xp, fk)
    da = dnum @ transpose(xp, v)
    if dden is not None:
        da = da + dden
    if alignment is not None:
        vis = causal_visible(xp, fq.shape[-2], fk.shape[-2], alignment, array_api_compat.device(fq))
        zero = xp.zeros((), dtype=a.dtype, device=array_api_compat.device(a))
        a = xp.where(vis, a, zero)
        da = xp.where(vis, da, zero)
    return da @ fk, transpose(xp, da) @ fq, transpose(xp, a) @ dnum


def _linear_vjp(xp, fq, fk, v, dnum, dden):
    s, z = kv_state(xp, fk, v)
    dfq = dnum @ transpose(xp, s)
    ds = transpose(xp, fq) @ dnum
    dfk = v @ transpose(xp, ds)
    if dden is not None:
        dfq = dfq + dden * z[..., None, :]
        dz = xp.sum(fq * dden, axis=-2)
        dfk = dfk + dz[..., None, :]
    return dfq, dfk, fk @ ds


def _reverse_exclusive_cumsum(xp, x, axis):
    """``y_c = sum_{c' > c} x_c'`` along ``axis``: the VJP of an exclusive prefix sum."""
    f = xp.cumulative_sum(xp.flip(x, axis=axis), axis=axis, include_initial=True)
    n = x.shape[axis]
    idx = [slice(None)] * x.ndim
    idx[axis] = slice(0, n)
    return xp.flip(f[tuple(idx)], axis=axis)


def _chunks(xp, x, n_chunks, c):
    return xp.reshape(x, tuple(x.shape[:-2]) + (n_chunks, c, x.shape[-1]))


def _chunked_causal_vjp(xp, fq, fk, v, dnum, dden, chunk_size):
    """VJP of the top-left chunked causal form on square inputs; same chunking as the forward."""
    n = fq.shape[-2]
    c = min(chunk_size, n)
    n_chunks = ceil_div(n, c)
    pad = n_chunks * c - n
    fq, fk, v, dnum = (pad_rows(xp, x, 0, pad) for x in (fq, fk, v, dnum))
    qc, kc, vc, dnc = (_chunks(xp, x, n_chunks, c) for x in (fq, fk, v, dnum))
    ddc = None if dden is None else _chunks(xp, pad_rows(xp, dden, 0, pad), n_chunks, c)
    s, z = kv_state(xp, kc, vc)
    s_prev = xp.cumulative_sum(s, axis=-3, include_initial=True)[..., :-1, :, :]
    # Inter-chunk read-out num = Qc S_{c-1}, den = Qc z_{c-1}.
    dqc = dnc @ transpose(xp, s_prev)
    ds_prev = transpose(xp, qc) @ dnc
    ds = _reverse_exclusive_cumsum(xp, ds_prev, -3)
    dkc = vc @ transpose(xp, ds)
    dvc = kc @ ds
    if ddc is not None:
        z_prev = xp.cumulative_sum(z, axis=-2, include_initial=True)[..., :-1, :]
        dqc = dqc + ddc * z_prev[..., None, :]
        dz = _reverse_exclusive_cumsum(xp, xp.sum(qc * ddc, axis=-2), -2)
        dkc = dkc + dz[..., None, :]
    # Intra-chunk masked block.
    a, b, e = _quadratic_vjp(xp, qc, kc, vc, dnc, ddc, TOP_LEFT)
    dqc, dkc, dvc = dqc + a, dkc + b, dvc + e

    def back(x):
        return xp.reshape(x, tuple(x.shape[:-3]) + (n_chunks * c, x.shape[-1]))[..., :n, :]

    return back(dqc), back(dkc), back(dvc)


def _causal_linear_vjp(xp, fq, fk, v, do, alignment, chunk_size, normalize, eps):
    nq, nk = fq.shape[-2], fk.shape[-2]
    fq2, fk2, v2, start = align_square(xp, fq, fk, v, alignment)
    num, den = _chunked_causal(xp, fq2, fk2, v2, chunk_size)
    num, den = num[..., start:start + nq, :], den[..., start:start + nq, :]
    dnum, dden = readout_vjp(xp, num, den, do, normalize, eps)
    length = fq2.shape[-2]
    dnum = pad_rows(xp, dnum, start, length - start - nq)
    dden = None if dden is None else pad_rows(xp, dden, start, length - start - nq)
    dfq2, dfk2, dv2 = _chunked_causal_vjp(xp, fq2, fk2, v2, dnum, dden, chunk_size)
    # Undo align_square: queries were shifted down by ``start`` rows; keys by
    # ``p_k`` rows, of which only the first ``keep`` (the ones some query sees) stayed.
    off = causal_offset(alignment, nq, nk)
    p_k = max(-off, 0)
    keep = max(min(nk, length - p_k), 0)
    dfk = pad_rows(xp, dfk2[..., p_k:p_k + keep, :], 0, nk - keep)
    dv = pad_rows(xp, dv2[..., p_k:p_k + keep, :], 0, nk - keep)
    return dfq2[..., start:, :], dfk, dv


def linear_from_features(fq, fk, v, do, /, *, causal=False, order="linear", chunk_size=DEFAULT_CHUNK_SIZE,
                         block_size=DEFAULT_BLOCK_SIZE, normalize=True, eps=DEFAULT_EPS, xp=None):
    """VJP of :func:`attn_ref.linear.linear_from_features` (the engine shared with Performer).

    Returns ``{"fq": dfq, "fk": dfk, "v": dv}``, each reduced to its input's shape.
    Same order, chunking and time as the forward; ``block_size`` is checked, but the
    backward takes the whole sequence at once (extra memory ``O(N C + (N / C) d' dv)``
    when causal, ``O(N d')`` otherwise).
    """
    xp, batch = check_qkv(fq, fk, v, xp=xp)
    alignment, normalize, eps = check_engine_options(causal, order, chunk_size, block_size, normalize, eps)
    nq, nk = fq.shape[-2], fk.shape[-2]
    do = check_cotangent(xp, do, batch + (nq, v.shape[-1]), v)
    if nq == 0 or nk == 0:
        dev = array_api_compat.device(v)
        return {n: xp.zeros(x.shape, dtype=x.dtype, device=dev)
                for n, x in (("fq", fq), ("fk", fk), ("v", v))}
    if order == "quadratic":
        num, den = quadratic_order(xp, fq, fk, v, alignment)
        dnum, dden = readout_vjp(xp, num, den, do, normalize, eps)
        dfq, dfk, dv = _quadratic_vjp(xp, fq, fk, v, dnum, dden, alignment)
    elif alignment is None:
        num, den = _linear_noncausal(xp, fq, fk, v)
        dnum, dden = readout_vjp(xp, num, den, do, normalize, eps)
        dfq, dfk, dv = _linear_vjp(xp, fq, fk, v, dnum, dden)
    else:
        dfq, dfk, dv = _causal_linear_vjp(xp, fq, fk, v, do, alignment, chunk_size, normalize, eps)
    return {"fq": unbroadcast(xp, dfq, fq.shape), "fk": unbroadcast(xp, dfk, fk.shape),
            "v": unbroadcast(xp, dv, v.shape)}


def linear_attention(q, k, v, do, /, *, feature_map="elu+1", causal=False, order="linear",
                     chunk_size=DEFAULT_CHUNK_SIZE, block_size=DEFAULT_BLOCK_SIZE, scale=None, normalize=True,
                     eps=DEFAULT_EPS, feature_map_vjp=None, xp=None):
    """VJP of :func:`attn_ref.linear_attention`: ``{"q": dq, "k": dk, "v": dv}``.

    Parameters
    ----------
    q, k, v : arrays, shapes (..., Nq, d), (..., Nk, d), (..., Nk, dv)
    do : array, shape (..., Nq, dv)
        Cotangent of the output.
    feature_map, causal, order, chunk_size, block_size, scale, normalize, eps, xp
        As in :func:`attn_ref.linear_attention`. The backward runs in the same
        ``order`` (and causal chunking) as the forward, with the same time; it takes
        the whole sequence at once (``block_size`` is checked, not used).
    feature_map_vjp : callable, optional
        ``(x, g) -> dx``, the VJP of a callable ``feature_map``; required for one.

    Returns
    -------
    dict
        Gradients of ``q``, ``k`` (through the feature map) and ``v``, shaped like them.

    Notes
    -----
    Linear order ``O(N d' dv)``; causal chunked ``O(N (C + d') dv)`` time,
    ``O(N C + (N / C) d' dv)`` extra memory; quadratic ``O(Nq Nk (d' + dv))``.
    Where the denominator was floored (``|den| < eps``) it is a constant, so its
    gradient is zero there.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import grad
    >>> x = xp.reshape(xp.sin(xp.arange(40.0)), (8, 5))
    >>> a = grad.linear_attention(x, x, x, x, causal=True, chunk_size=3)
    >>> b = grad.linear_attention(x, x, x, x, causal=True, order="quadratic")
    >>> all(bool(xp.max(xp.abs(a[n] - b[n])) < 1e-12) for n in "qkv")
    True
    """
    xp, _ = check_qkv(q, k, v, xp=xp)
    scale = check_scale(scale)
    fq, fk = features_qk(xp, q, k, feature_map)
    if scale != 1.0:
        fq = fq * scale
    g = linear_from_features(fq, fk, v, do, causal=causal, order=order, chunk_size=chunk_size,
                             block_size=block_size, normalize=normalize, eps=eps, xp=xp)
    dfq = g["fq"] * scale if scale != 1.0 else g["fq"]
    return {
        "q": feature_map_backward(q, dfq, feature_map=feature_map, vjp=feature_map_vjp, xp=xp),
        "k": feature_map_backward(k, g["fk"], feature_map=feature_map, vjp=feature_map_vjp, xp=xp),
        "v": g["v"],
    }
