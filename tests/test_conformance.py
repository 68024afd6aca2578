"""conformance: the oracle's own accuracy, cases, tolerance model, report, CLI, vectors, plugin.

The mutation catalogue lives in :mod:`conformance.mutants`; the calibration against
real kernels in ``tests/test_conformance_calibration.py``.
"""

import io
import json
import os
import subprocess
import sys
import time

import mpmath
import numpy as np
import pytest

from attn_ref.registry import get
from conformance import Case, cases, prepare, verify
from conformance.catalogue import CATALOGUE
from conformance.judging import judge
from conformance.mutants import MUTANTS, correct_kernel, run_mutant
from conformance.oracle import session
from conformance.report import Progress
from conformance.tolerance import (
    DEFAULTS,
    LOGITS_IN_DTYPE,
    ROW_SUMS_IN_FLOAT32,
    BF16Array,
    F16Array,
    bf16_round,
    f16_round,
    lp_array,
    measure,
    round_to,
    stochastic_array,
    stochastic_round,
    ulp,
)
from tests.helpers import run_plugin

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------ the golden itself


def _mp_attention(prep):
    """The case's exact output with 40-digit mpmath arithmetic."""
    mpmath.mp.dps = 40
    a = prep.arrays
    q, k, v = a["q"], a["k"], a["v"]
    scale = prep.kwargs.get("scale") or 1 / mpmath.sqrt(q.shape[-1])
    from conformance.features import allowed_matrix

    al = allowed_matrix(prep.case, a, prep.kwargs)
    B, H, nq, _ = q.shape
    out = np.zeros(prep.golden.shape)
    for b in range(B):
        for h in range(H):
            for i in range(nq):
                kb, kh = min(b, k.shape[0] - 1), min(h, k.shape[1] - 1)
                s = []
                for j in range(k.shape[2]):
                    ok = True if al is None else al[min(b, al.shape[0] - 1), min(h, al.shape[1] - 1),
                                                    i, j]
                    if ok:
                        x = mpmath.fsum(mpmath.mpf(float(q[b, h, i, t])) * mpmath.mpf(float(k[kb, kh, j, t]))
                                        for t in range(q.shape[-1])) * scale
                        if "bias" in a:
                            x += mpmath.mpf(float(a["bias"][0, h, i, j]))
                        s.append((j, x))
                if not s:
                    continue
                m = max(x for _, x in s)
                w = [(j, mpmath.exp(x - m)) for j, x in s]
                den = mpmath.fsum(e for _, e in w)
                for c in range(v.shape[-1]):
                    out[b, h, i, c] = float(mpmath.fsum(e * mpmath.mpf(float(v[kb, kh, j, c]))
                                                        for j, e in w) / den)
    return out


MP_CASES = [
    Case("mp", (1, 2), 5, 7, 4, 3),
    Case("mp", (1, 1), 6, 6, 4, 4, dist="large_logits"),
    Case("mp", (1, 1), 6, 8, 4, 4, dist="near_ties"),
    Case("mp", (2, 1), 5, 6, 3, 3, mask="fully_masked_rows", bias=True),
    Case("mp", (1, 1), 7, 5, 4, 4, causal="bottom-right"),
]


