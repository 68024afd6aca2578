"""Calling a kernel: what its signature declares, what it is given, what it returns.

* :class:`KernelSpec`: the features a kernel declares through its parameter names (and
  ``verify(supports=...)`` overrides); :func:`reference_features` the same for a
  registered ``attn_ref`` variant.
* :func:`kernel_kwargs`: the keyword arguments one case passes (feature values under the
  kernel's own parameter names, the variant's parameters and options).
* :func:`check_container`, :func:`snapshot`, :func:`same`: the checks of a returned array
  (library, dtype, device, shape) and of inputs left unchanged; the forward output and
  each ``backward=`` gradient go through the same checks.
* :func:`call_kernel`: the guard around every call into kernel code - its faults
  (any exception, ``SystemExit``, running past the time limit) become a
  :class:`Call` with a ``fault`` string instead of escaping; ``KeyboardInterrupt``
  is the one thing that escapes, so that Ctrl-C still stops a run.
  :class:`Watchdog` is the time limit itself.
* :func:`load_kernel`, :func:`parse_supports`: a kernel named on a command line.

What a kernel declares
----------------------
``supports=`` (``--supports`` on the command line) holds three kinds of entries:

* a feature (:data:`conformance.features.FEATURES`) and the parameter that carries it,
  ``True`` or ``False``: ``{"mask": "attn_mask", "bias": False, "broadcast": True}``;
* ``{"causal": "always"}``: the kernel is causal by construction (a recurrent or
  decoder-only kernel with no ``causal`` argument). It gets only the causal cases, in
  the alignment the semantics ``causal=`` declares, and no ``causal`` argument;
* the subset of cases it takes (:data:`DECLARATIONS`): ``{"cross": False}``
  (``Nq == Nk`` only), ``{"head_dims": (64, 128)}``, ``{"max_seq_len": 4096}``, or any
  ``{"cases": predicate}`` with ``predicate(case) -> bool``.

A case outside what the kernel declares is *not applicable* with the reason, and
:meth:`conformance.report.Report.table` counts those cases by reason.
Extension point: a new subset declaration is one :data:`DECLARATIONS` entry.

A *session* (:class:`conformance.oracle.Session`) is what these functions call ``ctx``:
the kernel's spec, its backend and layout, and the declared semantics.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import inspect
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .features import FEATURES, NotApplicable
from .layouts import pair_layout
from .noncontiguous import check_backend
from .tolerance import param_dtype

__all__ = ["KernelSpec", "Declaration", "DECLARATIONS", "ALWAYS", "reference_features",
           "kernel_kwargs", "applicable", "snapshot", "same", "library_name", "check_container",
           "first_output", "load_kernel", "KernelNotFound", "parse_supports", "parse_options",
           "KernelTimeout", "Watchdog", "Call", "call_kernel", "check_time_limit", "changed_input",
           "aliased_input"]

#: ``supports={feature: ALWAYS}``: the kernel applies the feature by construction.
ALWAYS = "always"
# features a kernel may have by construction: flags, with nothing to pass
_MAY_BE_ALWAYS = ("causal",)


def _flag(name, value):
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "yes", "false", "no"):
        return value.lower() in ("true", "yes")
    raise TypeError(f"supports[{name!r}] must be True or False, got {value!r}")


def _ints(name, value):
    given = value
    if isinstance(value, str):
        value = [x for x in value.replace(",", " ").split() if x]
    try:
        out = tuple(sorted({int(x) for x in value}))
    except (TypeError, ValueError):
        raise TypeError(f"supports[{name!r}] must be integers, e.g. (64, 128) or '64,128', "
                        f"got {given!r}") from None
    if not out or min(out) < 1:
        raise ValueError(f"supports[{name!r}] must be positive integers, got {value!r}")
    return out


def _positive_int(name, value):
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise TypeError(f"supports[{name!r}] must be an integer, got {value!r}") from None
    if n < 1 or (not isinstance(value, str) and n != value):
        raise ValueError(f"supports[{name!r}] must be a positive integer, got {value!r}")
    return n


def _predicate(name, value):
    if not callable(value):
        raise TypeError(f"supports[{name!r}] must be a function case -> bool, got {value!r}")
    return value


@dataclass(frozen=True)
class Declaration:
    """A subset of cases a kernel may declare it takes (``supports={name: value}``).

    ``parse(name, value)`` checks and normalises the declared value (a string from the
    command line included); ``excludes(case, value)`` returns why the case lies
    outside (``""`` if it lies inside). The reason reads ``"<what>: <details>"``; the
    report counts n/a cases by the part before the colon.
    """

    parse: Any
    excludes: Any
    doc: str = ""


def _cross_excludes(case, ok):
    return "" if ok or case.nq == case.nk else \
        f"kernel takes Nq == Nk only (supports cross=False): Nq={case.nq}, Nk={case.nk}"


def _head_dims_excludes(case, dims):
    bad = sorted({x for x in (case.d, case.dv) if x not in dims})
    return f"head dim outside the declared head_dims {dims}: {bad}" if bad else ""


def _max_len_excludes(case, n):
    longest = max(case.nq, case.nk)
    return f"sequence longer than the declared max_seq_len {n}: {longest}" if longest > n else ""


def _cases_excludes(case, predicate):
    return "" if predicate(case) else f"outside the subset the kernel declares (supports cases=" \
                                      f"{getattr(predicate, '__name__', 'predicate')})"


#: Subsets of cases a kernel can declare: name -> :class:`Declaration`.
DECLARATIONS: dict[str, Declaration] = {
    "cross": Declaration(_flag, _cross_excludes, "False: the kernel takes Nq == Nk only"),
    "head_dims": Declaration(_ints, _head_dims_excludes,
                             "the head dims d and dv the kernel takes, e.g. (64, 128)"),
    "max_seq_len": Declaration(_positive_int, _max_len_excludes,
                               "the longest Nq and Nk the kernel takes"),
    "cases": Declaration(_predicate, _cases_excludes,
                         "predicate(case) -> bool, any other subset (Python only)"),
}


def _signature(fn):
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


@dataclass
class KernelSpec:
    """What a kernel declares through its signature (and ``supports=`` overrides).

    ``names`` maps a feature name to the kernel parameter that carries it (None: the
    feature is declared but nothing is passed); ``always`` holds the features the kernel
    applies by construction, ``limits`` the subset declarations (:data:`DECLARATIONS`).
    """

    fn: Any
    names: dict
    accepts: frozenset  # every keyword the signature accepts
    var_kw: bool
    signature_known: bool
    always: frozenset = frozenset()
    limits: dict = field(default_factory=dict)
    #: extra outputs declared returned (True, or a convention of the extra such as
    #: ``{"lse": "+inf"}``) or never to check (False): ``{"lse": True}``
    outputs: dict = field(default_factory=dict)

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
        always, limits, outputs = set(), {}, {}
        from .extras import EXTRAS  # extras imports the report; calling stays import-light

        for feat_name, val in (supports or {}).items():
            if feat_name in EXTRAS:
                conventions = EXTRAS[feat_name].conventions
                if not isinstance(val, bool) and val not in conventions:
                    also = "".join(f", {c!r} ({why})" for c, why in conventions.items())
                    raise TypeError(f"supports[{feat_name!r}] (an extra output) must be True, "
                                    f"False{also}; got {val!r}")
                outputs[feat_name] = val
                continue
            if feat_name in DECLARATIONS:
                limits[feat_name] = DECLARATIONS[feat_name].parse(feat_name, val)
                continue
            if feat_name not in FEATURES:
                raise ValueError(f"supports= names unknown feature {feat_name!r}; known: "
                                 f"{sorted(FEATURES)} and the declarations "
                                 f"{sorted(DECLARATIONS)}; extra outputs {sorted(EXTRAS)}")
            if val == ALWAYS:
                if feat_name not in _MAY_BE_ALWAYS:
                    raise ValueError(f"supports[{feat_name!r}]={ALWAYS!r} is only meaningful for "
                                     f"{', '.join(map(repr, _MAY_BE_ALWAYS))}")
                # declared, never passed: the kernel has no parameter for it
                names[feat_name] = None
                always.add(feat_name)
            elif val is False:
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
        return cls(fn, names, frozenset(accepts), var_kw, sig is not None, frozenset(always),
                   limits, outputs)

    @property
    def features(self) -> frozenset:
        return frozenset(self.names)


def reference_features(variant) -> frozenset:
    """Features the reference function of ``variant`` can compute."""
    spec = KernelSpec.of(variant.fn)
    feats = set(spec.features)
    # A parameter named after a feature that is one of the variant's own registered
    # options is that option: local's, Longformer's and BigBird's ``window`` is a
    # half-width in tokens or blocks, not the softmax feature's ``(left, right)``, and the
    # window cases only made their references raise (n/a rows, "multiple values for
    # keyword argument 'window'").
    feats -= {f for f in feats if spec.names.get(f) in variant.options}
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
        if feat.declared_only or not feat.params:
            continue
        ref_name = feat.params[0]
        if ref_name in prep.arrays:
            if pname is None:
                continue
            val = convert(pair_layout(prep.arrays[ref_name], ctx.layout))
        elif ref_name in prep.kwargs:
            val = prep.kwargs[ref_name]
        else:
            continue
        if feat.to_kernel is not None:
            # also for a feature applied by construction: the case may still be one the
            # kernel cannot take (causal alignment with Nq != Nk)
            val = feat.to_kernel(val, case, ctx.semantics)
        if pname is not None:
            kw[pname] = val
    if "causal" not in case.needs and prep.kwargs.get("causal") is False \
            and ctx.kernel.names.get("causal") and "causal" not in ctx.kernel.always:
        # the reference is causal by default (strided, fixed), and so may a kernel written
        # after it be: say that this case is not
        kw[ctx.kernel.names["causal"]] = False
    for name, val in prep.params.items():
        kw[name] = convert(val, param_dtype(name, prep.dtype)) if isinstance(val, np.ndarray) else val
    for name, val in case.options:
        if name in prep.options and name not in ctx.kernel.accepts:
            # it computes the function of the one value it has: judged on the others' cases
            raise NotApplicable(f"the case sets option {name}={val!r}; the kernel takes no "
                                f"parameter {name!r}")
    for name, val in prep.options.items():
        if name in ctx.kernel.accepts:
            kw[name] = val
    return kw


def applicable(ctx, case):
    """Raise :class:`NotApplicable` if the kernel cannot take ``case`` at all."""
    if ctx.layout == "nd" and (case.batch != (1, 1) or case.kv_batch is not None):
        raise NotApplicable("layout 'nd' takes one head; case has batch/head dimensions")
    missing = {f for f in case.needs if f not in ctx.kernel.features}
    if missing == {"noncontiguous"}:
        raise NotApplicable("kernel requires contiguous inputs (supports noncontiguous=False); the "
                            "case hands it strided views")
    if missing:
        raise NotApplicable(f"kernel does not declare {sorted(missing)}")
    if "noncontiguous" in case.needs:
        check_backend(ctx)
    for name in sorted(ctx.kernel.always - case.needs):
        raise NotApplicable(f"kernel is {name} by construction (supports {name}={ALWAYS!r}); "
                            f"case is not {name}")
    for name, value in ctx.kernel.limits.items():
        why = DECLARATIONS[name].excludes(case, value)
        if why:
            raise NotApplicable(why)


def snapshot(ctx, x):
    """A host copy of ``x`` (to check later that the kernel left it unchanged)."""
    return np.array(ctx.to_host(x), copy=True)


def changed_input(ctx, arrays: dict, snaps: dict) -> str:
    """The name of the first of ``arrays`` that differs from its :func:`snapshot` in ``snaps``.

    ``''`` when every snapshotted array is bitwise unchanged (names without a snapshot,
    plain options, are skipped).
    """
    for n, x in arrays.items():
        if n in snaps and not same(snapshot(ctx, x), snaps[n]):
            return n
    return ""


def aliased_input(out, arrays: dict) -> str:
    """The name of the first of ``arrays`` whose memory ``out`` shares (``''``: none).

    A kernel that returns one of its inputs, or a view of one (``v`` itself when every
    row attends one key, ``q.view(...)`` after writing into ``q``), hands its caller an
    output that changes when the input does, and an input that changes when the output
    is written (``out += residual``). Checked for the object itself in any library, and for
    shared memory in NumPy (``np.may_share_memory``: separate allocations never overlap)
    and PyTorch (the same storage); JAX arrays are immutable, so sharing is harmless there.
    """
    for n, x in arrays.items():
        if x is out:
            return n
    mod = library_name(out)
    for n, x in arrays.items():
        if not hasattr(x, "shape") or library_name(x) != mod:
            continue
        if mod == "numpy" and isinstance(out, np.ndarray) and np.may_share_memory(out, x):
            return n
        if mod == "torch":
            so, sx = out.untyped_storage(), x.untyped_storage()
            if so.nbytes() and so.data_ptr() == sx.data_ptr():
                return n
    return ""


def same(a, b):
    """Bitwise equal host arrays (NaN equal to NaN)."""
    return a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")


def library_name(x):
    """The top-level package of an array's type (``jaxlib`` reads as ``jax``)."""
    mod = type(x).__module__.split(".")[0]
    return {"jaxlib": "jax"}.get(mod, mod)


