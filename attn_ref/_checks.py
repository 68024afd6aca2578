"""Argument checking shared by every variant.

Every public function validates its inputs here so that bad input fails the same way
everywhere: a ``ValueError`` or ``TypeError`` whose message names the argument, what
was expected and what arrived. Nothing here copies or modifies an input.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import array_api_compat

__all__ = [
    "namespace",
    "check_qkv",
    "check_mask",
    "check_bias",
    "check_positive_int",
    "check_nonnegative_int",
    "default_scale",
    "broadcast_batch",
    "is_floating",
]


def namespace(*named, xp=None):
    """Return the array namespace shared by ``named`` ``(name, array)`` pairs.

    ``None`` entries are ignored. Mixing arrays of different libraries raises a
    ``TypeError`` that lists which argument came from which library.
    """
    arrays = [(n, a) for n, a in named if a is not None]
    if xp is not None:
        return xp
    if not arrays:
        raise TypeError("no array arguments were given; cannot tell which array library to use")
    libs = {}
    for name, a in arrays:
        if not array_api_compat.is_array_api_obj(a):
            raise TypeError(
                f"{name} must be an array of an array-API library, got {type(a).__name__}"
            )
        libs.setdefault(_library(a), []).append(name)
    if len(libs) > 1:
        parts = "; ".join(f"{', '.join(ns)} from {lib}" for lib, ns in libs.items())
        raise TypeError(f"arguments come from different array libraries: {parts}")
    return array_api_compat.array_namespace(*(a for _, a in arrays))


def _library(a) -> str:
    mod = type(a).__module__.split(".")[0]
    return {"jaxlib": "jax"}.get(mod, mod)


def is_floating(xp, dtype) -> bool:
    return xp.isdtype(dtype, "real floating")


def _check_float(xp, name, x):
    if not is_floating(xp, x.dtype):
        raise TypeError(f"{name} must have a real floating dtype, got {x.dtype}")


def broadcast_batch(name_shapes: Sequence[tuple[str, tuple]]) -> tuple:
    """Broadcast the leading (batch) dimensions of several shapes, or raise naming them."""
    ndim = max((len(s) for _, s in name_shapes), default=0)
    out = []
    for axis in range(-ndim, 0):
        size = 1
        for _, s in name_shapes:
            if -axis <= len(s) and s[axis] != 1:
                if size not in (1, s[axis]):
                    desc = ", ".join(f"{n} {tuple(s)}" for n, s in name_shapes)
                    raise ValueError(
                        f"leading (batch, head) dimensions do not broadcast: {desc}"
                    )
                size = s[axis]
        out.append(size)
    return tuple(out)


def check_qkv(q, k, v, *, xp=None, same_length=False):
    """Validate ``q (..., Nq, d)``, ``k (..., Nk, d)``, ``v (..., Nk, dv)``.

    Returns ``(xp, batch_shape)`` where ``batch_shape`` is the broadcast of the three
    leading shapes. With ``same_length=True`` the variant needs ``Nq == Nk``
    (self-attention only).
    """
    xp = namespace(("q", q), ("k", k), ("v", v), xp=xp)
    for name, x, want in (("q", q, "(..., Nq, d)"), ("k", k, "(..., Nk, d)"),
                          ("v", v, "(..., Nk, dv)")):
        if x.ndim < 2:
            raise ValueError(f"{name} must have shape {want} (rank >= 2), got shape {tuple(x.shape)}")
        _check_float(xp, name, x)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k and v must share one floating dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must have the same head dimension d: q {tuple(q.shape)} is (..., Nq, d) "
            f"with d={q.shape[-1]}, k {tuple(k.shape)} has d={k.shape[-1]}"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"k and v must have the same sequence length Nk: k {tuple(k.shape)} has "
            f"Nk={k.shape[-2]}, v {tuple(v.shape)} has Nk={v.shape[-2]}"
        )
    if same_length and q.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"this variant is self-attention only and needs Nq == Nk, got q {tuple(q.shape)} "
            f"and k {tuple(k.shape)}"
        )
    devices = {str(array_api_compat.device(x)) for x in (q, k, v)}
    if len(devices) > 1:
        raise ValueError(f"q, k and v live on different devices: {sorted(devices)}")
    batch = broadcast_batch([("q", tuple(q.shape[:-2])), ("k", tuple(k.shape[:-2])),
                             ("v", tuple(v.shape[:-2]))])
    return xp, batch


def _check_pairwise(name, x, batch, nq, nk, what):
    """``x`` must broadcast to ``batch + (nq, nk)`` without enlarging it."""
    want = f"broadcastable to (..., Nq, Nk) = {tuple(batch) + (nq, nk)}"
    if x.ndim < 2:
        raise ValueError(f"{name} must be {what} {want}, got shape {tuple(x.shape)}")
    if x.shape[-2] not in (1, nq) or x.shape[-1] not in (1, nk):
        raise ValueError(f"{name} must be {what} {want}, got shape {tuple(x.shape)}")
    lead = tuple(x.shape[:-2])
    if len(lead) > len(batch) or broadcast_batch([("batch", batch), (name, lead)]) != tuple(batch):
        raise ValueError(
            f"{name} must be {what} {want} without adding batch dimensions, "
            f"got shape {tuple(x.shape)}"
        )


def check_mask(xp, mask, batch, nq, nk, name="mask"):
    """A boolean mask broadcastable to ``batch + (Nq, Nk)``; True = may attend."""
    if mask is None:
        return None
    if not array_api_compat.is_array_api_obj(mask):
        raise TypeError(f"{name} must be a boolean array, got {type(mask).__name__}")
    if mask.dtype != xp.bool:
        raise TypeError(f"{name} must have dtype bool (True = may attend), got {mask.dtype}")
    _check_pairwise(name, mask, batch, nq, nk, "a boolean array")
    return mask


def check_bias(xp, bias, batch, nq, nk, dtype, name="bias"):
    """An additive float logit bias broadcastable to ``batch + (Nq, Nk)``, cast to ``dtype``."""
    if bias is None:
        return None
    if not array_api_compat.is_array_api_obj(bias):
        raise TypeError(f"{name} must be a floating array, got {type(bias).__name__}")
    _check_float(xp, name, bias)
    _check_pairwise(name, bias, batch, nq, nk, "a floating array")
    return bias if bias.dtype == dtype else xp.astype(bias, dtype)


def check_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def check_nonnegative_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def default_scale(d, scale):
    """``scale`` or the usual ``1/sqrt(d)``."""
    if scale is None:
        return 1.0 / math.sqrt(d) if d > 0 else 1.0
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite real number or None, got {scale!r}")
    return float(scale)
