"""conformance.extras: a kernel's log-sum-exp, judged on its own row.

The promises: a correct FlashAttention-style kernel returning ``(out, lse)`` passes,
with an ``lse`` row per case; a wrong base, a scale applied twice, a 1e-3 relative bias
and +inf/NaN on rows that see no key each fail, diagnosed by name; a split-KV kernel
that merges three chunk partials passes; a declared lse that is missing fails; a tuple
whose second element is not an lse is left alone, as before.
"""

import math

import numpy as np
import pytest

from attn_ref import merge_attention, partial_attention
from conformance import cases, verify
from conformance.extras import lse_golden, lse_tolerance
from conformance.judging import prepare


def _logits(q, k, mask, causal, scale):
    s = (q @ np.swapaxes(k, -1, -2)) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    if causal:
        nq, nk = s.shape[-2:]
        s = np.where(np.triu(np.ones((nq, nk), bool), 1), -np.inf, s)
    return s


def flash(q, k, v, *, mask=None, bias=None, causal=False, scale=None):
    """A FlashAttention-style NumPy kernel: ``(out, lse)``, ``lse = -inf`` on empty rows."""
    s = _logits(q, k, mask, causal, scale)
    if bias is not None:
        s = s + bias
    m = np.max(s, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m)
    denom = p.sum(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = (m + np.log(denom))[..., 0]
    out = (p / np.where(denom > 0, denom, 1)) @ v
    return out.astype(q.dtype), lse.astype(q.dtype)


def _mutant(change):
    def kernel(q, k, v, *, mask=None, bias=None, causal=False, scale=None):
        out, lse = flash(q, k, v, mask=mask, bias=bias, causal=causal, scale=scale)
        return out, change(lse, q=q, k=k, v=v, mask=mask, bias=bias, causal=causal, scale=scale)
    return kernel


def _twice(lse, *, q, k, v, mask, bias, causal, scale):
    sc = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    return flash(q, k, v, mask=mask, bias=bias, causal=causal, scale=sc * sc)[1]


MUTANTS = {
    "base 2": (_mutant(lambda lse, **_: lse / np.log(2).astype(lse.dtype)), "lse in base 2"),
    "scale twice": (_mutant(_twice), "the scale applied twice"),
    "relative bias": (_mutant(lambda lse, **_: lse * lse.dtype.type(1 + 1e-3)),
                      "systematic relative bias of +0.001"),
    # FlashAttention 2's final lse, undeclared (declared, it passes: below)
    "+inf rows": (_mutant(lambda lse, **_: np.where(np.isneginf(lse), np.inf, lse)),
                  "+inf on 8 row(s) that see no key"),
    "NaN rows": (_mutant(lambda lse, **_: np.where(np.isneginf(lse), np.nan, lse)),
                 "NaN on 8 row(s) that see no key"),
}


def _lse_rows(report):
    return [r for r in report.results if r.output == "lse"]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_correct_kernel_returning_lse_passes_with_an_lse_row_per_case(dtype):
    report = verify(flash, backend="numpy", dtypes=(dtype,), suite="quick", progress=False)
    assert report.passed, report.table()
    rows = _lse_rows(report)
    ran = [r for r in report.results if r.output == "out" and r.verdict != "n/a"]
    assert len(rows) == len(ran) > 5
    # The bound is not slack: the correct kernel uses a real part of it somewhere.
    assert max(r.ratio for r in rows) > 1e-3


@pytest.mark.parametrize("name", list(MUTANTS))
def test_each_lse_bug_class_fails_and_is_named(name):
    kernel, words = MUTANTS[name]
    report = verify(kernel, backend="numpy", dtypes=("float32",), suite="quick", progress=False)
    assert not report.passed
    bad = [r for r in _lse_rows(report) if r.verdict != "pass"]
    assert bad and all(r.verdict == "fail" for r in bad)
    # The output rows are untouched: the fault is the lse's alone.
    assert all(r.verdict in ("pass", "n/a") for r in report.results if r.output == "out")
    assert any(words in r.diagnosis for r in bad), [r.diagnosis for r in bad]
    if name.endswith("rows"):
        assert {r.case for r in bad} == {r.case for r in _lse_rows(report) if "fully" in r.case}
    else:
        assert all(words in r.diagnosis for r in bad if "length1:b1h1-q1k1" not in r.case)


def _flash32(lse_dtype):
    """``flash`` computed in float32 whatever the input dtype; the lse returned in ``lse_dtype``."""
    def kernel(q, k, v, *, mask=None, bias=None, causal=False, scale=None):
        out, lse = flash(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32),
                         mask=mask, bias=None if bias is None else bias.astype(np.float32),
                         causal=causal, scale=scale)
        return out.astype(q.dtype), lse.astype(lse_dtype)
    return kernel


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_an_lse_returned_in_float16_fails_and_is_named(dtype):
    # Before: the stored value's term was one ulp in the dtype the kernel returned, so an
    # lse rounded to float16 (up to 0.0005 |lse| off, which a split-KV merge's weights
    # exp(lse_i - lse) inherit) passed every case of the standard suite in float32 and
    # float16. Its term is now float32's at the coarsest, as FlashAttention stores it.
    good = verify(_flash32(np.float32), backend="numpy", dtypes=(dtype,), suite="quick", progress=False)
    assert good.passed, good.table()
    bad = verify(_flash32(np.float16), backend="numpy", dtypes=(dtype,), suite="quick", progress=False)
    lse, out = _lse_rows(bad), [r for r in bad.results if r.output == "out"]
    assert {r.verdict for r in out} <= {"pass", "n/a"}, bad.table()
    failed = [r for r in lse if r.verdict == "fail"]
    assert len(failed) >= len(lse) - 1 and len(failed) >= 8, bad.table()
    assert all("the lse returned in float16" in r.diagnosis for r in failed), bad.table()