def check_container(ctx, out, like, want_shape, *, name="output"):
    """Library, dtype, device and shape of a kernel's array: an error string, or ''.

    Parameters
    ----------
    ctx : Session
        Its backend says which library is expected; a custom ``(to_kernel, to_host)``
        backend is checked for shape only.
    out : object
        What the kernel returned: the forward output, or one gradient of ``backward=``.
    like : array
        The input ``out`` must match in library, dtype and device (``q`` for the
        output and ``dq``, ``k`` for ``dk``, the bias for ``dbias``).
    want_shape : tuple of int
        The expected shape in the kernel's layout.
    name : str
        How the message calls ``out`` (``"output"``, ``"dq"``...).
    """
    if isinstance(ctx.backend, tuple):
        try:
            got = tuple(np.shape(ctx.to_host(out)))
        except Exception as exc:  # a list of strings, an object to_host cannot read
            return f"{name} cannot be read by to_host: {type(exc).__name__}: {exc}"
        if got != tuple(want_shape):
            return f"{name} shape {got}, expected {tuple(want_shape)}"
        return ""
    import array_api_compat

    if not array_api_compat.is_array_api_obj(out):
        return f"{name} is a {type(out).__name__}, expected a {ctx.backend.name} array"
    if library_name(out) != library_name(like):
        return f"{name} is a {library_name(out)} array, expected {library_name(like)} like the inputs"
    if str(out.dtype) != str(like.dtype):
        hint = ""
        if str(out.dtype) == "float64" and getattr(ctx.backend, "name", "") == "jax":
            # the oracle turned x64 on (its float64 cases need it): a default-dtype array
            # the kernel makes (jnp.zeros(shape), a NumPy float64 scalar) is float64 then,
            # where without x64 it would have been float32
            hint = ("; the oracle runs JAX with jax_enable_x64 on (for its float64 cases), so "
                    "an array the kernel makes without a dtype (jnp.zeros(shape), jnp.asarray of "
                    "a NumPy float64) is float64 here: give it the inputs' dtype (q.dtype)")
        return f"{name} dtype {out.dtype}, expected {like.dtype} (the inputs' dtype){hint}"
    dev_out, dev_in = str(array_api_compat.device(out)), str(array_api_compat.device(like))
    if dev_out != dev_in:
        return f"{name} on device {dev_out}, expected {dev_in} (the inputs' device)"
    if tuple(out.shape) != tuple(want_shape):
        return f"{name} shape {tuple(out.shape)}, expected {tuple(want_shape)} ({ctx.layout})"
    return ""


