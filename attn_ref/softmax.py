"""Exact softmax attention, in its defining (one-shot) and memory-efficient (online) forms.

``O = softmax(scale * Q K^T + B, masked) V``

The one-shot form materialises the ``(..., Nq, Nk)`` logits; the online form
(Rabe & Staats 2021, Dao et al. 2022) walks over key blocks with a running maximum and
running normaliser and never holds more than one ``block_q x block_k`` tile of logits.
Both compute the same function; see ``docs/online_softmax.md`` for why the recurrence
is exact.

Conventions shared by the family
--------------------------------
* ``mask``: boolean, broadcastable to ``(..., Nq, Nk)``, True = may attend.
* ``bias``: additive float logits bias (ALiBi, relative positions), same broadcast.
* ``causal``: ``False``; ``"top-left"`` (query ``i`` sees keys ``j <= i``; PyTorch's
  ``is_causal``, JAX); ``"bottom-right"`` (query ``i`` sees keys
  ``j <= i + Nk - Nq``, so the last query sees every key; FlashAttention, KV-cache
  decoding). ``True`` means ``"top-left"``. The two agree when ``Nq == Nk``.
* A query row with no key it may attend to (fully masked, ``Nk == 0``, or all
  logits ``-inf``) returns zeros, as PyTorch SDPA and FlashAttention do; its
  weights row is all zeros.
* ``Nq == 0`` gives an empty ``(..., 0, dv)`` output.
"""

from __future__ import annotations

import array_api_compat

from ._checks import (
    check_bias,
    check_mask,
    check_positive_int,
    check_qkv,
    default_scale,
)

__all__ = [
    "TOP_LEFT",
    "BOTTOM_RIGHT",
    "softmax_attention",
    "attention_weights",
    "online_softmax_attention",
]

TOP_LEFT = "top-left"
BOTTOM_RIGHT = "bottom-right"
_CAUSAL = (TOP_LEFT, BOTTOM_RIGHT)


def causal_alignment(causal):
    """Normalise ``causal`` to ``None``, ``"top-left"`` or ``"bottom-right"``."""
    if causal is False or causal is None:
        return None
    if causal is True:
        return TOP_LEFT
    if isinstance(causal, str) and causal in _CAUSAL:
        return causal
    raise ValueError(
        f"causal must be False, True (= {TOP_LEFT!r}), {TOP_LEFT!r} or {BOTTOM_RIGHT!r}, "
        f"got {causal!r}"
    )


def _causal_offset(alignment, nq, nk):
    # Query i may see key j iff j <= i + offset.
    return 0 if alignment == TOP_LEFT else nk - nq


def _block_coverage(alignment, nq, nk, q0, q1, k0, k1):
    """Is the causal tile ``[q0, q1) x [k0, k1)`` fully visible, fully hidden or mixed?"""
    if alignment is None:
        return "all"
    off = _causal_offset(alignment, nq, nk)
    if k1 - 1 <= q0 + off:
        return "all"
    if k0 > q1 - 1 + off:
        return "none"
    return "partial"


def _causal_tile(xp, alignment, nq, nk, q0, q1, k0, k1, device):
    off = _causal_offset(alignment, nq, nk)
    qi = xp.arange(q0, q1, device=device)
    kj = xp.arange(k0, k1, device=device)
    return kj[None, :] <= (qi[:, None] + off)


def _tile(x, q0, q1, k0, k1):
    """Slice a ``(..., Nq|1, Nk|1)`` broadcastable array to one tile."""
    if x is None:
        return None
    rows = slice(q0, q1) if x.shape[-2] != 1 else slice(None)
    cols = slice(k0, k1) if x.shape[-1] != 1 else slice(None)
    return x[..., rows, cols]


def _and(xp, a, b):
    if a is None:
        return b
    if b is None:
        return a
    return xp.logical_and(a, b)


def _prepare(q, k, v, mask, bias, causal, scale, xp):
    xp, batch = check_qkv(q, k, v, xp=xp)
    nq, nk = q.shape[-2], k.shape[-2]
    mask = check_mask(xp, mask, batch, nq, nk)
    bias = check_bias(xp, bias, batch, nq, nk, q.dtype)
    alignment = causal_alignment(causal)
    scale = default_scale(q.shape[-1], scale)
    return xp, batch, nq, nk, mask, bias, alignment, scale


