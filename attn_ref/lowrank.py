"""Linformer: softmax attention over keys and values projected to a fixed length.

``O = softmax(scale * Q (E K)^T) (F V)``

Wang et al. (2020), *Linformer: Self-Attention with Linear Complexity*, observe that
the ``N x N`` attention matrix is close to low rank and replace the ``Nk`` keys and
values by ``r`` linear combinations of them, ``E K`` and ``F V`` with ``E, F`` of
shape ``(r, Nk)``. Time and memory fall from ``O(N^2)`` to ``O(N r)``. The
projections are learned in real models, so here they are inputs;
:func:`linformer_projection` draws the scaled Gaussian (Johnson-Lindenstrauss)
projection that the paper's approximation theorem uses.

What the method cannot do
-------------------------
* Causal masking: each projected key mixes every position, so a query at ``i`` would
  see keys from its future. There is no clean causal form; ``causal=True`` raises.
* Padding masks: masking happens after the projection in logits space, where a
  column is a mixture of all positions, so a masked key cannot be removed. Zero the
  padded keys/values (or the projection's padded columns) before calling; ``mask=``
  raises rather than computing something wrong.
"""

from __future__ import annotations

from ._checks import check_array, check_positive_int, check_qkv, default_scale
from .random import standard_normal
from .softmax import attention_weights, softmax_attention

__all__ = ["linformer_attention", "linformer_weights", "linformer_projection", "prepare_linformer", "project"]


def _refuse(fn, mask, causal):
    if mask is not None:
        raise ValueError(
            f"{fn} does not support mask=: a projected key mixes every position, so a "
            "masked key cannot be removed after projection; zero the padded keys and values "
            "(or the projection's padded columns) instead"
        )
    if causal is not False and causal is not None:
        raise ValueError(
            f"{fn} does not support causal masking: each projected key mixes every position, "
            f"so queries would see their future; got causal={causal!r}"
        )


def _check_projection(xp, name, p, nk, batch, q):
    """``p`` is ``(r, Nk)`` or per head ``(h, r, Nk)`` with ``1 <= r <= Nk``, of ``q``'s
    library, device and dtype."""
    want = f"(r, Nk) or (h, r, Nk) with Nk={nk} and 1 <= r <= Nk"
    check_array(name, p, like=q, dtype=q.dtype)
    if p.ndim not in (2, 3) or p.shape[-1] != nk:
        raise ValueError(f"{name} must have shape {want}, got shape {tuple(p.shape)}")
    if not 1 <= p.shape[-2] <= nk:
        raise ValueError(
            f"{name} must have shape {want}: the projected length r={p.shape[-2]} "
            f"must lie in [1, Nk={nk}], got shape {tuple(p.shape)}"
        )
    if p.ndim == 3:
        heads = batch[-1] if batch else 1
        if p.shape[0] not in (1, heads):
            raise ValueError(
                f"{name} has per-head shape (h, r, Nk) = {tuple(p.shape)}, but h={p.shape[0]} "
                f"does not match the head axis (the last batch axis, size {heads}) of q, k, v"
            )
    return p


def prepare_linformer(q, k, v, e_proj, f_proj, mask, causal, scale, xp, fn):
    """Check the inputs of :func:`linformer_attention`: ``(xp, e_proj, f_proj, scale)``."""
    _refuse(fn, mask, causal)
    xp, batch = check_qkv(q, k, v, xp=xp)
    nk = k.shape[-2]
    e_proj = _check_projection(xp, "e_proj", e_proj, nk, batch, q)
    f_proj = e_proj if f_proj is None else _check_projection(xp, "f_proj", f_proj, nk, batch, q)
    if f_proj.shape[-2] != e_proj.shape[-2]:
        raise ValueError(
            f"e_proj and f_proj must project to the same length r, got e_proj "
            f"{tuple(e_proj.shape)} and f_proj {tuple(f_proj.shape)}"
        )
    return xp, e_proj, f_proj, default_scale(q.shape[-1], scale)


def project(p, x):
    """``P X``: ``(h?, r, N) @ (..., N, d) -> (..., r, d)``."""
    return p @ x