def first_output(out):
    """The output of what a kernel returned: the first element of a tuple (or list)
    ``(output, log-sum-exp, ...)``, ``out["out"]`` of a dict (:mod:`conformance.extras`)."""
    if isinstance(out, dict):
        return out.get("out")
    return out[0] if isinstance(out, (tuple, list)) and out else out


# ------------------------------------------------------------------ the kernel-call guard


class KernelTimeout(BaseException):
    """Raised inside a kernel call that runs past its time limit (see :class:`Watchdog`).

    A ``BaseException``, like ``KeyboardInterrupt``, so that a kernel's own
    ``except Exception:`` cannot swallow it and run on.
    """


def check_time_limit(time_limit):
    """``time_limit`` as a float (``None`` -> infinity); TypeError/ValueError otherwise."""
    if time_limit is None:
        return math.inf
    if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)):
        raise TypeError(f"time_limit must be a number of seconds or None, got "
                        f"{type(time_limit).__name__} {time_limit!r}")
    if not time_limit > 0:
        raise ValueError(f"time_limit must be positive seconds (None for no limit), got {time_limit!r}")
    return float(time_limit)


class Watchdog:
    """``with Watchdog(limit):`` raises :class:`KernelTimeout` in the block after ``limit`` s.

    Two mechanisms, because a kernel may be written in any library:

    * on the main thread (POSIX): ``SIGALRM`` from ``signal.setitimer``. Python runs
      the handler between bytecodes and as soon as a blocking call that checks for
      signals returns with ``EINTR`` - pure-Python loops, ``time.sleep``, waits on
      locks, and NumPy/PyTorch/JAX code between two operations. An ``ITIMER_REAL``
      armed by someone else (pytest-timeout's signal method) keeps working: the
      watchdog arms the earlier of the two deadlines, hands a signal meant for the
      other timer to its handler and re-arms what is left of it on exit.
    * on any other thread (or without ``SIGALRM``): a watchdog thread that sets an
      asynchronous exception in the calling thread (``PyThreadState_SetAsyncExc``);
      it interrupts Python bytecode only, so a ``time.sleep`` runs to its end first.

    Neither can stop a single call into C that never returns to Python (a spinning
    CUDA kernel, ``block_until_ready`` on one that never finishes, a C loop that does
    not check signals): such a call is stopped when it returns, if it ever does, and
    :func:`call_kernel` says so ("only when it returned from C code"). Run the whole
    check under an outer process timeout (``timeout 600 attn-ref verify ...``) to
    bound those too.

    ``limit`` of ``None`` or infinity arms nothing.
    """

    def __init__(self, limit):
        self.limit = check_time_limit(limit)
        self.fired = False
        self._active = False
        self._lock = threading.Lock()

    def __enter__(self):
        if not math.isfinite(self.limit):
            return self
        self._tid = threading.get_ident()
        self._t0 = time.monotonic()
        self._active = True
        if hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread():
            self._enter_signal()
        else:
            self._enter_thread()
        return self

    def __exit__(self, exc_type, exc, tb):
        if not math.isfinite(self.limit):
            return False
        try:
            self._active = False
        finally:
            if self._thread is None:
                self._exit_signal()
            else:
                self._exit_thread(exc_type)
        return False

    # -- SIGALRM on the main thread
    def _enter_signal(self):
        self._thread = None
        self._prev_handler = signal.getsignal(signal.SIGALRM)
        signal.signal(signal.SIGALRM, self._on_alarm)
        prev, _ = signal.setitimer(signal.ITIMER_REAL, 0)
        self._prev_deadline = self._t0 + prev if prev > 0 else None
        first = self.limit if prev <= 0 else min(self.limit, prev)
        signal.setitimer(signal.ITIMER_REAL, first)

    def _on_alarm(self, signum, frame):
        now = time.monotonic()
        if self._active and now - self._t0 >= self.limit - 1e-3:
            self._active, self.fired = False, True
            raise KernelTimeout(f"stopped after the time limit of {self.limit:g} s")
        if self._prev_deadline is not None and now >= self._prev_deadline - 1e-3:
            self._prev_deadline = None
            if self._active:  # our own deadline is still ahead: wait for it
                signal.setitimer(signal.ITIMER_REAL, max(self._t0 + self.limit - now, 1e-3))
            if callable(self._prev_handler):
                self._prev_handler(signum, frame)
        elif self._active:  # woken early (a clock step): wait for what is left
            signal.setitimer(signal.ITIMER_REAL, max(self._t0 + self.limit - now, 1e-3))

    def _exit_signal(self):
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self._prev_handler)
        if self._prev_deadline is not None:
            # the other timer's deadline, re-armed (at once if it passed in between)
            signal.setitimer(signal.ITIMER_REAL, max(self._prev_deadline - time.monotonic(), 1e-3))

    # -- asynchronous exception from a watchdog thread
    def _enter_thread(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="attn-ref watchdog", daemon=True)
        self._thread.start()

    def _watch(self):
        if self._stop.wait(self.limit):
            return
        with self._lock:
            if self._active:
                self._active, self.fired = False, True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._tid),
                                                           ctypes.py_object(KernelTimeout))

    def _exit_thread(self, exc_type):
        self._stop.set()
        self._thread.join()
        with self._lock:
            if self.fired and exc_type is not KernelTimeout:
                # fired as the block ended, not delivered yet: take it back
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._tid), None)


