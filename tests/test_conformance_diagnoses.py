"""The oracle's diagnoses never name a wrong cause.

A failing row's diagnosis either names the mistake the kernel made, or says that no known
mistake explains it (or that it cannot tell a lower dtype's rounding from a mistake of
that size): :func:`conformance.mutants.audit_diagnoses` runs each planted mistake of a
variant (:func:`conformance.mutants.variant_mutants`) and the variant's reference computed
in bfloat16, float16 and float32 (:func:`conformance.mutants.precision_mutants`) to their
first failing case, and to the first with 256 output values or more, and classifies every
failing row's diagnosis (:func:`conformance.mutants.classify_diagnosis`). The whole
catalogue: ``python -m conformance.mutants audit`` (0 wrong of 856 rows; docs/conformance.md,
"Reports and diagnosis").

Representative variants here: Gated DeltaNet (beta 1 % off, whose error in float32 is the
size of bfloat16 rounding and read "a plain bfloat16 implementation"), linear attention
and Performer (a feature map or a projection 1 % off: the same), softmax (the scale fit).
"""

import io

import numpy as np
import pytest

from conformance import verify
from conformance.catalogue import cases
from conformance.mutants import (
    MUTANT_CAUSES,
    audit_diagnoses,
    classify_diagnosis,
    precision_loss_kernel,
    precision_mutants,
    variant_kernel,
    variant_mutants,
)
from conformance.tolerance import UNTOLD

AUDITED = ("gated_deltanet", "linear", "performer", "softmax")


def _audit(mutants, dtypes=("float32", "float64")):
    return audit_diagnoses(mutants, dtypes=dtypes, out=io.StringIO())


@pytest.mark.parametrize("name", AUDITED)
def test_no_mutant_of_a_variant_is_diagnosed_with_a_wrong_cause(name):
    rows = _audit(variant_mutants(name))
    wrong = [(r[0], r[1], r[2], r[3], r[5]) for r in rows if r[4] in ("wrong", "missed")]
    assert not wrong, wrong
    # the mistakes a signature knows are named (a factor on the output not on a case of
    # four values, where rounding one scalar is a common factor too)
    for m in variant_mutants(name):
        if m.expect:
            mine = [r for r in rows if r[0] == m.name]
            assert any(r[4] == "right" for r in mine), mine


@pytest.mark.parametrize("name", ["gated_deltanet", "linear"])
def test_a_kernel_computing_in_a_lower_dtype_is_not_diagnosed_with_a_wrong_cause(name):
    rows = _audit(precision_mutants(name))
    assert not [r for r in rows if r[4] in ("wrong", "missed")], rows
    # the error shares the plain implementation's direction: the dtype is named outright,
    # except on a case of four values, too few to tell
    outs = [r for r in rows if r[3] == "out" and r[2] != "length1:b1h1-q1k1-d4"]
    assert outs and all(r[4] == "right" and UNTOLD not in r[5] for r in outs), outs


def _failures(kernel, name, dtype, todo):
    rep = verify(kernel, name, backend="numpy", dtypes=(dtype,), cases=todo, progress=False)
    assert rep.failures, rep.table()
    return rep.failures


def test_beta_one_percent_off_is_named_where_it_read_bfloat16():
    """HuggingFace's gated delta rule with beta x 1.01 read "a plain bfloat16
    implementation" in float32 (tests/test_conformance_thirdparty_recurrent.py): its error
    is that size. The fitted beta names it; at T = 1 it is the same output as the scale
    or the output 1 % too large, and all three are named."""
    name = "gated_deltanet"
    kernel = variant_kernel(name, lambda q, k, v, kw: (q, k, v, {**kw, "beta": kw["beta"] * 1.01}))
    long = [c for c in cases(name, "standard") if c.id == "chunks:b2h2-q100k100-d32-causal-tl"]
    (out, *_) = [r for r in _failures(kernel, name, "float32", long) if r.output == "out"]
    assert out.diagnosis.startswith("beta is 1 % too large"), out.diagnosis
    assert "bfloat16" not in out.diagnosis
    one = [c for c in cases(name, "standard") if c.id == "chunks:b2h2-q1k1-d32-causal-tl"]
    (out, *_) = [r for r in _failures(kernel, name, "float64", one) if r.output == "out"]
    for words in ("beta is 1 % too large", "the logit scale is 1 % too large",
                  "the output is 1 % too large", "the same output on this case"):
        assert words in out.diagnosis, out.diagnosis


