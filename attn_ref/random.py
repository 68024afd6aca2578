"""Seeded random matrices, built on the host and handed to any array library.

The array API standard has no random number generator, so the projections, random
features and initialisations that some variants need are drawn here with NumPy's
``default_rng(seed)`` - the one place in :mod:`attn_ref` that imports NumPy - and
moved to the caller's namespace and device with ``xp.asarray``. The same seed gives
the same matrix on every backend (up to the rounding of ``dtype``).
"""

from __future__ import annotations

# Host-side RNG only: the standard has none. Nothing else in attn_ref imports NumPy.
import numpy as np

__all__ = ["standard_normal", "uniform", "permutation", "to_namespace"]


def to_namespace(a, *, dtype=None, device=None, xp):
    """Move host data ``a`` to namespace ``xp`` (``dtype`` defaults to ``xp.float64``)."""
    if xp is None:
        raise TypeError("xp (the array namespace to build the array in) is required")
    dtype = xp.float64 if dtype is None else dtype
    return xp.asarray(np.ascontiguousarray(a, dtype=np.float64), dtype=dtype, device=device)


def _rng(seed):
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return np.random.default_rng(int(seed))


def standard_normal(shape, *, seed, dtype=None, device=None, xp):
    """Array of i.i.d. standard normal entries, shape ``shape``, drawn from ``seed``.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.random import standard_normal
    >>> a = standard_normal((2, 3), seed=0, xp=xp)
    >>> a.shape, a.dtype
    ((2, 3), array_api_strict.float64)
    """
    return to_namespace(_rng(seed).standard_normal(tuple(shape)), dtype=dtype, device=device,
                        xp=xp)


def uniform(shape, *, seed, low=0.0, high=1.0, dtype=None, device=None, xp):
    """Array of i.i.d. uniform entries on ``[low, high)``, drawn from ``seed``."""
    return to_namespace(_rng(seed).uniform(low, high, tuple(shape)), dtype=dtype, device=device,
                        xp=xp)


def permutation(n, *, seed):
    """A random permutation of ``range(n)`` as a Python list (host-side indices)."""
    return [int(i) for i in _rng(seed).permutation(n)]