@dataclass
class Call:
    """The outcome of one guarded call: its value, or the fault that stopped it."""

    value: Any = None
    fault: str = ""  # "" when the call returned normally
    timed_out: bool = False
    elapsed: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.fault


def call_kernel(fn, /, *args, time_limit=None, what="kernel", **kwargs) -> Call:
    """``fn(*args, **kwargs)`` with every kernel fault caught; see :class:`Call`.

    ``fn`` is kernel code, or a closure that calls the kernel and reads its output back
    (so that an asynchronous library finishes inside the limit). An exception of any
    kind - ``SystemExit`` from ``sys.exit()`` included - becomes ``fault`` =
    ``"<what> raised <type>: <message>"``; running past ``time_limit`` seconds is
    stopped by a :class:`Watchdog` and becomes ``timed_out``. Only
    ``KeyboardInterrupt`` propagates: the person at the keyboard wants the run to stop.
    NumPy floating-point warnings are silenced for the call.
    """
    watchdog = Watchdog(time_limit)
    t0 = time.perf_counter()
    try:
        with watchdog, np.errstate(all="ignore"):
            value = fn(*args, **kwargs)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        elapsed = time.perf_counter() - t0
        if isinstance(exc, KernelTimeout) and watchdog.fired:
            late = elapsed > watchdog.limit + 1.0
            return Call(fault=f"timed out: {what} stopped at the time limit of "
                              f"{watchdog.limit:g} s" + (
                                  ", but only when it returned from C code the watchdog "
                                  "cannot interrupt" if late else ""),
                        timed_out=True, elapsed=elapsed)
        hint = " (sys.exit() inside the kernel)" if isinstance(exc, SystemExit) else ""
        if "Array has been deleted" in str(exc):
            # JAX: a jit with donate_argnums frees the input buffers it donated, which the
            # oracle still holds (an audit's kernel errored so on 10 of 12 cases and passed
            # the 2 whose buffers XLA could not reuse)
            hint = (" (a jax.jit with donate_argnums deleted an input the oracle still holds: "
                    "do not donate q, k, v or the other inputs)")
        return Call(fault=f"{what} raised {type(exc).__name__}: {exc}{hint}", elapsed=elapsed)
    return Call(value, elapsed=time.perf_counter() - t0)


