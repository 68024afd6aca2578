"""Gradients of the Synthesizer: the dot-product-free logits and their mixture.

Every form is softmax attention with the additive bias ``alpha B`` and the logit scale
``(1 - alpha) scale`` (:func:`attn_ref.synthesizer.synthesizer_attention`), so its VJP
is the softmax attention VJP of :mod:`attn_ref.grad.softmax`, whose bias cotangent
``dS`` gives ``dB = alpha dS``. Then through the logits:

* random: ``dR = dB`` (summed over broadcast batch dimensions); factorised
  ``R = R1 R2^T``: ``dR1 = dB R2``, ``dR2 = dB^T R1``;
* dense, ``B = H W2 + b2``, ``H = relu(Z)``, ``Z = X W1 + b1`` with ``X = q``:
  ``dW2 = H^T dB``, ``db2 = sum dB``, ``dZ = (dB W2^T) [Z > 0]``, ``dW1 = X^T dZ``,
  ``db1 = sum dZ``, and ``dZ W1^T`` adds to ``dq`` (the relu's derivative at 0 is
  taken as 0).
"""

from __future__ import annotations

from .._checks import check_array, check_qkv
from ..synthesizer import (
    check_dense_weights,
    dense_synthesizer_logits,
    prepare_synthesizer,
    random_logits,
)
from ._common import check_cotangent, transpose, unbroadcast
from .softmax import softmax_attention

__all__ = [
    "synthesizer_attention",
    "dense_synthesizer_attention",
    "random_synthesizer_attention",
    "dense_synthesizer_logits_vjp",
]


def _flat_sum(xp, a, keep):
    """Sum over every axis but the last ``keep``: the gradient of a shared weight."""
    return xp.sum(a, axis=tuple(range(a.ndim - keep))) if a.ndim > keep else a


def dense_synthesizer_logits_vjp(x, w1, b1, w2, b2, db, /, *, xp=None):
    """VJP of :func:`attn_ref.synthesizer.dense_synthesizer_logits` given ``dB (..., N, n)``:
    ``{"x", "w1", "b1", "w2", "b2"}``. ``O(N d h + N h n)``."""
    xp = check_qkv(x, x, x, xp=xp)[0]
    check_dense_weights(xp, x, w1, b1, w2, b2)
    z = x @ w1 + b1
    h = xp.maximum(z, xp.zeros_like(z))
    dz = xp.where(z > 0, db @ transpose(xp, w2), xp.zeros_like(z))
    lead = tuple(db.shape[:-2])
    xb = xp.broadcast_to(x, lead + tuple(x.shape[-2:]))
    return {"x": unbroadcast(xp, dz @ transpose(xp, w1), x.shape),
            "w1": _flat_sum(xp, transpose(xp, xb) @ dz, 2), "b1": _flat_sum(xp, dz, 1),
            "w2": _flat_sum(xp, transpose(xp, h) @ db, 2), "b2": _flat_sum(xp, db, 1)}


def synthesizer_attention(q, k, v, do, /, *, logits, alpha=1.0, causal=False, scale=None, xp=None):
    """VJP of :func:`attn_ref.synthesizer.synthesizer_attention`: ``{"q", "k", "v", "logits"}``."""
    check_array("logits", logits, like=q, dtype=q.dtype)
    xp, batch, alpha, scale = prepare_synthesizer(q, k, v, logits.shape, alpha, causal, scale, xp)
    do = check_cotangent(xp, do, batch + (q.shape[-2], v.shape[-1]), q)
    g = softmax_attention(q, k, v, do, bias=alpha * logits, scale=(1.0 - alpha) * scale, causal=causal,
                          xp=xp)
    return {"q": g["q"], "k": g["k"], "v": g["v"], "logits": alpha * g["bias"]}


def dense_synthesizer_attention(q, k, v, do, /, *, w1, b1, w2, b2, alpha=1.0, causal=False, scale=None,
                                xp=None):
    """VJP of :func:`attn_ref.synthesizer.dense_synthesizer_attention`:
    ``{"q", "k", "v", "w1", "b1", "w2", "b2"}``; ``dq`` includes the path through the MLP.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import grad
    >>> from attn_ref.synthesizer import synthesizer_params
    >>> x = xp.reshape(xp.sin(xp.arange(24.0)), (6, 4))
    >>> g = grad.dense_synthesizer_attention(x, x, x, x, **synthesizer_params(6, 6, 4, kind="dense",
    ...                                                                       seed=0, xp=xp))
    >>> sorted(g), g["w2"].shape
    (['b1', 'b2', 'k', 'q', 'v', 'w1', 'w2'], (4, 6))
    """
    xp = check_qkv(q, k, v, xp=xp)[0]
    check_dense_weights(xp, q, w1, b1, w2, b2, n_out=k.shape[-2])
    b = dense_synthesizer_logits(q, w1, b1, w2, b2, xp=xp)
    g = synthesizer_attention(q, k, v, do, logits=b, alpha=alpha, causal=causal, scale=scale, xp=xp)
    gb = g["logits"]
    gm = dense_synthesizer_logits_vjp(q, w1, b1, w2, b2, gb, xp=xp)
    return {"q": g["q"] + gm["x"], "k": g["k"], "v": g["v"],
            **{n: gm[n] for n in ("w1", "b1", "w2", "b2")}}


def random_synthesizer_attention(q, k, v, do, /, *, r, r2=None, alpha=1.0, causal=False, scale=None,
                                 xp=None):
    """VJP of :func:`attn_ref.synthesizer.random_synthesizer_attention`:
    ``{"q", "k", "v", "r"}`` (and ``"r2"`` when factorised)."""
    xp = check_qkv(q, k, v, xp=xp)[0]
    logits = random_logits(xp, q, k, r, r2)
    g = synthesizer_attention(q, k, v, do, logits=logits, alpha=alpha, causal=causal, scale=scale, xp=xp)
    out = {"q": g["q"], "k": g["k"], "v": g["v"]}
    dr = g["logits"]
    if r2 is None:
        out["r"] = unbroadcast(xp, dr, r.shape)
    else:
        out["r"] = unbroadcast(xp, dr @ r2, r.shape)
        out["r2"] = unbroadcast(xp, transpose(xp, dr) @ r, r2.shape)
    return out
