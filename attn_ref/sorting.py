"""Sparse Sinkhorn attention: local block attention plus a soft-sorted block.

Tay, Bahri, Yang, Metzler and Juan, *Sparse Sinkhorn Attention* (ICML 2020). The
sequence is cut into ``n_b = N / b`` blocks of ``b`` positions. A sorting network
scores every pair of blocks, ``R (n_b, n_b)``; Sinkhorn balancing turns
``exp(R / temperature)`` into a (nearly) doubly stochastic matrix ``P``, a relaxed
permutation, and block ``i`` of the sorted keys is ``sum_j P_ij K_j`` (values alike).
Each query block attends, with one softmax, to its own block and to its sorted block:
``2 b`` keys per query, ``O(N b d)`` instead of ``O(N^2 d)``.

Conventions of this reference
-----------------------------
* **The sorting network's output is the input.** The paper computes ``R`` from block
  summaries with a small network; here the logits ``sort_logits`` are given (like
  Performer's projection), so any sort net can be put in front, and the gradient with
  respect to the logits is returned by :func:`attn_ref.grad.sinkhorn_attention`.
* **Deterministic Sinkhorn** (no Gumbel noise), in log space:
  ``X_0 = R / temperature``, then ``n_iters`` times a row normalisation
  ``X <- X - logsumexp_rows(X)`` followed by a column normalisation, and
  ``P = exp(X)`` (the order of sinkhorn-transformer's ``sinkhorn_sorting_operator``).
  ``n_iters = 0`` leaves ``P = exp(R / temperature)`` unnormalised; as ``n_iters`` grows
  the rows and the columns of ``P`` both sum to 1.
* **Causal** (Tay et al., Section 3.4): the sort matrix is masked to strictly earlier
  blocks (``P_ij = 0`` for ``j >= i``, the Sinkhorn iteration run on that support), the
  local block is attended causally, and the first block, which has no earlier block,
  attends to its own block only.
* ``N`` must be a multiple of ``block_size``; self-attention only (``Nq = Nk``).

:func:`sinkhorn_weights` is the defining form, a dense softmax over the ``N`` keys and
the ``N`` sorted keys with the mask the blocks imply; ``docs/hashing.md`` derives it.
"""

from __future__ import annotations

import math

import array_api_compat

from ._checks import (
    check_array,
    check_nonnegative_int,
    check_positive_int,
    check_qkv,
    check_real,
    default_scale,
    namespace,
)
from ._common import causal_alignment, scaled_logits
from .random import standard_normal

__all__ = [
    "sinkhorn_sort_matrix",
    "sinkhorn_iterates",
    "block_sorted_attention",
    "sinkhorn_attention",
    "sinkhorn_weights",
    # Named steps that attn_ref.grad differentiates.
    "prepare_sinkhorn",
    "sort_mask",
    "blocked",
    "block_keys_and_mask",
]


def sort_mask(xp, n_blocks, causal, device):
    """``(n_b, n_b)`` bool: block ``i`` may sort block ``j`` in (``j < i`` when causal)."""
    i = xp.arange(n_blocks, device=device)
    if causal:
        return i[None, :] < i[:, None]
    return xp.ones((n_blocks, n_blocks), dtype=xp.bool, device=device)


def _lse(xp, x, axis):
    """Log-sum-exp along ``axis``; ``-inf`` for an all ``-inf`` line (never NaN)."""
    m = xp.max(x, axis=axis, keepdims=True)
    # The shift is the maximum rounded to an integer (x - shift <= 1/2: nothing overflows,
    # the largest term is at least e^-1/2). Autodiff differentiates round as zero, so
    # the forward under autograd (torch, JAX) computes the log-sum-exp's exact backward,
    # softmax(x) dlse; through the maximum itself, whose derivative cancels only in exact
    # arithmetic, it put the rounding of 1 - sum(softmax) on the line's largest element:
    # in bfloat16 d sort_logits was 0.62 off where it is 0.02 (N = 1000, 250 blocks;
    # 0.056 with the rounded shift, and float32's error fell from 2.0e-5 to 2.8e-6).
    ms = xp.where(xp.isfinite(m), xp.round(m), xp.zeros_like(m))
    t = xp.sum(xp.exp(x - ms), axis=axis, keepdims=True)
    return xp.where(t > 0, ms + xp.log(xp.where(t > 0, t, xp.ones_like(t))), m)


