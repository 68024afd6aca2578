"""The tolerance model: baselines of the variant's own function, fp32-accumulating
float16/bfloat16 baselines, and the mutants every variant must fail.

* Every form a baseline is built from (:data:`conformance.judging.FORMS`) computes the
  variant's function: in float64 it agrees with the golden to float64 rounding.
* Every registered variant gets tolerances of the size softmax gets, dtype by dtype
  (median ``tol_max / max|golden|`` within 16x of softmax's; at most 5 % of cases
  ill-conditioned in float32/float64), computed with :func:`conformance.prepare` alone.
* Every registered variant has three mutants (:func:`conformance.mutants.variant_mutants`)
  that fail the standard suite in float64 and float32.
* A float16 kernel accumulating ``P V`` in float16 fails, diagnosed; fp32-accumulating
  kernels (torch SDPA math and fused paths, ``jax.nn.dot_product_attention``, a
  hand-written blockwise kernel, attn_ref's references) pass. The full calibration::

      ATTN_REF_CALIBRATION_SEEDS=20 python -m pytest tests/test_conformance_tolerance.py -k calibration
"""

import dataclasses
import functools
import math
import os
import statistics

import numpy as np
import pytest

from attn_ref.registry import get, variants
from conformance import verify
from conformance.catalogue import Case, cases
from conformance.features import NotApplicable
from conformance.judging import FOLD, FORMS, Form, baselines, forms, prepare
from conformance.mutants import (
    VARIANT_CHANGES,
    first_failure,
    fp32_accumulating_kernel,
    low_precision_accumulating_kernel,
    variant_mutants,
)
from conformance.tolerance import DEFAULTS, F16Array, compared_count, elementwise_ulp_rms, lp_array, measure

VARIANTS = [v.name for v in variants()]
DTYPES = ("float64", "float32", "bfloat16", "float16")
SEEDS = int(os.environ.get("ATTN_REF_CALIBRATION_SEEDS", "0"))


def _sample(name, every):
    """Every ``every``-th standard case of a variant (by id, so the choice is stable)."""
    return sorted(cases(name, "standard"), key=lambda c: c.id)[::every]


# ------------------------------------------------------- forms compute the same function


@pytest.mark.parametrize("name", VARIANTS)
def test_every_form_computes_the_variants_function(name):
    """A form whose float64 output is not the golden's (to rounding) is another function."""
    checked = 0
    for case in _sample(name, 5):
        try:
            prep = prepare(case, name, "float64")
        except NotApplicable:
            continue
        if not np.all(np.isfinite(prep.golden)):
            continue  # a reference that fails in longdouble (issue 14 item 4) is no yardstick
        mag = float(np.max(np.abs(prep.golden))) or 1.0
        # the float16/bfloat16-only forms too: in float64 they compute what they compute in
        # the dtype, without its rounding (Nystrom's kernels rounded once, the recurrent
        # float32 states)
        half_only = [f for f in FORMS.get(name, ()) if f.applies is not None
                     and not f.applies(prep) and f.applies(dataclasses.replace(prep, dtype="float16"))]
        for f in forms(prep, "float64") + half_only:
            with np.errstate(all="ignore"):
                out = prep.apply_semantics(f.run(prep, "float64"))
            err = float(np.max(np.abs(out - prep.golden)))
            # float64 rounding, amplified by at most ~1e4 (large logits): far below 1e-9
            assert err <= 1e-9 * mag, (name, f.name, case.id, err, mag)
            checked += 1
    assert checked >= 3, f"{name}: only {checked} form/case pairs could be checked"


def test_the_form_check_catches_another_function():
    """The base-2 scale fold is another function for linear attention (its feature map
    comes before the scale) - the mistake this module fixes: the check must see it."""
    case = Case("basic", (1, 2), 17, 17, 16, 16)
    prep = prepare(case, "linear", "float64")
    out = FOLD.run(prep, "float64")
    assert float(np.max(np.abs(out - prep.golden))) > 1e-3 * float(np.max(np.abs(prep.golden)))
    assert not any(f.fold_scale for f in FORMS["linear"] + FORMS["performer"])


def test_register_forms_rejects_non_forms():
    from conformance.judging import register_forms

    with pytest.raises(TypeError, match="Form objects"):
        register_forms("softmax", {"order": "quadratic"})
    assert all(isinstance(f, Form) for fs in FORMS.values() for f in fs)


def test_low_precision_baselines_drop_blockwise_forms():
    """In float16/bfloat16 a blockwise form accumulates in the dtype: it is no baseline."""
    case = Case("basic", (1, 2), 17, 17, 16, 16)
    for name in ("softmax", "online_softmax", "linear"):
        prep = prepare(case, name, "float16")
        assert not any(f.blockwise for f in forms(prep, "float16")), name
        assert any(f.blockwise for f in forms(prep, "float32")), name