def test_a_mistake_of_rounding_size_is_not_called_rounding():
    """Performer's projection 1 % off errs as much as a bfloat16 implementation, in no
    common direction with its error: the diagnosis says it cannot tell, where it named
    bfloat16; the reference computed in bfloat16 is named outright on the same case."""
    name = "performer"
    todo = [c for c in cases(name, "quick") if c.id == "basic:b2h3-q17k17-d16"]
    proj = [m for m in variant_mutants(name) if "projection" in m.name][0]
    (row,) = _failures(proj.kernel, name, "float32", todo)
    assert classify_diagnosis(row.diagnosis, proj.expect) == "honest", row.diagnosis
    assert UNTOLD in row.diagnosis or row.diagnosis.startswith("no known mistake"), row.diagnosis
    (row,) = _failures(precision_loss_kernel(name, "bfloat16"), name, "float32", todo)
    assert "a plain bfloat16 implementation makes" in row.diagnosis and UNTOLD not in row.diagnosis


def test_the_classification_tells_right_honest_and_wrong_apart():
    beta = MUTANT_CAUSES["beta x 1.01"]
    assert classify_diagnosis("beta is 1 % too large: the output matches ...", beta) == "right"
    assert classify_diagnosis("no known mistake explains it: error 3x ...", beta) == "honest"
    assert classify_diagnosis("the output is wrong only on heads 1 (of H = 2); ...", "") == "honest"
    assert classify_diagnosis("the error (0.002) is the size a plain bfloat16 implementation "
                              "makes (0.002): computing or accumulating in bfloat16 (low "
                              "precision)", beta) == "wrong"
    assert classify_diagnosis("the logit scale is 1 % too large: ...", beta) == "wrong"
    precision = "PRECISION bfloat16"
    assert classify_diagnosis("the error (0.002) is the size a plain bfloat16 implementation "
                              "makes (0.002): computing or accumulating in bfloat16", precision) == "right"
    assert classify_diagnosis("the error (0.002) is the size a plain float16 implementation "
                              "makes (0.002): computing or accumulating in float16", precision) == "wrong"
    # alternatives: the output's and the final state's words for one mistake
    ignored = MUTANT_CAUSES["initial state ignored"]
    assert classify_diagnosis("the initial state ignored: the final state is ...", ignored) == "right"


def test_bigbird_window_one_block_wider_is_named_beside_the_last_global_block():
    # On the 17-token basic case a window one block wider reaches the last block, as
    # HuggingFace's layout with the last block global does: the two give the same output
    # there, so the diagnosis names both, never the layout alone.
    (m,) = [m for m in variant_mutants("bigbird") if m.name == "bigbird: window one block wider"]
    rows = _audit([m], dtypes=("float32",))
    assert rows and all(r[4] == "right" for r in rows), rows
    basic = [r for r in rows if "last block is global" in r[5]]
    assert basic and all("window one block wider" in r[5] for r in basic), rows


def test_nystrom_iterated_once_more_is_not_named_exact_softmax_at_m_equal_n():
    """Nystromformer's pseudo-inverse iterated 7 times instead of 6 read "exact softmax
    attention where num_landmarks == N (HuggingFace's ...)" on the case m = N = 2: one more
    iteration moves the output towards exact softmax, but the 7-iteration output is the
    closer one, and on a case with m < N exact softmax is no candidate at all. Both counts
    off by one are named, as the count they computed."""
    name = "nystrom"
    todo = [c for c in cases(name, "standard")
            if c.id in ("length:b1h2-q2k2-d32", "basic:b2h3-q17k17-d16")]
    assert len(todo) == 2
    for n in (7, 5):
        kernel = variant_kernel(name, lambda q, k, v, kw, n=n: (q, k, v, {**kw, "pinv_iterations": n}))
        for dtype in ("float32", "float64"):
            outs = [r for r in _failures(kernel, name, dtype, todo) if r.output == "out"]
            assert len(outs) == 2, outs
            for r in outs:
                assert r.diagnosis.startswith(f"the pseudo-inverse is iterated {n} times instead "
                                              f"of 6"), (r.case, dtype, r.diagnosis)
                assert "exact softmax" not in r.diagnosis, r.diagnosis


def _gla_dropping_last_partial_chunk(chunk=64):
    """GLA whose chunk grid covers the full chunks only: the outputs of the last partial
    chunk stay zero."""
    def run(fn, q, k, v, kw):
        out = fn(q, k, v, **kw)
        first, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, None)
        t = first.shape[-2]
        first = first.copy()
        first[..., t - t % chunk:, :] = 0
        return first if rest is None else (first, *rest)
    return variant_kernel("gla", lambda q, k, v, kw: (q, k, v, kw, run))


