"""The array libraries attn-ref runs on, and moving arrays between them and NumPy.

Each backend is loaded on demand; one that is not installed (or, for CuPy, has no
usable CUDA device) is reported with the reason rather than raising at import.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "BACKENDS",
    "Backend",
    "BackendUnavailable",
    "load",
    "available",
    "required",
    "to_numpy",
    "from_numpy",
]

BACKENDS = ("array_api_strict", "numpy", "torch", "jax", "cupy")


class BackendUnavailable(RuntimeError):
    """The backend cannot be used here; the message says why."""


@dataclass(frozen=True)
class Backend:
    name: str
    xp: Any  # the array-API namespace
    device: Any  # the device arrays are created on

    def asarray(self, a: np.ndarray, dtype: str | None = None):
        return from_numpy(a, self, dtype)

    def dtype(self, name: str):
        return getattr(self.xp, name)


_CACHE: dict[str, Backend | BackendUnavailable] = {}


def _load(name: str) -> Backend:
    if name == "numpy":
        import array_api_compat.numpy as xp

        return Backend(name, xp, "cpu")
    if name == "array_api_strict":
        xp = importlib.import_module("array_api_strict")
        return Backend(name, xp, xp.Device("CPU_DEVICE") if hasattr(xp, "Device") else None)
    if name == "torch":
        import array_api_compat.torch as xp
        import torch  # noqa: F401

        return Backend(name, xp, "cpu")
    if name == "jax":
        import jax

        # The oracle and the float64 tests need real double precision.
        jax.config.update("jax_enable_x64", True)
        import jax.numpy as xp

        return Backend(name, xp, jax.devices("cpu")[0])
    if name == "cupy":
        import cupy

        try:
            n = cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:  # no driver, no runtime
            raise BackendUnavailable(f"cupy is installed but CUDA is not usable: {exc}") from exc
        if n < 1:
            raise BackendUnavailable("cupy is installed but there is no CUDA device")
        import array_api_compat.cupy as xp

        return Backend(name, xp, cupy.cuda.Device(0))
    raise ValueError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")


def load(name: str) -> Backend:
    """The :class:`Backend` called ``name``, or raise :class:`BackendUnavailable`."""
    if name not in _CACHE:
        try:
            _CACHE[name] = _load(name)
        except ImportError as exc:
            _CACHE[name] = BackendUnavailable(f"{name} is not installed ({exc})")
        except BackendUnavailable as exc:
            _CACHE[name] = exc
    got = _CACHE[name]
    if isinstance(got, BackendUnavailable):
        raise got
    return got


def available() -> dict[str, Backend | str]:
    """Every known backend: its :class:`Backend`, or the reason it is unavailable."""
    out: dict[str, Backend | str] = {}
    for name in BACKENDS:
        try:
            out[name] = load(name)
        except BackendUnavailable as exc:
            out[name] = str(exc)
    return out


def required() -> list[str]:
    """Backends listed in ``ATTN_REF_REQUIRE_BACKENDS`` (comma-separated)."""
    raw = os.environ.get("ATTN_REF_REQUIRE_BACKENDS", "")
    names = [n.strip() for n in raw.split(",") if n.strip()]
    for n in names:
        if n not in BACKENDS:
            raise ValueError(
                f"ATTN_REF_REQUIRE_BACKENDS names unknown backend {n!r}; known: {BACKENDS}"
            )
    return names


def to_numpy(x) -> np.ndarray:
    """Copy any backend's array to a host NumPy array (bfloat16 becomes float32)."""
    if isinstance(x, np.ndarray):
        return x
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        import torch

        t = x.detach().cpu()
        if t.dtype == torch.bfloat16:
            t = t.to(torch.float32)
        return t.numpy()
    if mod == "cupy":
        return x.get()
    if mod in ("jax", "jaxlib"):
        return np.asarray(x)
    if mod == "array_api_strict":
        # array_api_strict refuses __array__; DLPack is the sanctioned way out.
        return np.from_dlpack(x)
    return np.asarray(x)


def from_numpy(a: np.ndarray, backend: Backend, dtype: str | None = None):
    """Build an array of ``backend`` from host data, in dtype ``dtype`` (a name).

    bfloat16 goes through float32, since NumPy has no native bfloat16 to hand over.
    """
    a = np.asarray(a)
    xp = backend.xp
    if dtype is None:
        dtype = str(a.dtype)
    if dtype == "bfloat16":
        if backend.name == "torch":
            import torch

            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(torch.bfloat16)
        if backend.name == "jax":
            import jax
            import jax.numpy as jnp

            # converting on the host and placing with device_put compiles nothing
            return jax.device_put(np.ascontiguousarray(a, dtype=np.float32).astype(jnp.bfloat16),
                                  backend.device)
        raise TypeError(f"backend {backend.name} has no bfloat16")
    if backend.name == "jax":
        import jax

        # jnp.asarray(..., dtype=, device=) compiles a conversion per new shape; this does not
        host = np.ascontiguousarray(a) if a.dtype == np.bool_ else np.ascontiguousarray(
            a, dtype=np.dtype(dtype))
        return jax.device_put(host, backend.device)
    if a.dtype == np.bool_:
        return xp.asarray(np.ascontiguousarray(a), device=backend.device)
    host = np.ascontiguousarray(a, dtype=np.dtype(dtype))
    return xp.asarray(host, dtype=getattr(xp, dtype), device=backend.device)