def test_the_baseline_takes_each_measures_largest_over_the_forms():
    """b_max and b_rms are each the largest over the forms, from whichever form makes it.
    Before, a form counted only where its largest error was the largest: on this case the
    form with the largest RMS error has a smaller largest error, and the RMS bound was
    1.38 times lower (886 of 6157 standard bounds were lower, by a median 4.6 %)."""
    (case,) = [c for c in cases("softmax", "standard") if c.id == "range:b3h5-q37k37-d16-kv1x5"]
    prep = prepare(case, "softmax", "float16")
    ms = [measure(prep.apply_semantics(alt()), prep.golden, prep.keep) for alt in baselines(prep, "float16")]
    by_max = max(ms, key=lambda m: m.max_err)
    assert max(m.rms_err for m in ms) > by_max.rms_err  # the case is one where they differ
    assert prep.baseline.max_err == by_max.max_err
    assert prep.baseline.rms_err == max(m.rms_err for m in ms)
    tol = DEFAULTS["float16"]
    want = tol.bounds(by_max.max_err, max(m.rms_err for m in ms), float(np.max(np.abs(prep.golden))),
                      "float16", elementwise_ulp_rms(prep.golden, "float16", prep.keep),
                      compared_count(prep.golden, prep.keep))
    assert (prep.tol_max, prep.tol_rms) == want


def test_float16_baseline_accumulates_in_float32():
    """2048 + 1 + 1 + ... is 2048 forever in float16; an fp32 accumulator gets there."""
    x = lp_array(np.ones(4096), "float16")
    assert isinstance(x, F16Array)
    assert float(np.sum(x)) == 4096.0
    assert float(np.cumsum(x)[-1]) == 4096.0  # NumPy's own float16 cumsum stops at 2048
    assert float(np.cumsum(np.ones(4096, dtype=np.float16))[-1]) == 2048.0
    assert float((x + lp_array(np.full(4096, 1e-4), "float16"))[0]) == 1.0  # rounded to float16


# ---------------------------------------------- tolerances the size of softmax's, per dtype

# Variants allowed more than 5 % ill-conditioned cases in float32/float64, and only on
# the cases of these tags (docs/conformance.md, "Tolerances of approximate variants").
ILL_CONDITIONED_EXCEPTIONS: dict[tuple, tuple] = {
    # FAVOR+ features exp(w.x - |x|^2/2) of inputs with |x|^2/2 ~ 1e3 span more than
    # float32's exponent range: every float32 implementation's denominators underflow
    ("performer", "float32"): ("large-logits",),
    # k-means assignments and the top-k keys of logits ~ 1e4 flip between float64 and
    # longdouble rounding: the output is discontinuous in its rounding there
    ("clustered_topk", "float64"): ("large-logits",),
    ("clustered_topk", "float32"): ("large-logits",),
}
# every 4th standard case (by id): all variants and dtypes at a quarter of the cost
EVERY = 4


def _statistic(name, dtype, every=EVERY):
    """``(median tol_max / max|golden|, ill-conditioned case tags, cases)`` of a sample."""
    rel, ill, n = [], [], 0
    for case in _sample(name, every):
        n += 1
        try:
            prep = prepare(case, name, dtype)
        except NotApplicable as exc:
            if "ill-conditioned" in str(exc):
                ill.append(case.tag)
            continue
        mag = float(np.max(np.abs(prep.golden))) if prep.golden.size else 0.0
        if mag > 0:
            rel.append(prep.tol_max / mag)
    return (statistics.median(rel) if rel else math.nan), ill, n


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_variant_gets_a_tolerance_the_size_of_softmaxs(dtype):
    """Median tol/max|golden| within 16x of softmax's; <= 5 % ill-conditioned in f32/f64."""
    ref, _, _ = _statistic("softmax", dtype)
    bad = []
    for name in VARIANTS:
        med, ill, n = _statistic(name, dtype)
        if not med <= 16 * ref:
            bad.append(f"{name}: median tol/max|golden| {med:.3g} > 16 x softmax's {ref:.3g}")
        if dtype not in ("float32", "float64"):
            continue
        allowed = ILL_CONDITIONED_EXCEPTIONS.get((name, dtype))
        if allowed is not None:
            bad += [f"{name}: ill-conditioned {tag} case in {dtype} (only {allowed} are known)"
                    for tag in ill if tag not in allowed]
        elif len(ill) > 0.05 * n:
            bad.append(f"{name}: {len(ill)} of {n} sampled cases ill-conditioned in {dtype}: {ill}")
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------- mutants of every variant


def test_every_registered_variant_has_mutants():
    missing = [n for n in VARIANTS if n not in VARIANT_CHANGES]
    assert not missing, (f"variants without mutants: {missing}; add their 1 % perturbation and "
                         f"ignored parameter to conformance.mutants.VARIANT_CHANGES")
    with pytest.raises(KeyError, match="VARIANT_CHANGES"):
        variant_mutants("no-such-variant")


@pytest.mark.parametrize("name", VARIANTS)
def test_variant_mutants_fail_the_standard_suite(name):
    """Each mutant fails some standard case in float64 and float32 (cheapest cases first)."""
    missed = []
    for m in variant_mutants(name):
        for dtype in ("float64", "float32"):
            res, ran = first_failure(m, dtype)
            if res is None:
                missed.append(f"{m.name} passes all {ran} standard cases in {dtype}")
    assert not missed, "\n".join(missed)