@pytest.mark.parametrize("case", MP_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_golden_against_mpmath(case, dtype):
    prep = prepare(case, "softmax", dtype, seed=3)
    want = _mp_attention(prep)
    err = np.linalg.norm(prep.golden - want) / max(np.linalg.norm(want), 1e-300)
    if dtype == "float64":
        # computed in longdouble, then rounded once to float64: within an ulp of exact,
        # where a float64 computation would carry several roundings
        assert prep.golden_dtype == "longdouble"
        assert err < 1.2e-16
    else:
        assert err < 1e-13


# ------------------------------------------------------------------- tolerance model


def test_bf16_rounding_matches_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.random.default_rng(0).standard_normal(20000) * np.logspace(-30, 30, 20000)
    want = x.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(bf16_round(x), want)
    assert np.array_equal(round_to(x, "bfloat16"), want.astype(np.float64))


def test_bf16_rounding_matches_ml_dtypes_on_every_kind_of_bit_pattern():
    # bf16_round works on the bit pattern in 32 bits: float32 patterns across the whole
    # range (a prime stride over all 2^32), exact ties below both even and odd bfloat16
    # neighbours, the largest finite values (round to inf), infinities, subnormals and
    # NaNs with every payload the carry could wrap.
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(1)
    upper = rng.integers(0, 1 << 16, 4000, dtype=np.uint64) << 16
    bits = np.concatenate([
        np.arange(0, 1 << 32, 65521, dtype=np.uint64), upper | 0x8000, upper | 0x7FFF,
        upper | 0x8001, np.array([0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 1, 0x80000001,
                                  0x7FC00000, 0xFFFFFFFF, 0xFFFF8000, 0x7FFFFFFF], dtype=np.uint64),
    ]).astype(np.uint32)
    x = bits.view(np.float32)
    got = bf16_round(x)
    with np.errstate(invalid="ignore"):  # ml_dtypes' cast of NaN warns
        want = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    nan = np.isnan(x)
    assert got.dtype == np.float32 and np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    assert not np.shares_memory(got, x) and np.array_equal(x.view(np.uint32), bits)  # input kept
    zero_d = bf16_round(np.float64(1.0 + 2.0**-9))
    assert isinstance(zero_d, np.ndarray) and zero_d.shape == () and zero_d == np.float32(1.0)


def test_f16_rounding_is_numpys_cast_on_every_kind_of_bit_pattern():
    # f16_round rounds in float32 bits with fix-ups for float16's subnormals, overflow
    # and NaN (a NaN whose payload is all in the 13 bits rounded off would become
    # infinity): float32 patterns across the whole range (a prime stride over all 2^32),
    # exact ties below even and odd float16 neighbours in the normal range, ties of the
    # 2^-24 grid below 2^-14, both sides of 2^-14, of 65504 (the largest float16) and
    # of 65520 (the first to round to inf), infinities, NaNs, signed zeros; as one array
    # (the bit path) and in pieces smaller than the cast threshold (NumPy's cast).
    rng = np.random.default_rng(2)
    upper = rng.integers(0, 1 << 19, 4000, dtype=np.uint64) << 13
    grid = rng.integers(0, 1 << 10, 2000).astype(np.float64) * 2.0**-24
    special = np.array([2.0**-14, 2.0**-14 * (1 - 2.0**-24), 2.0**-25, 3 * 2.0**-25,
                        2.0**-24 * 0.5000001, 65504.0, 65519.996, 65520.0, 65536.0, 0.0],
                       dtype=np.float32)
    bits = np.concatenate([
        np.arange(0, 1 << 32, 65521, dtype=np.uint64), upper | 0x1000, upper | 0x0FFF,
        upper | 0x1001, np.array([0x7F800000, 0xFF800000, 0x7F800001, 0xFF801FFF, 0x7FC00000,
                                  0xFFFFFFFF, 0x7F7FFFFF, 1, 0x80000001], dtype=np.uint64),
    ]).astype(np.uint32)
    x = np.concatenate([bits.view(np.float32), (grid + 2.0**-25).astype(np.float32),
                        special, -special])
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(np.float16).astype(np.float32)
    nan = np.isnan(x)
    for got in (f16_round(x), np.concatenate([f16_round(p) for p in np.array_split(x, 1000)])):
        assert got.dtype == np.float32 and np.array_equal(np.isnan(got), nan)
        assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    kept = x.copy()
    f16_round(x)
    assert np.array_equal(x.view(np.uint32), kept.view(np.uint32))  # input kept
    # one typical array of each regime through the bit path: normal and mostly subnormal
    for y in (rng.standard_normal(4096), np.exp(rng.standard_normal(4096) * 4 - 14)):
        assert np.array_equal(f16_round(y), y.astype(np.float32).astype(np.float16).astype(np.float32))
    zero_d = f16_round(np.float64(1.0 + 2.0**-11))
    assert isinstance(zero_d, np.ndarray) and zero_d.shape == () and zero_d == np.float32(1.0)


def test_bf16_array_rounds_every_operation():
    a = bf16_round(np.linspace(0.1, 3.0, 12).reshape(3, 4)).view(BF16Array)
    for out in (a @ a.T, np.exp(a), a / 3.0, np.sum(a, axis=-1), np.where(a > 1, a * 1.1, a)):
        assert isinstance(out, BF16Array)
        assert np.array_equal(np.asarray(out), bf16_round(np.asarray(out)))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_stochastic_rounding_picks_a_neighbour_without_bias(dtype):
    # every result is one of the two values of the dtype around x (x itself where x is
    # one), the upper one as often as x is close to it, the same draws for the same seed
    rn = bf16_round if dtype == "bfloat16" else f16_round
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(20000) * 10.0 ** rng.integers(-9, 4, 20000)).astype(np.float32)
    x[:100] = rn(x[:100])  # already in the dtype
    got = stochastic_round(x, dtype, np.random.default_rng(0))
    assert got.dtype == np.float32 and got.shape == x.shape
    assert np.array_equal(rn(got), got)  # in the dtype
    assert np.array_equal(got[:100], x[:100])
    # within one ulp of x: its two neighbours (float16's below 2^-14 on the grid 2^-24)
    bits = 7 if dtype == "bfloat16" else 10
    step = np.ldexp(1.0, np.frexp(x)[1] - 1 - bits)
    if dtype == "float16":
        step = np.maximum(step, 2.0 ** -24)
    assert np.all(np.abs(got.astype(np.float64) - x) < step)
    assert 0.2 < np.mean(got != rn(x)) < 0.3  # a quarter of uniform fractions go the far way
    assert np.array_equal(stochastic_round(x, dtype, np.random.default_rng(0)), got)
    assert not np.array_equal(stochastic_round(x, dtype, np.random.default_rng(1)), got)
    # unbiased: 0.3 of an ulp above 1 goes up 30 % of the time
    one = np.full(20000, 1 + 0.3 * 2.0 ** -(7 if dtype == "bfloat16" else 10), dtype=np.float32)
    up = np.mean(stochastic_round(one, dtype, np.random.default_rng(2)) > 1)
    assert abs(up - 0.3) < 0.02, up
    assert stochastic_round(np.float32(2.0), dtype, rng).shape == ()  # 0-d stays 0-d
    nan = stochastic_round(np.array([np.nan, -np.inf]), dtype, rng)
    assert np.isnan(nan[0]) and nan[1] == -np.inf