def test_gla_last_partial_chunk_dropped_is_named_and_at_t_1_with_its_twin():
    """GLA with its last partial chunk of 64 dropped read "the causal mask is off by one:
    it hides the diagonal" at T = 1, where the two mistakes give the same output (zero):
    there both are named, said to be the same; on T = 65 and T = 100 the dropped chunk
    alone, with the tokens it zeroes."""
    name = "gla"
    by_id = {c.id: c for c in cases(name, "standard")}
    kernel = _gla_dropping_last_partial_chunk()
    (one,) = [r for r in _failures(kernel, name, "float32", [by_id["chunks:b2h2-q1k1-d32-causal-tl"]])
              if r.output == "out"]
    for words in ("the causal mask is off by one: it hides the diagonal",
                  "the last partial chunk of each sequence is dropped",
                  "these mistakes give the same output on this case"):
        assert words in one.diagnosis, one.diagnosis
    for cid, tokens in (("chunks:b2h2-q65k65-d32-causal-tl", "64..64"),
                        ("chunks:b2h2-q100k100-d32-causal-tl", "64..99")):
        (row,) = [r for r in _failures(kernel, name, "float32", [by_id[cid]]) if r.output == "out"]
        assert row.diagnosis.startswith("the last partial chunk of each sequence is dropped"), row.diagnosis
        assert f"tokens {tokens} are zero" in row.diagnosis and "causal" not in row.diagnosis, row.diagnosis


@pytest.mark.parametrize("name", ["k", "v"])
@pytest.mark.parametrize("read", ["bnhd", "bhnd", "column-major"])
def test_an_input_read_through_the_wrong_index_arithmetic_is_named(name, read):
    # A C/CUDA kernel reading one raw buffer as another layout (heads and sequence swapped
    # by a stride) or a head's matrix column-major: an independent audit's such kernels
    # failed as "no known mistake"; every failing case now names the input and the read.
    import array_api_compat.numpy as npx
    import numpy as np

    from attn_ref import softmax_attention

    def kernel(q, k, v, *, causal=False, scale=None):
        arrays = {"q": np.asarray(q), "k": np.asarray(k), "v": np.asarray(v)}
        x = arrays[name]
        b, h, n, d = x.shape
        arrays[name] = np.ascontiguousarray(
            np.reshape(np.swapaxes(x, 1, 2), (b, h, n, d)) if read == "bnhd" else
            np.swapaxes(np.reshape(x, (b, n, h, d)), 1, 2) if read == "bhnd" else
            np.swapaxes(np.reshape(x, (b, h, d, n)), -1, -2))
        return softmax_attention(arrays["q"], arrays["k"], arrays["v"], causal=causal, scale=scale,
                                 xp=npx)

    rep = verify(kernel, "softmax", backend="numpy", dtypes=("float32",), suite="quick",
                 causal="both", progress=False)
    words = f"{name} is read column-major" if read == "column-major" else \
        f"{name} is read with its heads and sequence axes swapped"
    assert rep.failures and all(words in r.diagnosis for r in rep.failures), rep.table()


def test_a_state_that_reaches_one_chunk_back_is_named():
    # the hand-over decay between chunks taken as 0: each chunk starts from the previous
    # chunk's own contribution. An audit's JAX retention with that bug read "the error
    # lives only in the last partial query block: rows 32..36 (block size 32)"
    from conformance.mutants import variant_kernel

    def one_back(q, k, v, kw):
        def run(fn, q, k, v, kw):
            rest = {n: x for n, x in kw.items() if n not in ("initial_state", "output_final_state")}
            outs, prev = [], None
            for c0 in range(0, q.shape[-2], 16):
                sl = (..., slice(c0, c0 + 16), slice(None))
                steps = {n: (x[..., c0:c0 + 16] if getattr(x, "ndim", 0) >= 3
                             and x.shape[2] == q.shape[-2] else x) for n, x in rest.items()}
                o, s = fn(q[sl], k[sl], v[sl], initial_state=prev, output_final_state=True, **steps)
                _, prev = fn(q[sl], k[sl], v[sl], output_final_state=True, **steps)
                outs.append(o)
            return np.concatenate(outs, axis=-2)

        return q, k, v, kw, run

    todo = [c for c in cases("retention", "standard") if c.id == "long:b1h1-q1000k1000-d64-causal-tl"]
    rep = verify(variant_kernel("retention", one_back), "retention", backend="numpy",
                 dtypes=("float32",), cases=todo, supports={"final_state": False}, progress=False)
    (row,) = [r for r in rep.results if r.output == "out"]
    assert row.verdict == "fail" and "reaches one chunk of 16 back" in row.diagnosis, rep.table()


