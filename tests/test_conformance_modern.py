"""The oracle's cases for what modern kernels take: grouped-query heads, sliding windows,
Llama 4's chunks, soft-capping, ALiBi, dropout keep-masks, per-sequence lengths (varlen
in padded form, KV-cache decoding). Calibration: PyTorch SDPA (``enable_gqa=True``, masks
built for windows, chunks and lengths, ALiBi as a float bias) and attn_ref's own online
form pass; the mutants (window off by one on either side, a chunk one position longer,
group mapping ``h % Hkv``, a varlen kernel that leaks across sequence boundaries, the
scale applied again after the soft-cap) fail.
"""

import math

import numpy as np
import pytest

from attn_ref import online_softmax_attention, softmax_attention, varlen_attention
from conformance import cases, verify
from conformance.calling import reference_features
from conformance.catalogue import Case
from conformance.features import FEATURES

torch = pytest.importorskip("torch")
F = torch.nn.functional

MODERN = {"gqa", "window", "chunk", "softcap", "alibi", "dropout_mask", "dropout_p", "seqlens_k", "seqlens_q"}


def _modern(suite="standard"):
    return [c for c in cases(None, suite) if c.needs & MODERN]


# ---------------------------------------------------------------- kernels under test


def _visibility(q, k, attn_mask, is_causal, window, seqlens_q, seqlens_k, *, window_shift=(0, 0),
                chunk=None):
    """Bool (B, 1|H, Nq, Nk) visibility and the per-sequence offset Lk - Lq (B, 1, 1, 1)."""
    b, nq, nk = q.shape[0], q.shape[-2], k.shape[-2]
    lq = torch.tensor(seqlens_q if seqlens_q is not None else [nq] * b).view(b, 1, 1, 1)
    lk = torch.tensor(seqlens_k if seqlens_k is not None else [nk] * b).view(b, 1, 1, 1)
    off = lk - lq
    i, j = torch.arange(nq).view(nq, 1), torch.arange(nk).view(1, nk)
    ok = (i < lq) & (j < lk)
    if attn_mask is not None:
        ok = ok & attn_mask
    if is_causal:
        ok = ok & (j <= i + (0 if is_causal == "top-left" else off))
    if window is not None:
        left, right = window[0] + window_shift[0], window[1] + window_shift[1]
        if window[0] >= 0:
            ok = ok & (j >= i + off - left)
        if window[1] >= 0:
            ok = ok & (j <= i + off + right)
    if chunk is not None:  # Llama 4's chunked_overlay on absolute positions
        ok = ok & (torch.div(i + off, chunk, rounding_mode="floor")
                   == torch.div(j, chunk, rounding_mode="floor"))
    return ok, off, i, j


def sdpa_modern(q, k, v, *, attn_mask=None, is_causal=False, scale=None, enable_gqa=False,
                window=None, chunk=None, alibi_slopes=None, seqlens_q=None, seqlens_k=None, _shift=(0, 0),
                _gqa_tile=False):
    """PyTorch SDPA with windows, chunks, lengths and causal as a mask and ALiBi as a float bias.

    Rows with no visible key are set to zero, as FlashAttention's un-padding does.
    """
    ok, off, i, j = _visibility(q, k, attn_mask, is_causal, window, seqlens_q, seqlens_k,
                                window_shift=_shift, chunk=chunk)
    bias = torch.zeros(ok.shape, dtype=q.dtype).masked_fill(~ok, -math.inf)
    if alibi_slopes is not None:
        bias = bias - alibi_slopes.to(q.dtype).view(1, -1, 1, 1) * (i + off - j).abs().to(q.dtype)
    if _gqa_tile:  # mutant: query head h reads kv head h % Hkv
        g = q.shape[1] // k.shape[1]
        k, v, enable_gqa = k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1), False
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=enable_gqa)
    return torch.where(ok.any(-1, keepdim=True), out, torch.zeros((), dtype=out.dtype))