def test_stochastic_float16_rounds_subnormals_on_their_grid_and_overflows_to_infinity():
    rng = np.random.default_rng(4)
    tiny = np.full(20000, 2.0 ** -20 + 0.25 * 2.0 ** -24, dtype=np.float32)
    got = stochastic_round(tiny, "float16", rng)
    assert set(np.unique(got)) == {np.float32(2.0 ** -20), np.float32(2.0 ** -20 + 2.0 ** -24)}
    assert abs(np.mean(got > 2.0 ** -20) - 0.25) < 0.02
    assert np.all(stochastic_round(np.array([-7e4, 7e4], dtype=np.float32), "float16", rng)
                  == [-np.inf, np.inf])


def test_stochastic_array_rounds_every_operation_at_random():
    cls = stochastic_array("bfloat16", 5)
    a = bf16_round(np.linspace(0.1, 3.0, 12).reshape(3, 4)).view(cls)
    out = a / 3.0
    assert type(out) is cls and np.array_equal(np.asarray(out), bf16_round(np.asarray(out)))
    exact = np.asarray(a, dtype=np.float64) / 3.0
    assert not np.array_equal(np.asarray(out), bf16_round(exact))  # not all to nearest
    again = bf16_round(np.linspace(0.1, 3.0, 12).reshape(3, 4)).view(stochastic_array("bfloat16", 5))
    assert np.array_equal(np.asarray(again / 3.0), np.asarray(out))