class KernelNotFound(LookupError):
    """A ``MODULE:FUNCTION`` that names no callable; the message says which part failed."""


def load_kernel(spec: str, what: str = "kernel"):
    """``"package.module:function"`` or ``"path/to/file.py:function"`` -> the callable.

    ``what`` names the argument in messages (``"kernel"``, ``"backward"``). Raises
    :class:`KernelNotFound` for a malformed spec, a missing file, module or attribute,
    a module that raises on import (chained, so its traceback stays available), or an
    object that is not callable.
    """
    if not isinstance(spec, str) or ":" not in spec:
        raise KernelNotFound(f"{what} must be MODULE:FUNCTION or path/to/file.py:FUNCTION, "
                             f"got {spec!r}")
    mod_name, _, attr = spec.rpartition(":")
    if not mod_name or not attr:
        raise KernelNotFound(f"{what} must be MODULE:FUNCTION, got {spec!r}")
    try:
        if mod_name.endswith(".py") or os.sep in mod_name:
            path = os.path.abspath(mod_name)
            if not os.path.isfile(path):
                raise KernelNotFound(f"{what} {spec!r}: no such file {path}")
            s = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0],
                                                       path)
            if s is None or s.loader is None:
                raise KernelNotFound(f"{what} {spec!r}: cannot load {path} as a module")
            mod = importlib.util.module_from_spec(s)
            s.loader.exec_module(mod)
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            mod = importlib.import_module(mod_name)
    except KernelNotFound:
        raise
    except ModuleNotFoundError as exc:
        raise KernelNotFound(f"{what} {spec!r}: no module named {exc.name!r}") from exc
    except Exception as exc:  # the user's module failed while importing
        raise KernelNotFound(f"{what} {spec!r}: importing {mod_name} raised "
                             f"{type(exc).__name__}: {exc}") from exc
    obj = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise KernelNotFound(f"{what} {spec!r}: {mod_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise KernelNotFound(f"{what} {spec!r} is a {type(obj).__name__}, not a function")
    return obj


def parse_supports(items) -> dict:
    """``["mask=attn_mask", "bias=no", "broadcast"]`` -> a ``supports=`` dict."""
    out = {}
    for item in items or ():
        name, _, val = item.partition("=")
        out[name] = {"": True, "true": True, "yes": True, "false": False, "no": False}.get(
            val.lower(), val)
    return out


def parse_options(items) -> dict:
    """``["feature_map=identity", "normalize=True", "eps=1e-6"]`` -> an ``options=`` dict.

    A value that reads as a Python literal (``True``, ``None``, ``3``, ``1e-6``,
    ``(0, 5)``, ``'elu+1'``) is that literal; anything else is the string itself
    (``identity``, ``elu+1``). Raises ``ValueError`` for an item without ``=`` or with an
    empty name, or a name given twice.
    """
    import ast

    out = {}
    for item in items or ():
        name, eq, text = item.partition("=")
        name = name.strip()
        if not eq or not name.isidentifier():
            raise ValueError(f"option must be NAME=VALUE with NAME a Python identifier, got "
                             f"{item!r}")
        if name in out:
            raise ValueError(f"option {name!r} given twice")
        try:
            out[name] = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            out[name] = text.strip()
    return out