def _minus(xp, x, lse):
    # an all -inf line stays -inf (x - lse would be -inf + inf = NaN)
    return x - xp.where(xp.isfinite(lse), lse, xp.zeros_like(lse))


def sinkhorn_iterates(sort_logits, /, *, n_iters=8, temperature=0.75, causal=False, xp=None):
    """The log-space Sinkhorn iterates ``[X_0, Y_1, X_1, ..., Y_n, X_n]``.

    ``X_0 = R / temperature`` (``-inf`` off the causal support), ``Y_t`` the row-normalised
    ``X_{t-1}`` and ``X_t`` the column-normalised ``Y_t``; ``P = exp(X_n)``. The backward
    pass (:mod:`attn_ref.grad.sorting`) walks this list in reverse.
    """
    xp = namespace(("sort_logits", sort_logits), xp=xp)
    n_blocks = sort_logits.shape[-1]
    allowed = sort_mask(xp, n_blocks, causal, array_api_compat.device(sort_logits))
    x = xp.where(allowed, sort_logits / temperature,
                 xp.asarray(-math.inf, dtype=sort_logits.dtype, device=array_api_compat.device(sort_logits)))
    out = [x]
    for _ in range(n_iters):
        y = _minus(xp, x, _lse(xp, x, -1))
        x = _minus(xp, y, _lse(xp, y, -2))
        out += [y, x]
    return out


def sinkhorn_sort_matrix(sort_logits, /, *, n_iters=8, temperature=0.75, causal=False, xp=None):
    """Sinkhorn-balanced sort matrix ``P = exp(X_n)`` of logits ``R (..., n_b, n_b)``.

    Parameters
    ----------
    sort_logits : array, shape (..., n_b, n_b)
        The sorting network's scores ``R``.
    n_iters : int
        Row-then-column normalisations (``0``: ``exp(R / temperature)`` itself).
    temperature : float
        ``> 0``; smaller is closer to a hard permutation.
    causal : bool
        Only strictly earlier blocks (``P_ij = 0`` for ``j >= i``).

    Returns
    -------
    array, shape (..., n_b, n_b)
        Non-negative; columns sum to 1 after every iteration (those with support), and
        the rows converge to 1 as ``n_iters`` grows. ``O(n_iters n_b^2)`` time.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.sorting import sinkhorn_sort_matrix
    >>> p = sinkhorn_sort_matrix(xp.asarray([[2.0, 0.0], [1.0, 1.0]]), n_iters=50)
    >>> bool(xp.max(xp.abs(xp.sum(p, axis=-1) - 1.0)) < 1e-12)
    True
    """
    xp = namespace(("sort_logits", sort_logits), xp=xp)
    _check_sort(xp, sort_logits, n_iters, temperature)
    return xp.exp(sinkhorn_iterates(sort_logits, n_iters=n_iters, temperature=temperature,
                                    causal=causal, xp=xp)[-1])


def _check_sort(xp, sort_logits, n_iters, temperature, n_blocks=None, like=None):
    if like is not None:
        check_array("sort_logits", sort_logits, like=like, dtype=like.dtype)
    if sort_logits.ndim < 2 or sort_logits.shape[-1] != sort_logits.shape[-2] or (
            n_blocks is not None and sort_logits.shape[-1] != n_blocks):
        want = "(..., n_b, n_b)" if n_blocks is None else f"(..., n_b, n_b) = (..., {n_blocks}, {n_blocks})"
        raise ValueError(f"sort_logits must have shape {want}, one row and column per block, "
                         f"got shape {tuple(sort_logits.shape)}")
    check_nonnegative_int("n_iters", n_iters)
    if check_real("temperature", temperature) <= 0:
        raise ValueError(f"temperature must be positive, got {temperature!r}")