def test_row_sums_in_float32_leave_a_softmax_backward_unrounded_until_it_meets_the_dtype():
    """torch's softmax backward on float16 weights: rowsum(P dP) in float32, not rounded
    before it is subtracted. With the largest weight rounded to 1 the rounded row sum
    cancels dP of the largest logit exactly (dS 0 there); the float32 one leaves
    -P_2 dP_2, as torch does. Every other sum, and a sum without keepdims, still rounds."""
    from attn_ref.grad._common import softmax_vjp

    torch = pytest.importorskip("torch")
    p = lp_array(np.array([[1 - 2.0 ** -20, 2.0 ** -20 * 19]]), "float16")  # rounds to [1, 1.8e-5]
    dp = lp_array(np.array([[-1.634766, -1.664062]]), "float16")
    assert float(p[0, 0]) == 1.0
    row = ROW_SUMS_IN_FLOAT32.sum(p * dp, axis=-1, keepdims=True)
    assert type(row) is np.ndarray and float(row[0, 0]) != float(lp_array(row, "float16")[0, 0])
    for axis in (0, None):
        assert isinstance(ROW_SUMS_IN_FLOAT32.sum(p * dp, axis=axis, keepdims=True), F16Array)
    assert isinstance(ROW_SUMS_IN_FLOAT32.sum(p * dp, axis=-1), F16Array)
    ds = softmax_vjp(ROW_SUMS_IN_FLOAT32, p, dp)
    want = torch.ops.aten._softmax_backward_data(
        torch.tensor(np.asarray(dp), dtype=torch.float16), torch.tensor(np.asarray(p), dtype=torch.float16),
        -1, torch.float16)
    np.testing.assert_array_equal(np.asarray(ds, dtype=np.float32), want.float().numpy())
    assert float(ds[0, 0]) != 0.0
    assert float(softmax_vjp(LOGITS_IN_DTYPE, p, dp)[0, 0]) == 0.0  # the rounded row sum


def test_floor_makes_tolerance_positive_for_exact_baselines():
    # one key: output is exactly v in every dtype, so the baseline error is zero
    prep = prepare(Case("one", (1, 1), 3, 1, 4, 4), "softmax", "float16")
    assert prep.baseline.max_err == 0.0
    floor = DEFAULTS["float16"].floor_ulps
    assert prep.tol_max >= floor * ulp(np.abs(prep.golden).max(), "float16") > 0
    assert prep.tol_rms > 0
    assert ulp(1.0, "float32") == 2.0**-23 and ulp(3.0, "float16") == 2.0**-9


def test_nonfinite_fails_and_nan_golden_never_passes():
    prep = prepare(Case("x", (1, 1), 4, 4, 4, 4), "softmax", "float32")
    got = prep.golden.copy()
    got[0, 0, 1, 2] = np.nan
    r = prep.check(got)
    assert r.verdict == "fail" and "NaN" in r.diagnosis and r.worst == (0, 0, 1)
    bad = prep.golden.copy()
    bad[0, 0, 0, 0] = np.nan
    m = measure(bad, bad)
    assert judge(prep, m).verdict == "error"


def test_tolerance_scales_with_dtype():
    c = Case("t", (1, 2), 33, 33, 16, 16)
    tols = [prepare(c, "softmax", dt).tol_max for dt in ("float64", "float32", "bfloat16", "float16")]
    assert tols[0] < 1e-13 < tols[1] < 1e-5 < tols[3] < tols[2] < 0.2


# ---------------------------------------------------------------------------- cases