def test_the_unchanged_reference_passes_where_its_mutants_fail():
    """The mutants fail because of their change: the same kernel without it passes."""
    from conformance.mutants import Mutant, variant_kernel

    for name in ("linear", "performer", "nystrom"):
        res, ran = first_failure(Mutant("unchanged", variant_kernel(name), "", variant=name),
                                 "float32", suite="quick")
        assert res is None and ran >= 5, (name, res, ran)


# ------------------------------------------------------ low-precision accumulation

LONG = [Case("long", (1, 1), 1000, 1000, 64, 64), Case("long", (1, 1), 4096, 4096, 64, 64)]


def test_float16_accumulation_fails_with_its_diagnosis():
    rep = verify(low_precision_accumulating_kernel, "softmax", backend="numpy",
                 dtypes=("float16",), cases=LONG, progress=False, diagnose=False)
    assert [r.verdict for r in rep.results] == ["fail", "fail"], rep.table()
    assert all(r.precision > 1.5 for r in rep.results), rep.table()
    assert "prec" in rep.table() and '"precision"' in rep.to_json()
    # the diagnosis emulates float16 accumulators (seconds per case): on N = 1000 only
    rep = verify(low_precision_accumulating_kernel, "softmax", backend="numpy",
                 dtypes=("float16",), cases=LONG[:1], progress=False)
    words = rep.results[0].diagnosis
    assert "accumulates in low precision" in words and "16 key(s) at a time" in words, words


def test_fp32_accumulating_float16_kernel_passes_long_rows():
    rep = verify(fp32_accumulating_kernel, "softmax", backend="numpy", dtypes=("float16",),
                 cases=LONG + [Case("long", (1, 1), 1000, 1000, 64, 64, causal="top-left")],
                 causal="top-left", progress=False)
    assert rep.passed, rep.table()
    assert all(r.precision < 1.0 for r in rep.results), rep.table()


@pytest.mark.parametrize("sums", [("pv",), ("row_sum",)])
def test_float16_accumulation_of_either_sum_fails_the_standard_suite_at_n_1000(sums):
    # 64 keys at a time, only one of the two sums in float16: the mildest form of the
    # bug. The standard suite's N = 1000 rows catch it, by default, with its diagnosis.
    rows = [c for c in cases("softmax", "standard") if c.nq >= 1000 and c.nk >= 1000]
    assert max(c.nk for c in rows) <= 1300
    kernel = functools.partial(low_precision_accumulating_kernel, block=64, sums=sums)
    rep = verify(kernel, "softmax", backend="numpy", dtypes=("float16",), cases=rows,
                 causal="top-left", progress=False, diagnose=False)
    assert not rep.passed, rep.table()
    failed = [r for r in rep.results if r.verdict == "fail"]
    rep = verify(kernel, "softmax", backend="numpy", dtypes=("float16",),
                 cases=[c for c in rows if c.id == failed[0].case], causal="top-left", progress=False)
    assert "accumulates in low precision" in rep.results[0].diagnosis, rep.results[0].diagnosis
    # the same kernel with both sums in float32 passes the same rows
    rep = verify(functools.partial(low_precision_accumulating_kernel, block=64, sums=()), "softmax",
                 backend="numpy",
                 dtypes=("float16",), cases=rows, causal="top-left", progress=False, diagnose=False)
    assert rep.passed, rep.table()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_baselines_take_masks_and_sequence_lengths(dtype):
    # The float16/bfloat16 baseline runs the reference on the oracle's low-precision
    # arrays; a boolean mask or dropout mask left a plain ndarray, or sequence lengths
    # made a plain ndarray by the reference, were refused as another library's, and
    # every such case fell back to 16 ulps of its largest output (0.27 in bfloat16, 1.06
    # on the combined case): ten times the fp32-accumulating baseline's error.
    ran = set()
    for case in cases("softmax", "standard"):
        if not {"mask", "dropout_mask", "seqlens_q", "seqlens_k"} & case.needs:
            continue
        try:
            prep = prepare(case, "softmax", dtype)
        except NotApplicable:
            continue
        assert prep.baseline_note == "", (case.id, prep.baseline_note)
        ran |= {"mask", "dropout_mask", "seqlens_q", "seqlens_k"} & case.needs
    assert ran == {"mask", "dropout_mask", "seqlens_q", "seqlens_k"}, ran


@pytest.mark.parametrize("name", VARIANTS)
def test_low_precision_baselines_run_on_every_variant(name):
    # The same refusal inside a variant: compressed, pooled and routing build a causal
    # mask from the low-precision q (a plain ndarray) and handed it to a check that took
    # the subclass for another library; every causal case fell back to 16 ulps. Only a
    # baseline that overflows (float16 linear attention, Performer) may fall back.
    ran = 0
    for case in _sample(name, 3):
        if case.nq * case.nk > 130 * 130:
            continue
        try:
            prep = prepare(case, name, "bfloat16")
        except NotApplicable:
            continue
        ran += 1
        assert prep.baseline_note == "" or "non-finite" in prep.baseline_note, (
            case.id, prep.baseline_note)
    assert ran >= 4, ran


