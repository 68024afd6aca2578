"""The softmax as ``exp(s - logsumexp(s))``: the same function, refused as a baseline form.

``conformance.judging.lse_form`` computes it for the variants whose softmax is taken over
a row of logits (``LSE_VARIANTS``); on rows whose log-sum-exp is large it loses
``eps |lse|`` of every weight where the max-shifted softmax loses nothing, and in the
baseline it would widen the large-logit cases' tolerances 18 to 1230x (docs/
conformance.md, "The softmax as exp(s - logsumexp)"). A kernel whose error is that
form's is failed there, and the diagnosis names the form.
"""

import numpy as np
import pytest

from conformance import cases, verify
from conformance.judging import LSE_VARIANTS, lse_form, prepare, verdict_of

LARGE = "large-logits:b1h2-q64k64-d64-large_logits"
LSE_WORDS = "softmax as exp(s - logsumexp): loses |lse| eps relative; a max-shifted softmax passes"
# softmax's options, each through the lse form: mask, bias, window, soft-cap, GQA, varlen,
# ALiBi, dropout, rows with no key
SOFTMAX_OPTIONS = ["mask:b2h2-q12k19-d8-mask-padding", "bias:b2h2-q65k65-d32-bias",
                   "window:b1h2-q65k129-d32-window0x5", "softcap:b2h2-q65k65-d32-bias-softcap5",
                   "gqa:b2h6-q63k63-d32-mask-random-kv_heads3",
                   "varlen:b3h2-q64k64-d32-causal-br-seqlens_q5x64x33-seqlens_k5x64x33",
                   "alibi:b2h4-q65k65-d32-causal-br", "dropout:b1h2-q65k129-d32-causal-br-dropout_p0.5",
                   "fully-masked:b2h2-q33k47-d32-mask-fully_masked_rows"]


def _case(variant, case_id):
    return next(c for c in cases(variant, "standard") if c.id == case_id)


def _float64_error(variant, case_id, fn):
    """``fn``'s max error against the golden in float64, and the case's tolerance."""
    prep = prepare(_case(variant, case_id), variant, "float64")
    out = prep.apply_semantics(prep.reference("float64", fn=fn))
    return float(np.max(np.abs(out - prep.golden))), prep.tol_max


def _dense(q, k, v, /, *, scale=None, xp=None, **_pattern):
    """The lse form of plain softmax, the variant's pattern and causal dropped."""
    return lse_form("softmax")(q, k, v, scale=scale, xp=xp)


@pytest.mark.parametrize("variant", LSE_VARIANTS)
@pytest.mark.parametrize("case_id", ["range:b3h5-q37k37-d16-kv1x5", "causal:b2h1-q65k65-d32-causal-br"])
def test_the_lse_form_is_the_variants_function(variant, case_id):
    # in float64 it is the golden to rounding; without the variant's pattern it is not
    err, tol = _float64_error(variant, case_id, lse_form(variant))
    assert err <= tol, (err, tol)
    if variant not in ("softmax", "online_softmax") or "causal" in case_id:
        err, tol = _float64_error(variant, case_id, _dense)
        assert err > 100 * tol, (variant, err, tol)


@pytest.mark.parametrize("case_id", SOFTMAX_OPTIONS)
def test_the_lse_softmax_takes_every_softmax_option(case_id):
    err, tol = _float64_error("softmax", case_id, lse_form("softmax"))
    assert err <= tol, (err, tol)


def test_lse_form_refuses_a_variant_it_does_not_compute():
    with pytest.raises(ValueError, match=r"lse_form takes a variant of \('softmax'.*got 'linear'"):
        lse_form("linear")


def _numpy_kernel(variant, factor=1.0):
    """A NumPy kernel with the variant's signature computing its lse form in the inputs'
    dtype, the output times ``factor``."""
    import inspect

    import array_api_compat.numpy as npx

    from attn_ref.registry import get

    fn = lse_form(variant)

    def kernel(q, k, v, **kw):
        kw.pop("xp", None)
        out = np.asarray(fn(q, k, v, xp=npx, **kw))
        return out * out.dtype.type(factor)

    kernel.__signature__ = inspect.signature(get(variant).fn)
    return kernel


def _rows(kernel, variant, ids, dtypes, seed=0, backend="numpy", **kw):
    chosen = [_case(variant, i) for i in ids]
    rep = verify(kernel, variant, backend=backend, dtypes=dtypes, cases=chosen, progress=False,
                 time_limit=None, seed=seed, **kw)
    return [r for r in rep.results if r.verdict != "n/a"]


@pytest.mark.parametrize(("variant", "dtype", "at_least"),
                         [("softmax", "float32", 50), ("softmax", "float64", 3), ("local", "float64", 50),
                          ("local", "float32", 5)])
def test_a_kernel_computing_the_lse_form_fails_the_large_logits_and_is_named(variant, dtype, at_least):
    # measured, seed 0: ratio 97 (softmax, float32), 5.4 (softmax, float64), 142 and 14 (local)
    (row,) = _rows(_numpy_kernel(variant), variant, [LARGE], (dtype,))
    assert row.verdict == "fail" and row.ratio > at_least, (row.ratio, row.diagnosis)
    assert row.diagnosis.startswith(LSE_WORDS), row.diagnosis
    # the same kernel passes the ordinary cases
    rows = _rows(_numpy_kernel(variant), variant, ["basic:b2h3-q17k17-d16",
                                                             "causal:b2h1-q65k65-d32-causal-tl"], (dtype,),
                 causal="both")
    assert rows and all(r.verdict == "pass" for r in rows), [(r.case, r.ratio) for r in rows]


