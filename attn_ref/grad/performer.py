"""Gradients of Performer (FAVOR+) attention.

Performer is linear attention on random features, so its VJP is the linear-attention
engine's (:func:`attn_ref.grad.linear.linear_from_features`) followed by the VJP of the
features. For ``x = sqrt(scale) q`` (or ``k``) and ``u = x W^T``:

* positive: ``phi = exp(u - |x|^2/2 - offset) / sqrt(m)``; with ``de = dphi * phi``:
  ``dx = de W - rowsum(de) x``, ``dW = de^T x``;
* trigonometric: ``phi = e [sin u, cos u] / sqrt(m)``, ``e = exp(|x|^2/2 - offset)``;
  ``du = (dphi_sin cos u - dphi_cos sin u) e / sqrt(m)``,
  ``dh = rowsum(dphi * phi)`` for the exponent ``h = |x|^2/2``:
  ``dx = du W + dh x``, ``dW = du^T x``.

The stabiliser offsets are treated as constants (``stop_gradient``): a per-query
offset, or one shared by every key a query sees, cancels in the normalised output, so
its exact gradient is zero. With a feature floor (``feature_eps > 0``) the features are
``(exp(...) + feature_eps) / sqrt(m)``: the exponential's part is ``phi - feature_eps /
sqrt(m)``, and the offsets, which no longer cancel, are held constant as
google-research's code (``stop_gradient``) and performer-pytorch (``.detach()``) hold
them: this is the gradient those implementations compute, not the derivative of the
offsets' maxima. The gradient of the projection ``W`` is returned too: it
is an input, and a model that learns its features needs it.
"""

from __future__ import annotations

import math

from ..linear import zero_keyless_rows
from ..performer import performer_features, prepare_performer
from ._common import transpose, unbroadcast
from .linear import linear_from_features

__all__ = ["performer_attention"]


def _features_vjp(xp, x, projection, phi, dphi, kernel, feature_eps=0.0):
    """``(dx, dW)`` for ``phi = features(x, W)`` (offset held constant)."""
    m = projection.shape[0]
    if kernel == "positive":
        de = dphi * (phi - feature_eps / math.sqrt(m) if feature_eps else phi)
        dx = de @ projection - xp.sum(de, axis=-1, keepdims=True) * x
        return dx, transpose(xp, de) @ x
    u = x @ transpose(xp, projection)
    ds, dc = dphi[..., :m], dphi[..., m:]
    # e / sqrt(m) from the features: phi_sin^2 + phi_cos^2 = (e / sqrt(m))^2.
    e = xp.sqrt(phi[..., :m] ** 2 + phi[..., m:] ** 2)
    du = (ds * xp.cos(u) - dc * xp.sin(u)) * e
    dh = xp.sum(dphi * phi, axis=-1, keepdims=True)
    return du @ projection + dh * x, transpose(xp, du) @ x


def performer_attention(q, k, v, do, /, *, projection, kernel="positive", causal=False, stabilize=True,
                        scale=None, order="linear", chunk_size=64, eps=None, feature_eps=0.0, xp=None):
    """VJP of :func:`attn_ref.performer_attention`: ``{"q", "k", "v", "projection"}``.

    Parameters
    ----------
    q, k, v, projection, kernel, causal, stabilize, scale, order, chunk_size, eps, feature_eps, xp
        As in :func:`attn_ref.performer_attention`.
    do : array, shape (..., Nq, dv)
        Cotangent of the output.

    Returns
    -------
    dict
        Gradients of ``q``, ``k``, ``v`` and the ``(m, d)`` ``projection``.

    Notes
    -----
    Same cost as the forward: ``O(N m (d + dv))`` (non-causal). The stabiliser is
    held constant (module docstring), as FAVOR+ implementations do. Range: the causal
    gradient is finite while ``scale max|q|^2`` and ``scale max|k|^2`` are below the
    dtype's largest value; past it (``scale=1e308``) the forward stays finite (its
    exponents are clamped) but this gradient can overflow.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import grad, random_features
    >>> x = xp.reshape(xp.sin(xp.arange(24.0)), (6, 4))
    >>> g = grad.performer_attention(x, x, x, x, projection=random_features(4, 8, seed=0, xp=xp))
    >>> sorted(g), g["projection"].shape
    (['k', 'projection', 'q', 'v'], (8, 4))
    """
    xp, alignment, scale, eps = prepare_performer(q, k, v, projection, kernel, causal, scale, eps, xp,
                                                  feature_eps, stabilize)
    fq, fk = performer_features(xp, q, k, projection, kernel, alignment, stabilize, scale, feature_eps)
    # the forward selects zeros on queries without a key: no cotangent reaches them
    do = zero_keyless_rows(xp, do, alignment, k.shape[-2])
    g = linear_from_features(fq, fk, v, do, causal=alignment or False, order=order, chunk_size=chunk_size,
                             eps=eps, xp=xp)
    root = math.sqrt(scale)
    dxq, dwq = _features_vjp(xp, q * root, projection, fq, g["fq"], kernel, feature_eps)
    dxk, dwk = _features_vjp(xp, k * root, projection, fk, g["fk"], kernel, feature_eps)
    dw = unbroadcast(xp, dwq, projection.shape) + unbroadcast(xp, dwk, projection.shape)
    return {"q": unbroadcast(xp, dxq * root, q.shape), "k": unbroadcast(xp, dxk * root, k.shape),
            "v": g["v"], "projection": dw}