def test_half_precision_baselines_do_not_follow_array_api_compats_clip(monkeypatch):
    """The "as registered" half-precision baselines compute the softmax from attn_ref's
    clipped logits (Performer its features from the clipped exponents) in float32 by
    the oracle's definition (conformance.tolerance.LOGITS_IN_FLOAT32), not because
    array_api_compat's NumPy clip happens to return a plain ndarray: with a clip that
    keeps the emulated arrays' type these two float16 tolerances were 5.3x and 6.5x what
    they are."""
    import array_api_compat.numpy as npx

    from conformance import judging

    todo = [("softmax", "softcap:b1h2-q64k64-d64-large_logits-softcap50"),
            ("performer", "headdim:b1h2-q33k33-d128")]

    def tolerances():
        judging._GOLDEN_CACHE.clear()  # prepared anew, baselines included
        out = []
        for name, cid in todo:
            case = {c.id: c for c in cases(name, "standard")}[cid]
            prep = prepare(case, name, "float16")
            out.append((prep.tol_max, prep.tol_rms))
        return out

    before = tolerances()
    compat_clip = npx.clip

    def clip(x, /, min=None, max=None, **kwargs):
        out = compat_clip(x, min=min, max=max, **kwargs)
        return out.view(type(x)) if isinstance(x, np.ndarray) and out.ndim else out

    monkeypatch.setattr(npx, "clip", clip)
    assert type(npx.clip(lp_array(np.ones(3), "float16"), max=0.5)) is F16Array  # in effect
    assert tolerances() == before
    judging._GOLDEN_CACHE.clear()


def test_float16_kernel_off_by_a_few_ulps_on_masked_rows_fails():
    # fp32-accumulating, then its output moved by 4 ulps of float16 where a mask is
    # given: inside the old 16-ulp fallback of masked cases, twice the baseline's error
    def kernel(q, k, v, *, mask=None, causal=False, scale=None):
        out = fp32_accumulating_kernel(q, k, v, mask=mask, causal=causal, scale=scale)
        return out if mask is None else (out.astype(np.float32) * (1 + 2.0**-8)).astype(out.dtype)

    masked = [c for c in cases("softmax", "standard")
              if c.needs == {"mask"} and c.batch[0] * c.batch[1] * c.nq >= 32]
    assert len(masked) >= 3
    rep = verify(kernel, "softmax", backend="numpy", dtypes=("float16",), cases=masked,
                 progress=False, diagnose=False)
    assert all(r.verdict == "fail" for r in rep.results), rep.table()
    rep = verify(fp32_accumulating_kernel, "softmax", backend="numpy", dtypes=("float16",),
                 cases=masked, progress=False, diagnose=False)
    assert rep.passed, rep.table()


def test_low_precision_rms_floor_is_a_minimum_not_an_addend():
    t = DEFAULTS["float16"]
    # an exact baseline: the floor alone; a large baseline: the fudge alone
    assert t.bounds(0.0, 0.0, 1.0, "float16", ulp_rms=1.0, count=10**6)[1] == pytest.approx(0.6006)
    assert t.bounds(0.0, 1.0, 1.0, "float16", ulp_rms=1.0, count=10**6)[1] == pytest.approx(1.5)
    # a handful of elements: the floor grows by 1/sqrt(n)
    assert t.bounds(0.0, 0.0, 1.0, "float16", ulp_rms=1.0, count=16)[1] == pytest.approx(0.75)
    assert DEFAULTS["float32"].bounds(0.0, 1.0, 1.0, "float32", ulp_rms=1.0)[1] == pytest.approx(5.0)


def test_clustered_topk_in_float16_is_judged_with_its_choices_in_the_dtype(monkeypatch):
    """Improved clustered attention's k-means and top-k keys, computed in float16 as a
    half-precision kernel computes them, can differ from the float32-accumulating form's
    (the output then differs by whole keys). The form with every operation in the dtype
    (and its VJP, conformance.grads) is a baseline: attn_ref's reference under torch
    passes these rows, or they are ill-conditioned in float16 (the form's choices differ
    too), where without it they failed at 73-883x; a kernel 2 ulps off still
    fails nearly every standard case."""
    pytest.importorskip("torch")
    import inspect

    from conformance import backends
    from conformance.cli import reference_kernel
    from conformance.judging import AS_REGISTERED

    ref = reference_kernel(get("clustered_topk"), backends.load("torch"))
    kw = dict(backend="torch", dtypes=("float16",), diagnose=False, progress=False,
              supports={"broadcast": True})
    todo = {c.id: c for c in cases("clustered_topk", "standard")}
    rows = ((1, "one-hot:b1h2-q65k65-d64-one_hot"), (2, "one-hot:b1h2-q65k65-d64-one_hot"),
            (2, "broadcast:b2h3-q17k19-d16-kv2x1"))
    for seed, case in rows:
        rep = verify(ref, "clustered_topk", cases=[todo[case]], seed=seed, grads=True, **kw)
        # where the dtype's choices give another function the case is ill-conditioned
        assert all(r.verdict == "pass" or "ill-conditioned" in r.diagnosis
                   for r in rep.results), rep.table(show_na=True)
    assert rep.results[0].output == "out" and rep.results[0].verdict == "pass", rep.table()

    def two_ulps_large(q, k, v, **options):
        return ref(q, k, v, **options) * (1 + 2.0 ** -9)

    two_ulps_large.__signature__ = inspect.signature(ref)
    rep = verify(two_ulps_large, "clustered_topk", seed=0, **kw)
    judged = [r for r in rep.results if r.verdict != "n/a"]
    assert len(judged) >= 30 and sum(r.verdict == "fail" for r in judged) >= len(judged) - 2, \
        rep.table()
    monkeypatch.setitem(FORMS, "clustered_topk", (AS_REGISTERED, FOLD))
    for seed, case in rows[:2]:
        rep = verify(ref, "clustered_topk", cases=[todo[case]], seed=seed, **kw)
        assert rep.counts["fail"] == 1 and rep.results[0].ratio > 50, rep.table()


