"""conformance reach: variant options, kernel declarations, the n/a footer, CLI and plugin.

Two kernels written here from their sources calibrate the options (``docs/conformance.md``,
"Variant options"): a recurrent, causal-by-construction linear attention that computes
the same function as flash-linear-attention's ``naive_recurrent_linear_attn``
(``fla/ops/linear_attn/naive.py``: identity feature map, float32 state, ``normalize``
divides by ``q . cumsum(k) + 1e-10``), and FAVOR+ from Choromanski et al. (ICLR 2021),
positive random features with the max-stabiliser. Each check that a kernel passes comes
with kernels a little wrong in the way the check is about, which must fail.
"""

import json
import math
import os
import re

import numpy as np
import pytest

from conformance import Case, cases, prepare, verify
from conformance.calling import KernelNotFound, load_kernel, parse_options
from conformance.judging import option_names, with_options
from conformance.mutants import correct_kernel
from conformance.report import na_reason
from tests.helpers import run_plugin

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLA_OPTIONS = {"feature_map": "identity", "normalize": True}
# fla's recurrent kernel: causal, one sequence length for q, k and v, (B, T, H, K) layout
FLA_SUPPORTS = {"causal": "always", "cross": False}


# ------------------------------------------------------------------ kernels under test


def recurrent_linear(q, k, v, *, scale=None, normalize=False):
    """Causal linear attention by its recurrence ``S_t = S_{t-1} + k_t v_t^T``.

    ``(B, T, H, K)`` layout, float32 state whatever the input dtype, ``o_t = S_t^T q_t
    scale``; ``normalize`` divides by ``scale q_t . sum_{s <= t} k_s + 1e-10``.
    Returns ``(o, None)`` (output, final state) as fla does.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dtype = q.dtype
    q, k, v = (np.asarray(x, dtype=np.float32) for x in (q, k, v))
    state = np.zeros((q.shape[0], q.shape[2], q.shape[3], v.shape[3]), dtype=np.float32)
    out = np.empty(v.shape, dtype=np.float32)
    for t in range(q.shape[1]):
        state = state + k[:, t, :, :, None] * v[:, t, :, None, :]
        out[:, t] = np.einsum("bhkv,bhk->bhv", state, q[:, t] * np.float32(scale))
    if normalize:
        den = np.sum(q * np.float32(scale) * np.cumsum(k, axis=1), axis=-1, keepdims=True)
        out = out / (den + np.float32(1e-10))
    return out.astype(dtype), None


def recurrent_linear_torch(q, k, v, *, scale=None, normalize=False):
    """:func:`recurrent_linear` in PyTorch (float32 state for every input dtype)."""
    import torch

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dtype = q.dtype
    q, k, v = (x.to(torch.float32) for x in (q, k, v))
    state = q.new_zeros((q.shape[0], q.shape[2], q.shape[3], v.shape[3]))
    out = torch.empty_like(v)
    for t in range(q.shape[1]):
        state = state + k[:, t, :, :, None] * v[:, t, :, None, :]
        out[:, t] = torch.einsum("bhkv,bhk->bhv", state, q[:, t] * scale)
    if normalize:
        out = out / ((q * scale * k.cumsum(1)).sum(-1, keepdim=True) + 1e-10)
    return out.to(dtype), None


def off_by_one_percent(q, k, v, *, scale=None, normalize=False):
    out, _ = recurrent_linear(q, k, v, scale=scale, normalize=normalize)
    return (out * np.float32(1.01)).astype(out.dtype), None


def excludes_the_diagonal(q, k, v, *, scale=None, normalize=False):
    """Query t reads the state before key t is added: strictly causal, a classic slip."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dtype = q.dtype
    q, k, v = (np.asarray(x, dtype=np.float32) for x in (q, k, v))
    state = np.zeros((q.shape[0], q.shape[2], q.shape[3], v.shape[3]), dtype=np.float32)
    z = np.zeros(q.shape[:1] + q.shape[2:], dtype=np.float32)
    out = np.zeros(v.shape, dtype=np.float32)
    for t in range(q.shape[1]):
        num = np.einsum("bhkv,bhk->bhv", state, q[:, t] * np.float32(scale))
        den = np.sum(q[:, t] * np.float32(scale) * z, axis=-1)[..., None] + np.float32(1e-10)
        out[:, t] = num / den if normalize else num
        state = state + k[:, t, :, :, None] * v[:, t, :, None, :]
        z = z + k[:, t]
    return out.astype(dtype), None


