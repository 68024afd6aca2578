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

Causal and stabilised, as the forward: the keys' features are held at their own
log-scales ``c_j`` (``phi(k_j) = fk_j exp(c_j)``) and query ``i`` reads key ``j`` with
the weight ``w_ij = exp(c_j - R_i)``, ``R_i`` the largest ``c_j`` it sees. With
``dA_ij = dnum_i . v_j + dden_i`` (the readout's cotangents, :mod:`attn_ref.grad.linear`):
``dfq_i = sum_j dA_ij w_ij fk_j``, ``dfk_j = sum_i dA_ij w_ij fq_i``,
``dv_j = sum_i (fq_i . fk_j) w_ij dnum_i``. In the chunked order each is the forward's
log-scaled chunked pass (:func:`attn_ref.performer.logscaled_chunked`): ``dfq`` reads
``[dnum, dden]`` against ``[v, 1]``; ``dfk`` and ``dv`` run it backwards in time, with the
queries' ``-R_i`` as the log-scales (their running maximum from the end is ``-R_j``, as
``R`` never decreases), times ``exp(c_j - R_j) <= 1``. Held in the dtype instead, one
offset for all keys underflowed every key's features on large logits in float64 (NaN
``dq``, ``dk``, ``dprojection`` and ``dv = 0`` where torch autograd of the forward gave
``dv`` up to 15).

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

import functools
import math

import array_api_compat

from ..linear import pad_rows, zero_keyless_rows
from ..performer import (
    logscaled_chunked,
    logscaled_square,
    logscaled_weights,
    performer_features,
    prepare_performer,
    stabilised_causal_features,
)
from ._common import transpose, unbroadcast
from .linear import linear_from_features, readout_vjp

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


def _prefix_max(xp, x):
    """Running maximum of ``x (..., L, 1)`` down its rows: ``ceil(log2 L)`` doubling steps."""
    n, s = x.shape[-2], 1
    while s < n:
        x = xp.maximum(x, xp.concat([x[..., :s, :], x[..., :n - s, :]], axis=-2))
        s *= 2
    return x


def _logscaled_vjp(xp, fq, fk, ck, v, do, alignment, order, chunk_size, eps):
    """``{"fq", "fk", "v"}`` cotangents of the causal log-scaled readout (module docstring).

    ``fq (..., Nq, m')``, ``fk (..., Nk, m')`` the row-stabilised features, ``ck (..., Nk, 1)``
    the keys' log-scales, ``v (..., Nk, dv)``, ``do (..., Nq, dv)``. Chunked: the forward's
    pass four times, ``O(N m' (dv + 1))`` each; quadratic: ``O(Nq Nk (m' + dv))``.
    """
    nq, nk = fq.shape[-2], fk.shape[-2]
    if order == "quadratic":
        w = logscaled_weights(xp, ck, nq, alignment)
        a = (fq @ transpose(xp, fk)) * w
        dnum, dden = readout_vjp(xp, a @ v, xp.sum(a, axis=-1, keepdims=True), do, True, eps)
        da = (dnum @ transpose(xp, v) + dden) * w
        return {"fq": da @ fk, "fk": transpose(xp, da) @ fq, "v": transpose(xp, a) @ dnum}
    fq, fk, ck, v, (p_q, p_k, keep) = logscaled_square(xp, fq, fk, ck, v, alignment)
    num, den = logscaled_chunked(xp, fq, fk, ck, v, chunk_size)
    dnum, dden = readout_vjp(xp, num[..., p_q:p_q + nq, :], den[..., p_q:p_q + nq, :], do, True, eps)
    rest = fq.shape[-2] - p_q - nq
    g = pad_rows(xp, xp.concat([dnum, dden], axis=-1), p_q, rest)
    ones = xp.ones(tuple(v.shape[:-1]) + (1,), dtype=v.dtype, device=array_api_compat.device(v))
    v1 = xp.concat([v, ones], axis=-1)
    dfq, _ = logscaled_chunked(xp, g, v1, ck, fk, chunk_size)
    r = _prefix_max(xp, ck)

    def backwards(at_key, at_query, values):
        # row j: the sum over queries i >= j of (at_key_j . at_query_i) exp(c_j - R_i)
        # values_i, as the forward pass in reversed time (its R'_j = -R_j) times exp(c_j - R_j)
        flip = functools.partial(xp.flip, axis=-2)
        out, _ = logscaled_chunked(xp, flip(at_key), flip(at_query), flip(-r), flip(values), chunk_size)
        return flip(out) * xp.exp(ck - r)

    dfk = backwards(v1, g, fq)
    dv = backwards(fk, fq, g[..., :-1])

    def keys(x):
        return pad_rows(xp, x[..., p_k:p_k + keep, :], 0, nk - keep)

    return {"fq": dfq[..., p_q:p_q + nq, :], "fk": keys(dfk), "v": keys(dv)}


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
    # the forward selects zeros on queries without a key: no cotangent reaches them
    do = zero_keyless_rows(xp, do, alignment, k.shape[-2])
    if alignment is not None and stabilize and q.shape[-2] > 0 and k.shape[-2] > 0:
        fq, fk, ck = stabilised_causal_features(xp, q, k, projection, kernel, scale)
        g = _logscaled_vjp(xp, fq, fk, ck, v, do, alignment, order, chunk_size, eps)
    else:
        fq, fk = performer_features(xp, q, k, projection, kernel, alignment, stabilize, scale, feature_eps)
        g = linear_from_features(fq, fk, v, do, causal=alignment or False, order=order,
                                 chunk_size=chunk_size, eps=eps, xp=xp)
    root = math.sqrt(scale)
    dxq, dwq = _features_vjp(xp, q * root, projection, fq, g["fq"], kernel, feature_eps)
    dxk, dwk = _features_vjp(xp, k * root, projection, fk, g["fk"], kernel, feature_eps)
    dw = unbroadcast(xp, dwq, projection.shape) + unbroadcast(xp, dwk, projection.shape)
    return {"q": unbroadcast(xp, dxq * root, q.shape), "k": unbroadcast(xp, dxk * root, k.shape),
            "v": g["v"], "projection": dw}

