"""Every registered reference gives a finite golden on finite input, in float64 and longdouble.

The conformance oracle computes its golden with the reference in a wider dtype than the
kernel (``np.longdouble`` for a float64 kernel). A finite stand-in for ``-inf`` written
as ``-float(finfo.max) / 4`` is ``-inf`` in longdouble (``float()`` of its max is inf), and
``inf - inf`` then poisons a causal Nq != Nk row with NaN (issue 14). This test calls
every reference the way the oracle does, through the public API only, on every case of
the "exhaustive" suite that the variant accepts.
"""

from __future__ import annotations

import inspect
import os

import array_api_compat.numpy as npx
import numpy as np
import pytest

from attn_ref.registry import variants
from conformance import cases

DTYPES = {"float64": np.float64, "longdouble": np.longdouble}
_BASE = ("q", "k", "v")
# Cases with more multiply-adds than this (Nq Nk d, times 64 in longdouble, which NumPy
# computes without BLAS) take seconds each on a shared CPU: marked slow.
# Very long key sequences (Nk >= 16384, the decode cases) are slow in any dtype.
_SLOW_WORK = 2**25
_SLOW_NK = 16384


def _slow(case, dtype):
    work = case.nq * case.nk * max(case.d, case.dv) * (64 if dtype == "longdouble" else 1)
    return work > _SLOW_WORK or case.nk >= _SLOW_NK


_PARAMS = {}


def _variant_params(variant, seed, nq, nk, d, dv):
    """``variant.params`` in float64, drawn once per shape and shared by the dtypes of a
    case (each casts a copy): Performer's orthogonal features at d = 256 cost about 2 s of
    QR decompositions per draw."""
    if variant.params is None:
        return {}
    key = (variant.name, seed, nq, nk, d, dv)
    if key not in _PARAMS:
        _PARAMS[key] = variant.params(seed, nq, nk, d, dv, dtype=npx.float64, device="cpu", xp=npx)
    return _PARAMS[key]


def _golden(variant, case, dtype, seed=0):
    """The reference's output for ``case`` in ``dtype`` (NumPy), and whether its inputs
    were finite."""
    arrays, kwargs = case.inputs(seed, "float64")
    params = _variant_params(variant, seed, case.nq, case.nk, case.d, case.dv)

    def cast(x):
        x = np.asarray(x) if hasattr(x, "shape") else x
        if isinstance(x, np.ndarray) and np.issubdtype(x.dtype, np.floating):
            return x.astype(dtype)
        return x

    a = {n: cast(x) for n, x in arrays.items()}
    p = {n: cast(x) for n, x in params.items()}
    finite = all(np.all(np.isfinite(x)) for x in list(a.values()) + list(p.values())
                 if isinstance(x, np.ndarray) and np.issubdtype(x.dtype, np.floating))
    try:
        with np.errstate(all="ignore"):
            out = variant.fn(a["q"], a["k"], a["v"], **{n: x for n, x in a.items() if n not in _BASE},
                             **kwargs, **p, **variant.options, xp=npx)
    except ValueError as exc:
        # A reference that refuses an option of the case by design (Linformer refuses a
        # mask) cannot take it: the oracle reports the case as not applicable. What is
        # checked then is that the refusal is a clear error, never a non-finite golden.
        assert str(exc), f"the {variant.name} reference refused {case.id} without a message"
        return None, finite
    return np.asarray(out), finite


def _clash(variant, case):
    """Case options that are also fixed options of the variant (a softmax ``window`` case
    offered to local attention, whose own ``window`` means something else): the oracle
    cannot call that reference with the case either, so it is not collected."""
    from conformance.features import FEATURES

    names = {FEATURES[f].params[0] for f in case.needs if f in FEATURES and FEATURES[f].params}
    return names & set(variant.options)


# The slow cases (minutes each in longdouble: NumPy has no BLAS for it) are collected
# only with ATTN_REF_FULL_GOLDEN=1; CI runs every other case of the exhaustive suite.
FULL = os.environ.get("ATTN_REF_FULL_GOLDEN") == "1"


