"""conformance cases and diagnoses: batch, head and length ranges (issue 14 items 2 and 8).

The standard suite must reach the indices and lengths kernels get wrong (batch entries
>= 2, heads >= 4, keys past 1024 and 2048), for every feature set a kernel may declare;
the structural mutants of :mod:`conformance.mutants` must fail it. A diagnosis names a
mistake only when the mistake reproduces the kernel's output: every mutant is run
against every other mutant's signature, and no failure may be named for a mistake
other than its own. Oracle runs are NumPy-only and use short case lists.
"""

import numpy as np
import pytest

from conformance import Case, cases, verify
from conformance.catalogue import CATALOGUE, case_strategy
from conformance.mutants import MUTANTS, STRUCTURAL, correct_kernel, structural_cases
from conformance.oracle import search, session

FULL = {"causal": "both", "supports": {"broadcast": True}, "progress": False}

# feature sets a kernel may declare alone (None: no feature), with the causal alignment
FEATURE_SETS = [
    ((), None), (("mask",), None), (("bias",), None), (("scale",), None),
    (("causal",), "top-left"), (("causal",), "bottom-right"), (("value_dim",), None),
    (("broadcast",), None),
]


def _range_case(needs, causal):
    return [c for c in cases(None, "standard") if c.needs == frozenset(needs)
            and c.causal == causal and c.batch[0] >= 3 and c.batch[1] >= 5]


# ------------------------------------------------------------------- the catalogue


@pytest.mark.parametrize("needs,causal", FEATURE_SETS, ids=lambda x: str(x))
def test_standard_reaches_batch_3_and_5_heads_for_every_feature_set(needs, causal):
    # a kernel declaring only these features still meets batch index 2 and head index 4
    assert _range_case(needs, causal), (needs, causal)