def favor_plus(q, k, v, *, projection, scale=None, stabilize=True):
    """FAVOR+ (Choromanski et al. 2021), bidirectional, ``(B, H, N, d)``.

    ``phi(x) = exp(W x - |x|^2 / 2) / sqrt(m)`` on ``x = sqrt(scale) q`` and
    ``sqrt(scale) k`` (positive random features, Lemma 1), then
    ``phi(Q) (phi(K)^T V) / phi(Q) phi(K)^T 1``. The stabiliser subtracts each query's
    largest exponent and the largest key exponent of the (batch, head): constants that
    cancel in the normalised output but keep ``exp`` finite.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    root, m = math.sqrt(scale), projection.shape[0]
    x, y = q * root, k * root
    eq = x @ projection.T - 0.5 * np.sum(x * x, axis=-1, keepdims=True)
    ek = y @ projection.T - 0.5 * np.sum(y * y, axis=-1, keepdims=True)
    if stabilize:
        eq = eq - np.max(eq, axis=-1, keepdims=True)
        ek = ek - np.max(ek, axis=(-2, -1), keepdims=True)
    fq, fk = np.exp(eq) / math.sqrt(m), np.exp(ek) / math.sqrt(m)
    num = fq @ (np.swapaxes(fk, -1, -2) @ v)
    den = fq @ np.sum(fk, axis=-2)[..., None]
    return num / den


def favor_unstabilised(q, k, v, *, projection, scale=None):
    return favor_plus(q, k, v, projection=projection, scale=scale, stabilize=False)


def favor_off_by_one_percent(q, k, v, *, projection, scale=None):
    return favor_plus(q, k, v, projection=projection, scale=scale) * 1.01


# FAVOR+ cases: small, and (measured) well-conditioned in float32/float64 with today's
# tolerances; one with large logits, where exp() overflows without the stabiliser
FAVOR_CASES = [Case("favor", (2, 3), 17, 17, 16, 16), Case("favor", (1, 2), 9, 23, 8, 12),
               Case("favor", (1, 1), 1, 1, 4, 4), Case("favor", (1, 2), 1, 7, 8, 8),
               Case("favor", (1, 2), 16, 16, 8, 8, dist="large_logits"),
               Case("favor", (1, 2), 33, 33, 1, 1), Case("favor", (1, 2), 33, 33, 2, 2),
               Case("favor", (1, 2), 65, 65, 32, 32, dist="constant_keys")]
# the quick suite of exact softmax, the variant these tests verify (the k-means cases are
# clustered's and clustered_topk's only: Case.variant)
QUICK = cases("softmax", "quick")
# cases of the catalogue for the command line (its ids are what --case and -k take):
# the first plain one, and the first causal one with Nq == Nk and nothing else
PLAIN = next(c for c in QUICK if not c.needs - {"value_dim"})
CAUSAL = next(c for c in QUICK if c.needs - {"value_dim"} == {"causal"} and c.nq == c.nk)
FAVOR_OPTIONS = {"kernel": "positive", "stabilize": True}


def _fla(kernel, dtype, options=FLA_OPTIONS, backend="numpy", suite="standard"):
    return verify(kernel, "linear", backend=backend, dtypes=(dtype,), layout="bnhd", suite=suite,
                  options=options, supports=FLA_SUPPORTS, progress=False)


# ----------------------------------------------------------------------- variant options


def test_option_names_follow_each_variants_function():
    assert option_names("softmax") == ()
    assert {"feature_map", "normalize", "eps"} <= set(option_names("linear"))
    assert {"kernel", "stabilize"} <= set(option_names("performer"))
    # a plain value the variant derives per case may be set; its random arrays may not
    assert "num_segments" in option_names("pooled") and "projection" not in option_names("performer")
    # local's own integer window is an option; softmax's window feature is not
    assert "window" in option_names("local")


def test_options_that_the_function_does_not_take_or_refuses_are_clear_errors():
    with pytest.raises(ValueError, match=r"takes no option 'feature_mapp'; its options: feature_map"):
        with_options("linear", {"feature_mapp": "identity"})
    with pytest.raises(ValueError, match=r"'causal' .* is set by each case"):
        with_options("linear", {"causal": True})
    with pytest.raises(ValueError, match=r"refuses options feature_map='idenity': .*feature_map must"):
        with_options("linear", {"feature_map": "idenity"})
    with pytest.raises(TypeError, match="options must be a dict"):
        with_options("linear", [("feature_map", "identity")])
    with pytest.raises(ValueError, match="refuses"):
        verify(correct_kernel, "performer", backend="numpy", options={"kernel": "cosine"})
    assert with_options("linear", {}).options == with_options("linear").options


def test_golden_and_baseline_follow_the_options():
    from attn_ref import linear_attention, pooled_attention

    case = Case("opt", (1, 2), 12, 12, 4, 4, causal="top-left")
    plain = prepare(case, "linear", "float32")
    ident = prepare(case, "linear", "float32", options=FLA_OPTIONS)
    a = ident.arrays
    want = linear_attention(a["q"], a["k"], a["v"], causal="top-left", feature_map="identity",
                            normalize=True)
    np.testing.assert_allclose(ident.golden, want, rtol=1e-12, atol=1e-12)
    assert ident.options["feature_map"] == "identity" and plain.options["feature_map"] == "elu+1"
    assert np.max(np.abs(plain.golden - ident.golden)) > 0.1  # not served from the cache
    # the baseline is the float32 run of the same function: well under the difference
    assert ident.baseline.max_err < 1e-3 * np.max(np.abs(ident.golden))
    # an option replacing a plain derived parameter: pooled's num_segments
    case = Case("opt", (1, 1), 12, 12, 4, 4)
    prep = prepare(case, "pooled", "float64", options={"num_segments": 2})
    assert prep.params["num_segments"] == 2 and "num_segments" not in prep.options
    a = prep.arrays
    np.testing.assert_allclose(prep.golden, pooled_attention(a["q"], a["k"], a["v"], num_segments=2))


def test_options_reach_a_kernel_that_takes_them():
    seen = []

    def kernel(q, k, v, *, feature_map="elu+1", normalize=True):
        from attn_ref import linear_attention

        seen.append((feature_map, normalize))
        return linear_attention(q, k, v, feature_map=feature_map, normalize=normalize)

    rep = verify(kernel, "linear", backend="numpy", suite="quick", options=FLA_OPTIONS,
                 progress=False)
    assert rep.passed and set(seen) == {("identity", True)}
    assert "options: feature_map='identity', normalize=True" in rep.table()
    assert rep.to_dict()["options"] == FLA_OPTIONS


def test_fla_recurrent_linear_attention_passes_with_identity_normalised():
    # measured: 5 causal Nq == Nk cases of the standard suite pass in float32 and float16
    for dtype in ("float32", "float16"):
        rep = _fla(recurrent_linear, dtype)
        assert rep.passed and rep.counts["pass"] >= 4, rep.table()
    # it computes in float32 whatever it is given: a float64 check must say so
    rep = _fla(recurrent_linear, "float64", suite="quick")
    assert not rep.passed and "float32" in rep.failures[0].diagnosis


@pytest.mark.parametrize("kernel, options", [
    (off_by_one_percent, FLA_OPTIONS),                  # output 1 % too large
    (excludes_the_diagonal, FLA_OPTIONS),               # query t does not see key t
    (recurrent_linear, None),                           # the options left at elu+1
    (recurrent_linear, {"feature_map": "identity"}),    # normalize left out
], ids=["1.01", "no-diagonal", "default-options", "unnormalised-reference"])
def test_fla_style_kernels_a_little_wrong_fail(kernel, options):
    rep = _fla(kernel, "float32", options=options)
    assert not rep.passed and rep.counts["fail"] >= 4, rep.table()


def test_fla_recurrent_linear_attention_torch_low_precision():
    pytest.importorskip("torch")
    rep = verify(recurrent_linear_torch, "linear", backend="torch",
                 dtypes=("float32", "bfloat16", "float16"), layout="bnhd", options=FLA_OPTIONS,
                 supports=FLA_SUPPORTS, progress=False)
    # measured: 5 cases pass in float32, 4 in float16, 1 in bfloat16 (4 ill-conditioned)
    passes = {dt: sum(r.verdict == "pass" for r in rep.results if r.dtype == dt)
              for dt in ("float32", "bfloat16", "float16")}
    assert rep.passed and min(passes.values()) >= 1 and passes["float32"] >= 4, rep.table()


def test_favor_plus_from_the_paper_passes_with_positive_features():
    for dtype in ("float64", "float32"):
        rep = verify(favor_plus, "performer", backend="numpy", dtypes=(dtype,), cases=FAVOR_CASES,
                     options=FAVOR_OPTIONS, supports={"broadcast": True}, progress=False)
        assert rep.passed and rep.counts["pass"] >= 4, rep.table()


@pytest.mark.parametrize("kernel, options", [
    (favor_unstabilised, FAVOR_OPTIONS),                 # exp overflows on large logits
    (favor_off_by_one_percent, FAVOR_OPTIONS),
    (favor_plus, {"kernel": "trigonometric"}),           # the other estimator
], ids=["unstabilised", "1.01", "trigonometric-reference"])
def test_favor_plus_a_little_wrong_fails(kernel, options):
    rep = verify(kernel, "performer", backend="numpy", dtypes=("float64",), cases=FAVOR_CASES,
                 options=options, supports={"broadcast": True}, progress=False)
    assert not rep.passed, rep.table()


def test_exported_vectors_follow_and_record_the_options(tmp_path):
    from conformance.vectors import export_vectors, load_vectors

    todo = [Case("vec", (2, 1), 16, 16, 8, 8, causal="top-left")]
    man = export_vectors(tmp_path, "linear", cases=todo, options=FLA_OPTIONS, layout="bnhd")
    raw = json.loads((tmp_path / "manifest.json").read_text())
    assert raw["variant_options"]["feature_map"] == "identity"
    assert raw["variant_options"]["normalize"] is True and man["cases"]
    for entry, arrays in load_vectors(tmp_path):
        for opts, ok in ((FLA_OPTIONS, True), ({}, False)):
            q, k, v = (arrays[n] for n in "qkv")
            out, _ = recurrent_linear(q, k, v, normalize=bool(opts))
            err = np.abs(out.astype(np.float64) - arrays["golden"])[arrays["compare"]].max()
            assert (err <= entry["tol_max_abs"]) == ok


# ------------------------------------------------------------------ kernel declarations


def _causal_only(q, k, v, *, mask=None, bias=None, scale=None, **kw):
    """Causal (top-left) softmax attention with no ``causal`` argument."""
    assert not kw, kw
    return correct_kernel(q, k, v, causal=True, mask=mask, bias=bias, scale=scale)


def test_a_top_left_kernel_gets_no_bottom_right_varlen_case_whose_sequences_differ():
    # Padded to Nq == Nk = 64, the sequences inside are 40 queries on 17 keys: top-left
    # and bottom-right differ there, so a kernel whose causal=True is top-left cannot take
    # the case. It was handed causal=True and failed (1.5e6 x its bound in float32) though
    # it is correct; attn_ref's own softmax_attention was the kernel that showed it.
    from attn_ref import softmax_attention

    varlen = [c for c in cases("softmax", "standard") if "seqlens_q" in c.needs]
    short = [c for c in varlen if tuple(c.param("seqlens_q")) != tuple(c.param("seqlens_k"))]
    assert len(short) == 1 and short[0].nq == short[0].nk
    rep = verify(softmax_attention, "softmax", backend="numpy", cases=varlen, progress=False)
    assert rep.passed, rep.table()
    assert [r.verdict for r in rep.results if r.case == short[0].id] == ["n/a"]
    assert dict(rep.na_reasons()) == {
        "kernel's causal=True is top-left; case needs bottom-right with sequences of "
        "Lq = (40, 64, 9) on Lk = (17, 64, 0)": 1}
    # declared as what it is not, it is handed the case and fails it
    rep = verify(softmax_attention, "softmax", backend="numpy", cases=short, causal="bottom-right",
                 progress=False)
    assert rep.counts["fail"] == 1, rep.table()
    # as what it is ("both": True/"bottom-right" strings), it passes it
    assert verify(softmax_attention, "softmax", backend="numpy", cases=short, causal="both",
                  progress=False).passed


def test_causal_by_construction_gets_only_causal_cases_and_no_argument():
    todo = [Case("c", (2, 1), 16, 16, 8, 8, causal="top-left"),
            Case("c", (1, 2), 13, 21, 8, 8, causal="top-left"),
            Case("c", (1, 2), 13, 21, 8, 8, causal="bottom-right"),
            Case("c", (1, 2), 12, 12, 8, 8, causal="bottom-right", mask="random"),
            Case("n", (2, 1), 16, 16, 8, 8), Case("n", (1, 2), 16, 16, 8, 8, bias=True)]
    rep = verify(_causal_only, "softmax", backend="numpy", cases=todo,
                 supports={"causal": "always"}, progress=False)
    assert rep.passed and [r.verdict for r in rep.results] == ["pass", "pass", "n/a", "pass",
                                                                 "n/a", "n/a"], rep.table()
    assert dict(rep.na_reasons()) == {
        "kernel is causal by construction (supports causal='always'); case is not causal": 2,
        "kernel's causal=True is top-left; case needs bottom-right with Nq != Nk": 1}
    # a kernel that is not causal but says it is fails
    rep = verify(lambda q, k, v, *, mask=None: correct_kernel(q, k, v, mask=mask), "softmax",
                 backend="numpy", cases=todo, supports={"causal": "always"}, progress=False)
    assert not rep.passed and rep.counts["fail"] == 3
    with pytest.raises(ValueError, match="causal by construction"):
        verify(_causal_only, "softmax", backend="numpy", supports={"causal": "always"},
               causal="both")
    with pytest.raises(ValueError, match="only meaningful for 'causal'"):
        verify(correct_kernel, "softmax", backend="numpy", supports={"mask": "always"})


def test_declared_subsets_become_na_with_their_reason_and_nothing_else_does():
    def subset_only(q, k, v):
        # right on Nq == Nk <= 20, d == 16, batch > 1 (the subset it declares); keys
        # reversed anywhere else
        if q.shape[-2] != k.shape[-2] or q.shape[-1] != 16 or q.shape[-2] > 20 or q.shape[0] < 2:
            k = k[..., ::-1, :]
        return correct_kernel(q, k, v)

    todo = [Case("sub", (2, 1), 8, 8, 16, 16), Case("sub", (2, 1), 8, 9, 16, 16),
            Case("sub", (2, 1), 8, 8, 8, 8), Case("sub", (2, 1), 24, 24, 16, 16),
            Case("sub", (1, 1), 8, 8, 16, 16)]
    sup = {"cross": False, "head_dims": "16", "max_seq_len": 20, "cases": lambda c: c.batch[0] > 1}
    rep = verify(subset_only, "softmax", backend="numpy", cases=todo, supports=sup,
                 progress=False)
    assert rep.passed and [r.case for r in rep.results if r.verdict == "pass"] == [todo[0].id]
    assert dict(rep.na_reasons()) == {
        "kernel takes Nq == Nk only (supports cross=False)": 1,
        "head dim outside the declared head_dims (16,)": 1,
        "sequence longer than the declared max_seq_len 20": 1,
        "outside the subset the kernel declares (supports cases=<lambda>)": 1,
    }
    # the same kernel without its declarations fails
    rep = verify(subset_only, "softmax", backend="numpy", cases=todo, progress=False)
    assert rep.counts["fail"] == 4 and rep.counts["pass"] == 1
    with pytest.raises(TypeError, match=r"supports\['max_seq_len'\] must be an integer"):
        verify(correct_kernel, "softmax", backend="numpy", supports={"max_seq_len": "long"})
    with pytest.raises(ValueError, match="and the declarations"):
        verify(correct_kernel, "softmax", backend="numpy", supports={"crosss": False})


def test_table_footer_counts_na_by_reason_and_show_na_lists_them():
    def no_mask(q, k, v, *, causal=False, scale=None):
        return correct_kernel(q, k, v, causal=causal, scale=scale)

    todo = [Case("f", (1, 2), 16, 16, 8, 8), Case("f", (2, 2), 16, 16, 8, 8, mask="random"),
            Case("f", (2, 2), 12, 19, 8, 8, mask="padding"), Case("f", (1, 2), 16, 16, 8, 8, bias=True),
            Case("f", (1, 2), 13, 21, 8, 8, causal="bottom-right")]
    rep = verify(no_mask, "softmax", backend="numpy", cases=todo, dtypes=("float32", "float64"),
                 progress=False)
    text = rep.table()
    assert "not applicable, by reason" in text
    assert "     4  kernel does not declare ['mask']" in text
    assert "     2  kernel does not declare ['bias']" in text
    footer = text.split("not applicable, by reason")[1].splitlines()[1:]
    assert sum(int(line.split()[0]) for line in footer) == rep.counts["n/a"] == 8
    # the rows themselves only with show_na
    assert todo[1].id not in text and todo[1].id in rep.table(show_na=True)
    assert na_reason("ill-conditioned in float32: a plain float32 ... 0.3") == "ill-conditioned in float32"


def test_case_ids_are_printed_whole_and_work_with_pytest_k():
    from _pytest.mark.expression import Expression

    long_case = Case("a-rather-long-tag-for-a-case", (1, 2), 13, 21, 8, 8, causal="bottom-right",
                     mask="padding", bias=True, scale=0.125)
    assert len(long_case.id) > 60
    rep = verify(correct_kernel, "softmax", backend="numpy", cases=[long_case], causal="both",
                 progress=False)
    assert any(line.startswith(long_case.id + " ") for line in rep.table().splitlines())
    ident = re.compile(r"(:?\w|:|\+|-|\.|\[|\]|\\|/)+$")  # pytest's -k identifier
    for suite in ("quick", "standard", "exhaustive"):
        for c in cases(None, suite):
            assert ident.match(c.id), c.id
            name = f"test_case[float32-{c.id}]".lower()
            assert Expression.compile(c.id).evaluate(lambda s, name=name: s.lower() in name)


# ---------------------------------------------------------------------- CLI and plugin


def _cli(*args):
    from conformance.cli import main

    return main(list(args))


KERNELS = '''
import numpy as np
import array_api_compat.numpy as npx
from attn_ref.grad import softmax_attention as softmax_vjp
from conformance.mutants import correct_kernel


def backward(q, k, v, do, *, mask=None, bias=None, causal=False, scale=None):
    g = softmax_vjp(q, k, v, do, mask=mask, bias=bias, causal=causal, scale=scale, xp=npx)
    return g["q"], g["k"], g["v"]


def backward_dq_off(q, k, v, do, **kw):
    dq, dk, dv = backward(q, k, v, do, **kw)
    return dq * 1.01, dk, dv


def wants_torch(q, k, v):
    return q.contiguous() @ k.mT


def raises(q, k, v):
    return _inner(q)


def _inner(q):
    raise RuntimeError("no kernel image is available")
'''


@pytest.fixture
def kernels_file(tmp_path):
    path = tmp_path / "mykernels.py"
    path.write_text(KERNELS + "\n\n" + _source_of(recurrent_linear))
    return path


def _source_of(fn):
    import inspect

    return "import numpy as np\n\n" + inspect.getsource(fn)


@pytest.mark.parametrize("args, message", [
    (["nosuch_module_xyz:fn"], "no module named 'nosuch_module_xyz'"),
    (["conformance.mutants:nosuch"], "has no attribute 'nosuch'"),
    (["conformance.mutants"], "must be MODULE:FUNCTION"),
    (["conformance.mutants:correct_kernel", "--variant", "nosuch"], "unknown variant 'nosuch'"),
    (["conformance.mutants:correct_kernel", "--option", "feature_map=identity"],
     "takes no option 'feature_map'"),
    (["conformance.mutants:correct_kernel", "--variant", "linear", "--option",
      "feature_map=idenity"], "refuses options feature_map='idenity'"),
    (["conformance.mutants:correct_kernel", "--option", "novalue"], "NAME=VALUE"),
    (["conformance.mutants:correct_kernel", "--case", PLAIN.id[:-1]], f"did you mean {PLAIN.id}"),
    (["conformance.mutants:correct_kernel", "--dtype", "bfloat16"], "numpy has no bfloat16"),
    (["conformance.mutants:correct_kernel", "--dtype", "float8"], "--dtype must be among"),
    (["conformance.mutants:correct_kernel", "--supports", "crosss=false"], "unknown feature 'crosss'"),
    (["conformance.mutants:correct_kernel", "--backward", "nosuch_module_xyz:bwd"], "backward"),
    (["--variant", "nosuch"], "unknown variant 'nosuch'"),
])
def test_cli_usage_errors_are_one_line_and_exit_2(args, message, capsys):
    assert _cli("verify", *args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("attn-ref: ") and message in err, err


def test_cli_options_declarations_and_exit_status(kernels_file, capsys):
    base = ["verify", f"{kernels_file}:recurrent_linear", "--variant", "linear", "--layout", "bnhd",
            "--supports", "causal=always", "--supports", "cross=false"]
    assert _cli(*base, "--option", "feature_map=identity", "--option", "normalize=True") == 0
    out = capsys.readouterr().out
    assert "options: feature_map='identity', normalize=True" in out and "PASS" in out
    assert _cli(*base) == 1  # the default elu+1 reference: the kernel fails, exit 1
    assert "FAIL" in capsys.readouterr().out
    assert parse_options(["a=identity", "b=True", "c=1e-6", "d=(0, 5)", "e=elu+1", "f='x'"]) == \
        {"a": "identity", "b": True, "c": 1e-6, "d": (0, 5), "e": "elu+1", "f": "x"}


def test_cli_backward_case_and_traceback(kernels_file, capsys):
    one = ["--case", PLAIN.id, "--causal", "both"]
    assert _cli("verify", "conformance.mutants:correct_kernel", "--backward",
                f"{kernels_file}:backward", *one) == 0
    out = capsys.readouterr().out
    assert all(f" {g} " in out for g in ("dq", "dk", "dv")) and "PASS: 4 passed" in out
    assert _cli("verify", "conformance.mutants:correct_kernel", "--backward",
                f"{kernels_file}:backward_dq_off", *one) == 1
    out = capsys.readouterr().out
    assert re.search(re.escape(PLAIN.id) + r" +float32 +dq .* fail", out), out
    # --traceback shows the kernel's own frames; without it, only the message
    assert _cli("verify", f"{kernels_file}:raises", *one) == 1
    assert "Traceback" not in capsys.readouterr().out
    assert _cli("verify", f"{kernels_file}:raises", "--traceback", *one) == 1
    out = capsys.readouterr().out
    assert "kernel traceback 1 of 1" in out and "in _inner" in out and "no kernel image" in out


def test_cli_suggests_backend_when_every_case_fails_on_the_array_type(kernels_file, capsys):
    assert _cli("verify", f"{kernels_file}:wants_torch", "--suite", "quick") == 1
    out = capsys.readouterr().out
    assert "hint: every case failed on the type of the arrays" in out and "--backend" in out
    assert _cli("verify", f"{kernels_file}:raises", "--suite", "quick") == 1
    assert "hint:" not in capsys.readouterr().out  # a RuntimeError is not a type mismatch


def test_cli_case_ids_from_the_table_paste_into_case(capsys):
    assert _cli("verify", "conformance.mutants:correct_kernel", "--suite", "quick", "--causal",
                "both") == 0
    ids = [line.split()[0] for line in capsys.readouterr().out.splitlines()
           if line.endswith("  pass")]
    assert len(ids) == len(QUICK)
    assert _cli("verify", "conformance.mutants:correct_kernel", "--causal", "both",
                *sum((["--case", i] for i in ids[:3]), [])) == 0
    out = capsys.readouterr().out
    assert "3 passed" in out and all(i in out for i in ids[:3])


def test_cli_export_vectors_records_options(tmp_path, capsys):
    assert _cli("export-vectors", str(tmp_path), "--variant", "linear", "--option",
                "feature_map=identity", "--case", PLAIN.id) == 0
    man = json.loads((tmp_path / "manifest.json").read_text())
    assert man["variant_options"]["feature_map"] == "identity" and len(man["cases"]) == 1
    assert _cli("export-vectors", str(tmp_path), "--option", "feature_map=identity") == 2


def test_load_kernel_errors_name_the_argument(tmp_path):
    bad = tmp_path / "broken_mod.py"
    bad.write_text("raise ImportError('needs a GPU')\n")
    with pytest.raises(KernelNotFound, match=r"backward '.*broken_mod.py:f': importing .* needs a GPU"):
        load_kernel(f"{bad}:f", "backward")
    with pytest.raises(KernelNotFound, match="is a int, not a function"):
        load_kernel("sys:maxsize")


def test_plugin_options_declarations_backward_and_k(kernels_file, tmp_path, monkeypatch, capsys):
    def run(*args):
        # In this process (tests.helpers.run_plugin): four child processes imported the
        # oracle again, 8 s of the suite's CPU.
        return run_plugin(monkeypatch, tmp_path, *args)

    args = ["--attn-kernel", f"{kernels_file}:recurrent_linear", "--attn-variant", "linear",
            "--attn-layout", "bnhd", "--attn-suite", "quick", "--attn-supports", "causal=always",
            "--attn-supports", "cross=false", "--attn-option", "feature_map=identity",
            "--attn-option", "normalize=True", "-k", CAUSAL.id]
    code, seen = run(*args)
    assert code == 0 and seen.outcomes() == (1, 0, 0) and seen.deselected == len(QUICK) - 1, \
        (code, seen.outcomes(), seen.deselected)
    # the same case against the default (elu+1) reference fails
    i = args.index("--attn-option")
    code, seen = run(*args[:i], *args[i + 4:])
    assert code == 1 and seen.outcomes() == (0, 1, 0), (code, seen.outcomes())
    # an explicit backward, and a usage error
    args = ["--attn-kernel", "conformance.mutants:correct_kernel", "--attn-causal", "both",
            "--attn-backward", f"{kernels_file}:backward_dq_off", "--attn-suite", "quick",
            "-k", PLAIN.id]
    code, seen = run(*args)
    failed = [r.longreprtext for r in seen.reports if r.failed]
    assert code == 1 and any("dq max err" in text for text in failed), (code, failed)
    capsys.readouterr()
    code, _ = run(*args[:-2], "--attn-option", "feature_map=identity")
    err = capsys.readouterr().err
    assert code == 4 and "takes no option 'feature_map'" in err, (code, err)


def test_docs_list_every_variants_options():
    from attn_ref.registry import variants

    text = open(os.path.join(ROOT, "docs", "conformance.md"), encoding="utf-8").read()
    table = text.split("| variant | options")[1].split("\n\n")[0]
    rows = {}
    for line in table.splitlines()[2:]:
        names, opts = line.strip("|").split("|")[:2]
        listed = re.findall(r"`(\w+)`(?: \[|,|$| )", opts.strip() + " ")
        for name in re.findall(r"`(\w+)`", names):
            rows[name] = [] if opts.strip() == "none" else listed
    assert set(rows) == {v.name for v in variants()}
    for v in variants():
        assert tuple(rows[v.name]) == option_names(v), v.name


def squared(x):
    """A signed feature map given as a callable (array API: works on any backend)."""
    return x * x


def test_callable_options_work_and_report_by_name():
    from attn_ref import linear_attention

    case = Case("opt", (1, 1), 9, 9, 4, 4)
    prep = prepare(case, "linear", "float64", options={"feature_map": squared})
    a = prep.arrays
    np.testing.assert_allclose(prep.golden, linear_attention(a["q"], a["k"], a["v"],
                                                             feature_map=squared), rtol=1e-13)
    rep = verify(correct_kernel, "linear", backend="numpy", cases=[case],
                 options={"feature_map": squared}, progress=False)
    want = {"feature_map": "tests.test_conformance_reach.squared"}
    assert json.loads(rep.to_json())["options"] == want
    assert "options: feature_map=tests.test_conformance_reach.squared" in rep.table()