def _params():
    out = []
    for variant in variants():
        for case in cases(variant.name, "exhaustive"):
            if _clash(variant, case):
                continue
            for dname in DTYPES:
                if _slow(case, dname) and not FULL:
                    continue
                marks = [pytest.mark.slow] if _slow(case, dname) else []
                out.append(pytest.param(variant, case, dname, marks=marks,
                                        id=f"{variant.name}-{case.id}-{dname}"))
    return out


@pytest.mark.parametrize("variant,case,dtype", _params())
def test_reference_golden_is_finite(variant, case, dtype):
    out, finite = _golden(variant, case, DTYPES[dtype])
    if out is None:  # refused by design, with a clear error (see _golden)
        return
    assert out.dtype == DTYPES[dtype]
    if finite:
        bad = ~np.isfinite(out)
        assert not bad.any(), (
            f"{variant.name} on {case.id} in {dtype}: {int(bad.sum())} non-finite outputs "
            f"of {out.size} from finite inputs, first at {tuple(int(i) for i in np.argwhere(bad)[0])}"
        )


def test_longdouble_causal_rectangular_performer_is_finite():
    # The case issue 14 found: causal, Nq != Nk, in longdouble.
    (variant,) = [v for v in variants() if v.name == "performer"]
    chosen = [c for c in cases("performer", "exhaustive")
              if c.nq != c.nk and c.causal]
    assert chosen, "the exhaustive suite has no causal Nq != Nk case for performer"
    out, _ = _golden(variant, chosen[0], np.longdouble)
    assert np.all(np.isfinite(out))


# Variants whose output past a documented range is not finite, and why. Every other
# variant that takes ``scale`` must give finite output and gradients for any finite one.
_HUGE_SCALE_RANGE = {
    # The normalised output does not depend on the scale, but the reference forms the
    # sums scale * phi(Q) phi(K)^T V; its module docstring states the range.
    "linear": "attn_ref.linear: |scale| Nk max|phi(q)| max|phi(k)| d' max(1, max|v|) < finfo.max",
    # unnormalised: the output scale * q S_t is linear in the scale, so past the range it
    # is +-inf, the true value out of range (attn_ref.recurrent's docstring states it)
    **dict.fromkeys(("retention", "gla", "ssd", "deltanet", "gated_deltanet"),
                    "attn_ref.recurrent: the output scale * q S_t is linear in the scale"),
}
_HUGE_SCALE_VJP_RANGE = {
    **_HUGE_SCALE_RANGE,
    # The VJPs below differentiate logits they do not return past the clamp: their
    # gradients overflow where the forward saturates (documented in attn_ref.grad).
    "performer": "causal: the key stabiliser's bound exp(|w|^2/2) meets exponents clamped at finfo.max",
    "clustered_topk": "the centroid and member softmaxes are recomputed without their logits",
    "reformer": "differentiates the dense weights, recomputed without their logits",
}


def _scaled_variants():
    return [v for v in variants()
            if "scale" in inspect.signature(v.fn).parameters and v.name not in _HUGE_SCALE_RANGE]


@pytest.mark.parametrize("variant", _scaled_variants(), ids=lambda v: v.name)
def test_huge_scale_gives_finite_output_and_gradients(variant):
    # scale=1e308: the logits saturate (the softmax tends to each row's hardmax); finite
    # input must still give finite output, never inf - inf = NaN from a scaled copy of q.
    rng = np.random.default_rng(0)
    n, d = 12, 4
    q, k, v, do = (rng.standard_normal((2, n, d)) for _ in range(4))
    extra = variant.extra(0, n, n, d, d, dtype=npx.float64, device="cpu", xp=npx)
    for opts in ({"causal": True}, {}) if variant.causal else ({},):
        with np.errstate(all="ignore"):
            out = np.asarray(variant.fn(q, k, v, scale=1e308, **extra, **opts))
            assert np.all(np.isfinite(out)), f"{variant.name} {opts}: non-finite output at scale=1e308"
            if variant.name in _HUGE_SCALE_VJP_RANGE:
                continue
            g = variant.vjp(q, k, v, do, scale=1e308, **extra, **opts)
        bad = sorted(n for n, x in g.items() if not np.all(np.isfinite(np.asarray(x))))
        assert not bad, f"{variant.name} {opts}: non-finite gradients {bad} at scale=1e308"