def _masked_logits(xp, q, k, mask, bias, alignment, scale, nq, nk, q0, k0):
    """Scaled logits of one tile with ``-inf`` where attention is not allowed.

    Returns ``(logits, allowed)``; ``allowed`` is None when every entry is allowed.
    """
    q1, k1 = q0 + q.shape[-2], k0 + k.shape[-2]
    s = q @ xp.matrix_transpose(k)
    if scale != 1.0:
        s = s * scale
    if bias is not None:
        s = s + _tile(bias, q0, q1, k0, k1)
    allowed = _tile(mask, q0, q1, k0, k1)
    if _block_coverage(alignment, nq, nk, q0, q1, k0, k1) != "all":
        device = array_api_compat.device(q)
        allowed = _and(xp, allowed, _causal_tile(xp, alignment, nq, nk, q0, q1, k0, k1, device))
    if allowed is not None:
        s = xp.where(allowed, s, -xp.inf)
    return s, allowed


def _row_max(xp, s):
    """Row maximum with rows of only ``-inf`` mapped to 0, so ``exp(s - m)`` is 0 there."""
    m = xp.max(s, axis=-1, keepdims=True)
    return xp.where(m == -xp.inf, xp.zeros_like(m), m)


def attention_weights(q, k, /, *, mask=None, bias=None, causal=False, scale=None, xp=None):
    """Softmax attention probabilities ``P = softmax(scale Q K^T + bias)``, masked.

    Parameters
    ----------
    q : array, shape (..., Nq, d)
    k : array, shape (..., Nk, d)
    mask : bool array broadcastable to (..., Nq, Nk), optional
        True where the query may attend the key.
    bias : float array broadcastable to (..., Nq, Nk), optional
        Added to the scaled logits.
    causal : {False, True, "top-left", "bottom-right"}
        See the module docstring; True means "top-left".
    scale : float, optional
        Logit scale, default ``1/sqrt(d)``.

    Returns
    -------
    array, shape (..., Nq, Nk)
        Each row sums to 1, except rows with no allowed key, which are all zero.

    Notes
    -----
    ``O(Nq Nk d)`` time, ``O(Nq Nk)`` memory.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import attention_weights
    >>> q = xp.asarray([[1.0, 0.0], [0.0, 1.0]])
    >>> p = attention_weights(q, q, causal=True)
    >>> p[0, 1] == 0.0, float(xp.sum(p[1, :]))
    (Array(True, dtype=array_api_strict.bool), 1.0)
    """
    xp, batch, nq, nk, mask, bias, alignment, scale = _prepare(
        q, k, k, mask, bias, causal, scale, xp
    )
    if nq == 0 or nk == 0:
        return xp.zeros(batch + (nq, nk), dtype=q.dtype, device=array_api_compat.device(q))
    s, allowed = _masked_logits(xp, q, k, mask, bias, alignment, scale, nq, nk, 0, 0)
    p = xp.exp(s - _row_max(xp, s))
    denom = xp.sum(p, axis=-1, keepdims=True)
    # Rows with no allowed key have p == 0 everywhere; dividing by 1 keeps them zero.
    return p / xp.where(denom > 0, denom, xp.ones_like(denom))


def softmax_attention(q, k, v, /, *, mask=None, bias=None, causal=False, scale=None, xp=None):
    """Exact softmax attention, one-shot: ``softmax(scale Q K^T + bias) V``.

    Parameters
    ----------
    q : array, shape (..., Nq, d)
    k : array, shape (..., Nk, d)
    v : array, shape (..., Nk, dv)
        Leading (batch, head) dimensions of ``q``, ``k``, ``v`` broadcast.
    mask, bias, causal, scale
        As in :func:`attention_weights`.
    xp : namespace, optional
        Array namespace; inferred from the inputs by default.

    Returns
    -------
    array, shape (..., Nq, dv)
        Rows with no key to attend to are zero.

    Notes
    -----
    ``O(Nq Nk (d + dv))`` time, ``O(Nq Nk)`` extra memory: the whole logits matrix is
    materialised. Use :func:`online_softmax_attention` for long sequences.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import softmax_attention
    >>> q = k = xp.asarray([[0.0, 0.0], [0.0, 0.0]])
    >>> v = xp.asarray([[1.0], [3.0]])
    >>> softmax_attention(q, k, v)[:, 0]    # equal logits: the mean of v
    Array([2., 2.], dtype=array_api_strict.float64)
    """
    xp, batch, nq, nk, mask, bias, alignment, scale = _prepare(
        q, k, v, mask, bias, causal, scale, xp
    )
    p = attention_weights(q, k, mask=mask, bias=bias, causal=alignment or False, scale=scale,
                          xp=xp)
    if nk == 0:
        return xp.zeros(batch + (nq, v.shape[-1]), dtype=q.dtype,
                        device=array_api_compat.device(q))
    return p @ v


