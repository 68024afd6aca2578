"""Memory-compressed attention: keys and values shortened by a strided convolution.

``O = softmax(scale * Q conv(K)^T) conv(V)``

Liu et al. (2018), *Generating Wikipedia by Summarizing Long Sequences*, pass keys and
values through a 1-D convolution with kernel size ``c`` and stride ``s`` (3 and 3 in
the paper) before softmax attention, so a query scores ``M ~ N / s`` compressed blocks
instead of ``N`` keys.

The convolution
---------------
Block ``j`` covers key positions ``[j s, j s + c)`` and is
``sum_t X[j s + t] @ W[t]`` with ``W`` of shape ``(c, d_in, d_out)`` (no bias). It is
computed by windowing and one matmul: the ``c`` strided slices ``X[t::s]`` are stacked
into ``(..., M, c d_in)`` windows and multiplied by ``W`` reshaped to
``(c d_in, d_out)``.

Ragged tail: there are ``M = ceil(max(N - c, 0) / s) + 1`` blocks, the fewest that
cover every position; a last window that runs past the end is zero-padded (the
missing rows contribute nothing), as a convolution with zero padding at the end
does. With an averaging kernel, such a block is the tail's sum divided by ``c``, not
its mean. A stride larger than the kernel skips the ``s - c`` positions between
windows, as any strided convolution does (:func:`num_blocks`).

Causal masking (the tensor2tensor rule)
---------------------------------------
A query at position ``i`` sees compressed block ``j`` only when the whole block lies in
its past: ``min(j s + c, N) - 1 <= i`` (shifted by ``Nk - Nq`` for
``"bottom-right"``). A block that mixes in even one future position is hidden, so no
future token can reach a query through a compressed key or value. Queries before the
end of the first block see nothing and, by the convention of
:mod:`attn_ref.softmax`, return zeros.
"""

from __future__ import annotations

import math

import array_api_compat

from ._checks import broadcast_batch, check_array, check_positive_int, check_qkv, default_scale
from ._common import causal_alignment, causal_offset, ceil_div
from .softmax import attention_weights, online_softmax_attention, softmax_attention

__all__ = [
    "compressed_attention",
    "compressed_weights",
    "strided_conv",
    "num_blocks",
    # Named steps that attn_ref.grad differentiates.
    "prepare_compressed",
    "compress_kv",
    "compressed_causal_mask",
]


def num_blocks(n, kernel_size, stride):
    """Number of compressed blocks: ``M = ceil(max(n - c, 0) / s) + 1`` (0 when ``n == 0``).

    The fewest windows that reach every position a window can reach; when ``s > c``
    the count is capped at ``ceil(n / s)`` so that every window starts inside the
    sequence.
    """
    if n == 0:
        return 0
    return min(ceil_div(max(n - kernel_size, 0), stride) + 1, ceil_div(n, stride))


def _check_weight(name, w, d_in, batch, q):
    want = f"(c, d_in, d_out) or per head (h, c, d_in, d_out) with d_in={d_in}"
    check_array(name, w, like=q, dtype=q.dtype)
    if w.ndim not in (3, 4) or w.shape[-2] != d_in or w.shape[-3] < 1 or w.shape[-1] < 1:
        raise ValueError(f"{name} must have shape {want}, got shape {tuple(w.shape)}")
    if w.ndim == 4:
        heads = batch[-1] if batch else 1
        if w.shape[0] not in (1, heads):
            raise ValueError(
                f"{name} has per-head shape (h, c, d_in, d_out) = {tuple(w.shape)}, but "
                f"h={w.shape[0]} does not match the head axis (the last batch axis, size "
                f"{heads}) of q, k, v"
            )
    return w


def strided_conv(x, w, /, *, stride, xp=None):
    """1-D strided convolution along the sequence axis, by windowing and one matmul.

    Parameters
    ----------
    x : array, shape (..., N, d_in)
    w : array, shape (c, d_in, d_out) or (h, c, d_in, d_out)
        Kernel of size ``c``; the per-head form matches the last batch axis of ``x``.
    stride : int
        ``s >= 1``.

    Returns
    -------
    array, shape (..., M, d_out)
        ``out[j] = sum_t x[j s + t] @ w[t]`` with rows past the end of ``x`` taken as
        zero; ``M = num_blocks(N, c, s)``.

    Notes
    -----
    ``O(M c d_in d_out)`` time, ``O(M c d_in)`` memory for the windows.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.compressed import strided_conv
    >>> x = xp.reshape(xp.arange(5.0), (5, 1))
    >>> strided_conv(x, xp.ones((2, 1, 1)), stride=2)[:, 0]    # [0+1, 2+3, 4+pad]
    Array([1., 5., 4.], dtype=array_api_strict.float64)
    """
    xp = array_api_compat.array_namespace(x, w) if xp is None else xp
    check_positive_int("stride", stride)
    c, d_in, d_out = w.shape[-3], w.shape[-2], w.shape[-1]
    n = x.shape[-2]
    m = num_blocks(n, c, stride)
    if m == 0:
        lead = broadcast_batch([("x", tuple(x.shape[:-2])), ("w", tuple(w.shape[:-3]))])
        return xp.zeros(lead + (0, d_out), dtype=x.dtype, device=array_api_compat.device(x))
    pad = (m - 1) * stride + c - n
    if pad > 0:
        zeros = xp.zeros(x.shape[:-2] + (pad, d_in), dtype=x.dtype,
                         device=array_api_compat.device(x))
        x = xp.concat([x, zeros], axis=-2)
    # Window t of every block is the strided slice x[t::s], cut to M rows.
    taps = [x[..., t:t + (m - 1) * stride + 1:stride, :] for t in range(c)]
    windows = xp.reshape(xp.stack(taps, axis=-2), x.shape[:-2] + (m, c * d_in))
    return windows @ xp.reshape(w, w.shape[:-3] + (c * d_in, d_out))


