"""Gradients of sparse Sinkhorn attention, the sort logits included.

Nothing here is discrete: the sort matrix ``P`` is a smooth function of the logits
``R``, so the VJP returns ``d sort_logits`` too (a model learns its sorting network
through it). Backwards, in three steps:

* the block attention: a softmax over each block's ``2 b`` keys (its own and its sorted
  block), ``dS = A * (dO V'^T - rowsum(dO * O))``, ``dQ = scale dS K'``,
  ``dK' = scale dS^T Q``, ``dV' = A^T dO``;
* the sorted blocks ``K_s = P K_blocks``: ``dP = dK_s K_blocks^T + dV_s V_blocks^T`` and
  ``dK_blocks += P^T dK_s`` (values alike);
* the Sinkhorn iterations in reverse: each step ``Z = X - logsumexp(X, axis)`` has the
  VJP ``dX = dZ - exp(Z) sum(dZ, axis)``; ``P = exp(X_n)`` gives ``dX_n = P * dP``, and
  ``dR = dX_0 / temperature`` on the (causal) support, zero off it.
"""

from __future__ import annotations

from .._common import scaled_logits
from ..sorting import block_keys_and_mask, blocked, prepare_sinkhorn, sinkhorn_iterates
from ._common import check_cotangent, softmax_vjp, through_clamp, transpose, unbroadcast

__all__ = ["sinkhorn_attention"]


def _normalise_vjp(xp, z, dz, axis):
    """VJP of ``z = x - logsumexp(x, axis)`` from its output ``z``."""
    return dz - xp.exp(z) * xp.sum(dz, axis=axis, keepdims=True)


def _flat(xp, xb):
    return xp.reshape(xb, tuple(xb.shape[:-2]) + (xb.shape[-2] * xb.shape[-1],))


def sinkhorn_attention(q, k, v, do, /, *, sort_logits, block_size, n_iters=8, temperature=0.75, causal=False,
                       scale=None, xp=None):
    """VJP of :func:`attn_ref.sorting.sinkhorn_attention`: ``{"q", "k", "v", "sort_logits"}``.

    Parameters
    ----------
    q, k, v, sort_logits, block_size, n_iters, temperature, causal, scale, xp
        As in :func:`attn_ref.sorting.sinkhorn_attention`.
    do : array, shape (..., N, dv)
        Cotangent of the output.

    Returns
    -------
    dict
        Gradients of ``q``, ``k``, ``v`` and ``sort_logits``, each of its input's shape.

    Notes
    -----
    The forward's cost, ``O(N b (d + dv) + n_b^2 (n_iters + b (d + dv)))``, and
    ``O(n_iters n_b^2)`` memory for the Sinkhorn iterates.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import grad
    >>> x = xp.reshape(xp.sin(xp.arange(32.0)), (8, 4))
    >>> g = grad.sinkhorn_attention(x, x, x, x, sort_logits=xp.zeros((2, 2)), block_size=4)
    >>> sorted(g), g["sort_logits"].shape
    (['k', 'q', 'sort_logits', 'v'], (2, 2))
    """
    xp, batch, causal, scale = prepare_sinkhorn(q, k, v, sort_logits, block_size, n_iters, temperature,
                                                causal, scale, xp)
    n, b = q.shape[-2], block_size
    do = check_cotangent(xp, do, batch + (n, v.shape[-1]), q)
    iterates = sinkhorn_iterates(sort_logits, n_iters=n_iters, temperature=temperature, causal=causal, xp=xp)
    p = xp.exp(iterates[-1])
    kk, vv, mask = block_keys_and_mask(xp, k, v, p, b, causal)
    qb, dob = blocked(xp, q, b), blocked(xp, do, b)
    s = scaled_logits(xp, qb @ transpose(xp, kk), scale)
    s = xp.where(mask, s, xp.full_like(s, -xp.inf))
    a = xp.exp(s - xp.max(s, axis=-1, keepdims=True))
    a = a / xp.sum(a, axis=-1, keepdims=True)
    # the block attention
    dvv = transpose(xp, a) @ dob
    ds = through_clamp(xp, softmax_vjp(xp, a, dob @ transpose(xp, vv)), s)
    dqb = scale * (ds @ kk)
    dkk = scale * (transpose(xp, ds) @ qb)
    # the sorted blocks: K_s = P K_blocks, V_s = P V_blocks
    kb, vb = blocked(xp, k, b), blocked(xp, v, b)
    dks, dvs = _flat(xp, dkk[..., b:, :]), _flat(xp, dvv[..., b:, :])
    dp = dks @ transpose(xp, _flat(xp, kb)) + dvs @ transpose(xp, _flat(xp, vb))
    dkb = _flat(xp, dkk[..., :b, :]) + transpose(xp, p) @ dks
    dvb = _flat(xp, dvv[..., :b, :]) + transpose(xp, p) @ dvs
    # the Sinkhorn iterations, last first: [X_0, Y_1, X_1, ..., Y_n, X_n]
    dx = p * dp
    for t in range(n_iters, 0, -1):
        dy = _normalise_vjp(xp, iterates[2 * t], dx, -2)
        dx = _normalise_vjp(xp, iterates[2 * t - 1], dy, -1)
    dr = xp.where(xp.isfinite(iterates[0]), dx / temperature, xp.zeros_like(dx))
    return {"q": unbroadcast(xp, xp.reshape(dqb, tuple(dqb.shape[:-3]) + (n, q.shape[-1])), q.shape),
            "k": unbroadcast(xp, xp.reshape(dkb, tuple(dkb.shape[:-2]) + (n, k.shape[-1])), k.shape),
            "v": unbroadcast(xp, xp.reshape(dvb, tuple(dvb.shape[:-2]) + (n, v.shape[-1])), v.shape),
            "sort_logits": unbroadcast(xp, dr, sort_logits.shape)}