def linformer_attention(q, k, v, /, *, e_proj, f_proj=None, scale=None, mask=None, causal=False,
                        xp=None):
    """Linformer attention: ``softmax(scale Q (E K)^T) (F V)``.

    Parameters
    ----------
    q : array, shape (..., Nq, d)
    k : array, shape (..., Nk, d)
    v : array, shape (..., Nk, dv)
    e_proj : array, shape (r, Nk) or (h, r, Nk)
        Key projection ``E``; the per-head form matches the last batch axis of the
        inputs (the head axis of ``(B, h, N, d)``). ``1 <= r <= Nk``. Same dtype as ``q``.
    f_proj : array, optional
        Value projection ``F``, same shape rules and same ``r``; ``None`` shares the key
        projection (``F = E``, the paper's key-value sharing).
    scale : float, optional
        Logit scale, default ``1/sqrt(d)``.
    mask, causal
        Not supported (see the module docstring); anything but the defaults raises
        ``ValueError``.

    Returns
    -------
    array, shape (..., Nq, dv)
        With ``E = F = I`` (``r = Nk``) this is softmax attention exactly.
        ``Nq == 0`` gives an empty ``(..., 0, dv)`` output; ``Nk == 0`` is an error
        (there is no ``r`` with ``1 <= r <= 0``).

    Notes
    -----
    ``O(r Nk (d + dv) + Nq r (d + dv))`` time, ``O(Nq r)`` extra memory. Wang et al.,
    *Linformer: Self-Attention with Linear Complexity*, 2020.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import linformer_attention, softmax_attention
    >>> x = xp.reshape(xp.sin(xp.arange(24.0)), (6, 4))
    >>> eye = xp.eye(6, dtype=xp.float64)
    >>> a = linformer_attention(x, x, x, e_proj=eye)
    >>> bool(xp.max(xp.abs(a - softmax_attention(x, x, x))) < 1e-15)
    True
    """
    xp, e_proj, f_proj, scale = prepare_linformer(q, k, v, e_proj, f_proj, mask, causal, scale, xp,
                                                  "linformer_attention")
    return softmax_attention(q, project(e_proj, k), project(f_proj, v), scale=scale, xp=xp)


def linformer_weights(q, k, /, *, e_proj, f_proj=None, scale=None, mask=None, causal=False,
                      xp=None):
    """The ``(..., Nq, Nk)`` attention matrix Linformer implies: ``softmax(scale Q (E K)^T) F``.

    ``linformer_attention(q, k, v, ...) == linformer_weights(q, k, ...) @ v``. Rows need
    not sum to one or be non-negative unless ``F`` is row-stochastic.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import linformer_weights
    >>> x = xp.reshape(xp.cos(xp.arange(12.0)), (4, 3))
    >>> linformer_weights(x, x, e_proj=xp.ones((2, 4)) / 4).shape
    (4, 4)
    """
    xp, e_proj, f_proj, scale = prepare_linformer(q, k, k, e_proj, f_proj, mask, causal, scale, xp,
                                                  "linformer_weights")
    return attention_weights(q, project(e_proj, k), scale=scale, xp=xp) @ f_proj


def linformer_projection(k, n, /, *, heads=None, seed, dtype=None, device=None, xp):
    """A Gaussian Johnson-Lindenstrauss projection ``E`` of shape ``(k, n)`` or ``(heads, k, n)``.

    Entries are i.i.d. ``N(0, 1/k)``, the projection of Linformer's Theorem 1, so that
    ``E^T E`` is close to the identity on any fixed low-dimensional subspace and
    ``||E x|| ~ ||x||``. Drawn on the host from ``seed`` (:mod:`attn_ref.random`), so
    every backend gets the same matrix.

    Parameters
    ----------
    k : int
        Projected length, ``1 <= k <= n``.
    n : int
        Sequence length ``Nk`` the projection applies to.
    heads : int, optional
        Draw an independent projection per head.
    seed : int
    dtype, device, xp
        Where to build the result; ``dtype`` defaults to ``xp.float64``.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref import linformer_projection
    >>> linformer_projection(4, 10, heads=2, seed=0, xp=xp).shape
    (2, 4, 10)
    """
    check_positive_int("n", n)
    check_positive_int("k", k)
    if k > n:
        raise ValueError(f"k (the projected length) must be at most n={n}, got k={k}")
    shape = (k, n) if heads is None else (check_positive_int("heads", heads), k, n)
    e = standard_normal(shape, seed=seed, dtype=dtype, device=device, xp=xp)
    return e * (1.0 / k) ** 0.5


def _params(seed, nq, nk, d, dv, *, dtype, device, xp):
    r = max(1, min(nk, 8))
    return {
        "e_proj": linformer_projection(r, nk, seed=seed, dtype=dtype, device=device, xp=xp),
        "f_proj": linformer_projection(r, nk, seed=seed + 1, dtype=dtype, device=device, xp=xp),
    }


def _register():
    from .registry import Variant, register

    register(Variant(
        name="linformer", fn=linformer_attention, family="lowrank", exact=False, causal=False,
        vjp="attn_ref.grad.lowrank:linformer_attention",
        time="O(N r d)", memory="O(N r)", params=_params, weights=linformer_weights,
        summary="softmax(Q (EK)^T / sqrt(d)) (FV), keys/values projected to r = min(8, N)",
    ))


_register()
