"""The online softmax (Rabe & Staats 2021; Dao et al. 2022, FlashAttention): key blocks
with a running maximum and normaliser (:func:`attn_ref._common.online_step`), never more
than one ``block_q x block_k`` tile of logits. ``docs/online_softmax.md`` shows why the
recurrence is exact.
"""

from __future__ import annotations

import array_api_compat

from .._checks import check_positive_int
from .._common import finish_partial, online_step, partial_lse
from .options import prepare_problem
from .tiles import dropout_scale, keep_tile, logit_dtype, tile_coverage, tile_logits, transposed_copy

__all__ = [
    "online_softmax_attention",
    "online_forward",
]


def online_forward(pb, block_q, block_k):
    """The online-softmax recurrence over key blocks: ``(out, lse)`` in the grouped shapes
    ``batch_g + (Nq, dv)`` and ``batch_g + (Nq,)``.

    ``lse`` is the log-sum-exp of each row's masked logits (before dropout), ``+inf`` for
    a row with no key to attend to, so that the backward's ``exp(S - lse)`` is 0 there.
    The forward discards it (a few ``O(Nq)`` operations). ``out`` has q's dtype; ``lse``
    and the running statistics are in :func:`logit_dtype` (float32 for float16).
    """
    xp, spec = pb.xp, pb.spec
    nq, nk, dv = spec.nq, spec.nk, pb.v.shape[-1]
    device = array_api_compat.device(pb.q)
    dtype = logit_dtype(xp, pb.q.dtype)
    if nq == 0 or nk == 0:
        return pb.zeros(dv), xp.full(pb.batch_g + (nq,), xp.inf, dtype=dtype, device=device)
    # The scale is not folded into q: scale * q can overflow where scale * (q k) does not.
    kt = transposed_copy(xp, pb.k)
    v = pb.v
    outputs, lses = [], []
    for q0 in range(0, nq, block_q):
        q1 = min(q0 + block_q, nq)
        qb = pb.q[..., q0:q1, :]
        shape = pb.batch_g + (q1 - q0, 1)
        m = xp.full(shape, -xp.inf, dtype=dtype, device=device)
        l = xp.zeros(shape, dtype=dtype, device=device)
        acc = xp.zeros(pb.batch_g + (q1 - q0, dv), dtype=dtype, device=device)
        for k0 in range(0, nk, block_k):
            k1 = min(k0 + block_k, nk)
            if tile_coverage(spec, q0, q1, k0, k1) == "none":
                continue
            s, _ = tile_logits(xp, qb, kt[..., k0:k1], spec, q0, k0)
            # The normaliser counts dropped weights too (dropout acts after the softmax).
            m, l, p, alpha = online_step(xp, m, l, s)
            pv = keep_tile(xp, p, spec, q0, k0)
            acc = acc * alpha + (pv if pv.dtype == v.dtype else xp.astype(pv, v.dtype)) @ v[..., k0:k1, :]
        outputs.append(xp.astype(finish_partial(xp, l, acc), pb.q.dtype))
        lses.append(partial_lse(xp, m, l)[..., 0])
    out = outputs[0] if len(outputs) == 1 else xp.concat(outputs, axis=-2)
    lse = lses[0] if len(lses) == 1 else xp.concat(lses, axis=-1)
    drop = dropout_scale(spec)
    return (out * drop if drop != 1.0 else out), lse


def online_softmax_attention(
    q, k, v, /, *, mask=None, bias=None, causal=False, scale=None, window=None, softcap=None,
    alibi_slopes=None, dropout_p=0.0, dropout_mask=None, seqlens_q=None, seqlens_k=None,
    gqa=False, block_q=512, block_k=1024, xp=None,
):
    """Exact softmax attention by the online-softmax recurrence over key blocks.

    For each query block, key/value blocks are visited in order while carrying the
    running row maximum ``m``, normaliser ``l`` and unnormalised output ``acc``::

        m' = max(m, rowmax(S_j));  a = exp(m - m')
        l' = a l + rowsum(exp(S_j - m'));  acc' = a acc + (exp(S_j - m') * keep_j) V_j

    and the output is ``acc / l`` (times ``1 / (1 - dropout_p)`` with dropout). This is
    the algorithm of Rabe & Staats (2021) and FlashAttention (Dao et al. 2022); it is
    exact, not an approximation.

    Parameters
    ----------
    q, k, v, mask, bias, causal, scale, window, softcap, alibi_slopes, dropout_p, \
dropout_mask, seqlens_q, seqlens_k, gqa, xp
        As in :func:`softmax_attention`.
    block_q, block_k : int
        Tile sizes. Sequence lengths need not be multiples of them. Tiles that the
        causal mask or the window hide entirely are skipped (bounds that depend on
        ``seqlens_q``/``seqlens_k`` are only known at run time and skip nothing). With
        ``gqa=True`` the ``g`` query heads of a group share each key/value tile.

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
    >>> a = online_softmax_attention(x, x, x, window=(2, 1), softcap=5.0, block_q=2, block_k=2)
    >>> b = softmax_attention(x, x, x, window=(2, 1), softcap=5.0)
    >>> bool(xp.max(xp.abs(a - b)) < 1e-14)
    True
    """
    pb = prepare_problem(q, k, v, mask=mask, bias=bias, causal=causal, scale=scale, window=window,
                         softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                         dropout_mask=dropout_mask, seqlens_q=seqlens_q, seqlens_k=seqlens_k, gqa=gqa, xp=xp)
    check_positive_int("block_q", block_q)
    check_positive_int("block_k", block_k)
    out, _ = online_forward(pb, block_q, block_k)
    return pb.ungroup(out)