def test_low_precision_tolerance_is_tighter_than_the_old_floor():
    """The float16 RMS floor is half an ulp per element, not 2 ulps of the maximum."""
    assert DEFAULTS["float16"].floor_rms_ulps <= 0.6 and DEFAULTS["float16"].rms_floor_is_minimum
    assert DEFAULTS["float16"].fudge <= 2.0
    assert DEFAULTS["float32"].fudge == 4.0  # float32/float64 keep their calibrated model


# ------------------------------------------------ calibration: fp32-accumulating kernels


def _torch_blockwise(q, k, v, *, mask=None, is_causal=False, scale=None, block=64):
    """A hand-written FlashAttention-style kernel: running max, row sum and ``P V`` in
    float32 (float64 for float64 inputs), ``P`` rounded to the input dtype for ``P V``."""
    import torch

    dt = q.dtype
    acc_t = torch.float64 if dt == torch.float64 else torch.float32
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    nq, nk = q.shape[-2], k.shape[-2]
    m = torch.full(q.shape[:-1] + (1,), -math.inf, dtype=acc_t)
    den = torch.zeros(q.shape[:-1] + (1,), dtype=acc_t)
    acc = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=acc_t)
    for j0 in range(0, nk, block):
        s = (q.to(acc_t) @ k[..., j0:j0 + block, :].to(acc_t).transpose(-1, -2)) * scale
        if is_causal:
            j = torch.arange(j0, min(nk, j0 + block))
            s = s.masked_fill(j[None, :] > torch.arange(nq)[:, None], -math.inf)
        if mask is not None:
            s = s.masked_fill(~mask[..., j0:j0 + block], -math.inf)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - m_safe)
        alpha = torch.exp(torch.where(torch.isinf(m), torch.full_like(m, -math.inf), m - m_safe))
        den = alpha * den + p.sum(-1, keepdim=True)
        acc = alpha * acc + p.to(dt).to(acc_t) @ v[..., j0:j0 + block, :].to(acc_t)
        m = m_new
    return (acc / torch.where(den > 0, den, torch.ones_like(den))).to(dt)


def _sdpa_forced(backends):
    from torch.nn.attention import sdpa_kernel

    from tests.test_conformance_calibration import sdpa

    def kernel(q, k, v, *, mask=None, bias=None, is_causal=False, scale=None):
        with sdpa_kernel(backends):
            return sdpa(q, k, v, mask=mask, bias=bias, is_causal=is_causal, scale=scale)

    return kernel


def _kernel(name):
    """``(kernel, verify keywords)`` of one calibration kernel."""
    if name == "jax":
        from tests.test_conformance_calibration import jax_dpa

        return jax_dpa, dict(backend="jax", layout="bnhd", supports={"value_dim": False},
                             fully_masked="mean", causal="top-left")
    if name == "reference":
        from attn_ref.softmax import softmax_attention

        return softmax_attention, dict(backend="torch", causal="both", supports={"broadcast": True})
    if name == "blockwise":
        return _torch_blockwise, dict(backend="torch", causal="top-left")
    from torch.nn.attention import SDPBackend

    # the fused CPU kernel takes no mask or bias: those cases fall back to the math path
    paths = {"sdpa-math": [SDPBackend.MATH],
             "sdpa-fused": [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]}[name]
    return _sdpa_forced(paths), dict(backend="torch", supports={"broadcast": True})


CALIBRATION = [(k, dt) for k in ("sdpa-math", "sdpa-fused", "blockwise", "reference", "jax")
               for dt in DTYPES
               # XLA on CPU has no float16 dot; float64 needs jax_enable_x64 process-wide
               if not (k == "jax" and dt in ("float16", "float64"))]


@pytest.mark.slow
@pytest.mark.parametrize("kernel,dtype", CALIBRATION)
def test_calibration_fp32_accumulating_kernels_pass(kernel, dtype):
    """Standard suite plus N = 4096 rows; CI: one seed per kernel and dtype, drawn from
    the pair so that CI sees many draws over the runs (ATTN_REF_CALIBRATION_SEEDS=20: all)."""
    pytest.importorskip("jax" if kernel == "jax" else "torch")
    fn, kw = _kernel(kernel)
    # N = 4096 rows where accumulation shows most (in float64 their longdouble golden
    # costs a minute: the low-precision dtypes only, unless the full calibration runs)
    extra = [Case("long", (1, 1), 4096, 4096, 64, 64),
             Case("long", (1, 1), 4096, 4096, 64, 64, causal="top-left")]
    if not SEEDS:  # CI: the non-causal row only (the causal one averages half the keys)
        extra = [] if dtype in ("float32", "float64") else extra[:1]
    # CI: the quick suite and the long rows (where accumulation shows); full: standard
    suite = cases("softmax", "standard" if SEEDS else "quick")
    if not SEEDS:
        suite += [c for c in cases("softmax", "standard") if c.tag == "long"]
    ci_seed = CALIBRATION.index((kernel, dtype)) % 20
    for seed in (range(SEEDS) if SEEDS else [ci_seed]):
        rep = verify(fn, "softmax", dtypes=(dtype,), seed=seed, cases=suite + extra,
                     progress=False, diagnose=False, **kw)
        xla_bug = [r for r in rep.failures if r.verdict == "error"
                   and "ALG_DOT_BF16_BF16_F32" in r.diagnosis and "q1k1" in r.case]
        rep.results = [r for r in rep.results if r not in xla_bug]
        assert rep.passed, f"seed {seed}\n" + rep.table()
        assert rep.counts["pass"] >= (40 if SEEDS else 10), rep.summary()


