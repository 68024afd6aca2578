"""Gradients of Reformer LSH attention.

The buckets ``argmax([k R; -k R])`` are piecewise constant in ``k`` and are held
constant (the derivative almost everywhere), and so are the sort, the chunks and the
duplicate counts. Given them, the output is one masked softmax
(:func:`attn_ref.hashing.reformer_weights`): ``out = P V`` with
``P = softmax(S)`` over the union mask, ``S_ij = scale q_i . k_j`` and the diagonal
replaced by the constant ``self_logit``. So ``dV = P^T dO``,
``dS = P * (dO V^T - rowsum(dO * out))`` with the diagonal zeroed when it was
replaced, ``dQ = scale dS K`` and ``dK = scale dS^T Q``. The rotations only choose
buckets: their gradient is zero and is not returned.
"""

from __future__ import annotations

import array_api_compat

from ..hashing import DEFAULT_SELF_LOGIT, prepare_reformer, reformer_weights
from ._common import check_cotangent, softmax_vjp, transpose, unbroadcast

__all__ = ["reformer_attention"]


def reformer_attention(q, k, v, do, /, *, rotations, chunk_size, causal=False, self_logit=DEFAULT_SELF_LOGIT,
                       scale=None, look_back="round", dedup=True, buckets=None, xp=None):
    """VJP of :func:`attn_ref.hashing.reformer_attention`: ``{"q", "k", "v"}``.

    Parameters
    ----------
    q, k, v, rotations, chunk_size, causal, self_logit, scale, look_back, dedup, buckets, xp
        As in :func:`attn_ref.hashing.reformer_attention`; with ``dedup=False`` the
        ``log c_ij`` added to each logit is a constant like the buckets.
    do : array, shape (..., N, dv)
        Cotangent of the output.

    Returns
    -------
    dict
        Gradients of ``q``, ``k`` and ``v``, each of its input's shape.

    Notes
    -----
    Built on the defining form: ``O(N^2 (d + dv + H))`` time and ``O(N^2)`` memory,
    the price of a backward that is obviously the forward's derivative.

    Range: the gradient is finite while ``|scale| max|q| max|k| d`` is below the dtype's
    largest value; past it (``scale=1e308``) the forward's logits are clamped and stay
    finite, but clamped ties give this gradient an overflowing ``scale dS K``.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import grad
    >>> from attn_ref.hashing import lsh_rotations
    >>> x = xp.reshape(xp.sin(xp.arange(24.0)), (6, 4))
    >>> g = grad.reformer_attention(x, x, x, x, rotations=lsh_rotations(4, 2, 4, seed=0, xp=xp),
    ...                             chunk_size=2)
    >>> sorted(g), g["q"].shape
    (['k', 'q', 'v'], (6, 4))
    """
    xp, batch, alignment, scale = prepare_reformer(q, k, v, rotations, chunk_size, causal, self_logit,
                                                   scale, xp, look_back, dedup, buckets)
    do = check_cotangent(xp, do, batch + (q.shape[-2], v.shape[-1]), q)
    p = reformer_weights(q, k, rotations=rotations, chunk_size=chunk_size, causal=causal,
                         self_logit=self_logit, scale=scale, look_back=look_back, dedup=dedup,
                         buckets=buckets, xp=xp)
    ds = softmax_vjp(xp, p, do @ transpose(xp, v))
    if self_logit is not None:
        # the replaced diagonal logit is a constant
        n = q.shape[-2]
        eye = xp.eye(n, dtype=xp.bool, device=array_api_compat.device(q))
        ds = xp.where(eye, xp.zeros_like(ds), ds)
    return {"q": unbroadcast(xp, scale * (ds @ k), q.shape),
            "k": unbroadcast(xp, scale * (transpose(xp, ds) @ q), k.shape),
            "v": unbroadcast(xp, transpose(xp, p) @ do, v.shape)}
