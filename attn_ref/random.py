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

from ._checks import check_nonnegative_int, check_positive_int
from ._common import ceil_div

__all__ = ["standard_normal", "uniform", "permutation", "to_namespace", "orthogonal_gaussian"]


def to_namespace(a, *, dtype=None, device=None, xp):
    """Move host data ``a`` to namespace ``xp`` (``dtype`` defaults to ``xp.float64``)."""
    if xp is None:
        raise TypeError("xp (the array namespace to build the array in) is required")
    dtype = xp.float64 if dtype is None else dtype
    return xp.asarray(np.ascontiguousarray(a, dtype=np.float64), dtype=dtype, device=device)


def _rng(seed):
    return np.random.default_rng(check_nonnegative_int("seed", seed))


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


def orthogonal_gaussian(m, d, *, seed, dtype=None, device=None, xp):
    """``(m, d)`` rows with Gaussian marginals that are orthogonal within blocks of ``d``.

    Each block of ``d`` rows is the ``Q`` factor of the QR decomposition of a ``d x d``
    standard normal matrix (signs fixed by ``R``'s diagonal, so ``Q`` is Haar
    distributed); every row is then rescaled to the norm of an independent standard
    normal ``d``-vector, so each row on its own is distributed exactly as an i.i.d.
    Gaussian row. The last block is truncated when ``d`` does not divide ``m``. These
    are the orthogonal random features of Choromanski et al. (2020).

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.random import orthogonal_gaussian
    >>> w = orthogonal_gaussian(6, 4, seed=0, xp=xp)
    >>> g = w[:4, :] @ w[:4, :].mT
    >>> bool(xp.max(xp.abs(g * (1.0 - xp.eye(4)))) < 1e-12)
    True
    """
    m, d = check_positive_int("m", m), check_positive_int("d", d)
    rng = _rng(seed)
    blocks = []
    for _ in range(ceil_div(m, d)):
        qf, r = np.linalg.qr(rng.standard_normal((d, d)))
        blocks.append(qf.T * np.where(np.diag(r) < 0, -1.0, 1.0)[:, None])
    w = np.concatenate(blocks, axis=0)[:m]
    norms = np.linalg.norm(rng.standard_normal((m, d)), axis=1)
    return to_namespace(w * norms[:, None], dtype=dtype, device=device, xp=xp)