def _fails_with_option(variant, name, value):
    """The failing rows of the variant's reference run with option ``name=value`` on the
    first twelve standard cases that need no feature."""
    def change(q, k, v, kw):
        return q, k, v, {**kw, name: value}

    rep = verify(variant_kernel(variant, change), variant, backend="numpy", dtypes=("float32",),
                 cases=[c for c in cases(variant, "standard") if not c.needs][:12], progress=False)
    assert len(rep.failures) >= 8, rep.table()
    return rep.failures


@pytest.mark.parametrize("variant, name, alt", [
    ("linear", "feature_map", "relu"),
    ("linear", "feature_map", "identity"),
    ("performer", "kernel", "trigonometric"),
])
def test_another_named_feature_map_or_kernel_is_named(variant, name, alt):
    """A linear-attention kernel with relu (or identity) features, or a Performer with
    trigonometric features, against the cases' defaults (elu+1, positive) read "no known
    mistake": the variant's other named choices are now tried, and the option that
    declares the kernel's is given."""
    fails = _fails_with_option(variant, name, alt)
    named = [r for r in fails if f"the kernel's {name} is {alt!r}" in r.diagnosis]
    assert len(named) >= len(fails) * 9 // 10, [(r.case, r.diagnosis) for r in fails]
    assert f"options={{{name!r}: {alt!r}}}" in named[0].diagnosis


@pytest.mark.parametrize("variant, name", [("linear", "normalize"), ("routing", "balanced")])
def test_a_boolean_option_the_other_way_is_named(variant, name):
    """Linear attention without its denominator (normalize=False) and routing without
    balanced clusters read "no known mistake" (routing once "the size a plain bfloat16
    implementation makes", in float32): every boolean option of the reference, set or
    default, is now tried the other way."""
    fails = _fails_with_option(variant, name, False)
    words = f"the kernel computes {name}=False where the case asks for {name}=True"
    assert all(words in r.diagnosis for r in fails), [(r.case, r.diagnosis) for r in fails]


def _sdpa_times(factor):
    """PyTorch's SDPA (4-D inputs, the calibration's kernel) with its output times ``factor``."""
    pytest.importorskip("torch")
    from tests.test_conformance_calibration import sdpa

    def kernel(q, k, v, *, causal=False, scale=None):
        return sdpa(q, k, v, is_causal=bool(causal), scale=scale) * factor
    return kernel


@pytest.mark.parametrize("dtype, factor, case_id, before", [
    ("bfloat16", 1.02, "length:b1h2-q31k31-d32", "the kernel accumulates in low precision"),
    ("bfloat16", 1.02, "cross:b1h2-q9k23-d8v12", "no known mistake explains it"),
    ("float16", 1.004, "near-ties:b1h2-q64k64-d32-near_ties", "the kernel accumulates in low precision")])
def test_an_output_a_few_ulps_off_by_one_factor_is_named_where_it_fails_the_rms_bound(
        dtype, factor, case_id, before):
    # Within the largest error's bound and past the RMS one, the factor's output leaves
    # the kernel's own rounding, far more than 1/50 of its error; a change of function
    # (functional) it is named when within both bounds of it with half the RMS error left.
    # Over the standard suite SDPA x 1.02 in bfloat16 is now named on 56 of its 57
    # failing cases (19 before), x 1.004 in float16 on 58 of 59 (49).
    todo = [c for c in cases("softmax", "standard") if c.id == case_id]
    (r,) = verify(_sdpa_times(factor), "softmax", backend="torch", dtypes=(dtype,), cases=todo).results
    assert r.verdict == "fail" and r.max_err <= r.tol_max and r.rms_err > r.tol_rms, r
    assert f"the output is {100 * (factor - 1):.2g} % too large" in r.diagnosis, (before, r.diagnosis)


def test_a_failure_of_the_rms_bound_alone_names_no_rows():
    # No row beyond its own bound: "wrong only on query rows ... (of Nq = 1)" named none.
    # Half a bfloat16 ulp of factor is no factor either (below the dtype's epsilon: a
    # rounding's bias is as large).
    todo = [c for c in cases("softmax", "standard") if c.id == "length1:b1h1-q1k1-d4"]
    (r,) = verify(_sdpa_times(1.004), "softmax", backend="torch", dtypes=("bfloat16",), cases=todo).results
    assert r.verdict == "fail" and r.max_err <= r.tol_max and r.rms_err > r.tol_rms, r
    assert "wrong only on" not in r.diagnosis and "too large" not in r.diagnosis, r.diagnosis