def attn_ref_online(q, k, v, *, mask=None, bias=None, causal=False, scale=None, gqa=False,
                    window=None, chunk=None, softcap=None, alibi_slopes=None, dropout_p=0.0,
                    dropout_mask=None, seqlens_q=None, seqlens_k=None):
    return online_softmax_attention(q, k, v, mask=mask, bias=bias, causal=causal, scale=scale, gqa=gqa,
                                    window=window, chunk=chunk, softcap=softcap, alibi_slopes=alibi_slopes,
                                    dropout_p=dropout_p, dropout_mask=dropout_mask, seqlens_q=seqlens_q,
                                    seqlens_k=seqlens_k, block_q=32, block_k=64)


def softcap_scale_twice(q, k, v, *, is_causal=False, scale=None, enable_gqa=False, window=None,
                        softcap=None):
    """Mutant: the logit scale applied before the soft-cap and once more after it."""
    ok, _, _, _ = _visibility(q, k, None, is_causal, window, None, None)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if enable_gqa:
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q.float() @ k.float().transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap) * scale
    s = s.masked_fill(~ok, -math.inf)
    return (torch.softmax(s, -1).nan_to_num() @ v.float()).to(q.dtype)


def _packed_adapter(packed_kernel):
    """A kernel over padded ``(B, H, N, d)`` batches with ``seqlens_q``/``seqlens_k`` built
    from a FlashAttention-style packed kernel ``(total, H, d)`` + ``cu_seqlens`` (the
    ``unpad_input``/``pad_input`` of FlashAttention's tests)."""

    def kernel(q, k, v, *, is_causal=False, seqlens_q, seqlens_k):
        def pack(x, lens):
            return torch.cat([x[b, :, :n].transpose(0, 1) for b, n in enumerate(lens)], 0)

        cq = [0] + np.cumsum(seqlens_q).tolist()
        ck = [0] + np.cumsum(seqlens_k).tolist()
        o = packed_kernel(pack(q, seqlens_q), pack(k, seqlens_k), pack(v, seqlens_k), cq, ck, is_causal)
        out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype)
        for b, n in enumerate(seqlens_q):
            out[b, :, :n] = o[cq[b]:cq[b] + n].transpose(0, 1)
        return out

    return kernel


def _varlen_ref(q, k, v, cq, ck, causal):
    return varlen_attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, causal=causal or False)


def _varlen_leaky(q, k, v, cq, ck, causal):
    """Mutant: the whole pack attends to the whole pack (no sequence boundaries)."""
    return varlen_attention(q, k, v, cu_seqlens_q=[0, q.shape[0]], cu_seqlens_k=[0, k.shape[0]],
                            causal=causal or False)


def _by_feature(report, feature):
    ids = {c.id for c in _modern() if feature in c.needs}
    return [r for r in report.results if r.case in ids]


# ---------------------------------------------------------------- catalogue


def test_modern_features_and_cases_are_catalogued():
    assert MODERN <= set(FEATURES)
    assert MODERN <= reference_features(__import__("attn_ref.registry").registry.get("softmax"))
    std = _modern("standard")
    decode = [c for c in std if c.tag == "decode"]
    assert sorted(c.nq for c in decode) == [1, 2, 5, 16] and all(c.nk >= 1000 for c in decode)
    long = [c for c in _modern("exhaustive") if c.tag == "decode"]
    assert max(c.nk for c in long) == 65536 and {c.nq for c in long} >= {1, 16}
    for feat in MODERN:
        assert any(feat in c.needs for c in std), feat
    # a sliding-window decode step (Mistral, Gemma, Qwen 2 with a cache): causal, Nq < Nk,
    # the window bounded on the left; alone at batch 3 x 5 heads too
    sliding = [c for c in std
               if c.needs == {"window", "causal"} and c.nq < c.nk and c.param("window")[0] >= 0]
    assert any(c.batch[0] >= 3 and c.batch[1] >= 5 for c in sliding), [c.id for c in sliding]
    # Llama 4's chunks: a decode step on a cache no chunk divides, batch >= 3 x heads >= 5,
    # a cache of 1000 keys (8192 in exhaustive, the step straddling a chunk boundary), and
    # a prefill
    chunked = [c for c in std if "chunk" in c.needs and c.causal and c.nq < c.nk]
    assert any(c.nk % c.param("chunk") and c.batch[0] >= 3 and c.batch[1] >= 5 for c in chunked)
    assert any(c.nk >= 1000 for c in chunked) and any(c.nq == c.nk for c in std if "chunk" in c.needs)
    assert any("chunk" in c.needs and (c.nk - c.nq) // c.param("chunk") != (c.nk - 1) // c.param("chunk")
               and c.nk > 8000 for c in _modern("exhaustive"))
    ids = [c.id for c in cases(None, "exhaustive")]
    assert len(ids) == len(set(ids))


