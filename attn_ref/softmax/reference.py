"""Softmax attention's defining form: ``softmax(scale Q K^T + bias, masked) V`` in one shot.

The whole ``(..., Nq, Nk)`` logits matrix is one tile of :mod:`attn_ref.softmax.tiles`, so
every option means here exactly what it means in the online form. ``O(Nq Nk (d + dv))``
time, ``O(Nq Nk)`` extra memory. Conventions: :mod:`attn_ref.softmax`.
"""

from __future__ import annotations

from .options import prepare_problem, with_options_doc
from .tiles import dropout_scale, keep_tile, row_max, tile_logits

__all__ = [
    "softmax_attention",
    "attention_weights",
    "one_shot",
]


def _weights(pb):
    """The defining form: ``P = softmax(S)`` row by row, then dropout.

    ``S`` is the whole ``(Nq, Nk)`` logits matrix as the single tile ``[0, Nq) x [0, Nk)``
    of :func:`~attn_ref.softmax.tiles.tile_logits`: ``scale q.k``, soft-cap, bias, ALiBi,
    ``-inf`` where the mask, causal, window or lengths forbid.
    """
    xp, spec = pb.xp, pb.spec
    if spec.nq == 0 or spec.nk == 0:
        return pb.zeros(spec.nk)
    s, _ = tile_logits(xp, pb.q, xp.matrix_transpose(pb.k), spec, 0, 0)
    p = xp.exp(s - row_max(xp, s))
    denom = xp.sum(p, axis=-1, keepdims=True)
    # Rows with no allowed key have p == 0 everywhere; dividing by 1 keeps them zero.
    p = p / xp.where(denom > 0, denom, xp.ones_like(denom))
    if p.dtype != pb.q.dtype:
        p = xp.astype(p, pb.q.dtype)
    p = keep_tile(xp, p, spec, 0, 0)
    drop = dropout_scale(spec)
    return p * drop if drop != 1.0 else p


def one_shot(pb):
    """The output ``P V`` of a prepared :class:`~attn_ref.softmax.options.Problem`, in
    the grouped shape ``batch_g + (Nq, dv)``."""
    if pb.spec.nq == 0 or pb.spec.nk == 0:
        return pb.zeros(pb.v.shape[-1])
    return _weights(pb) @ pb.v


@with_options_doc
def attention_weights(q, k, /, *, mask=None, bias=None, causal=False, scale=None, window=None, chunk=None,
                      softcap=None, alibi_slopes=None, dropout_p=0.0, dropout_mask=None,
                      seqlens_q=None, seqlens_k=None, gqa=False, xp=None):
    """Softmax attention probabilities ``P = softmax(scale Q K^T + bias)``, masked.

    Parameters
    ----------
    q : array, shape (..., Nq, d)
    k : array, shape (..., Nk, d)
    {options}

    Returns
    -------
    array, shape (..., Nq, Nk)
        Each row sums to 1, except rows with no allowed key, which are all zero. With
        dropout, the weights actually applied to ``V``: ``P * keep / (1 - dropout_p)``.

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
    >>> attention_weights(xp.zeros((3, 1)), xp.zeros((3, 1)), window=(1, 0))
    Array([[1. , 0. , 0. ],
           [0.5, 0.5, 0. ],
           [0. , 0.5, 0.5]], dtype=array_api_strict.float64)
    """
    pb = prepare_problem(q, k, k, mask=mask, bias=bias, causal=causal, scale=scale, window=window,
                         chunk=chunk, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                         dropout_mask=dropout_mask, seqlens_q=seqlens_q, seqlens_k=seqlens_k, gqa=gqa, xp=xp)
    return pb.ungroup(_weights(pb))


@with_options_doc
def softmax_attention(q, k, v, /, *, mask=None, bias=None, causal=False, scale=None, window=None, chunk=None,
                      softcap=None, alibi_slopes=None, dropout_p=0.0, dropout_mask=None,
                      seqlens_q=None, seqlens_k=None, gqa=False, xp=None):
    """Exact softmax attention, one-shot: ``softmax(scale Q K^T + bias) V``.

    Parameters
    ----------
    q : array, shape (..., Nq, d)
    k : array, shape (..., Nk, d)
    v : array, shape (..., Nk, dv)
        Leading (batch, head) dimensions of ``q``, ``k``, ``v`` broadcast (with
        ``gqa=True``, the head axis -3 of ``k``, ``v`` may divide that of ``q``).
    {options}
    xp : namespace, optional
        Array namespace; inferred from the inputs by default.

    Returns
    -------
    array, shape (..., Nq, dv)
        Rows with no key to attend to are zero.

    Notes
    -----
    ``O(Nq Nk (d + dv))`` time, ``O(Nq Nk)`` extra memory: the whole logits matrix is
    materialised. Use :func:`online_softmax_attention` for long sequences. The order
    of operations and each option's convention are in the docstring of
    :mod:`attn_ref.softmax`.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import softmax_attention
    >>> q = k = xp.asarray([[0.0, 0.0], [0.0, 0.0]])
    >>> v = xp.asarray([[1.0], [3.0]])
    >>> softmax_attention(q, k, v)[:, 0]    # equal logits: the mean of v
    Array([2., 2.], dtype=array_api_strict.float64)

    KV-cache decoding with grouped-query heads: two new queries per sequence against
    caches holding 3 and 5 tokens (the rest of the cache is padding).

    >>> q = xp.zeros((2, 4, 2, 8))                # (B, Hq, Nq, d)
    >>> k = xp.zeros((2, 2, 6, 8))                # (B, Hkv, Ncache, d)
    >>> v = xp.reshape(xp.arange(2 * 2 * 6 * 1.0), (2, 2, 6, 1))
    >>> o = softmax_attention(q, k, v, causal="bottom-right", gqa=True,
    ...                       seqlens_k=xp.asarray([3, 5]))
    >>> o[0, 0, :, 0], o[1, 3, :, 0]   # query i sees cache keys j <= i + Lk - Nq
    (Array([0.5, 1. ], dtype=array_api_strict.float64), Array([19.5, 20. ], dtype=array_api_strict.float64))
    """
    pb = prepare_problem(q, k, v, mask=mask, bias=bias, causal=causal, scale=scale, window=window,
                         chunk=chunk, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                         dropout_mask=dropout_mask, seqlens_q=seqlens_q, seqlens_k=seqlens_k, gqa=gqa, xp=xp)
    return pb.ungroup(one_shot(pb))