def test_torch_blockwise_kernel_is_a_fair_calibration_kernel():
    """The hand-written kernel is right (float64 passes) and its float16 accumulator
    variant fails: the calibration kernel is not trivially exact or trivially wrong."""
    pytest.importorskip("torch")
    rep = verify(_torch_blockwise, "softmax", backend="torch", dtypes=("float64",),
                 suite="quick", causal="top-left", progress=False)
    assert rep.passed, rep.table()
    bad = functools.partial(_torch_lp_accumulating, block=16)
    rep = verify(bad, "softmax", backend="torch", dtypes=("bfloat16",), cases=LONG[1:],
                 progress=False, diagnose=False)
    assert not rep.passed and rep.results[0].precision > 1.5, rep.table()


def _torch_lp_accumulating(q, k, v, *, is_causal=False, scale=None, block=16):
    import torch

    dt = q.dtype
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    p = torch.exp(s - s.amax(-1, keepdim=True))
    acc = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=dt)
    for j0 in range(0, k.shape[-2], block):  # P V accumulated in the kernel's own dtype
        acc = (acc.float() + p[..., j0:j0 + block].to(dt).float() @ v[..., j0:j0 + block, :].float()).to(dt)
    return (acc.float() / p.sum(-1, keepdim=True)).to(dt)


# ---------------------------------------- softmax: P V summed key by key, as one thread a row


def _key_by_key_softmax(q, k, v, *, causal=False, scale=None, off_by=0.0):
    """A plain float32 kernel with one thread per query row: running sums of ``p_j`` and
    ``p_j v_j`` over the keys in order, divided once at the end (an independent audit's
    C kernel, in NumPy); ``off_by`` scales the output by ``1 + off_by``."""
    q, k, v = (np.asarray(x, dtype=np.float32) for x in (q, k, v))
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ np.swapaxes(k, -1, -2)) * np.float32(scale)
    nq, nk = s.shape[-2:]
    if causal:
        shift = nk - nq if causal == "bottom-right" else 0
        s = np.where(np.arange(nk)[None, :] <= np.arange(nq)[:, None] + shift, s, -np.inf)
    e = np.exp(s - np.max(s, axis=-1, keepdims=True))
    den = np.zeros(e.shape[:-1] + (1,), np.float32)
    num = np.zeros(e.shape[:-1] + (v.shape[-1],), np.float32)
    for j in range(nk):
        den += e[..., j:j + 1]
        num += e[..., j:j + 1] * v[..., j:j + 1, :]
    return num / den * np.float32(1 + off_by)


@pytest.mark.parametrize("seed", [0, 1])
def test_softmax_keys_summed_one_by_one_pass_and_a_1e_5_error_fails(seed):
    """The softmax baselines summed over keys in BLAS products and blocks only: the kernel
    above failed the 4096-key cases at 1.00-1.12 (seeds 0-2, RMS bound); the key-by-key
    form (conformance.judging.KEY_BY_KEY) makes them 0.40-0.43, and the same kernel off
    by a relative 1e-5 still fails at 2.7 or more."""
    long = [c for c in cases("softmax", "standard") if c.id.startswith("long:") and "k4096" in c.id]
    assert len(long) == 2
    for off_by, passed in ((0.0, True), (1e-5, False)):
        kernel = functools.partial(_key_by_key_softmax, off_by=off_by)
        rep = verify(kernel, "softmax", backend="numpy", dtypes=("float32",), cases=long,
                     seed=seed, causal="both", progress=False, diagnose=False)
        assert all((r.verdict == "pass") == passed for r in rep.results), rep.table()
        if passed:
            assert max(r.ratio for r in rep.results) < 0.6, rep.table()


# ------------------------------------- linear attention: another summation order over keys


def _torch_linear(q, k, v, *, causal=False, scale=None, off_by=0.0, den_dtype=None):
    """elu+1 linear attention in plain torch, quadratic order: ``(A V) / rowsum A``.
    ``off_by``: the output scaled by ``1 + off_by``; ``den_dtype``: the row sums rounded to
    that dtype (slightly wrong kernels)."""
    import torch
    import torch.nn.functional as F

    fq, fk = F.elu(q) + 1, F.elu(k) + 1
    a = (1.0 if scale is None else scale) * fq @ fk.transpose(-1, -2)
    if causal:
        nq, nk = q.shape[-2], k.shape[-2]
        off = nk - nq if causal == "bottom-right" else 0
        a = a.masked_fill(torch.arange(nk)[None] > torch.arange(nq)[:, None] + off, 0.0)
    # rows that see no key: 0, as attn_ref's eps = 1e-6 floor gives (elu+1 is positive)
    den = a.sum(-1, keepdim=True).clamp_min(1e-6)
    if den_dtype is not None:
        den = den.to(getattr(torch, den_dtype)).to(a.dtype)
    return (a @ v) / den * (1 + off_by)