def test_standard_reaches_long_keys_and_unequal_long_lengths():
    std = cases(None, "standard")
    assert any(c.nk >= 4096 and c.causal is None for c in std)
    # bottom-right: the last query sees every key, so keys past any buffer count
    assert any(c.nk >= 4096 and c.causal == "bottom-right" for c in std)
    assert any(c.nq > c.nk >= 1000 for c in std) and any(c.nk > c.nq >= 1000 for c in std)
    # the long cases need no feature, so every kernel takes the non-causal ones
    assert any(c.nk >= 4096 and not c.needs for c in std)
    assert {c.id for c in structural_cases()} <= {c.id for c in CATALOGUE["standard"]}
    # a key buffer of 1024 must not coincide with a dropped tail block of 16..256
    for c in std:
        if 1024 < c.nk < 2048:
            assert all((c.nk // bs) * bs != 1024 for bs in (16, 32, 64, 128, 256)), c.id


def test_search_draws_batch_up_to_4_and_heads_up_to_8():
    from hypothesis import HealthCheck, Phase, find, settings
    from hypothesis.errors import NoSuchExample

    opts = settings(max_examples=300, database=None, derandomize=True, phases=(Phase.generate,),
                    suppress_health_check=list(HealthCheck))
    assert find(case_strategy(), lambda c: c.batch == (4, 8), settings=opts).batch == (4, 8)
    with pytest.raises(NoSuchExample):
        find(case_strategy(), lambda c: c.batch[0] > 4 or c.batch[1] > 8, settings=opts)


def test_search_finds_a_kernel_wrong_only_on_heads_past_the_fourth():
    heads = next(m for m in STRUCTURAL if "heads" in m.name)
    sess = session(heads.kernel, "softmax", backend="numpy", diagnose=False, causal="both",
                   supports={"broadcast": True})
    res = search(sess, "float32", 40)
    assert res is not None and res.verdict == "fail"
    assert "-b1h5-" in f"-{res.case.split(':')[1]}"  # shrunk to the smallest failing shape


# ------------------------------------------------------- structural mutants fail standard


def test_correct_kernel_passes_the_range_cases():
    for dt in ("float32", "float64"):
        rep = verify(correct_kernel, "softmax", backend="numpy", dtypes=(dt,),
                     cases=structural_cases(), **FULL)
        assert rep.passed and rep.counts["n/a"] == 0, rep.table()


@pytest.mark.parametrize("mutant", STRUCTURAL, ids=lambda m: m.name)
def test_structural_mutants_fail_standard_for_every_feature_set(mutant):
    rep = verify(mutant.kernel, "softmax", backend="numpy", cases=structural_cases(),
                 diagnose=False, **FULL)
    failed = {r.case for r in rep.failures}
    assert failed  # the standard suite holds these cases: it fails
    if "buffer" in mutant.name:
        long = [c for c in structural_cases() if c.nk >= 4096]
        assert {c.causal for c in long} == {None, "bottom-right"}
        assert all(c.id in failed for c in long), failed  # causal and not
        if "1024" in mutant.name:
            assert any(c.nk < 2048 and c.nq != c.nk and c.id in failed for c in structural_cases())
        return
    for needs, causal in FEATURE_SETS:
        for c in _range_case(needs, causal):
            if "batch" in mutant.name and c.kv_batch and c.kv_batch[0] == 1:
                continue  # keys and values broadcast over the batch: nothing to misread
            assert c.id in failed, (c.id, sorted(failed))


# ------------------------------------------------------------------------ diagnoses

# every mutant against every signature: quick cases plus a few that reach the new
# signatures cheaply (batch 3 x 5 heads, keys past 1024 and 2048, large logits there)
CROSS = cases(None, "quick") + [
    Case("range", (3, 5), 37, 37, 16, 16),
    Case("range", (3, 5), 29, 37, 16, 16, causal="bottom-right", mask="random", bias=True),
    Case("long", (1, 2), 8, 1300, 16, 16),
    Case("long", (1, 1), 9, 2100, 16, 16, causal="bottom-right"),
    Case("long", (1, 1), 8, 2100, 16, 16, dist="large_logits"),
    # mistakes that coincide here must both be named: a dropped last key and a diagonal
    # placed for the shorter length hide the diagonal, as a causal mask off by one does;
    # with one query, the other alignment sees every key, as an ignored causal mask does
    Case("causal", (2, 1), 65, 65, 32, 32, causal="bottom-right"),
    Case("causal", (2, 1), 1, 100, 32, 32, causal="top-left"),
    # Q K^T of float32 inputs overflows float16 here (|q.k| ~ 1e4 sqrt(d))
    Case("large-logits", (1, 2), 64, 64, 64, 64, dist="large_logits"),
]
# what a failure may say when it names no mistake: a container check or no explanation
NEUTRAL = ("no known mistake explains it", "kernel raised", "output shape")
SOFTMAX_MUTANTS = [m for m in MUTANTS if getattr(m, "variant", "softmax") == "softmax"]


@pytest.mark.parametrize("mutant", SOFTMAX_MUTANTS, ids=lambda m: m.name)
def test_no_mutant_is_named_for_another_mistake(mutant):
    own = None if mutant in STRUCTURAL else mutant.options.get("cases")
    opts = {**FULL, **{k: v for k, v in mutant.options.items() if k != "cases"}}
    rep = verify(mutant.kernel, "softmax", backend="numpy", cases=own or CROSS, **opts)
    assert rep.failures
    assert any(mutant.expect in r.diagnosis for r in rep.failures), rep.table()
    wrong = [(r.case, r.diagnosis) for r in rep.failures
             if mutant.expect not in r.diagnosis and not r.diagnosis.startswith(NEUTRAL)]
    assert not wrong, wrong


def _prepared_failure(kernel, case, dtype="float32"):
    rep = verify(kernel, "softmax", backend="numpy", dtypes=(dtype,), cases=[case], **FULL)
    assert not rep.passed, rep.table()
    return rep.failures[0].diagnosis


def test_overflow_and_underflow_are_told_apart_on_the_same_row_set():
    no_max = next(m for m in MUTANTS if m.name == "no max-subtraction").kernel
    tile = next(m for m in MUTANTS if "tile" in m.name).kernel
    # two keys of logits ~ +-1e4: rows with a positive logit overflow, rows with both
    # negative underflow on both keys
    c = Case("two-keys", (1, 4), 16, 2, 8, 8, dist="large_logits")

    def unguarded(q, k, v):  # exp(s) / sum(exp(s)): inf / inf and 0 / 0 both give NaN
        e = np.exp(q @ np.swapaxes(k, -1, -2) / np.float32(np.sqrt(q.shape[-1])))
        return (e / e.sum(-1, keepdims=True)) @ v

    words = _prepared_failure(unguarded, c)
    assert "exp() overflows" in words and "0/0 from underflow" in words
    assert "row maximum is not subtracted" in words
    # the mutant guards its division: the underflowing rows are zeros, only overflow NaNs
    words = _prepared_failure(no_max, c)
    assert "exp() overflows" in words and "0/0" not in words
    words = _prepared_failure(tile, c)
    assert "0/0 from underflow" in words and "overflow" not in words
    assert "maximum over all queries of the head" in words


def test_nan_elsewhere_is_not_blamed_on_exp():
    def nan_in_row_3(q, k, v, *, mask=None, bias=None, causal=False, scale=None):
        out = correct_kernel(q, k, v, mask=mask, bias=bias, causal=causal, scale=scale)
        out[..., 3, :] = np.nan
        return out

    words = _prepared_failure(nan_in_row_3, Case("x", (1, 2), 16, 16, 8, 8, dist="large_logits"))
    assert "overflow" not in words and "underflow" not in words
    assert "NaN in 2 rows, first at (batch, head, query) = (0, 0, 3)" in words


def test_a_mistake_that_explains_most_but_not_all_of_the_error_is_not_named():
    # 90 % of the way to keys and values swapped: the swap leaves 1/9 of the error
    # unexplained, more than the 1/50 a named mistake may leave
    def mostly_swapped(q, k, v, *, mask=None, bias=None, causal=False, scale=None):
        kw = dict(mask=mask, bias=bias, causal=causal, scale=scale)
        return 0.1 * correct_kernel(q, k, v, **kw) + 0.9 * correct_kernel(q, v, k, **kw)

    for c in (CROSS[0], CROSS[-8]):
        words = _prepared_failure(mostly_swapped, c)
        assert words.startswith("no known mistake explains it"), words


def test_scale_off_by_a_percent_is_fitted_not_called_precision():
    # the case: 1 % at d > 128, which used to read as bfloat16 rounding
    k = next(m for m in MUTANTS if m.name == "scale 1 % too large").kernel
    for dt in ("float32", "float64"):
        words = _prepared_failure(k, Case("headdim", (1, 2), 33, 33, 256, 256), dt)
        assert "the logit scale is 1 % too large" in words and "precision" not in words, words
    # 3 % too small, on an explicit scale
    def small(q, k, v, *, mask=None, bias=None, causal=False, scale=None):
        return correct_kernel(q, k, v, mask=mask, bias=bias, causal=causal, scale=scale * 0.97)

    words = _prepared_failure(small, Case("scale", (1, 2), 33, 33, 32, 32, scale=0.2))
    assert "the logit scale is 3 % too small" in words and "scale 0.194 " in words, words


def test_batch_entries_and_heads_are_named():
    def clamped(q, k, v, *, mask=None, bias=None, causal=False, scale=None):
        out = correct_kernel(q, k, v, mask=mask, bias=bias, causal=causal, scale=scale)
        out[2:, 4:] = 0  # a grid of two batch entries x four heads, the rest never written
        return out

    words = _prepared_failure(clamped, Case("bh", (4, 8), 9, 11, 8, 8))
    assert ("wrong only on batch entries 2..3 (of B = 4) and heads 4..7 (of H = 8)" in words
            and "all zeros (never written)" in words), words


def test_keys_past_a_buffer_are_not_called_a_tail_block_or_precision():
    buf = next(m for m in STRUCTURAL if "1024" in m.name).kernel
    for c in (Case("long", (1, 1), 8, 1300, 16, 16), Case("long", (1, 1), 8, 4096, 16, 16)):
        words = _prepared_failure(buf, c)
        assert words.startswith("keys beyond the first 1024 are ignored"), words
        assert "partial key block" not in words and "precision" not in words
    # a cut that coincides with a dropped tail block names both
    words = _prepared_failure(buf, Case("long", (1, 1), 8, 1100, 16, 16))
    assert "keys beyond the first 1024" in words and "last partial key block" in words, words