def _visible(xp, alignment, nq, nk, c, s, m, device):
    """``(Nq, M)`` mask: block ``j`` is visible to query ``i`` iff its last real position
    ``min(j s + c, Nk) - 1`` is at most ``i + offset``."""
    off = causal_offset(alignment, nq, nk)
    last = xp.minimum(xp.arange(m, device=device) * s + (c - 1),
                      xp.full((m,), nk - 1, device=device))
    qi = xp.arange(nq, device=device)
    return last[None, :] <= qi[:, None] + off


def prepare_compressed(q, k, v, k_weight, v_weight, stride, causal, scale, xp):
    """Check the inputs of :func:`compressed_attention`: ``(xp, batch, alignment, scale)``."""
    xp, batch = check_qkv(q, k, v, xp=xp)
    check_positive_int("stride", stride)
    _check_weight("k_weight", k_weight, q.shape[-1], batch, q)
    if k_weight.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"k_weight must map keys back to the query dimension d={q.shape[-1]}: expected "
            f"shape (c, {q.shape[-1]}, {q.shape[-1]}), got {tuple(k_weight.shape)}"
        )
    if v_weight is not None:
        _check_weight("v_weight", v_weight, v.shape[-1], batch, q)
        if v_weight.shape[-3] != k_weight.shape[-3]:
            raise ValueError(
                f"k_weight and v_weight must have the same kernel size c, got k_weight "
                f"{tuple(k_weight.shape)} and v_weight {tuple(v_weight.shape)}"
            )
    alignment = causal_alignment(causal)
    return xp, batch, alignment, default_scale(q.shape[-1], scale)


def compress_kv(xp, k, v, k_weight, v_weight, stride):
    """The compressed keys and values ``(kc, vc)``, ``(..., M, d)`` and ``(..., M, dv)``
    (``vc`` is None without ``v``)."""
    kc = strided_conv(k, k_weight, stride=stride, xp=xp)
    vc = None if v is None else strided_conv(v, v_weight, stride=stride, xp=xp)
    return kc, vc


def compressed_causal_mask(xp, alignment, q, k, k_weight, stride):
    """The ``(Nq, M)`` mask of the compressed blocks each query may see (None when not causal)."""
    if alignment is None:
        return None
    nq, nk, c = q.shape[-2], k.shape[-2], k_weight.shape[-3]
    m = num_blocks(nk, c, stride)
    return _visible(xp, alignment, nq, nk, c, stride, m, array_api_compat.device(q))


def compressed_attention(q, k, v, /, *, k_weight, v_weight=None, stride=3, causal=False, scale=None,
                         block_q=None, xp=None):
    """Memory-compressed attention (Liu et al. 2018).

    Parameters
    ----------
    q : array, shape (..., Nq, d)
    k : array, shape (..., Nk, d)
    v : array, shape (..., Nk, dv)
    k_weight : array, shape (c, d, d) or per head (h, c, d, d)
        Convolution kernel for the keys; its first axis (after ``h``) is the kernel
        size ``c`` (3 in the paper). Same dtype as ``q``.
    v_weight : array, shape (c, dv, dv_out) or (h, c, dv, dv_out), optional
        Kernel for the values, same ``c``; ``None`` uses ``k_weight`` (then ``dv`` must
        equal ``d``).
    stride : int
        Convolution stride ``s`` (3 in the paper).
    causal : {False, True, "top-left", "bottom-right"}
        The tensor2tensor rule of the module docstring.
    scale : float, optional
        Logit scale, default ``1/sqrt(d)``.
    block_q : int, optional
        ``None``: one-shot softmax over the compressed keys (the defining form,
        ``O(Nq N / s)`` memory). An integer: :func:`~attn_ref.online_softmax_attention`
        over query blocks of this size with all compressed keys in one block, the same
        function in ``O(block_q N / s)`` memory.

    Returns
    -------
    array, shape (..., Nq, dv_out)
        With ``c = s = 1`` and identity kernels this is softmax attention (causal
        included); with ``W[t] = I / c`` and ``c = s`` dividing ``N`` it is attention
        over mean-pooled keys and values. ``Nk == 0`` gives zeros.

    Notes
    -----
    ``O(N c d^2 / s)`` time for the convolutions and ``O(Nq (N / s) (d + dv))`` for the
    attention; ``O(Nq N / s)`` extra memory, ``O(block_q N / s)`` with ``block_q``.
    Liu et al., *Generating Wikipedia by Summarizing Long Sequences*, ICLR 2018.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import compressed_attention, softmax_attention
    >>> x = xp.reshape(xp.sin(xp.arange(18.0)), (6, 3))
    >>> w = xp.reshape(xp.eye(3, dtype=xp.float64), (1, 3, 3))
    >>> a = compressed_attention(x, x, x, k_weight=w, stride=1, causal=True)
    >>> bool(xp.max(xp.abs(a - softmax_attention(x, x, x, causal=True))) < 1e-15)
    True
    """
    v_weight = k_weight if v_weight is None else v_weight
    xp, batch, alignment, scale = prepare_compressed(q, k, v, k_weight, v_weight, stride, causal, scale, xp)
    kc, vc = compress_kv(xp, k, v, k_weight, v_weight, stride)
    mask = compressed_causal_mask(xp, alignment, q, k, k_weight, stride)
    if block_q is None:
        return softmax_attention(q, kc, vc, mask=mask, scale=scale, xp=xp)
    check_positive_int("block_q", block_q)
    return online_softmax_attention(q, kc, vc, mask=mask, scale=scale, block_q=block_q,
                                    block_k=max(1, kc.shape[-2]), xp=xp)