_LINEAR_4096 = [c for c in cases("linear", "standard") if c.nk == 4096]


def _verify_linear(kernel, dtypes, seeds, todo=_LINEAR_4096):
    pytest.importorskip("torch")
    return [verify(kernel, "linear", backend="torch", dtypes=dtypes, cases=todo, seed=seed,
                   causal="both", progress=False, diagnose=False) for seed in seeds]


def test_calibration_plain_torch_linear_attention_passes():
    """torch's float64 sums over 4096 keys err up to 4x NumPy's blocked ones (RMS): seed 2
    of ``long:b1h1-q64k4096-d32`` failed at 1.056 before the baseline took a form that sums
    the keys one by one. CI: seeds 1 and 2 on the 4096-key rows and the large-logits one
    (below); full calibration (ATTN_REF_CALIBRATION_SEEDS=20): the standard suite."""
    todo = cases("linear", "standard") if SEEDS else _LINEAR_4096 + [
        c for c in cases("linear", "standard") if c.id == _ELU_CASE]
    for seed, rep in zip(range(SEEDS) if SEEDS else (1, 2), _verify_linear(
            _torch_linear, ("float64", "float32"), range(SEEDS) if SEEDS else (1, 2), todo)):
        rep.results = [r for r in rep.results if (seed, r.case, r.dtype) not in _ILL_FOR_TORCH]
        assert rep.passed, rep.table()
        assert rep.counts["pass"] >= len(todo), rep.summary()


# torch's elu(x) + 1 is expm1(x) + 1, which keeps e^x << 1 only to an absolute u/2: on
# large negative inputs the output is a ratio of such features. The form "elu(x) + 1 as
# written" is in the baseline for it (seed 1 of this case failed at 1.95 in float64
# without it); at seed 14 in float32 the plain torch kernel errs 0.54 on outputs of size
# 0.80 and that form 0.19 (just under the 1/4 of max|golden| that makes a case
# ill-conditioned): two samples of quantised features, which the RMS bound (3x the
# form's) misses by 5 %. Left out of the 20-seed calibration, named here.
_ELU_CASE = "large-logits:b1h2-q16k16-d8-large_logits"
_ILL_FOR_TORCH = {(14, _ELU_CASE, "float32")}


@pytest.mark.parametrize("wrong", [dict(off_by=1e-13), dict(den_dtype="float32")])
def test_a_linear_kernel_slightly_off_fails_at_4096_keys(wrong):
    """The summed-one-by-one baseline is no blanket: an output 1e-13 too large, or row
    sums rounded to float32, fail the float64 rows it made pass."""
    rep, = _verify_linear(functools.partial(_torch_linear, **wrong), ("float64",), (2,))
    assert all(r.verdict == "fail" for r in rep.results), rep.table()


def test_the_sequential_linear_form_is_in_the_baseline():
    """float64 at 4096 keys: the baseline is the largest of the forms, the keys summed one
    by one among them (about 4x the blocked orders' RMS error, measured)."""
    prep = prepare(_LINEAR_4096[0], "linear", "float64", 2)
    names = [f.name for f in forms(prep, "float64")]
    assert "quadratic order, keys summed one by one" in names


def _torch_half_nystrom(q, k, v, *, num_landmarks, factor=1.0):
    """Nystromformer as a plain torch kernel runs it in float16/bfloat16: balanced landmark
    means, logits by half-precision matmuls times the scale, ``softmax`` in float32 rounded
    once to the dtype, six iterations of the pseudo-inverse and the products in the dtype;
    ``factor`` scales the output (a planted mistake)."""
    import torch

    n, dt = q.shape[-2], q.dtype
    c, r = divmod(n, num_landmarks)
    sizes = [c + 1] * r + [c] * (num_landmarks - r)

    def means(x):
        return torch.stack([p.mean(-2) for p in torch.split(x, sizes, dim=-2)], -2)

    ql, kl = means(q), means(k)
    scale = q.shape[-1] ** -0.5

    def kernel(a, b):
        return torch.softmax(((a @ b.transpose(-1, -2)) * scale).float(), -1).to(dt)

    k1, k2, k3 = kernel(q, kl), kernel(ql, kl), kernel(ql, k)
    z = k2.transpose(-1, -2) / (k2.abs().sum(-2).amax(-1) * k2.abs().sum(-1).amax(-1))[..., None, None]
    eye = torch.eye(k2.shape[-1], dtype=dt)
    for _ in range(6):
        az = k2 @ z
        z = 0.25 * (z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az))))
    return (k1 @ (z @ (k3 @ v))) * factor