def test_flash_attention_2s_plus_inf_rows_pass_when_declared_and_only_then():
    fa2 = MUTANTS["+inf rows"][0]
    report = verify(fa2, backend="numpy", dtypes=("float32",), suite="quick", progress=False,
                    supports={"lse": "+inf"})
    assert report.passed, report.table()
    assert any("fully" in r.case for r in _lse_rows(report))
    # declared, the -inf = log 0 kernel contradicts it; NaN still fails
    for kernel, words in ((flash, "-inf on 8 row(s)"), (MUTANTS["NaN rows"][0], "NaN on 8 row(s)")):
        report = verify(kernel, backend="numpy", dtypes=("float32",), suite="quick",
                        progress=False, supports={"lse": "+inf"})
        bad = [r for r in _lse_rows(report) if r.verdict != "pass"]
        assert bad and all(words in r.diagnosis for r in bad), [r.diagnosis for r in bad]
    with pytest.raises(TypeError, match="'\\+inf'"):
        verify(flash, backend="numpy", dtypes=("float32",), suite="quick", progress=False,
               supports={"lse": "inf"})


def test_the_tolerance_separates_a_one_ulp_scale_bias_from_rounding():
    # lse is a few units here; a 1e-3 relative bias is ~100x the per-row bound.
    prep = prepare(next(c for c in cases("softmax", "quick") if c.id.startswith("basic")),
                   "softmax", "float32")
    golden = lse_golden(prep)
    tol = lse_tolerance(prep, golden, "float32")
    assert np.all(tol < 1e-3 * np.abs(golden) / 10)
    assert np.all(tol > 4 * np.spacing(np.abs(golden).astype(np.float32)))


