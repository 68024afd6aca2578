"""The pieces every mistake signature is built from: :class:`Signature` and its
registry, the host softmax in float64, the reference with some inputs changed, the
rule by which a mistake's output reproduces a kernel's (:func:`reproduces`), and the
fit of a small factor (a scale, beta, the output itself) to a kernel's output."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from ..extras import nearest_rounding
from ..features import allowed_matrix
from ..tolerance import (
    measure,
)

__all__ = ["Signature", "SIGNATURES", "register_signature", "AS_CASE", "host_logits",
           "softmax_host", "finish", "ref_with", "UNEXPLAINED", "reproduces",
           "SCALE_FIT_RANGE", "compared", "fit_factor", "off_by", "nearest_output_rounding"]


@dataclass(frozen=True)
class Signature:
    """A known mistake: ``candidates(prep)`` yields ``(message, output)`` pairs.

    With ``needs_output=True`` it is called ``candidates(prep, got)``: a mistake with a
    continuous parameter (a scale off by some percent) fits it to the kernel's output.
    """

    name: str
    candidates: Callable[..., Iterator]
    exact_only: bool = False  # needs the variant to be exact softmax
    needs_output: bool = False
    # a costly fit, skipped once another mistake reproduces the output within tolerance
    fit: bool = False
    # every candidate is another function, never another rounding of this one: a kernel
    # within tolerance of it in both norms names it also where it fails the RMS bound alone
    # (in bfloat16 a gate clipped at -5 fails that bound only, and its own rounding is far
    # more than 1/50 of its error)
    functional: bool = False


SIGNATURES: list[Signature] = []


def register_signature(sig: Signature) -> Signature:
    SIGNATURES.append(sig)
    return sig


# ------------------------------------------------------------------ host softmax pieces


AS_CASE = object()  # "as the case has it"


def host_logits(prep, *, scale=None, allowed=AS_CASE, bias=AS_CASE):
    a = prep.arrays
    s = (a["q"] @ np.swapaxes(a["k"], -1, -2)) * (prep.scale if scale is None else scale)
    b = a.get("bias") if bias is AS_CASE else bias
    if b is not None:
        s = s + b
    al = allowed_matrix(prep.case, a, prep.kwargs) if allowed is AS_CASE else allowed
    if al is not None:
        s = np.where(al, s, -np.inf)
    return s


def softmax_host(s, v, *, axis=-1, eps=0.0):
    """``softmax(s, axis) @ v`` in float64; rows with no finite logit give zeros."""
    m = np.max(s, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    den = np.sum(e, axis=axis, keepdims=True)
    p = e / np.where(den + eps > 0, den + eps, 1.0)
    return p @ v


def finish(prep, out):
    return prep.apply_semantics(np.broadcast_to(out, prep.golden.shape).astype(np.float64))


def ref_with(prep, **changes):
    """The variant's reference in float64 with some arrays/kwargs changed (None removes)."""
    arrays, kwargs = dict(prep.arrays), dict(prep.kwargs)
    for k, v in changes.items():
        target = arrays if k in ("q", "k", "v", "mask", "bias") else kwargs
        if v is None:
            target.pop(k, None)
        else:
            target[k] = v
    return prep.reference("float64", arrays=arrays, kwargs=kwargs)


def nearest_output_rounding(prep, got):
    """``(message, output)`` of the recurrent family's known rounding nearest the
    kernel's output (:func:`conformance.extras.nearest_rounding`), or None; made once per
    prepared case for the signature that names it and the driver's rule past the
    signatures' reach, which both ask."""
    return nearest_rounding(prep, got, lambda c: finish(prep, c.reference("float64")),
                            prep.keep, key="out")


# ----------------------------------------------- does a mistake reproduce the output


# A named mistake leaves at most this fraction of the kernel's error unexplained (when
# its output is not within the case tolerance of the kernel's outright).
UNEXPLAINED = 1 / 50