def online_softmax_attention(
    q, k, v, /, *, mask=None, bias=None, causal=False, scale=None, block_q=512, block_k=1024,
    xp=None,
):
    """Exact softmax attention by the online-softmax recurrence over key blocks.

    For each query block, key/value blocks are visited in order while carrying the
    running row maximum ``m``, normaliser ``l`` and unnormalised output ``acc``::

        m' = max(m, rowmax(S_j));  a = exp(m - m')
        l' = a l + rowsum(exp(S_j - m'));  acc' = a acc + exp(S_j - m') V_j

    and the output is ``acc / l``. This is the algorithm of Rabe & Staats (2021) and
    FlashAttention (Dao et al. 2022); it is exact, not an approximation.

    Parameters
    ----------
    q, k, v, mask, bias, causal, scale, xp
        As in :func:`softmax_attention`.
    block_q, block_k : int
        Tile sizes. Sequence lengths need not be multiples of them. Causal tiles that
        lie wholly in the future are skipped.

    Returns
    -------
    array, shape (..., Nq, dv)
        Equal to :func:`softmax_attention` up to rounding.

    Notes
    -----
    ``O(Nq Nk (d + dv))`` time; ``O(block_q block_k)`` extra memory per batch entry
    plus ``O(Nq dv)`` for the output, never ``O(Nq Nk)``.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import online_softmax_attention, softmax_attention
    >>> x = xp.reshape(xp.sin(xp.arange(30.0)), (5, 6))
    >>> a = online_softmax_attention(x, x, x, causal=True, block_q=2, block_k=3)
    >>> bool(xp.max(xp.abs(a - softmax_attention(x, x, x, causal=True))) < 1e-14)
    True
    """
    xp, batch, nq, nk, mask, bias, alignment, scale = _prepare(
        q, k, v, mask, bias, causal, scale, xp
    )
    check_positive_int("block_q", block_q)
    check_positive_int("block_k", block_k)
    device = array_api_compat.device(q)
    dv = v.shape[-1]
    if nq == 0 or nk == 0:
        return xp.zeros(batch + (nq, dv), dtype=q.dtype, device=device)

    # Folding the scale into q once saves a pass over every logits tile.
    qs = q * scale
    outputs = []
    for q0 in range(0, nq, block_q):
        q1 = min(q0 + block_q, nq)
        qb = qs[..., q0:q1, :]
        shape = batch + (q1 - q0, 1)
        m = xp.full(shape, -xp.inf, dtype=q.dtype, device=device)
        l = xp.zeros(shape, dtype=q.dtype, device=device)
        acc = xp.zeros(batch + (q1 - q0, dv), dtype=q.dtype, device=device)
        for k0 in range(0, nk, block_k):
            k1 = min(k0 + block_k, nk)
            if _block_coverage(alignment, nq, nk, q0, q1, k0, k1) == "none":
                continue
            s, _ = _masked_logits(xp, qb, k[..., k0:k1, :], mask, bias, alignment, 1.0,
                                  nq, nk, q0, k0)
            m_new = xp.maximum(m, xp.max(s, axis=-1, keepdims=True))
            # A row that has seen no allowed key yet keeps m = -inf; shift it by 0 so
            # exp(-inf - 0) = 0 instead of exp(-inf + inf) = NaN.
            m_safe = xp.where(m_new == -xp.inf, xp.zeros_like(m_new), m_new)
            p = xp.exp(s - m_safe)
            alpha = xp.exp(m - m_safe)
            l = l * alpha + xp.sum(p, axis=-1, keepdims=True)
            acc = acc * alpha + p @ v[..., k0:k1, :]
            m = m_new
        outputs.append(acc / xp.where(l > 0, l, xp.ones_like(l)))
    return outputs[0] if len(outputs) == 1 else xp.concat(outputs, axis=-2)


def _register():
    from .registry import Variant, register

    register(Variant(
        name="softmax", fn=softmax_attention, family="softmax", exact=True, causal=True,
        time="O(N^2 d)", memory="O(N^2)", weights=attention_weights,
        summary="one-shot softmax(QK^T/sqrt(d))V",
    ))
    register(Variant(
        name="online_softmax", fn=online_softmax_attention, family="softmax", exact=True,
        causal=True, time="O(N^2 d)", memory="O(N)", weights=attention_weights,
        options={"block_q": 16, "block_k": 24},
        summary="online-softmax (FlashAttention) recurrence over key blocks",
    ))


_register()