def prepare_sinkhorn(q, k, v, sort_logits, block_size, n_iters, temperature, causal, scale, xp):
    """Check the inputs of :func:`sinkhorn_attention`: ``(xp, batch, causal flag, scale)``."""
    xp, batch = check_qkv(q, k, v, xp=xp, same_length=True)
    check_positive_int("block_size", block_size)
    n = q.shape[-2]
    if n % block_size:
        raise ValueError(f"block_size must divide the sequence length N={n}, got block_size={block_size}")
    _check_sort(xp, sort_logits, n_iters, temperature, n // block_size, q)
    return xp, batch, causal_alignment(causal) is not None, default_scale(q.shape[-1], scale)


def blocked(xp, x, block_size):
    """``(..., N, e)`` as ``(..., N / b, b, e)``."""
    return xp.reshape(x, tuple(x.shape[:-2]) + (x.shape[-2] // block_size, block_size, x.shape[-1]))


def _sorted_blocks(xp, p, xb):
    """``sum_j P_ij X_j``: ``p (..., n_b, n_b)``, ``xb (..., n_b, b, e)``."""
    lead = tuple(xb.shape[:-3])
    nb, b, e = xb.shape[-3:]
    flat = xp.reshape(xb, lead + (nb, b * e))
    return xp.reshape(p @ flat, tuple((p @ flat).shape[:-2]) + (nb, b, e))


def block_keys_and_mask(xp, k, v, p, block_size, causal):
    """Each block's keys and values, its own then its sorted block, and the key mask.

    Returns ``(kk (..., n_b, 2b, d), vv (..., n_b, 2b, dv), mask (n_b, b, 2b))``.
    """
    kb, vb = blocked(xp, k, block_size), blocked(xp, v, block_size)
    ks, vs = _sorted_blocks(xp, p, kb), _sorted_blocks(xp, p, vb)
    kb, ks = xp.broadcast_arrays(kb, ks)
    vb, vs = xp.broadcast_arrays(vb, vs)
    nb, b = kb.shape[-3], block_size
    dev = array_api_compat.device(k)
    if causal:
        local = xp.arange(b, device=dev)[None, :] <= xp.arange(b, device=dev)[:, None]
        # the first block has no earlier block to sort in
        sorted_ok = xp.broadcast_to((xp.arange(nb, device=dev) > 0)[:, None, None], (nb, b, b))
        mask = xp.concat([xp.broadcast_to(local, (nb, b, b)), sorted_ok], axis=-1)
    else:
        mask = xp.ones((nb, b, 2 * b), dtype=xp.bool, device=dev)
    return xp.concat([kb, ks], axis=-2), xp.concat([vb, vs], axis=-2), mask


def block_sorted_attention(q, k, v, sort_matrix, /, *, block_size, causal=False, scale=None, xp=None):
    """Attention of each query block to its own block and its sorted block, given ``P``.

    The second half of :func:`sinkhorn_attention`, for any ``sort_matrix (..., n_b, n_b)``
    (a hard permutation, a Sinkhorn matrix, ...). Causal: the local block causally, the
    sorted block fully except in the first block, which has no earlier block.
    ``O(N b (d + dv) + n_b^2 b (d + dv))`` time.
    """
    xp = namespace(("q", q), ("k", k), ("v", v), ("sort_matrix", sort_matrix), xp=xp)
    scale = default_scale(q.shape[-1], scale)
    kk, vv, mask = block_keys_and_mask(xp, k, v, sort_matrix, block_size, causal)
    qb = blocked(xp, q, block_size)
    s = scaled_logits(xp, qb @ xp.matrix_transpose(kk), scale)
    s = xp.where(mask, s, xp.asarray(-math.inf, dtype=s.dtype, device=array_api_compat.device(s)))
    m = xp.max(s, axis=-1, keepdims=True)  # finite: a query always sees itself
    p = xp.exp(s - m)
    out = (p @ vv) / xp.sum(p, axis=-1, keepdims=True)
    return xp.reshape(out, tuple(out.shape[:-3]) + (q.shape[-2], v.shape[-1]))


def sinkhorn_attention(q, k, v, /, *, sort_logits, block_size, n_iters=8, temperature=0.75, causal=False,
                       scale=None, xp=None):
    """Sparse Sinkhorn attention: own block plus the Sinkhorn-sorted block, one softmax.

    Parameters
    ----------
    q, k : array, shape (..., N, d)
    v : array, shape (..., N, dv)
    sort_logits : array, shape (..., N / block_size, N / block_size)
        The sorting network's block scores ``R`` (same dtype and library as ``q``).
    block_size : int
        Divides ``N``.
    n_iters : int
        Sinkhorn iterations (row then column normalisation each).
    temperature : float
        ``X_0 = R / temperature``.
    causal : {False, True, "top-left", "bottom-right"}
        The sort matrix masked to earlier blocks and causal local attention (both
        alignments agree: ``Nq = Nk``).
    scale : float, optional
        Logit scale, default ``1/sqrt(d)``.

    Returns
    -------
    array, shape (..., N, dv)
        ``sinkhorn_weights(q, k, ...) @ v``. With ``P = I`` (a sort that keeps each block
        in place) every query sees its own block twice: block-local attention.

    Notes
    -----
    ``O(N b (d + dv) + n_b^2 (n_iters + b (d + dv)))`` time, ``O(N b + n_iters n_b^2)``
    extra memory. Tay et al., *Sparse Sinkhorn Attention*, ICML 2020.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.sorting import sinkhorn_attention
    >>> x = xp.reshape(xp.sin(xp.arange(48.0)), (12, 4))
    >>> r = xp.reshape(xp.cos(xp.arange(9.0)), (3, 3))
    >>> sinkhorn_attention(x, x, x, sort_logits=r, block_size=4).shape
    (12, 4)
    """
    xp, batch, causal, scale = prepare_sinkhorn(q, k, v, sort_logits, block_size, n_iters, temperature,
                                                causal, scale, xp)
    p = sinkhorn_sort_matrix(sort_logits, n_iters=n_iters, temperature=temperature, causal=causal, xp=xp)
    return block_sorted_attention(q, k, v, p, block_size=block_size, causal=causal, scale=scale, xp=xp)


def sinkhorn_weights(q, k, /, *, sort_logits, block_size, n_iters=8, temperature=0.75, causal=False,
                     scale=None, xp=None):
    """The defining form: the ``(..., N, N)`` matrix ``W`` with ``out = W V``.

    A dense softmax of query ``i`` over ``2N`` keys - the ``N`` keys and the ``N``
    sorted keys ``ks_(I, t) = sum_J P_IJ k_(J, t)`` - masked to its own block (causally)
    and its own sorted block (none for the first block when causal); the weight of
    sorted key ``(I, t)`` is then spread back to the keys ``(J, t)`` by ``P_IJ``.
    ``O(N^2 (d + n_b))`` time, ``O(N^2)`` memory. Arguments as in
    :func:`sinkhorn_attention`.
    """
    xp, batch, causal, scale = prepare_sinkhorn(q, k, k, sort_logits, block_size, n_iters, temperature,
                                                causal, scale, xp)
    p = sinkhorn_sort_matrix(sort_logits, n_iters=n_iters, temperature=temperature, causal=causal, xp=xp)
    n, b = q.shape[-2], block_size
    dev = array_api_compat.device(q)
    # S = P (x) I_b: sorted key (I, t) = sum_J P_IJ key (J, t), as an (N, N) matrix
    eye = xp.eye(b, dtype=q.dtype, device=dev)
    spread = xp.reshape(p[..., :, None, :, None] * eye[:, None, :], tuple(p.shape[:-2]) + (n, n))
    ks = spread @ k
    pos = xp.arange(n, device=dev)
    same = (pos[:, None] // b) == (pos[None, :] // b)
    own = same & (pos[None, :] <= pos[:, None]) if causal else same
    srt = same & (pos[:, None] >= b) if causal else same
    s = scaled_logits(xp, xp.concat([q @ xp.matrix_transpose(k), q @ xp.matrix_transpose(ks)], axis=-1),
                      scale)
    mask = xp.concat([own, srt], axis=-1)
    s = xp.where(mask, s, xp.asarray(-math.inf, dtype=s.dtype, device=dev))
    a = xp.exp(s - xp.max(s, axis=-1, keepdims=True))
    a = a / xp.sum(a, axis=-1, keepdims=True)
    return a[..., :n] + a[..., n:] @ spread


def _params(seed, nq, nk, d, dv, *, dtype, device, xp):
    # the largest block of at most 4 that divides N (1 for a prime N)
    b = max(s for s in range(1, min(4, max(nk, 1)) + 1) if nk % s == 0)
    nb = nk // b
    return {"block_size": b,
            "sort_logits": standard_normal((nb, nb), seed=seed, dtype=dtype, device=device, xp=xp)}


def _register():
    from .registry import Variant, register

    register(Variant(
        name="sinkhorn", fn=sinkhorn_attention, family="sorting", exact=False, causal=True,
        vjp="attn_ref.grad.sorting:sinkhorn_attention",
        time="O(N b d + (N/b)^2 b d)", memory="O(N b + (N/b)^2)", params=_params, weights=sinkhorn_weights,
        self_attention=True, options={"n_iters": 8, "temperature": 0.75},
        summary="Sparse Sinkhorn: blocks of <= 4, own block + Sinkhorn-sorted block (8 iterations)",
    ))


_register()