def test_case_inputs_follow_the_feature():
    c = next(c for c in _modern() if c.tag == "gqa" and c.param("kv_heads") == 2)
    arrays, kwargs = c.inputs(seed=3)
    assert arrays["k"].shape[1] == 2 and arrays["q"].shape[1] == 8 and kwargs["gqa"] is True
    c = Case("t", (2, 4), 5, 9, 4, 4, causal="bottom-right",
             params=(("window", (1, 0)), ("seqlens_k", (9, 3)), ("dropout_p", 0.25)),
             features=("window", "seqlens_k", "alibi", "dropout_mask", "dropout_p"))
    arrays, kwargs = c.inputs(seed=1)
    assert kwargs["window"] == (1, 0) and kwargs["seqlens_k"] == (9, 3) and kwargs["dropout_p"] == 0.25
    assert arrays["dropout_mask"].dtype == np.bool_ and arrays["dropout_mask"].shape == (2, 4, 5, 9)
    # slopes 2^-e, e in 1..8 from the seed: not the paper's 2^(-8h/H), which a kernel
    # ignoring alibi_slopes computes itself
    e = -np.log2(arrays["alibi_slopes"])
    assert e.shape == (4,) and np.all(e == np.round(e)) and np.all((1 <= e) & (e <= 8))
    assert not np.array_equal(e, 2.0 * np.arange(1, 5))
    from conformance.features import allowed_matrix

    allowed = np.broadcast_to(allowed_matrix(c, arrays, kwargs), (2, 4, 5, 9))
    # sequence 1: Lk = 3, off = 3 - 5 = -2: query i sees keys i - 3 <= j <= i - 2, j < 3
    want = np.array([[i - 3 <= j <= i - 2 and j < 3 for j in range(9)] for i in range(5)])
    np.testing.assert_array_equal(allowed[1, 0], want)


@pytest.mark.parametrize("case", [c for c in _modern() if c.causal and "dropout_p" not in c.needs],
                         ids=lambda c: c.id)
def test_the_visible_keys_are_those_the_reference_attends(case):
    """``allowed_matrix`` (rows with no key, the diagnoses' masks) is the reference's: a
    causal mask bottom-right from each sequence's own end, ``i + Lk - Lq``. It measured
    from the batch's ``Nk - Nq`` and let a query of a decoding case with a shorter cache
    see one key past its own position per missing query (the decode cases)."""
    from attn_ref import attention_weights
    from conformance.features import allowed_matrix

    arrays, kwargs = case.inputs(seed=0)
    b, h = case.batch
    allowed = np.broadcast_to(allowed_matrix(case, arrays, kwargs), (b, h, case.nq, case.nk))
    extra = {n: arrays[n] for n in ("mask", "alibi_slopes") if n in arrays}
    p = attention_weights(arrays["q"], arrays["k"], **extra, **kwargs)
    lq = np.asarray(kwargs.get("seqlens_q", (case.nq,) * b)).reshape(b, 1, 1, 1)
    rows = np.arange(case.nq)[:, None] < lq  # padded query rows attend nothing either way
    np.testing.assert_array_equal(allowed & rows, (p > 0) & rows)


# ---------------------------------------------------------------- calibration


@pytest.mark.parametrize("dtype,seeds", [("float32", (0, 1)), ("bfloat16", (2,)), ("float16", (3,))])
def test_sdpa_with_masks_and_alibi_bias_passes(dtype, seeds):
    for seed in seeds:
        rep = verify(sdpa_modern, "softmax", backend="torch", dtypes=(dtype,), cases=_modern(),
                     seed=seed, causal="both", progress=False)
        assert rep.passed, rep.table()
        ran = {r.case for r in rep.results if r.verdict == "pass"}
        for feat in ("gqa", "window", "chunk", "alibi", "seqlens_k", "seqlens_q"):
            assert any(r.case in ran for r in _by_feature(rep, feat)), feat
        # SDPA has no soft-cap and no keep-mask: those cases are n/a, never passed
        assert all(r.verdict == "n/a" for f in ("softcap", "dropout_mask") for r in _by_feature(rep, f))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attn_ref_online_on_torch_passes_every_modern_case(dtype):
    rep = verify(attn_ref_online, "softmax", backend="torch", dtypes=(dtype,), cases=_modern(),
                 causal="both", progress=False)
    assert rep.passed, rep.table()
    assert all(r.verdict == "pass" for r in rep.results), rep.table()