def test_cases_are_deterministic_and_cover_the_issue():
    std = cases(None, "standard")
    ids = [c.id for c in std]
    assert len(ids) == len(set(ids))
    a1, _ = std[5].inputs(seed=4)
    a2, _ = std[5].inputs(seed=4)
    a3, _ = std[5].inputs(seed=5)
    assert np.array_equal(a1["q"], a2["q"]) and not np.array_equal(a1["q"], a3["q"])
    lengths = {c.nk for c in std} | {c.nq for c in std}
    assert {1, 63, 65, 127, 129, 1000} <= lengths
    assert {1, 80, 96, 256} <= {c.d for c in std}
    assert {"large_logits", "near_ties", "one_hot", "constant_keys"} <= {c.dist for c in std}
    assert {"padding", "random", "fully_masked_rows"} <= {c.mask for c in std}
    assert {"top-left", "bottom-right"} <= {c.causal for c in std}
    assert any(c.kv_batch for c in std) and any(c.bias for c in std)
    assert any(c.nq != c.nk for c in std)
    assert len(CATALOGUE["quick"]) < len(std) < len(CATALOGUE["exhaustive"])


def test_case_inputs_have_the_advertised_properties():
    arr, _ = Case("x", (1, 1), 8, 8, 8, 8, mask="fully_masked_rows").inputs(0)
    assert (~arr["mask"].any(-1)).any()
    arr, _ = Case("x", (1, 1), 8, 8, 8, 8, dist="constant_keys").inputs(0)
    assert np.all(arr["k"] == arr["k"][..., :1, :])
    arr, _ = Case("x", (1, 1), 8, 8, 64, 64, dist="large_logits").inputs(0, "float32")
    s = arr["q"] @ np.swapaxes(arr["k"], -1, -2) / 8
    assert np.abs(s).max() > 5e3
    arr, _ = Case("x", (1, 1), 8, 8, 64, 64, dist="large_logits").inputs(0, "float16")
    assert np.abs(arr["q"] @ np.swapaxes(arr["k"], -1, -2)).max() < 6e4


def test_cases_filtered_by_reference_capabilities():
    # every softmax case is computable by the softmax reference
    # (cases of a family, Case.family, are that family's only: the recurrent one's, and
    # exact softmax's large logits over 1000 keys; those of a variant, Case.variant, that
    # variant's: the sparse patterns' option cases)
    assert len(cases("softmax", "standard")) == len(
        [c for c in cases(None, "standard") if c.family in (None, "softmax")
         and c.variant in (None, "softmax")])


@pytest.mark.parametrize("name", ["local", "longformer", "bigbird"])
def test_a_variant_option_named_like_a_feature_is_the_option(name):
    # local's, Longformer's and BigBird's ``window`` is their own half-width, not the
    # softmax feature's (left, right): the window cases made their references raise
    # (n/a rows, "multiple values for keyword argument 'window'") until they were left out
    from conformance.calling import reference_features

    assert "window" not in reference_features(get(name))
    assert not [c.id for c in cases(name, "exhaustive") if "window" in c.needs]
    assert "window" in reference_features(get("softmax"))


# --------------------------------------------------------------------- verify

def _plain(q, k, v):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1]).astype(q.dtype)
    e = np.exp(s - s.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)) @ v


def test_capabilities_come_from_the_signature():
    rep = verify(_plain, "softmax", backend="numpy", suite="quick", progress=False)
    assert rep.passed, rep.table()
    na = [r for r in rep.results if r.verdict == "n/a"]
    assert na and all("does not declare" in r.diagnosis for r in na)
    assert not any(r.verdict == "pass" for r in rep.results if "mask" in r.case)
    # the two features assumed unless a kernel opts out
    assert rep.features == ["noncontiguous", "value_dim"]
    full = verify(correct_kernel, "softmax", backend="numpy", suite="quick", causal="both",
                  progress=False)
    assert full.counts["n/a"] == 0 and full.passed
    # supports= can take a feature away, or name the parameter
    rep2 = verify(correct_kernel, "softmax", backend="numpy", suite="quick", causal="both",
                  supports={"mask": False}, progress=False)
    assert all(r.verdict == "n/a" for r in rep2.results if "mask-" in r.case)