def compressed_weights(q, k, /, *, k_weight, v_weight=None, stride=3, causal=False, scale=None,
                       xp=None):
    """The ``(..., Nq, Nk)`` attention matrix implied when ``v_weight`` is a scalar kernel.

    ``softmax(scale Q conv(K)^T) C`` with ``C[j, p] = w_t`` for ``p = j s + t``, where the
    value kernel must be ``W_v[t] = w_t I`` (a scalar per tap, shape ``(c, dv, dv)``
    or ``(c, 1, 1)``): only then is the output a fixed mixture of the rows of ``V``.
    ``v_weight=None`` means the averaging kernel ``w_t = 1 / c``. Only
    ``v_weight[:, 0, 0]`` is read (values cannot be checked under ``jax.jit``).
    ``O(Nq Nk)`` memory, for diagnostics at moderate ``N``.
    """
    c = k_weight.shape[-3]
    xp, batch, alignment, scale = prepare_compressed(q, k, k, k_weight, None, stride, causal, scale, xp)
    device = array_api_compat.device(q)
    if v_weight is None:
        taps = xp.full((c,), 1.0 / c, dtype=q.dtype, device=device)
    else:
        if v_weight.ndim != 3 or v_weight.shape[0] != c or v_weight.shape[1] != v_weight.shape[2]:
            raise ValueError(
                f"v_weight must be a scalar kernel of shape (c, dv, dv) with c={c}, "
                f"got shape {tuple(v_weight.shape)}"
            )
        taps = v_weight[:, 0, 0]
    kc, _ = compress_kv(xp, k, None, k_weight, None, stride)
    mask = compressed_causal_mask(xp, alignment, q, k, k_weight, stride)
    p = attention_weights(q, kc, mask=mask, scale=scale, xp=xp)
    nk = k.shape[-2]
    m = num_blocks(nk, c, stride)
    # C[j, p] = taps[p - j s] where 0 <= p - j s < c, else 0.
    rel = xp.arange(nk, device=device)[None, :] - xp.arange(m, device=device)[:, None] * stride
    zero = xp.zeros((m, nk), dtype=q.dtype, device=device)
    mix = zero
    for t in range(c):
        mix = mix + xp.where(rel == t, taps[t], zero)
    return p @ mix


def _params(seed, nq, nk, d, dv, *, dtype, device, xp):
    from .random import standard_normal

    c = 3
    noise = standard_normal((c, d, d), seed=seed, dtype=dtype, device=device, xp=xp)
    # Noise of size 0.1 / sqrt(d) per entry keeps the map near identity; at d = 0 the
    # weights are empty and there is nothing to scale.
    kw = xp.eye(d, dtype=dtype, device=device) / c + noise * (0.1 / math.sqrt(max(d, 1)))
    # Averaging values kernel (a scalar per tap), so the implied matrix is defined.
    vw = xp.stack([xp.eye(dv, dtype=dtype, device=device) / c] * c)
    return {"k_weight": kw, "v_weight": vw}


def _register():
    from .registry import Variant, register

    register(Variant(
        name="compressed", fn=compressed_attention, family="compressed", exact=False,
        vjp="attn_ref.grad.compressed:compressed_attention",
        causal=True, time="O(N^2 d / s)", memory="O(N^2 / s)", params=_params,
        options={"stride": 3}, weights=compressed_weights,
        summary="memory-compressed attention: keys/values through a stride-3 kernel-3 conv",
    ))


_register()
