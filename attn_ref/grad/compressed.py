"""Gradients of memory-compressed attention (Liu et al. 2018).

The forward is softmax attention on keys and values passed through a strided
convolution, ``Kc = conv(K, Wk)``, ``Vc = conv(V, Wv)``; the convolution is windowing
plus one matrix product (:func:`attn_ref.compressed.strided_conv`). Its VJP: the
matrix-product VJP gives ``dW = windows^T dOut`` and ``dwindows = dOut W^T``; the
windowing VJP scatters tap ``t`` of window ``j`` back to row ``j s + t`` (a strided
placement, summed over taps; rows of the zero padding are dropped).
"""

from __future__ import annotations

import array_api_compat

from ..compressed import compress_kv, compressed_causal_mask, num_blocks, prepare_compressed
from ._common import transpose, unbroadcast
from .softmax import softmax_attention

__all__ = ["compressed_attention", "strided_conv_vjp"]


def strided_conv_vjp(x, w, dy, /, *, stride, xp=None):
    """``(dx, dw)`` for ``y = strided_conv(x, w, stride=stride)`` given ``dy (..., M, d_out)``."""
    xp = array_api_compat.array_namespace(x, w) if xp is None else xp
    c, d_in, d_out = w.shape[-3], w.shape[-2], w.shape[-1]
    n = x.shape[-2]
    m = num_blocks(n, c, stride)
    device = array_api_compat.device(x)
    if m == 0:
        return xp.zeros_like(x), xp.zeros_like(w)
    length = (m - 1) * stride + c
    pad = length - n
    xpad = x if pad <= 0 else xp.concat(
        [x, xp.zeros(x.shape[:-2] + (pad, d_in), dtype=x.dtype, device=device)], axis=-2)
    taps = [xpad[..., t:t + (m - 1) * stride + 1:stride, :] for t in range(c)]
    windows = xp.reshape(xp.stack(taps, axis=-2), xpad.shape[:-2] + (m, c * d_in))
    wr = xp.reshape(w, w.shape[:-3] + (c * d_in, d_out))
    dwr = unbroadcast(xp, transpose(xp, windows) @ dy, wr.shape)
    dwin = xp.reshape(dy @ transpose(xp, wr), tuple(dy.shape[:-2]) + (m, c, d_in))
    lead = tuple(dwin.shape[:-3])
    span = max(length, c - 1 + m * stride)
    dx = None
    for t in range(c):
        g = dwin[..., t, :]  # (..., m, d_in), goes to rows t + j s
        if stride > 1:
            zeros = xp.zeros(lead + (m, stride - 1, d_in), dtype=x.dtype, device=device)
            g = xp.reshape(xp.concat([g[..., None, :], zeros], axis=-2), lead + (m * stride, d_in))
        parts = [g]
        if t:
            parts.insert(0, xp.zeros(lead + (t, d_in), dtype=x.dtype, device=device))
        tail = span - t - g.shape[-2]
        if tail:
            parts.append(xp.zeros(lead + (tail, d_in), dtype=x.dtype, device=device))
        g = xp.concat(parts, axis=-2) if len(parts) > 1 else g
        dx = g if dx is None else dx + g
    return unbroadcast(xp, dx[..., :n, :], x.shape), xp.reshape(dwr, w.shape)


def compressed_attention(q, k, v, do, /, *, k_weight, v_weight=None, stride=3, causal=False, scale=None,
                         xp=None):
    """VJP of :func:`attn_ref.compressed_attention`.

    Returns ``{"q", "k", "v", "k_weight"}`` plus ``"v_weight"`` when it was given
    (with ``v_weight=None`` the key kernel is shared and both terms land in
    ``"k_weight"``). Same cost as the forward.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import grad
    >>> x = xp.reshape(xp.sin(xp.arange(24.0)), (6, 4))
    >>> eye = xp.reshape(xp.eye(4, dtype=xp.float64), (1, 4, 4))
    >>> a = grad.compressed_attention(x, x, x, x, k_weight=eye, stride=1)
    >>> b = grad.softmax_attention(x, x, x, x)
    >>> all(bool(xp.max(xp.abs(a[n] - b[n])) < 1e-13) for n in "qkv")
    True
    """
    shared = v_weight is None
    v_weight = k_weight if shared else v_weight
    xp, batch, alignment, scale = prepare_compressed(q, k, v, k_weight, v_weight, stride, causal, scale, xp)
    kc, vc = compress_kv(xp, k, v, k_weight, v_weight, stride)
    mask = compressed_causal_mask(xp, alignment, q, k, k_weight, stride)
    g = softmax_attention(q, kc, vc, do, mask=mask, scale=scale, xp=xp)
    dk, dwk = strided_conv_vjp(k, k_weight, g["k"], stride=stride, xp=xp)
    dv, dwv = strided_conv_vjp(v, v_weight, g["v"], stride=stride, xp=xp)
    out = {"q": g["q"], "k": dk, "v": dv}
    if shared:
        out["k_weight"] = dwk + dwv
    else:
        out["k_weight"], out["v_weight"] = dwk, dwv
    return out