def test_layouts_and_custom_backend_pair():
    for layout in ("bnhd", "nd"):
        def k_layout(q, k, v, *, causal=False, _l=layout):
            if _l == "bnhd":
                q, k, v = (np.swapaxes(x, 1, 2) for x in (q, k, v))
            out = correct_kernel(q, k, v, causal=causal)
            return np.swapaxes(out, 1, 2) if _l == "bnhd" else out

        rep = verify(k_layout, "softmax", backend="numpy", layout=layout, suite="quick",
                     causal="both", progress=False)
        assert rep.passed, rep.table()
        if layout == "nd":
            assert all(r.verdict == "n/a" for r in rep.results if "b1h1" not in r.case)
    pair = (lambda a, dt: np.asarray(a, dtype=dt).tolist(), lambda x: np.asarray(x))

    def list_kernel(q, k, v):
        return _plain(*(np.asarray(x, dtype=np.float32) for x in (q, k, v))).tolist()

    rep = verify(list_kernel, "softmax", backend=pair, suite="quick", progress=False)
    assert rep.passed and rep.backend == "custom"


def test_semantics_are_declared_not_guessed():
    def mean_rows(q, k, v, *, mask=None):  # the convention of jax.nn.dot_product_attention
        s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
        s = np.where(mask, s, np.float32(-1e30))
        e = np.exp(s - s.max(-1, keepdims=True))
        return ((e / e.sum(-1, keepdims=True)) @ v).astype(q.dtype)

    only = [c for c in cases(None, "quick") if c.mask == "fully_masked_rows"]
    assert verify(mean_rows, "softmax", backend="numpy", cases=only, fully_masked="mean",
                  progress=False).passed
    rep = verify(mean_rows, "softmax", backend="numpy", cases=only, progress=False)
    assert not rep.passed and "fully_masked='mean'" in rep.failures[0].diagnosis
    assert verify(mean_rows, "softmax", backend="numpy", cases=only, fully_masked="excluded",
                  progress=False).passed
    # every row fully masked: with its rows excluded nothing is left to judge (n/a, where
    # it had read a pass on no values); declared as zeros, it is judged
    dead = [Case("fully-masked", (1, 1), 1, 4, 4, 4, mask="fully_masked_rows")]
    rep = verify(mean_rows, "softmax", backend="numpy", cases=dead, fully_masked="excluded",
                 progress=False)
    assert [r.verdict for r in rep.results] == ["n/a"] and "no value is judged" in rep.results[0].diagnosis
    assert [r.verdict for r in verify(mean_rows, "softmax", backend="numpy", cases=dead,
                                      progress=False).results] == ["fail"]
    with pytest.raises(ValueError, match="fully_masked"):
        verify(mean_rows, "softmax", backend="numpy", fully_masked="nan")
    with pytest.raises(TypeError, match="semantics"):
        verify(mean_rows, "softmax", backend="numpy", fully_maskd="zeros")


def test_determinism_and_time_limit():
    calls = []

    def flaky(q, k, v):
        calls.append(1)
        return _plain(q, k, v) + np.float32(len(calls) % 2) * np.float32(1e-9)

    c = cases(None, "quick")[:2]
    rep = verify(flaky, "softmax", backend="numpy", cases=c, deterministic=True, progress=False)
    assert not rep.passed and "deterministic" in rep.failures[0].diagnosis

    def slow(q, k, v):
        time.sleep(0.05)
        return _plain(q, k, v)

    rep = verify(slow, "softmax", backend="numpy", cases=c, time_limit=0.01, progress=False)
    assert not rep.passed and "time limit" in rep.failures[0].diagnosis