def reproduces(prep, got, cand, err=None, functional=False):
    """How closely a mistake's output ``cand`` reproduces the kernel's ``got``.

    The rule of the module docstring: None unless the mistake changes the output of
    this case (it is off the golden by more than the tolerance) and the kernel's output
    is within ``max(tolerance, UNEXPLAINED * kernel error)`` of it; else the largest
    difference. A mistake within the max bound, past the RMS one, must leave
    ``UNEXPLAINED`` of the kernel's error in both norms, or (``functional``: a change of
    function, never of rounding) be within both bounds of the kernel's output and leave
    at most half its RMS error. The mistake may change which rows are empty, so the
    candidate is tried as it is and with the declared convention applied to the case's
    empty rows.
    """
    if err is None:
        err = measure(got, prep.golden, prep.keep).max_err
    best = None
    raw = np.broadcast_to(cand, prep.golden.shape).astype(np.float64)
    for c in (finish(prep, cand), raw):
        off = measure(c, prep.golden, prep.keep)
        if off.max_err <= prep.tol_max and off.rms_err <= prep.tol_rms:
            continue  # the mistake makes no difference on this case
        m = measure(got, c, prep.keep)
        if m.nonfinite or m.golden_nonfinite:
            continue
        if off.max_err <= prep.tol_max:
            # a mistake within the max bound, past the RMS one, is named only when it
            # leaves at most UNEXPLAINED of the kernel's error in both norms: within the
            # max bound, any small error would be "within tolerance of it"
            rms = measure(got, prep.golden, prep.keep).rms_err
            if (m.max_err <= err * UNEXPLAINED and m.rms_err <= rms * UNEXPLAINED) or (
                    functional and m.max_err <= prep.tol_max and m.rms_err <= prep.tol_rms
                    and m.rms_err <= rms / 2):
                best = m.max_err if best is None else min(best, m.max_err)
        elif m.max_err <= max(prep.tol_max, err * UNEXPLAINED):
            best = m.max_err if best is None else min(best, m.max_err)
    return best


# ------------------------------------------------------------- fitting a small factor


# A scale off by a small factor (a rounded or mistyped 1/sqrt(d), log2(e) folded in
# twice or not at all) is fitted, not guessed: the factor a with the reference at
# scale a*s closest to the kernel's output. Larger factors are the named mistakes of
# _scale_sigs (1/d, no scale, scale squared); this one covers 0.8 <= a <= 1.25. The
# delta rule's beta and the output itself are fitted the same way: a mistake of a
# small factor makes an error of the size of low-precision rounding, and must be told
# apart from it by what it is, a consistent factor.
SCALE_FIT_RANGE = (0.8, 1.25)


def compared(prep, got):
    """Where a fit compares the kernel's output with the golden: the kept positions
    where both are finite."""
    keep = np.ones(prep.golden.shape, bool) if prep.keep is None else prep.keep
    return keep & np.isfinite(prep.golden) & np.isfinite(got)


def fit_factor(prep, got, at):
    """The factor ``a`` in :data:`SCALE_FIT_RANGE` (not 1) whose output ``at(a)`` is
    closest to ``got`` (Gauss-Newton on the scalar, the output being smooth in it) and
    that output; None when there is none."""
    ok = compared(prep, got)
    lo, hi = SCALE_FIT_RANGE[0] * 0.9, SCALE_FIT_RANGE[1] * 1.1
    a, f, h = 1.0, at(1.0), 1e-4
    for _ in range(4):
        jac = (at(a + h) - f) / h
        den = float(np.sum(np.where(ok, jac * jac, 0.0)))
        if not den > 0:
            return None
        step = float(np.sum(np.where(ok, jac * (got - f), 0.0))) / den
        if abs(step) < 1e-6:
            break
        a = min(max(a + step, lo), hi)
        f = at(a)
    if not SCALE_FIT_RANGE[0] <= a <= SCALE_FIT_RANGE[1] or abs(a - 1.0) < 1e-6:
        return None
    return a, f


def off_by(a):
    return f"{100 * abs(a - 1):.2g} % too {'large' if a > 1 else 'small'}"