def test_split_kv_kernel_merging_three_chunks_passes():
    def split_kv(q, k, v, *, mask=None, causal=False, scale=None):
        n = k.shape[-2]
        cuts = [0, n // 3, 2 * n // 3, n]
        parts = [partial_attention(q, k[..., a:b, :], v[..., a:b, :], causal=causal,
                                   key_offset=a, scale=scale,
                                   mask=None if mask is None else mask[..., a:b])
                 for a, b in zip(cuts, cuts[1:])]
        return merge_attention(parts)

    report = verify(split_kv, backend="numpy", dtypes=("float32", "float64"), suite="quick",
                    progress=False)
    assert report.passed, report.table()
    assert len(_lse_rows(report)) > 5

    def wrong_merge(q, k, v, **kw):
        out, lse = split_kv(q, k, v, **kw)
        # averaging the chunk outputs instead of weighting them by exp(lse_i - lse)
        n = k.shape[-2]
        cuts = [0, n // 3, 2 * n // 3, n]
        outs = [partial_attention(q, k[..., a:b, :], v[..., a:b, :], scale=kw.get("scale"))[0]
                for a, b in zip(cuts, cuts[1:]) if b > a]
        return sum(outs) / len(outs), lse

    bad = verify(wrong_merge, backend="numpy", dtypes=("float32",), suite="quick", progress=False)
    assert not bad.passed


def _merge_from(reference):
    """Split-KV over chunks of 256 keys, merged with weights exp(lse_r - ref): ``ref`` the
    largest partial lse (``"max"``) or the first one (``"first"``, a merge that is exact
    in real arithmetic and overflows when a later chunk's lse is ~90 above the first's)."""
    def kernel(q, k, v, *, scale=None):
        n = k.shape[-2]
        cuts = list(range(0, n, 256)) + [n]
        outs, lses = zip(*(partial_attention(q, k[..., a:b, :], v[..., a:b, :], scale=scale)
                           for a, b in zip(cuts, cuts[1:])))
        lses = np.stack(lses)
        ref = lses.max(0) if reference == "max" else lses[0]
        with np.errstate(over="ignore", invalid="ignore"):
            w = np.exp(lses - ref)
            den = w.sum(0)
            out = sum(wi[..., None] * o for wi, o in zip(w, outs)) / den[..., None]
        lse = (ref + np.log(den)).astype(np.float32 if q.dtype != np.float64 else q.dtype)
        return out.astype(q.dtype), lse
    return kernel


def test_a_split_kv_merge_weighted_from_the_first_partial_fails_on_large_logits():
    # Before: every large-logits case had at most 64 keys (one chunk), so a merge whose
    # weights are exp(lse_r - lse_0) passed the standard suite in float32 and bfloat16: it
    # is exact until a later chunk's lse exceeds the first's by ~88 (float32's exp range).
    many = _case_ids(lambda c: c.dist == "large_logits" and c.nk >= 1000)
    assert many == ["large-logits:b1h2-q16k1000-d32-large_logits"]
    chosen = [c for c in cases("softmax", "standard") if c.id in many]
    good = verify(_merge_from("max"), backend="numpy", dtypes=("float32",), cases=chosen, progress=False)
    assert good.passed and len(_lse_rows(good)) == 1, good.table()
    bad = verify(_merge_from("first"), backend="numpy", dtypes=("float32",), cases=chosen, progress=False)
    out = [r for r in bad.results if r.output == "out"]
    assert [r.verdict for r in out] == ["fail"] and "NaN" in out[0].diagnosis, bad.table()


def _case_ids(pred):
    return [c.id for c in cases("softmax", "standard") if pred(c)]


def test_a_declared_lse_that_is_missing_or_misshapen_fails():
    def out_only(q, k, v, *, mask=None, causal=False, scale=None):
        return flash(q, k, v, mask=mask, causal=causal, scale=scale)[0]

    report = verify(out_only, backend="numpy", supports={"lse": True}, suite="quick", progress=False)
    bad = [r for r in _lse_rows(report) if r.verdict == "fail"]
    assert bad and "declared supports={'lse': True} but the kernel returned no lse" in bad[0].diagnosis

    def keepdims(q, k, v, *, mask=None, causal=False, scale=None):
        out, lse = flash(q, k, v, mask=mask, causal=causal, scale=scale)
        return out, lse[..., None]

    report = verify(keepdims, backend="numpy", supports={"lse": True}, suite="quick", progress=False)
    assert not report.passed
    assert any("lse shape" in r.diagnosis and "expected" in r.diagnosis for r in _lse_rows(report))


def test_a_tuple_with_something_else_second_is_left_alone_and_a_dict_is_read_by_name():
    def with_weights(q, k, v, *, mask=None, causal=False, scale=None):
        s = _logits(q, k, mask, causal, scale)
        return flash(q, k, v, mask=mask, causal=causal, scale=scale)[0], s

    report = verify(with_weights, backend="numpy", suite="quick", progress=False)
    assert report.passed and not _lse_rows(report)

    def as_dict(q, k, v, *, mask=None, causal=False, scale=None):
        out, lse = flash(q, k, v, mask=mask, causal=causal, scale=scale)
        return {"out": out, "lse": lse * 2}

    report = verify(as_dict, backend="numpy", suite="quick", progress=False)
    assert not report.passed and all(r.verdict == "fail" for r in _lse_rows(report)
                                     if r.verdict != "n/a" and "q1k1" not in r.case)
    with pytest.raises(TypeError, match=r"supports\['lse'\] \(an extra output\) must be True, False"):
        verify(flash, backend="numpy", supports={"lse": "yes"}, suite="quick", progress=False)


def test_lse_layouts():
    # FlashAttention's softmax_lse is (B, H, Nq) whatever the layout of out.
    def bnhd(q, k, v, *, mask=None, causal=False, scale=None):
        t = lambda x: np.swapaxes(x, 1, 2)  # noqa: E731
        out, lse = flash(t(q), t(k), t(v), mask=mask, causal=causal, scale=scale)
        return t(out), lse

    assert verify(bnhd, backend="numpy", layout="bnhd", suite="quick", progress=False).passed

    def nd(q, k, v, *, mask=None, causal=False, scale=None):
        return flash(q, k, v, mask=mask, causal=causal, scale=scale)

    report = verify(nd, backend="numpy", layout="nd", suite="quick", progress=False)
    assert report.passed and _lse_rows(report)


def test_torch_flash_style_kernel_passes():
    torch = pytest.importorskip("torch")

    def fa(q, k, v, *, mask=None, causal=False, scale=None):
        s = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
        if mask is not None:
            s = s.masked_fill(~mask, -math.inf)
        if causal:
            nq, nk = s.shape[-2:]
            s = s.masked_fill(torch.ones(nq, nk, dtype=torch.bool).triu(1), -math.inf)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0)[..., None])
        return p @ v, lse

    report = verify(fa, backend="torch", dtypes=("float32", "float64"), suite="quick", progress=False)
    assert report.passed, report.table()
    assert _lse_rows(report)
