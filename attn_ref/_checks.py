"""Argument checking shared by every variant.

Every public function validates its inputs here so that bad input fails the same way
everywhere: a ``ValueError`` or ``TypeError`` whose message names the argument, what
was expected and what arrived. Nothing here copies or modifies an input.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence

import array_api_compat

__all__ = [
    "namespace",
    "check_qkv",
    "check_mask",
    "check_bias",
    "check_array",
    "check_flag",
    "check_real",
    "check_positive_int",
    "check_nonnegative_int",
    "check_index_array",
    "is_integer",
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
    if array_api_compat.is_numpy_array(a):
        # a subclass of ndarray (np.ma, the oracle's low-precision arrays) is NumPy to
        # array_api_compat too, and arrays the reference makes from it are plain ndarrays
        return "numpy"
    mod = type(a).__module__.split(".")[0]
    return {"jaxlib": "jax"}.get(mod, mod)


_KIND_WORDS = {"real floating": "a real floating", "bool": "a boolean", "integral": "an integer"}


def check_array(name, x, *, like, like_name="q", kind="real floating", dtype=None):
    """``x`` must be an array of the library and device of ``like`` (the argument
    ``like_name``, usually ``q``), of dtype kind ``kind`` and, when given, exactly ``dtype``.

    Every array option of every public function goes through here, so an array from
    another library fails with a message that names both libraries instead of deep
    inside the backend. Returns ``x`` unchanged.

    Raises ``TypeError`` for a non-array, another library or a wrong dtype, and
    ``ValueError`` for another device (as :func:`check_qkv` does for ``q``, ``k``, ``v``).
    """
    what = _KIND_WORDS.get(kind, kind)
    if not array_api_compat.is_array_api_obj(x):
        raise TypeError(f"{name} must be an array of {_library(like)} ({what} dtype) like "
                        f"{like_name}, got {type(x).__name__}")
    if _library(x) != _library(like):
        raise TypeError(
            f"{name} must be an array of the library of {like_name} ({_library(like)}), got an "
            f"array of {_library(x)}; convert it with {_library(like)}'s asarray first"
        )
    xp = array_api_compat.array_namespace(like)
    if dtype is not None and x.dtype != dtype:
        raise TypeError(f"{name} must have the dtype of {like_name} ({dtype}), got {x.dtype}")
    if not xp.isdtype(x.dtype, kind):
        want = "dtype bool (True = may attend)" if kind == "bool" else f"{what} dtype"
        raise TypeError(f"{name} must have {want}, got {x.dtype}")
    dev_x, dev_like = array_api_compat.device(x), array_api_compat.device(like)
    # A JAX tracer (under jax.vjp, jax.grad, jax.jit) has no device yet (None): a concrete
    # mask closed over by a differentiated function meets a traced q, and is placed with it.
    if dev_x is not None and dev_like is not None and str(dev_x) != str(dev_like):
        raise ValueError(f"{name} must live on the device of {like_name} ({dev_like}), got {dev_x}")
    return x


def _is_numpy_bool(value) -> bool:
    # NumPy's bool scalar, without importing NumPy here (the class is ``numpy.bool``
    # on NumPy 2 and ``numpy.bool_`` before).
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")


def check_flag(name, value) -> bool:
    """A Python ``bool`` or NumPy ``bool_``, returned as ``bool``; anything else (``"no"``,
    ``0``, ``None``) is a ``TypeError``, so a misspelt flag never silently means True."""
    if isinstance(value, bool) or _is_numpy_bool(value):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")


def is_integer(value) -> bool:
    """Is ``value`` an integer scalar by the rule of :func:`check_positive_int` (``int``,
    ``np.int64``, anything with ``__index__``; not a bool)?"""
    if isinstance(value, bool) or _is_numpy_bool(value):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _integer(name, value, what):
    if isinstance(value, bool) or _is_numpy_bool(value):
        raise TypeError(f"{name} must be {what}, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be {what}, got {value!r} ({type(value).__name__})") from None


def check_real(name, value, want="a finite real number") -> float:
    """A finite real scalar (``int``, ``float``, NumPy integer or floating scalar) as a
    Python ``float``. A non-number (a string, a bool, an array) is a ``TypeError``; NaN
    or infinity is a ``ValueError``."""
    if isinstance(value, bool) or _is_numpy_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {want}, got {value!r} ({type(value).__name__})")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{name} must be {want}, got {value!r}")
    return out


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
    # None: a JAX tracer, not placed yet (see check_array)
    devices = {str(d) for d in (array_api_compat.device(x) for x in (q, k, v)) if d is not None}
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


def check_mask(xp, mask, batch, nq, nk, name="mask", *, like):
    """A boolean mask of ``like``'s library broadcastable to ``batch + (Nq, Nk)``; True =
    may attend. ``like`` is ``q`` (the library and device the mask must share)."""
    if mask is None:
        return None
    check_array(name, mask, like=like, kind="bool")
    _check_pairwise(name, mask, batch, nq, nk, "a boolean array")
    return mask


def check_bias(xp, bias, batch, nq, nk, dtype, name="bias", *, like):
    """An additive float logit bias of ``like``'s library broadcastable to
    ``batch + (Nq, Nk)``, cast to ``dtype``."""
    if bias is None:
        return None
    check_array(name, bias, like=like)
    _check_pairwise(name, bias, batch, nq, nk, "a floating array")
    return bias if bias.dtype == dtype else xp.astype(bias, dtype)


def check_positive_int(name, value, want="a positive integer"):
    """An integer >= 1 (``int`` or anything with ``__index__``, e.g. ``np.int64``) as ``int``.

    A non-integer is a ``TypeError``, an integer below 1 a ``ValueError``; both messages
    read ``{name} must be {want}``."""
    value = _integer(name, value, want)
    if value < 1:
        raise ValueError(f"{name} must be {want}, got {value!r}")
    return value


def check_nonnegative_int(name, value):
    """An integer >= 0 as ``int``; a non-integer is a ``TypeError``, a negative a ``ValueError``."""
    value = _integer(name, value, "a non-negative integer")
    if value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def check_index_array(fn, name, given, tail, tail_names, meaning):
    """Refuse ``given`` (an argument ``name`` of ``fn`` fixing a discrete choice: routes,
    top-k keys, cluster assignments) unless it is an integer array whose trailing shape is
    ``tail``, spelt ``tail_names`` (e.g. ``"C, w"``) in the message, with ``meaning``
    after the shape. Its values are the caller's to keep: checking them would read the
    array on the host."""
    shape = tuple(getattr(given, "shape", ()))
    xp = array_api_compat.array_namespace(given) if hasattr(given, "shape") else None
    tail = tuple(tail)
    if len(shape) < len(tail) or shape[len(shape) - len(tail):] != tail or xp is None or \
            not xp.isdtype(given.dtype, "integral"):
        raise ValueError(f"{fn}: {name} must be an integer array of shape (..., {tail_names}) = "
                         f"(..., {', '.join(str(n) for n in tail)}){meaning}; got shape {shape} "
                         f"and dtype {getattr(given, 'dtype', type(given).__name__)}")


def default_scale(d, scale):
    """``scale`` (a finite real, see :func:`check_real`) or the usual ``1/sqrt(d)``."""
    if scale is None:
        return 1.0 / math.sqrt(d) if d > 0 else 1.0
    return check_real("scale", scale)