def test_attn_ref_on_jax_passes_the_small_modern_cases():
    # Under jax.jit (eager JAX costs tens of ms an op): options are static, lengths too.
    jax = pytest.importorskip("jax")
    static = ("causal", "gqa", "window", "chunk", "softcap", "dropout_p", "seqlens_q", "seqlens_k")
    jitted = jax.jit(softmax_attention, static_argnames=static)

    def kernel(q, k, v, *, mask=None, causal=False, gqa=False, window=None, chunk=None, softcap=None,
               alibi_slopes=None, dropout_p=0.0, dropout_mask=None, seqlens_q=None, seqlens_k=None):
        return jitted(q, k, v, mask=mask, causal=causal, gqa=gqa, window=window, chunk=chunk, softcap=softcap,
                      alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_mask=dropout_mask,
                      seqlens_q=seqlens_q, seqlens_k=seqlens_k)

    # every feature but the bias (the kernel takes none); fewer shapes to compile
    small = [c for c in _modern() if c.nk <= 129 and not c.bias]
    rep = verify(kernel, "softmax", backend="jax", dtypes=("float32",), cases=small, causal="both",
                 progress=False)
    assert rep.passed and all(r.verdict == "pass" for r in rep.results), rep.table()


def test_packed_varlen_kernel_passes_and_a_leaky_one_fails():
    varlen = [c for c in _modern() if c.tag == "varlen"]
    good = verify(_packed_adapter(_varlen_ref), "softmax", backend="torch", cases=varlen,
                  causal="both", progress=False)
    assert good.passed and all(r.verdict == "pass" for r in good.results), good.table()
    bad = verify(_packed_adapter(_varlen_leaky), "softmax", backend="torch", cases=varlen,
                 causal="both", progress=False)
    assert not bad.passed
    assert all(r.verdict == "fail" and "across sequence boundaries" in r.diagnosis
               for r in bad.results), bad.table()


# ---------------------------------------------------------------- mutants


def _window_left(q, k, v, *, is_causal=False, scale=None, enable_gqa=False, window=None, attn_mask=None,
                 seqlens_q=None, seqlens_k=None):
    return sdpa_modern(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, window=window,
                       attn_mask=attn_mask, seqlens_q=seqlens_q, seqlens_k=seqlens_k, _shift=(1, 0))


def _window_right(q, k, v, *, is_causal=False, scale=None, enable_gqa=False, window=None, attn_mask=None,
                  seqlens_q=None, seqlens_k=None):
    return sdpa_modern(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, window=window,
                       attn_mask=attn_mask, seqlens_q=seqlens_q, seqlens_k=seqlens_k, _shift=(0, -1))


def _chunk_plus_one(q, k, v, *, is_causal=False, scale=None, enable_gqa=False, chunk=None, attn_mask=None,
                    seqlens_q=None, seqlens_k=None):
    return sdpa_modern(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                       chunk=None if chunk is None else chunk + 1, attn_mask=attn_mask,
                       seqlens_q=seqlens_q, seqlens_k=seqlens_k)


def _gqa_modulo(q, k, v, *, is_causal=False, scale=None, enable_gqa=False, attn_mask=None,
                seqlens_q=None, seqlens_k=None):
    return sdpa_modern(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                       attn_mask=attn_mask, seqlens_q=seqlens_q, seqlens_k=seqlens_k, _gqa_tile=True)


def _bounded(side):
    """Cases whose window ``side`` (0 left, 1 right) is bounded: an unbounded one cannot be
    off by one."""
    return lambda case: case.param("window")[side] >= 0


