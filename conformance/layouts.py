"""Array layouts: the canonical ``(B, H, N, d)`` and the layouts kernels take.

``bhnd`` is PyTorch SDPA's, ``bnhd`` FlashAttention's and JAX's, ``nd`` one head. Masks
and biases are always head-major ``(B|1, H|1, Nq|1, Nk)``, each dim of size 1
broadcast (a padding mask is ``(B, 1, 1, Nk)``; ``(Nq|1, Nk)`` for ``nd``).
"""

from __future__ import annotations

import numpy as np

__all__ = ["LAYOUTS", "to_layout", "from_layout", "pair_layout"]

LAYOUTS = ("bhnd", "bnhd", "nd")


def to_layout(x: np.ndarray, layout: str) -> np.ndarray:
    """Canonical ``(B, H, N, d)`` -> ``layout``."""
    if layout == "bhnd":
        return x
    if layout == "bnhd":
        return np.swapaxes(x, 1, 2)
    if layout == "nd":
        return x[0, 0]
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def from_layout(x: np.ndarray, layout: str) -> np.ndarray:
    """``layout`` -> canonical ``(B, H, N, d)``."""
    if layout == "bhnd":
        return x
    if layout == "bnhd":
        return np.swapaxes(x, 1, 2)
    if layout == "nd":
        return x[None, None]
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def pair_layout(x: np.ndarray, layout: str) -> np.ndarray:
    """A ``(B|1, H|1, Nq|1, Nk)`` mask or bias as the kernel takes it (head-major always)."""
    return x[0, 0] if layout == "nd" else x

