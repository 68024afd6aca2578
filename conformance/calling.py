"""Calling a kernel: what its signature declares, what it is given, what it returns.

* :class:`KernelSpec`: the features a kernel declares through its parameter names (and
  ``verify(supports=...)`` overrides); :func:`reference_features` the same for a
  registered ``attn_ref`` variant.
* :func:`kernel_kwargs`: the keyword arguments one case passes (feature values under the
  kernel's own parameter names, the variant's parameters and options).
* :func:`check_container`, :func:`snapshot`, :func:`same`: the checks of a returned array
  (library, dtype, device, shape) and of inputs left unchanged.
* :func:`load_kernel`, :func:`parse_supports`: a kernel named on a command line.

A *session* (:class:`conformance.oracle.Session`) is what these functions call ``ctx``:
the kernel's spec, its backend and layout, and the declared semantics.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from .features import FEATURES, NotApplicable
from .layouts import pair_layout

__all__ = ["KernelSpec", "reference_features", "kernel_kwargs", "applicable", "snapshot",
           "same", "library_name", "check_container", "first_output", "load_kernel",
           "parse_supports"]


def _signature(fn):
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


@dataclass
class KernelSpec:
    """What a kernel declares through its signature (and ``supports=`` overrides).

    ``names`` maps a feature name to the kernel parameter that carries it.
    """

    fn: Any
    names: dict
    accepts: frozenset  # every keyword the signature accepts
    var_kw: bool
    signature_known: bool

    @classmethod
    def of(cls, fn, supports: dict | None = None) -> KernelSpec:
        sig = _signature(fn)
        accepts, var_kw = set(), False
        if sig is not None:
            for p in sig.parameters.values():
                if p.kind is p.VAR_KEYWORD:
                    var_kw = True
                elif p.kind is not p.POSITIONAL_ONLY:
                    accepts.add(p.name)
        names = {}
        for feat in FEATURES.values():
            for alias in feat.params:
                if alias in accepts:
                    names[feat.name] = alias
                    break
        for feat in FEATURES.values():
            if feat.assumed and feat.name not in names:
                names[feat.name] = feat.params[0] if feat.params else None
        for feat_name, val in (supports or {}).items():
            if feat_name not in FEATURES:
                raise ValueError(f"supports= names unknown feature {feat_name!r}; known: "
                                 f"{sorted(FEATURES)}")
            if val is False:
                names.pop(feat_name, None)
            elif val is True:
                f = FEATURES[feat_name]
                names[feat_name] = names.get(feat_name) or (f.params[0] if f.params else None)
            elif isinstance(val, str):
                names[feat_name] = val
                accepts.add(val)
            else:
                raise TypeError(f"supports[{feat_name!r}] must be True, False or a parameter "
                                f"name, got {val!r}")
        return cls(fn, names, frozenset(accepts), var_kw, sig is not None)

    @property
    def features(self) -> frozenset:
        return frozenset(self.names)


def reference_features(variant) -> frozenset:
    """Features the reference function of ``variant`` can compute."""
    spec = KernelSpec.of(variant.fn)
    feats = set(spec.features)
    if not variant.causal:
        feats.discard("causal")
    feats.add("broadcast")  # every attn_ref function broadcasts leading dims
    return frozenset(feats)



def kernel_kwargs(ctx, prep, convert):
    """The keyword arguments of one call: features, variant parameters, options.

    Raises :class:`NotApplicable` when the case needs a feature the kernel lacks.
    """
    case = prep.case
    kw = {}
    for feat_name in sorted(case.needs):
        feat = FEATURES[feat_name]
        if feat_name not in ctx.kernel.features:
            raise NotApplicable(f"kernel does not declare {feat_name!r} "
                                f"(parameter {' / '.join(feat.params) or 'supports='})")
        pname = ctx.kernel.names[feat_name]
        if feat.declared_only or pname is None:
            continue
        ref_name = feat.params[0]
        if ref_name in prep.arrays:
            val = convert(pair_layout(prep.arrays[ref_name], ctx.layout))
        elif ref_name in prep.kwargs:
            val = prep.kwargs[ref_name]
        else:
            continue
        if feat.to_kernel is not None:
            val = feat.to_kernel(val, case, ctx.semantics)
        kw[pname] = val
    for name, val in prep.params.items():
        kw[name] = convert(val) if isinstance(val, np.ndarray) else val
    for name, val in prep.options.items():
        if name in ctx.kernel.accepts:
            kw[name] = val
    return kw


def applicable(ctx, case):
    """Raise :class:`NotApplicable` if the kernel cannot take ``case`` at all."""
    if ctx.layout == "nd" and (case.batch != (1, 1) or case.kv_batch is not None):
        raise NotApplicable("layout 'nd' takes one head; case has batch/head dimensions")
    missing = {f for f in case.needs if f not in ctx.kernel.features}
    if missing:
        raise NotApplicable(f"kernel does not declare {sorted(missing)}")


def snapshot(ctx, x):
    """A host copy of ``x`` (to check later that the kernel left it unchanged)."""
    return np.array(ctx.to_host(x), copy=True)


def same(a, b):
    """Bitwise equal host arrays (NaN equal to NaN)."""
    return a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")


def library_name(x):
    """The top-level package of an array's type (``jaxlib`` reads as ``jax``)."""
    mod = type(x).__module__.split(".")[0]
    return {"jaxlib": "jax"}.get(mod, mod)