def test_a_max_shifted_kernel_off_by_more_is_not_named_the_lse_form():
    # output x (1 + 1e-4) on the large-logit case errs 3.4x the lse form (ratio 333 against
    # 97): a size the form does not make, so the diagnosis does not name it
    (row,) = _rows(_numpy_kernel("softmax", 1.0001), "softmax", [LARGE], ("float32",))
    assert row.verdict == "fail"
    assert LSE_WORDS not in row.diagnosis, row.diagnosis


def test_the_lse_form_in_the_baseline_would_let_a_planted_error_through():
    # Why it is no baseline form: its error, times the tolerance's fudge factors, is a
    # bound that a max-shifted kernel with its output 1e-5 too large stays under on the
    # large-logit case (float32, seed 0), where the present bound fails it 33x.
    from conformance.tolerance import measure

    prep = prepare(_case("softmax", LARGE), "softmax", "float32")
    out = prep.apply_semantics(prep.reference("float32", fn=lse_form("softmax")))
    lse = measure(out, prep.golden, prep.keep)
    planted = measure(prep.reference("float32") * (1 + 1e-5), prep.golden, prep.keep)
    verdict, _, ratio = verdict_of(planted, prep.tol_max, prep.tol_rms)
    assert verdict == "fail" and ratio > 10, ratio
    t = prep.tolerance
    assert planted.max_err < t.fudge * lse.max_err and planted.rms_err < t.fudge_rms * lse.rms_err


def _chunks(num_blocks):
    # LocalSelfAttention's layout: block a sees blocks a and a - 1 (block 0 the last one)
    return tuple(tuple(b in (a, (a - 1) % num_blocks) for b in range(num_blocks)) for a in range(num_blocks))


@pytest.mark.parametrize(("seed", "dtype"), [(0, "float64"), (2, "float32")])
def test_huggingface_local_self_attention_one_hot_passes_as_a_dense_kernel(seed, dtype, monkeypatch):
    # transformers' Reformer LocalSelfAttention computes exp(s - logsumexp(s)); on one-hot
    # rows (|lse| ~ 280) it failed by 1.06 (seed 0, float64) and 1.25 (seed 2, float32)
    # while block_sparse's only baselines were its efficient forms, whose logits (products
    # over gathered blocks) NumPy sums more exactly than a BLAS product of the whole
    # matrix. A plain dense kernel (eager masked attention, max-shifted) failed such cases
    # at 1.15-1.73; with the dense masked softmax among the forms (conformance.judging,
    # _dense_form) both pass: HuggingFace's at 0.62 and 0.45. Without that form the old
    # verdict, and the lse form's diagnosis, come back.
    pytest.importorskip("torch")
    from conformance import judging
    from tests.test_conformance_thirdparty import hf_local_kernel

    def row():
        (r,) = _rows(hf_local_kernel, "block_sparse", ["one-hot:b1h2-q65k65-d64-one_hot"], (dtype,),
                     seed=seed, backend="torch", options={"layout": _chunks(5), "block_size": 16},
                     supports={"value_dim": False, "scale": False})
        return r

    assert row().verdict == "pass"
    monkeypatch.setitem(judging.FORMS, "block_sparse", tuple(
        f for f in judging.FORMS["block_sparse"] if f.name != "dense masked softmax"))
    r = row()
    assert r.verdict == "fail", r.ratio
    assert r.diagnosis.startswith(LSE_WORDS), r.diagnosis


def _half_lse_kernel(q, k, v, *, causal=False, scale=None):
    """``exp(S - logsumexp(S)) V`` on half tensors, every step in their dtype (HuggingFace's
    Reformer attentions, trax): the log-sum-exp rounded to the dtype."""
    import torch

    s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return torch.exp(s - torch.logsumexp(s, dim=-1, keepdim=True)) @ v


@pytest.mark.parametrize("dtype, case_id", [
    ("bfloat16", "basic:b2h3-q17k17-d16"), ("bfloat16", "causal:b1h2-q13k21-d8-causal-tl"),
    ("float16", "length:b1h2-q31k31-d32")])
def test_a_half_precision_kernel_rounding_its_log_sum_exp_is_named(dtype, case_id):
    # Over the standard suite this kernel failed 59 bfloat16 and 62 float16 cases and read
    # "accumulates in low precision" or "no known mistake" on 55 of each; now the form is
    # named on 55 and 57 (a one-row case reads as a factor on the output, which it is)
    pytest.importorskip("torch")
    (r,) = verify(_half_lse_kernel, "softmax", backend="torch", dtypes=(dtype,),
                  cases=[_case("softmax", case_id)], causal="top-left").results
    assert r.verdict == "fail" and r.diagnosis.startswith(LSE_WORDS), r.diagnosis
    assert f"in {dtype}, the log-sum-exp rounded to it" in r.diagnosis, r.diagnosis


def test_a_float16_accumulator_as_large_as_the_lse_form_is_not_named_it():
    # P V and the row sum accumulated in float16 16 keys at a time err as much as the
    # form on the N = 1000 rows (within 2x), but not in its direction: by size alone 5 of
    # its 8 failing standard cases read as the form
    import functools

    from conformance.mutants import low_precision_accumulating_kernel

    (r,) = verify(functools.partial(low_precision_accumulating_kernel, block=16), "softmax",
                  backend="numpy", dtypes=("float16",),
                  cases=[_case("softmax", "long:b1h1-q1000k1000-d64")]).results
    assert r.verdict == "fail" and r.diagnosis.startswith("the kernel accumulates in low precision"), \
        r.diagnosis