def test_kernel_exceptions_are_errors_not_crashes():
    def broken(q, k, v):
        raise RuntimeError("no kernel image")

    rep = verify(broken, "softmax", backend="numpy", suite="quick", progress=False)
    c = rep.counts
    assert c["error"] > 0 and c["pass"] == c["fail"] == 0 and not rep.passed
    assert "RuntimeError: no kernel image" in rep.table()


def test_report_table_and_json(tmp_path):
    rep = run_mutant(MUTANTS[0])
    text = rep.table()
    assert "FAIL" in text and "1/d instead of 1/sqrt(d)" in text and "worst at" in text
    path = tmp_path / "r.json"
    rep.to_json(path)
    d = json.loads(path.read_text())
    assert d["passed"] is False and d["counts"]["fail"] == len(rep.failures)
    r0 = d["results"][0]
    for key in ("case", "dtype", "shapes", "max_err", "rms_err", "tol_max", "ratio", "worst",
                "verdict", "diagnosis"):
        assert key in r0


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_mutants_are_caught_and_diagnosed(mutant):
    rep = run_mutant(mutant)
    assert not rep.passed
    assert any(mutant.expect in r.diagnosis for r in rep.failures), rep.table()


def test_search_shrinks_to_a_small_failing_case():
    def drops_keys_after_40(q, k, v, *, mask=None, bias=None, causal=False, scale=None):
        cut = {n: None if x is None else x[..., :40] for n, x in (("mask", mask), ("bias", bias))}
        return correct_kernel(q, k[..., :40, :], v[..., :40, :], causal=causal, scale=scale, **cut)

    from conformance.oracle import search

    sess = session(drops_keys_after_40, "softmax", backend="numpy", diagnose=False,
                   causal="both", supports={"broadcast": True})
    res = search(sess, "float32", 30)
    assert res is not None and res.verdict == "fail"
    assert "smallest failing case" in res.diagnosis
    assert res.case == "search:b1h1-q1k41-d1"  # shrunk: one query, 41 keys, d = 1


def test_progress_only_on_terminals():
    buf = io.StringIO()
    p = Progress(enabled=False, stream=buf)
    p.t0 -= 10
    p.update(1, 2, "x")
    assert buf.getvalue() == ""
    p = Progress(enabled=True, stream=buf)
    p.t0 -= 10
    p.update(1, 2, "case-id")
    p.done()
    assert "[1/2] case-id" in buf.getvalue()
    assert Progress(stream=io.StringIO()).enabled is False  # not a tty


# ---------------------------------------------------------------------- vectors


def test_export_vectors_round_trip(tmp_path):
    from conformance.vectors import export_vectors, load_vectors

    quick = cases("softmax", "quick")
    man = export_vectors(tmp_path, "softmax", dtypes=("float16", "bfloat16"), cases=quick,
                         layout="bnhd")
    raw = json.loads((tmp_path / "manifest.json").read_text())
    assert raw["format"] == "attn-ref-vectors" and len(raw["cases"]) == 2 * len(quick)
    with np.load(tmp_path / man["cases"][0]["file"], allow_pickle=False) as z:
        assert z["q"].dtype == np.float16 and z["golden"].dtype == np.float64
    n = 0
    for entry, arrays in load_vectors(tmp_path):
        if entry["dtype"] == "bfloat16":
            assert arrays["q"].dtype == np.float32
        q, k, v = (np.swapaxes(arrays[x].astype(np.float64), 1, 2) for x in "qkv")
        out = correct_kernel(q, k, v, mask=arrays.get("mask"),
                             bias=arrays["bias"].astype(np.float64) if "bias" in arrays else None,
                             causal=entry["causal"] or False, scale=entry["scale"])
        err = np.abs(np.swapaxes(out, 1, 2) - arrays["golden"])[arrays["compare"]]
        assert err.max() <= entry["tol_max_abs"]
        n += 1
    assert n == 2 * len(quick)


# --------------------------------------------------------------------- CLI, plugin


def _cli(*args):
    from conformance.cli import main

    return main(list(args))


