"""The catalogue of attention variants.

Each family module registers its public variants here with what a caller needs to
run, compare, differentiate and benchmark them generically: the function, its cost
in ``N``, whether it is exact and supports causal masking, how to build the extra
inputs (projections, random features, ...) it takes, the attention matrix it implies
and its vector-Jacobian product. ``attn-ref verify``, the conformance
oracle, the benchmarks and the docs' comparison table all iterate over this list, so
a new variant is picked up everywhere by registering it once.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Variant", "register", "unregister", "get", "variants", "FAMILIES"]

# Family modules, imported on first use of the catalogue.
FAMILIES = ("softmax", "lowrank", "compressed", "reduced", "sparse", "linear", "performer",
            "routing", "synthesizer", "hashing", "sorting", "recurrent")

_REGISTRY: dict[str, Variant] = {}


@dataclass(frozen=True)
class Variant:
    """One registered attention variant.

    Attributes
    ----------
    name : str
        Short name used everywhere (``"softmax"``, ``"linformer"``, ...).
    fn : callable
        ``fn(q, k, v, **params, **options)`` with ``q (..., Nq, d)``,
        ``k (..., Nk, d)``, ``v (..., Nk, dv)``, returning ``(..., Nq, dv)``.
    family : str
        The module of :mod:`attn_ref` that defines it.
    exact : bool
        True when the variant computes softmax attention exactly.
    causal : bool
        True when ``fn`` accepts ``causal=True``.
    causal_only : bool
        True when the variant is causal by construction (a recurrence over time):
        ``fn`` computes the causal function whatever it is given, refuses
        ``causal=False``, and conformance only draws causal cases for it.
    time, memory : str
        Cost in ``N`` (sequence length) and ``d`` (head dimension), e.g. ``"O(N^2 d)"``.
    params : callable, optional
        ``params(seed, nq, nk, d, dv, *, dtype, device, xp) -> dict`` building the extra
        arguments (projections, features) deterministically from ``seed``. Arrays in
        the dict are in namespace ``xp``; other entries are plain Python values. A
        params function that also takes a keyword ``batch`` receives the leading
        ``(batch, heads)`` shape of ``q`` there (``()`` when the caller does not say), for
        inputs drawn per head and step (the gates of :mod:`attn_ref.recurrent`); they
        must broadcast against ``q`` when ``batch`` is ``()``. Another keyword it takes
        (``block_sparse``'s ``block_size``) is a value the parameters are drawn from: a
        conformance case that sets that option passes it there.
    weights : callable, optional
        ``weights(q, k, **params, **options) -> (..., Nq, Nk)``: the attention matrix
        the variant implies.
    self_attention : bool
        True when the variant needs ``Nq == Nk``.
    options : dict
        Keyword options that ``attn-ref verify`` passes besides ``params`` (a block
        size, a window, ...).
    summary : str
        One line for the docs' comparison table.
    vjp : callable or str, optional
        The exact gradient ``vjp(q, k, v, do, /, **params, **options) -> {input name:
        gradient}`` (see :mod:`attn_ref.grad`), or where to import it from, as
        ``"module:function"``. A family module registers the path: the VJPs import the
        forward modules, so a forward module cannot import its VJP while it registers.
        :func:`variants` and :func:`get` import it on first use, so a variant read from
        the catalogue always holds the function.
    """

    name: str
    fn: Callable[..., Any]
    family: str
    exact: bool
    causal: bool
    time: str
    memory: str
    params: Callable[..., dict] | None = None
    weights: Callable[..., Any] | None = None
    self_attention: bool = False
    causal_only: bool = False
    options: dict = field(default_factory=dict)
    summary: str = ""
    vjp: Callable[..., dict] | str | None = None

    def extra(self, seed, nq, nk, d, dv, *, dtype, device, xp, batch=()):
        """The extra arguments for one call: ``params(...)`` merged with ``options``.

        ``batch`` (the leading shape of ``q``) is passed to a params function that
        takes it (see ``params``)."""
        out = dict(self.options)
        if self.params is not None:
            out.update(self.params(seed, nq, nk, d, dv, dtype=dtype, device=device, xp=xp,
                                   **self.batch_keyword(batch)))
        return out

    def batch_keyword(self, batch) -> dict:
        """``{"batch": batch}`` when ``params`` takes the keyword, else ``{}``."""
        try:
            takes = "batch" in inspect.signature(self.params).parameters
        except (TypeError, ValueError):
            takes = False
        return {"batch": tuple(batch)} if takes else {}


def register(variant: Variant) -> Variant:
    """Add ``variant`` to the catalogue (again, with the same function: a reloaded module)."""
    if variant.name in _REGISTRY and _REGISTRY[variant.name].fn is not variant.fn:
        raise ValueError(f"variant {variant.name!r} is already registered")
    _REGISTRY[variant.name] = variant
    return variant


def unregister(name: str) -> Variant:
    """Remove the variant called ``name`` (a plugin's or a test's) and return it."""
    try:
        return _REGISTRY.pop(name)
    except KeyError:
        raise KeyError(f"unknown variant {name!r}; known: {sorted(_REGISTRY)}") from None


def _resolve(name: str, path: str) -> Callable[..., dict]:
    module, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ImportError(f"variant {name!r}: cannot import its vjp {path!r} "
                          f"(expected 'module:function'): {exc}") from exc


def _load():
    for fam in FAMILIES:
        importlib.import_module(f"attn_ref.{fam}")
    # Resolved here, after every forward module is imported, because the VJP modules
    # import the forward modules (see Variant.vjp).
    for name, variant in list(_REGISTRY.items()):
        if isinstance(variant.vjp, str):
            _REGISTRY[name] = dataclasses.replace(variant, vjp=_resolve(name, variant.vjp))


def variants() -> list[Variant]:
    """Every registered variant, in registration order."""
    _load()
    return list(_REGISTRY.values())


def get(name: str) -> Variant:
    """The variant called ``name``; ``KeyError`` lists the known names."""
    _load()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown variant {name!r}; known: {sorted(_REGISTRY)}") from None
