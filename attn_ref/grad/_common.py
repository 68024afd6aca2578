"""Small vector-Jacobian products that the variants' backward passes are built from.

Every VJP in :mod:`attn_ref.grad` is a composition of these: the VJP of a matrix
product, of a row softmax, of broadcasting (a sum over the broadcast dimensions), and
of the elementwise feature maps. Each takes the forward's saved values and the
cotangent of its output and returns the cotangents of its inputs. Nothing here
modifies an argument.
"""

from __future__ import annotations

from .._checks import check_array

__all__ = [
    "through_clamp",
    "unbroadcast",
    "matmul_vjp",
    "softmax_vjp",
    "check_cotangent",
    "transpose",
]


def transpose(xp, x):
    return xp.matrix_transpose(x)


def unbroadcast(xp, g, shape):
    """Sum ``g`` down to ``shape``: the VJP of broadcasting an array of ``shape`` to ``g.shape``.

    Leading dimensions that broadcasting added are summed away; dimensions where
    ``shape`` has 1 and ``g`` does not are summed with ``keepdims``.
    """
    shape = tuple(shape)
    extra = g.ndim - len(shape)
    if extra > 0:
        g = xp.sum(g, axis=tuple(range(extra)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    if axes:
        g = xp.sum(g, axis=axes, keepdims=True)
    return g


def matmul_vjp(xp, a, b, g, *, a_shape=None, b_shape=None):
    """Cotangents of ``a`` and ``b`` for ``c = a @ b`` with cotangent ``g`` of ``c``.

    ``da = g b^T`` and ``db = a^T g``, each summed over the batch dimensions that
    broadcasting added to it (``a_shape``/``b_shape`` default to the shapes of ``a``
    and ``b``).
    """
    da = unbroadcast(xp, g @ transpose(xp, b), a.shape if a_shape is None else a_shape)
    db = unbroadcast(xp, transpose(xp, a) @ g, b.shape if b_shape is None else b_shape)
    return da, db


def through_clamp(xp, ds, s):
    """``dS`` through the clamp of :func:`attn_ref._common.scaled_logits`: zero where the
    logit ``s`` sits at ``+-finfo.max``.

    The derivative of a clamp is zero outside its range. Without it, logits clamped to
    one value tie, ``P`` splits between them, and ``scale dS K`` overflows where the
    mathematics (a saturated softmax) has a vanishing gradient.
    """
    return xp.where(xp.abs(s) < xp.finfo(s.dtype).max, ds, xp.zeros_like(ds))


def softmax_vjp(xp, p, dp):
    """Cotangent of the logits of ``p = softmax(s)`` (last axis) given that of ``p``.

    ``ds = p * (dp - rowsum(p * dp))``. Entries where ``p == 0`` (masked logits, rows
    with no allowed key) get exactly zero, never NaN, as long as ``dp`` is finite.
    """
    return p * (dp - xp.sum(p * dp, axis=-1, keepdims=True))


def check_cotangent(xp, do, shape, like, name="do", dtype=None):
    """``do`` must be an array of the output's ``shape`` (broadcasting not allowed) with the
    library, device and dtype of ``like`` (``q``), as the forward requires of ``k`` and ``v``
    (``dtype``, when given, instead of ``like``'s)."""
    check_array(name, do, like=like, dtype=like.dtype if dtype is None else dtype)
    if tuple(do.shape) != tuple(shape):
        raise ValueError(
            f"{name} must have the output's shape (..., Nq, dv) = {tuple(shape)}, got shape "
            f"{tuple(do.shape)}"
        )
    return do