@pytest.mark.parametrize("seed, dtype, case_id", [(0, "bfloat16", "basic:b2h3-q17k17-d16"),
                                                  (1, "float16", "length:b1h2-q3k3-d32"),
                                                  (2, "float16", "near-ties:b1h2-q64k64-d32-near_ties")])
def test_a_torch_half_precision_nystrom_passes_and_one_percent_off_fails(seed, dtype, case_id):
    # An independent audit's torch Nystromformer of this kind failed these three output
    # rows at 1.50, 1.32 and 1.18x while the forms were the plain ones, the one with every
    # operation in the dtype and the one with its softmax kernels rounded once from exact
    # logits: the pseudo-inverse amplifies the logits' own rounding, which none of them
    # made. With the form "logits in the dtype, softmax kernels rounded once" they pass;
    # the output 1 % off still fails in float16 (about 2.6 bfloat16 ulps: below what a
    # single bfloat16 row resolves here).
    pytest.importorskip("torch")
    chosen = [c for c in cases("nystrom", "standard") if c.id == case_id]
    assert len(chosen) == 1

    def run(factor):
        rep = verify(functools.partial(_torch_half_nystrom, factor=factor), "nystrom", backend="torch",
                     dtypes=(dtype,), cases=chosen, seed=seed, progress=False, time_limit=None)
        return [r for r in rep.results if r.verdict != "n/a"]

    rows = run(1.0)
    assert [r.verdict for r in rows] == ["pass"], [(r.verdict, r.ratio, r.diagnosis) for r in rows]
    if dtype == "float16":
        assert [r.verdict for r in run(1.01)] == ["fail"]


def _sdpa(last_row=1.0):
    """PyTorch's SDPA as a kernel, its last query row times ``last_row``."""
    torch = pytest.importorskip("torch")

    def kernel(q, k, v, *, causal=False, scale=None):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=bool(causal),
                                                              scale=scale)
        if last_row != 1.0:
            o = o.clone()
            o[..., -1, :] *= last_row
        return o
    return kernel


@pytest.mark.parametrize("dtype,factor", [("bfloat16", 1.1), ("float16", 1.02)])
def test_an_error_on_one_small_row_fails_though_larger_rows_set_the_case_bound(dtype, factor):
    # The last row of a 1000-key causal case averages 1000 values: at most 0.15 against 2.7
    # for the first rows, whose rounding sets the case's bounds. Its output 10 % off
    # (bfloat16) was within them (ratio 0.42 for 15 %); its own bound
    # (Tolerance.row_bounds) fails it, and the diagnosis says where.
    case = [c for c in cases("softmax", "standard") if c.id == "long:b1h1-q1000k1000-d64-causal-tl"]
    kw = dict(backend="torch", dtypes=(dtype,), cases=case)
    assert verify(_sdpa(), "softmax", **kw).passed
    (r,) = verify(_sdpa(factor), "softmax", **kw).results
    assert r.verdict == "fail" and r.max_err <= r.tol_max and r.rms_err <= r.tol_rms, r
    assert "output row (batch 0, head 0, row 999) errs" in r.diagnosis, r.diagnosis
    assert "wrong only on query row 999 (of Nq = 1000)" in r.diagnosis, r.diagnosis


def test_one_row_far_above_the_cases_bound_is_named_by_the_rows_own_bounds():
    # The last row 5 % off in float16 exceeds the case's bound itself (8.7 times); every
    # other row stays within 0.15 of its own. Named only by the case's bound it read "no
    # known mistake explains it"
    case = [c for c in cases("softmax", "standard") if c.id == "long:b1h1-q1000k1000-d64-causal-tl"]
    (r,) = verify(_sdpa(1.05), "softmax", backend="torch", dtypes=("float16",), cases=case).results
    assert r.verdict == "fail" and r.max_err > r.tol_max, r
    assert "the output is wrong only on query row 999 (of Nq = 1000); every other row errs at most" \
        in r.diagnosis, r.diagnosis


def test_a_rows_bound_is_between_the_cases_bound_scaled_to_the_row_and_the_cases_bound():
    # never tighter than the relative error the case allows (a lucky baseline row tightens
    # nothing), never looser than the case's bound; tighter than it on small rows
    (case,) = [c for c in cases("softmax", "standard") if c.id == "long:b1h1-q1000k1000-d64-causal-tl"]
    prep = prepare(case, "softmax", "bfloat16")
    size = np.max(np.abs(prep.golden), axis=-1)
    rows = prep.tol_rows
    assert rows.shape == prep.golden.shape[:-1]
    assert np.all(rows <= prep.tol_max) and np.all(rows >= prep.tol_max * size / size.max() * (1 - 1e-12))
    # (0.0062 of 0.053: the baselines' error there taken twice, ROW_SLACK)
    assert rows[0, 0, -1] < prep.tol_max / 8, (rows[0, 0, -1], prep.tol_max)


def test_neighbourhood_max_takes_the_window_either_side():
    from conformance.tolerance import neighbourhood_max

    x = np.zeros((2, 12))
    x[0, 5], x[1, 0] = 1.0, 2.0
    got = neighbourhood_max(x, 2)
    assert got[0].tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0]
    assert got[1].tolist() == [2, 2, 2] + [0] * 9
    assert np.array_equal(neighbourhood_max(x, 0), x)