def test_cli_verify_kernel_and_builtin(tmp_path, capsys):
    assert _cli("verify", "conformance.mutants:correct_kernel", "--suite", "quick",
                "--causal", "both", "--json", str(tmp_path / "r.json")) == 0
    assert json.loads((tmp_path / "r.json").read_text())["passed"] is True
    bad = tmp_path / "bad.py"
    bad.write_text("import numpy as np\n"
                   "def k(q, k, v):\n"
                   "    s = q @ np.swapaxes(k, -1, -2) / q.shape[-1]\n"
                   "    e = np.exp(s - s.max(-1, keepdims=True))\n"
                   "    return (e / e.sum(-1, keepdims=True)) @ v\n")
    assert _cli("verify", f"{bad}:k", "--suite", "quick", "--dtype", "float16") == 1
    assert "1/d instead of 1/sqrt(d)" in capsys.readouterr().out
    assert _cli("verify", "--backend", "numpy", "--variant", "softmax",
                "--variant", "online_softmax") == 0
    out = capsys.readouterr().out
    assert "online_softmax" in out and "float64" in out and "all passed" in out


def test_cli_builtin_job_in_workers_is_the_same_table(capsys):
    # --jobs 2 runs the references in spawned worker processes; the table must be the
    # one the single process prints, row for row, in the same order.
    args = ("verify", "--backend", "numpy", "--backend", "array_api_strict", "--variant",
            "softmax", "--variant", "linear", "--dtype", "float32")
    assert _cli(*args, "--jobs", "1") == 0
    one = capsys.readouterr().out
    assert _cli(*args, "--jobs", "2") == 0
    two = capsys.readouterr().out
    rows = [line for line in one.splitlines() if line.startswith(("softmax", "linear"))]
    assert len(rows) == 4 and rows == [line for line in two.splitlines()
                                       if line.startswith(("softmax", "linear"))]
    assert _cli(*args, "--jobs", "0") == 2
    assert "--jobs must be at least 1" in capsys.readouterr().err


def test_cli_export_vectors(tmp_path, capsys):
    assert _cli("export-vectors", str(tmp_path), "--suite", "quick", "--dtype", "float32") == 0
    assert (tmp_path / "manifest.json").exists() and "wrote" in capsys.readouterr().out


def test_plugin_is_inert_and_light():
    code = ("import sys, conformance.pytest_plugin as p; "
            "print(sorted(m for m in ('numpy', 'torch', 'jax', 'attn_ref') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stderr


def test_plugin_runs_one_item_per_case(tmp_path, monkeypatch):
    code, seen = run_plugin(monkeypatch, tmp_path, "--attn-kernel", "conformance.mutants:correct_kernel",
                            "--attn-suite", "quick", "--attn-causal", "top-left", "-rs")
    assert code == 0, [r.longreprtext for r in seen.reports if r.failed]
    # The plugin's items follow the oracle's verdicts: a pass per passing case, a skip
    # per case the kernel's declared semantics exclude (the bottom-right causal case).
    rep = verify(correct_kernel, "softmax", backend="numpy", suite="quick", causal="top-left")
    verdicts = [r.verdict for r in rep.results if r.output == "out"]
    assert len(verdicts) == len(cases("softmax", "quick")) and "n/a" in verdicts
    passed, skipped = verdicts.count("pass"), verdicts.count("n/a")
    assert passed + skipped == len(verdicts)
    assert seen.outcomes() == (passed, 0, skipped), (seen.outcomes(), passed, skipped)
    assert any("bottom-right" in str(r.longrepr) for r in seen.reports if r.skipped)


def test_a_gradient_rows_worst_index_is_labelled_by_its_axes():
    # dk's and dv's worst index counts keys; every row said "(batch, head, query)"
    from conformance.report import worst_axes

    assert worst_axes("out") == worst_axes("dq") == "(batch, head, query)"
    assert worst_axes("dk") == worst_axes("dv") == "(batch, head, key)"
    assert worst_axes("de_proj") == "index of de_proj"