@pytest.mark.parametrize("mutant,feature,words,changes", [
    (_window_left, "window", "left extent is off by one", _bounded(0)),
    (_window_right, "window", "right extent is off by one", _bounded(1)),
    (_chunk_plus_one, "chunk", "chunk size is off by one", None),
    (_gqa_modulo, "gqa", "h % Hkv", lambda case: case.param("kv_heads") > 1),
    (softcap_scale_twice, "softcap", "scale is applied again after the soft-cap", None),
], ids=["window-left+1", "window-right-1", "chunk+1", "gqa-h%Hkv", "softcap-scale-twice"])
def test_mutants_fail(mutant, feature, words, changes):
    rep = verify(mutant, "softmax", backend="torch", dtypes=("float32",), cases=_modern(),
                 causal="both", progress=False)
    assert not rep.passed
    hits = [r for r in _by_feature(rep, feature) if r.verdict != "n/a"]
    failed = [r for r in hits if r.verdict == "fail"]
    # every case of the feature that the bug can change fails (multi-query heads cannot
    # be mapped wrong), with the error far beyond the tolerance
    by_id = {c.id: c for c in _modern()}
    changeable = {r.case for r in hits if changes is None or changes(by_id[r.case])}
    assert changeable and {r.case for r in failed} == changeable, rep.table()
    assert min(r.ratio for r in failed) > 10
    assert all(words in r.diagnosis for r in failed), rep.table()  # and the right diagnosis
    # and nothing else is blamed: cases without the feature still pass
    others = [r for r in rep.results if r.case not in {h.case for h in hits}]
    assert all(r.verdict in ("pass", "n/a") for r in others), rep.table()


def test_alibi_slopes_of_head_h_mod_4_fail_the_five_head_case():
    """A kernel whose ALiBi slopes repeat every 4 heads (slope of head h % 4, a slope table
    sized for 4 heads) passed every case while ALiBi had at most 4 heads; batch 3 x 5
    heads (as _ranges gives the other features) fails it on head 4 alone."""
    def alibi_mod4(q, k, v, *, is_causal=False, scale=None, alibi_slopes=None, seqlens_k=None):
        if alibi_slopes is not None:
            alibi_slopes = alibi_slopes[torch.arange(q.shape[1]) % 4]
        return sdpa_modern(q, k, v, is_causal=is_causal, scale=scale, alibi_slopes=alibi_slopes,
                           seqlens_k=seqlens_k)

    alibi = [c for c in _modern() if "alibi" in c.needs]
    rep = verify(alibi_mod4, "softmax", backend="torch", dtypes=("float32",), cases=alibi,
                 causal="both", progress=False)
    five = [r for r in rep.results if r.case == "alibi:b3h5-q29k37-d16"]
    assert [r.verdict for r in five] == ["fail"], rep.table()
    assert "wrong only on head 4 (of H = 5)" in five[0].diagnosis
    others = [r.verdict for r in rep.results if r.case != five[0].case and r.verdict != "n/a"]
    assert len(others) >= 3 and set(others) == {"pass"}, rep.table()
    assert verify(sdpa_modern, "softmax", backend="torch", dtypes=("float32",), cases=alibi,
                  causal="both", progress=False).passed


def test_exported_vectors_carry_the_options(tmp_path):
    # A reader outside Python gets everything it needs from the files: each golden is
    # recomputed from the stored inputs and the manifest's options alone.
    from conformance import export_vectors, load_vectors

    tags = ("gqa", "window", "alibi", "dropout", "varlen", "combo", "decode")
    picked = [next(c for c in _modern() if c.tag == t) for t in tags]
    export_vectors(tmp_path, "softmax", dtypes=("float32",), cases=picked, causal="both")
    seen = 0
    for entry, arrays in load_vectors(tmp_path):
        opts = entry["options"]
        kw = {n: tuple(x) if isinstance(x, list) else x for n, x in opts.items()}
        for n in ("alibi_slopes", "dropout_mask", "mask", "bias"):
            if n in arrays:
                kw[n] = arrays[n].astype(np.float64) if arrays[n].dtype != np.bool_ else arrays[n]
        q, k, v = (arrays[n].astype(np.float64) for n in ("q", "k", "v"))
        out = softmax_attention(q, k, v, causal=entry["causal"] or False, scale=entry["scale"], **kw)
        np.testing.assert_allclose(out, arrays["golden"], rtol=1e-12, atol=1e-12)
        seen += 1
    assert seen == len(picked)