def check_container(ctx, out, inputs: dict, want_shape):
    """Library, dtype, device, shape: returns an error string or ''."""
    if isinstance(ctx.backend, tuple):
        if tuple(np.shape(ctx.to_host(out))) != tuple(want_shape):
            return f"output shape {tuple(np.shape(ctx.to_host(out)))}, expected {tuple(want_shape)}"
        return ""
    import array_api_compat

    q = inputs["q"]
    if not array_api_compat.is_array_api_obj(out):
        return f"output is a {type(out).__name__}, expected a {ctx.backend.name} array"
    if library_name(out) != library_name(q):
        return f"output is a {library_name(out)} array, expected {library_name(q)} like the inputs"
    if str(out.dtype) != str(q.dtype):
        return f"output dtype {out.dtype}, expected {q.dtype} (the inputs' dtype)"
    dev_out, dev_in = str(array_api_compat.device(out)), str(array_api_compat.device(q))
    if dev_out != dev_in:
        return f"output on device {dev_out}, expected {dev_in} (the inputs' device)"
    if tuple(out.shape) != tuple(want_shape):
        return f"output shape {tuple(out.shape)}, expected {tuple(want_shape)} ({ctx.layout})"
    return ""



def first_output(out):
    """A kernel may return a tuple (output, log-sum-exp, ...): its first element."""
    return out[0] if isinstance(out, tuple) else out


def load_kernel(spec: str):
    """``"package.module:function"`` or ``"path/to/file.py:function"`` -> the callable."""
    if ":" not in spec:
        raise SystemExit(f"attn-ref: kernel must be MODULE:FUNCTION, got {spec!r}")
    mod_name, _, attr = spec.rpartition(":")
    if mod_name.endswith(".py") or os.sep in mod_name:
        path = os.path.abspath(mod_name)
        s = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
        if s is None or s.loader is None:
            raise SystemExit(f"attn-ref: cannot load {path}")
        mod = importlib.util.module_from_spec(s)
        s.loader.exec_module(mod)
    else:
        sys.path.insert(0, os.getcwd())
        mod = importlib.import_module(mod_name)
    obj = mod
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj



def parse_supports(items) -> dict:
    """``["mask=attn_mask", "bias=no", "broadcast"]`` -> a ``supports=`` dict."""
    out = {}
    for item in items or ():
        name, _, val = item.partition("=")
        out[name] = {"": True, "true": True, "yes": True, "false": False, "no": False}.get(
            val.lower(), val)
    return out

