"""False passes found by an outside audit of the oracle, each pinned by the planted kernel
that passed before its fix (it must fail now, named where a diagnosis exists) and by a
correct kernel that must still pass the same cases.

The kernels are NumPy (PyTorch where the check needs bfloat16), written from the
definitions or through ``attn_ref``'s public functions with one convention changed, so
each check reads as an outside kernel author's would; each runs on the few cases that
reveal its mistake, not the whole suite.
"""

import numpy as np
import pytest

from attn_ref import softmax_attention
from conformance import cases, verify


def _case(variant, pred):
    found = [c for c in cases(variant, "standard") if pred(c)]
    assert found, f"no {variant} case matches"
    return found


def _softmax(q, k, v, *, bias=None, causal=False, scale=None, softcap=None, alibi_slopes=None,
             cap_after_bias=False, cap_factor=True):
    """Softmax attention from its definition (FlashAttention's order: scale, cap, then bias
    and ALiBi); ``cap_after_bias`` caps the biased logits instead, ``cap_factor=False``
    caps as ``tanh(s / c)``."""
    nq, nk = q.shape[-2], k.shape[-2]
    scale = 1.0 / float(np.sqrt(q.shape[-1])) if scale is None else float(scale)
    s = scale * (q @ np.swapaxes(k, -1, -2))
    add = np.zeros_like(s)
    i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
    if bias is not None:
        add = add + bias
    if alibi_slopes is not None:
        add = add - alibi_slopes.reshape(1, -1, 1, 1) * np.abs(i + nk - nq - j).astype(q.dtype)
    if softcap is not None and not cap_after_bias:
        s = (softcap if cap_factor else 1.0) * np.tanh(s / softcap)
    s = s + add
    if softcap is not None and cap_after_bias:
        s = softcap * np.tanh(s / softcap)
    if causal:
        off = nk - nq if causal == "bottom-right" else 0
        s = np.where(j <= i + off, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def _cap_kernel(cap_after_bias):
    def kernel(q, k, v, *, bias=None, causal=False, scale=None, softcap=None, alibi_slopes=None):
        return _softmax(q, k, v, bias=bias, causal=causal, scale=scale, softcap=softcap,
                        alibi_slopes=alibi_slopes, cap_after_bias=cap_after_bias)
    return kernel


def test_softcap_after_the_bias_or_alibi_fails_where_it_passed_before():
    # Before: the soft-cap cases had neither a bias nor ALiBi, so capping the biased logits
    # was the same function there, and passed the standard suite in float32 and float64.
    capped = _case("softmax", lambda c: c.tag == "softcap")
    both = [c for c in capped if c.bias or "alibi" in c.needs]
    assert len(both) == 2
    for dtype in ("float32", "float64"):
        good = verify(_cap_kernel(False), "softmax", backend="numpy", dtypes=(dtype,),
                      cases=capped, causal="both", progress=False)
        assert good.passed and all(r.verdict == "pass" for r in good.results), good.table()
        bad = verify(_cap_kernel(True), "softmax", backend="numpy", dtypes=(dtype,), cases=both,
                     causal="both", progress=False)
        rows = [r for r in bad.results if r.output == "out"]
        assert [r.verdict for r in rows] == ["fail", "fail"], bad.table()
        assert all("soft-cap is applied after the bias/ALiBi" in r.diagnosis for r in rows)


def test_a_soft_cap_without_its_factor_c_is_named():
    """``tanh(s / c)`` instead of ``c tanh(s / c)`` was named "scaled by 1/d" on the biased
    case (the bias dominates both outputs there) and "no known mistake" elsewhere."""

    def kernel(q, k, v, *, bias=None, causal=False, scale=None, softcap=None, alibi_slopes=None):
        return _softmax(q, k, v, bias=bias, causal=causal, scale=scale, softcap=softcap,
                        alibi_slopes=alibi_slopes, cap_factor=False)

    capped = _case("softmax", lambda c: c.tag == "softcap")
    rep = verify(kernel, "softmax", backend="numpy", dtypes=("float32",), cases=capped, progress=False)
    assert [r.verdict for r in rep.results] == ["fail"] * len(capped), rep.table()
    assert all(r.diagnosis.startswith("the soft-cap's factor c is dropped") for r in rep.results), \
        rep.table()


def test_a_kernel_reading_batch_0s_bias_for_every_entry_fails():
    # Before: every case's bias was (1, H, Nq, Nk), so a kernel with a zero batch stride
    # for the bias (batch 0's bias for every entry) passed the standard suite.
    full = _case("softmax", lambda c: c.bias and c.param("bias_batch", 1) > 1)

    def stride0(q, k, v, *, bias=None, scale=None):
        return softmax_attention(q, k, v, bias=None if bias is None else bias[:1], scale=scale)

    def right(q, k, v, *, bias=None, scale=None):
        return softmax_attention(q, k, v, bias=bias, scale=scale)

    assert verify(right, "softmax", backend="numpy", cases=full, progress=False).passed
    rep = verify(stride0, "softmax", backend="numpy", cases=full, progress=False)
    (row,) = rep.results
    assert row.verdict == "fail" and "batch entries 1..2 (of B = 3)" in row.diagnosis, rep.table()


def test_a_key_padding_mask_read_from_entry_min_b_1_fails():
    # Before: every key-padding mask (B, 1, 1, Nk) had B <= 2, so a kernel whose
    # broadcast-mask path reads entry min(b, 1) (a grid written for two) passed the
    # standard suite in float32 and bfloat16; the 3 x 5 padding case fails it on entry 2.
    padded = _case("softmax", lambda c: c.mask == "padding")
    assert max(c.batch[0] for c in padded) == 3

    def clamped(q, k, v, *, mask=None, scale=None):
        if mask is not None and mask.shape[1] == 1:
            mask = mask[np.minimum(np.arange(mask.shape[0]), 1)]
        return softmax_attention(q, k, v, mask=mask, scale=scale)

    def right(q, k, v, *, mask=None, scale=None):
        return softmax_attention(q, k, v, mask=mask, scale=scale)

    assert verify(right, "softmax", backend="numpy", cases=padded, progress=False).passed
    rep = verify(clamped, "softmax", backend="numpy", cases=padded, progress=False)
    failed = [r for r in rep.results if r.verdict == "fail"]
    assert [r.case for r in failed] == ["range:b3h5-q37k37-d16-mask-padding"], rep.table()
    assert "wrong only on batch entry 2 (of B = 3)" in failed[0].diagnosis
    rest = [r.verdict for r in rep.results if r not in failed and r.verdict != "n/a"]
    assert rest and set(rest) == {"pass"}, rep.table()


def _per_sequence(mistake=None):
    """Padded varlen attention one sequence at a time. ``"clamp"`` takes a sequence's
    offset ``Lk - Lq`` as ``max(Lk - Lq, 0)`` (top-left where it has fewer keys than
    queries); ``"guard"`` reads ``max(Lk, 1)`` keys (key 0 of a sequence with none)."""
    def kernel(q, k, v, *, causal=False, scale=None, seqlens_q=None, seqlens_k=None):
        b, nq, nk = q.shape[0], q.shape[-2], k.shape[-2]
        lqs = seqlens_q if seqlens_q is not None else [nq] * b
        lks = seqlens_k if seqlens_k is not None else [nk] * b
        out = np.zeros(q.shape[:-1] + v.shape[-1:], dtype=q.dtype)
        for i, (lq, lk) in enumerate(zip(lqs, lks)):
            c = "top-left" if mistake == "clamp" and causal and lk < lq else causal
            lk = max(lk, 1) if mistake == "guard" else lk
            if lk:
                out[i, :, :lq] = softmax_attention(q[i, :, :lq], k[i, :, :lk], v[i, :, :lk],
                                                   causal=c, scale=scale)
        return out
    return kernel


@pytest.mark.parametrize("mistake, entry", [("clamp", 0), ("guard", 2)])
def test_a_varlen_kernel_clamping_an_offset_or_guarding_an_empty_sequence_fails(mistake, entry):
    # Before: every per-sequence case had 0 < Lk and Lq <= Lk in each sequence, where
    # neither mistake changes anything: both passed the standard suite in float32 and
    # bfloat16. A sequence of 40 queries on 17 keys fails the clamp (its first 23 rows see
    # no key, bottom-right), one of 9 queries on no key the guard (zeros, not V's key 0).
    varlen = _case("softmax", lambda c: "seqlens_q" in c.needs)
    short = [c for c in varlen if any(a < b for a, b in zip(c.param("seqlens_k"), c.param("seqlens_q")))]
    assert [c.id for c in short] == ["varlen:b3h2-q64k64-d32-causal-br-seqlens_q40x64x9-seqlens_k17x64x0"]
    assert verify(_per_sequence(), "softmax", backend="numpy", cases=varlen, causal="both",
                  progress=False).passed
    rep = verify(_per_sequence(mistake), "softmax", backend="numpy", cases=varlen, causal="both",
                 progress=False)
    failed = [r for r in rep.results if r.verdict == "fail"]
    assert [r.case for r in failed] == [short[0].id], rep.table()
    assert f"wrong only on batch entry {entry} (of B = 3)" in failed[0].diagnosis, failed[0].diagnosis


def _delta_kernel(eps):
    """DeltaNet normalising q and k itself, ``x / sqrt(|x|^2 + eps)`` (fla's eps is 1e-6)."""
    from attn_ref.recurrent import delta_rule

    def kernel(q, k, v, *, beta, scale=None, initial_state=None, output_final_state=False,
               cu_seqlens=None):
        with np.errstate(invalid="ignore", divide="ignore"):
            q, k = (x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps) for x in (q, k))
        return delta_rule(q, k, v, beta=beta, scale=scale, initial_state=initial_state,
                          output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                          form="recurrent")
    return kernel


def test_an_l2_normalisation_with_another_eps_fails_in_float32():
    # Before: q and k were N(0, 1), |k|^2 ~ d, where eps = 0 or 1e-12 instead of 1e-6 moves
    # the normalised keys by ~1e-8, below float32's resolution: both passed in float32.
    small = _case("deltanet", lambda c: c.dist == "small_qk")
    ok = verify(_delta_kernel(1e-6), "deltanet", backend="numpy", cases=small, progress=False,
                supports={"causal": "always"})
    assert ok.passed, ok.table()
    for eps in (0.0, 1e-12):
        rep = verify(_delta_kernel(eps), "deltanet", backend="numpy", cases=small,
                     progress=False, supports={"causal": "always"})
        assert {r.verdict for r in rep.results} == {"fail"}, (eps, rep.table())


def _linear_kernel(eps_added):
    """Non-causal linear attention with ``elu+1`` features, quadratic order; the normaliser
    ``den`` as it is (the reference, for ``den >= 1e-6``) or ``den + 1e-6``."""
    def kernel(q, k, v, *, scale=None):
        scale = 1.0 if scale is None else scale
        fq, fk = (np.where(x > 0, x + 1, np.exp(np.minimum(x, 0))) for x in (q, k))
        a = np.asarray(scale, dtype=q.dtype) * (fq @ np.swapaxes(fk, -1, -2))
        den = a.sum(-1, keepdims=True)
        return (a @ v) / (den + np.asarray(1e-6, dtype=q.dtype) if eps_added else den)
    return kernel


def test_linear_attention_with_eps_added_to_the_denominator_fails_in_float32():
    # Before: den ~ N d on every case, and den + 1e-6 (Katharopoulos et al.'s form) passed
    # the standard suite in float32 (it failed in float64 only).
    small = _case("linear", lambda c: c.tag == "small-denominator")
    ok = verify(_linear_kernel(False), "linear", backend="numpy", cases=small, progress=False)
    assert ok.passed, ok.table()
    rep = verify(_linear_kernel(True), "linear", backend="numpy", cases=small, progress=False)
    (row,) = rep.results
    assert row.verdict == "fail" and row.ratio > 20, rep.table()


def test_a_kernel_returning_its_input_fails():
    # Before: a kernel that returned v itself where every row attends one key (the exact
    # values) passed: its output aliased its input.
    one = _case("softmax", lambda c: c.nk == 1)

    def shortcut(q, k, v, *, scale=None):
        if k.shape[-2] == 1 and q.shape[-2] == 1:
            return v
        return softmax_attention(q, k, v, scale=scale)

    def viewed(q, k, v, *, scale=None):
        return softmax_attention(q, k, v, scale=scale) if k.shape[-2] > 1 else v[..., :, :]

    for kernel in (shortcut, viewed):
        rep = verify(kernel, "softmax", backend="numpy", cases=one, progress=False)
        (row,) = rep.results
        assert row.verdict == "fail" and "input 'v' or a view of it" in row.diagnosis, rep.table()
    good = verify(lambda q, k, v: softmax_attention(q, k, v), "softmax", backend="numpy",
                  cases=one, progress=False)
    assert good.passed, good.table()


def _padded(per_sequence):
    """A KV-cache kernel with a window and ALiBi: per sequence (the reference's own
    ``seqlens_k``), or by masking the keys past each length in one padded call, which
    measures the window and ALiBi from the padded end ``Nk - Nq`` instead."""
    def kernel(q, k, v, *, causal=False, window=None, alibi_slopes=None, seqlens_k=None):
        kw = dict(causal=causal, window=window, alibi_slopes=alibi_slopes)
        if per_sequence:
            return softmax_attention(q, k, v, seqlens_k=seqlens_k, **kw)
        keep = np.arange(k.shape[-2]) < np.asarray(seqlens_k).reshape(-1, 1, 1, 1)
        return softmax_attention(q, k, v, mask=keep, **kw)
    return kernel


def test_window_and_alibi_from_the_padded_end_fail():
    # Before: no case had a window or ALiBi together with per-sequence lengths, and a kernel
    # that measured them from the padded end passed the standard suite.
    both = _case("softmax", lambda c: c.param("seqlens_k") and c.needs & {"window", "alibi"}
                 and "gqa" not in c.needs)
    assert len(both) == 2
    good = verify(_padded(True), "softmax", backend="numpy", cases=both, causal="both",
                  progress=False)
    assert good.passed and all(r.verdict == "pass" for r in good.results), good.table()
    bad = verify(_padded(False), "softmax", backend="numpy", cases=both, causal="both",
                 supports={"mask": False}, progress=False)
    assert [r.verdict for r in bad.results] == ["fail", "fail"], bad.table()
    assert all("wrong only on batch entry 1 (of B = 2)" in r.diagnosis for r in bad.results)


def test_a_bfloat16_store_by_truncation_is_named_not_low_precision_accumulation():
    # A kernel exact in float32 whose bfloat16 store drops the low 16 bits (rounds toward
    # zero) fails the constant-keys case (outputs near-equal along each row, RMS 0.58 ulp
    # against rounding's 0.29) and was diagnosed "accumulates in low precision ... P V
    # and row sum accumulated 16 keys at a time", a wrong cause; rounded to nearest, the
    # same kernel passes.
    torch = pytest.importorskip("torch")
    case = _case("softmax", lambda c: c.dist == "constant_keys")

    def kernel(truncate):
        def fn(q, k, v, *, scale=None):
            s = (q.float() @ k.float().transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
            o = torch.softmax(s, dim=-1) @ v.float()
            if truncate:
                o = (o.contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32)
            return o.to(torch.bfloat16)
        return fn

    good = verify(kernel(False), "softmax", backend="torch", dtypes=("bfloat16",), cases=case, progress=False)
    assert good.passed, good.table()
    bad = verify(kernel(True), "softmax", backend="torch", dtypes=("bfloat16",), cases=case, progress=False)
    (row,) = bad.results
    assert row.verdict == "fail", bad.table()
    assert row.diagnosis.startswith("the output is rounded toward zero (truncated) to bfloat16"), \
        row.diagnosis


def test_an_error_that_only_grows_with_n_is_not_named_low_precision():
    # A GLA kernel exact in float32 that loses the decay of every 1024th step fails the
    # 4096-step case in bfloat16 at 98.8x a plain implementation's error, growing with N;
    # no low-precision state reproduces it, yet it read "the kernel accumulates in low
    # precision". Growth is now reported as a measurement, with no cause.
    pytest.importorskip("torch")
    from attn_ref.recurrent import gated_linear_attention

    def kernel(q, k, v, *, g, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
        g = g.float().clone()
        g[..., 1024::1024, :] = 0.0
        out = gated_linear_attention(q.float(), k.float(), v.float(), g=g, scale=scale,
                                     initial_state=initial_state, output_final_state=output_final_state,
                                     cu_seqlens=cu_seqlens)
        return (out[0].to(q.dtype), out[1]) if output_final_state else out.to(q.dtype)

    long = [c for c in cases("gla", "exhaustive") if c.family == "recurrent" and c.nq == 4096]
    rep = verify(kernel, "gla", backend="torch", dtypes=("bfloat16",), cases=long, progress=False,
                 supports={"causal": "always"})
    (out,) = [r for r in rep.results if r.output == "out"]
    assert out.verdict == "fail", rep.table()
    assert not out.diagnosis.startswith("the kernel accumulates in low precision"), out.diagnosis
    assert "grows with N" in out.diagnosis, out.diagnosis
    assert "no low-precision accumulator tried reproduces it" in out.diagnosis


def test_favor_features_without_the_stabiliser_are_named():
    # performer_attention with stabilize=False (exp(W x - |x|^2/2), no max W x subtracted)
    # is the same function in real arithmetic; on the one-hot case every feature of a row
    # underflows. It failed there, named "a plain bfloat16 implementation's size"
    # (float32) or "features floored after the stabiliser" (float16): wrong causes.
    from attn_ref import performer_attention

    def unstable(q, k, v, *, projection, kernel="positive", causal=False, scale=None, chunk_size=64):
        a = np.float64 if q.dtype == np.float64 else np.float32
        out = performer_attention(q.astype(a), k.astype(a), v.astype(a), projection=projection.astype(a),
                                  kernel=kernel, causal=causal, scale=scale, chunk_size=chunk_size,
                                  stabilize=False)
        return out.astype(q.dtype)

    peaked = _case("performer", lambda c: c.dist == "one_hot")
    for dtype in ("float32", "float16"):
        rep = verify(unstable, "performer", backend="numpy", dtypes=(dtype,), cases=peaked, progress=False)
        (row,) = rep.results
        assert row.verdict == "fail", rep.table()
        assert row.diagnosis.startswith("FAVOR+ features without the stabiliser"), row.diagnosis


# ------------------------------------------- grouped-query heads with per-head inputs


@pytest.mark.parametrize("name", ["bias", "alibi_slopes", "dropout_mask"])
def test_per_query_head_inputs_read_at_the_kv_head_fail_under_gqa(name):
    """The bias, ALiBi's slope and the dropout keep-mask belong to the query head; a kernel
    reading them at its kv head's index (``h // group``) passed every case before the
    cases combined them with GQA. The reference itself passes the same cases."""

    def kernel(q, k, v, *, gqa=False, bias=None, alibi_slopes=None, dropout_mask=None,
               dropout_p=0.0, mistake=True):
        given = {"bias": bias, "alibi_slopes": alibi_slopes, "dropout_mask": dropout_mask}
        x = given[name]
        if mistake and x is not None and gqa:
            heads = q.shape[1]
            at_kv = np.arange(heads) // (heads // k.shape[1])
            given[name] = x[at_kv] if name == "alibi_slopes" else x[:, at_kv]
        return softmax_attention(q, k, v, gqa=gqa, dropout_p=dropout_p,
                                 **{n: x for n, x in given.items() if x is not None})

    def right(q, k, v, *, gqa=False, bias=None, alibi_slopes=None, dropout_mask=None,
              dropout_p=0.0):
        return kernel(q, k, v, gqa=gqa, bias=bias, alibi_slopes=alibi_slopes,
                      dropout_mask=dropout_mask, dropout_p=dropout_p, mistake=False)

    few = _case("softmax", lambda c: c.tag.startswith("gqa-"))
    bad = verify(kernel, "softmax", backend="numpy", dtypes=("float32",), cases=few,
                 progress=False)
    failed = [r.case.split(":")[0] for r in bad.results if r.verdict == "fail"]
    assert failed == [{"bias": "gqa-bias", "alibi_slopes": "gqa-alibi",
                       "dropout_mask": "gqa-dropout"}[name]], bad.table()
    assert verify(right, "softmax", backend="numpy", dtypes=("float32",), cases=few,
                  progress=False).passed


def _tiled_softmax(skip_below, block):
    """A FlashAttention-style loop over key blocks of ``block``, float32, that skips the
    rescale of its running sums when the running maximum rose by less than
    ``skip_below`` (and still takes the new maximum): a "fast path"."""

    def kernel(q, k, v, *, scale=None):
        scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
        q, k, v = (np.asarray(x, dtype=np.float32) for x in (q, k, v))
        m = np.full(q.shape[:-1] + (1,), -np.inf, dtype=np.float32)
        row_sum = np.zeros_like(m)
        acc = np.zeros(q.shape[:-1] + (v.shape[-1],), dtype=np.float32)
        for j0 in range(0, k.shape[-2], block):
            s = np.float32(scale) * (q @ np.swapaxes(k[..., j0:j0 + block, :], -1, -2))
            new = np.maximum(m, s.max(axis=-1, keepdims=True))
            alpha = np.where(new - m < skip_below, np.float32(1), np.exp(m - new))
            p = np.exp(s - new)
            acc = acc * alpha + p @ v[..., j0:j0 + block, :]
            row_sum = row_sum * alpha + p.sum(axis=-1, keepdims=True)
            m = new
        return acc / row_sum

    return kernel


@pytest.mark.parametrize("block", [16, 64, 256])
def test_a_skipped_rescale_for_small_moves_of_the_maximum_fails_the_rising_case(block):
    """An online softmax that skips the rescale when its running maximum moved by less
    than 1e-5 passed every case (random logits settle their maximum within a few blocks);
    the rising case (each row's logits creep up along 4096 keys) fails it at key blocks
    of 16 to 256. Without the fast path the same loop passes."""
    rising = _case("softmax", lambda c: c.dist == "rising")
    bad = verify(_tiled_softmax(1e-5, block), "softmax", backend="numpy", dtypes=("float32",),
                 cases=rising, progress=False)
    assert [r.verdict for r in bad.results] == ["fail"], bad.table()
    good = verify(_tiled_softmax(0.0, block), "softmax", backend="numpy", dtypes=("float32",),
                  cases=rising, progress=False)
    assert good.passed, good.table()
    # without the rising case, the fast path passed the whole standard suite's exact cases
    others = _case("softmax", lambda c: c.dist != "rising" and c.needs <= {"scale"}
                   and c.nq * c.nk <= 1 << 20)
    assert verify(_tiled_softmax(1e-5, block), "softmax", backend="numpy", dtypes=("float32",),
                  cases=others, progress=False).passed


# ------------------------------------------- causal FAVOR+ stabilised with future keys


def _causal_favor(global_key_max):
    """Causal FAVOR+ in float32 (positive features of the projection the oracle passes,
    quadratic form): each key's features stabilised by its own largest exponent and
    re-weighted by ``exp(c_j - max_{j' <= i} c_j')`` per query (exact), or by one maximum
    over every key, the future's included (performer-pytorch's causal path): the same in
    exact arithmetic, unless the earlier keys' features underflow."""

    def kernel(q, k, v, *, projection, causal=False, scale=None):
        q, k, v, w = (np.asarray(x, dtype=np.float32) for x in (q, k, v, projection))
        d, m = q.shape[-1], w.shape[0]
        r = np.float32(np.sqrt(1.0 / np.sqrt(d) if scale is None else scale))
        eq, ek = ((x * r) @ w.T - np.sum((x * r) ** 2, axis=-1, keepdims=True) / 2
                  for x in (q, k))
        fq = np.exp(eq - eq.max(axis=-1, keepdims=True)) / float(np.sqrt(m))
        c = ek.max(axis=(-1, -2) if global_key_max else -1, keepdims=True)
        fk = np.exp(ek - c) / float(np.sqrt(m))
        c = np.broadcast_to(c, ek.shape[:-1] + (1,))[..., 0]  # (B, H, Nk)
        seen = np.tril(np.ones((q.shape[-2], k.shape[-2]), dtype=bool))
        cm = np.where(seen, c[..., None, :], -np.inf)
        a = (fq @ np.swapaxes(fk, -1, -2)) * np.where(seen, np.exp(cm - cm.max(-1, keepdims=True)), 0)
        return (a @ v) / a.sum(axis=-1, keepdims=True)

    return kernel


def test_causal_favor_stabilised_by_a_maximum_over_future_keys_fails():
    """Stabilising every key by the largest exponent of all keys cancels in exact
    arithmetic, but where the later keys' exponents are ~100 above the earlier ones'
    (the fading-keys case) the features each earlier query sees underflow in float32.
    Such a kernel passed every case before that case; the per-key form passes it."""
    fading = _case("performer", lambda c: c.dist == "fading_keys")
    bad = verify(_causal_favor(True), "performer", backend="numpy", dtypes=("float32",),
                 cases=fading, progress=False)
    assert [r.verdict for r in bad.results] == ["fail"], bad.table()
    good = verify(_causal_favor(False), "performer", backend="numpy", dtypes=("float32",),
                  cases=fading, progress=False)
    assert good.passed, good.table()
    causal = _case("performer", lambda c: c.dist != "fading_keys" and c.causal == "top-left"
                   and c.needs <= {"causal"})
    assert verify(_causal_favor(True), "performer", backend="numpy", dtypes=("float32",),
                  cases=causal, progress=False).passed


def test_the_rising_case_is_judged_for_the_forward_only():
    """Its gradient rows are n/a, saying why (the fused bounds' saved output), and the
    forward row is judged."""
    torch = pytest.importorskip("torch")
    from conformance.grads import FORWARD_ONLY

    rising = _case("softmax", lambda c: c.dist == "rising")

    def kernel(q, k, v, *, scale=None):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)

    rep = verify(kernel, "softmax", backend="torch", dtypes=("float32",), cases=rising,
                 grads=True, progress=False)
    rows = {r.output: r for r in rep.results}
    assert rows["out"].verdict == "pass" and set(rows) == {"out", "grads"}, rep.table()
    assert rows["grads"].verdict == "n/a" and rows["grads"].diagnosis == FORWARD_ONLY


# ------------------------------------------- dK, dV accumulated in the dtype across query blocks


def _blockwise_backward_function(accumulate_in_dtype, block=64):
    """Softmax attention as a torch Function whose backward goes over query blocks of
    ``block`` rows, each block's ``P``, ``dP``, ``D`` and ``dS`` in float32, adding its
    part of ``dK`` and ``dV`` to running sums kept in float32 (as FlashAttention's
    backward keeps them) or, with ``accumulate_in_dtype``, stored in the input dtype after
    every block."""
    import torch

    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, scale):
            s = (q.float() @ k.float().transpose(-1, -2)) * scale
            p = torch.softmax(s, dim=-1)
            out = (p @ v.float()).to(q.dtype)
            ctx.save_for_backward(q, k, v, out)
            ctx.scale = scale
            return out

        @staticmethod
        def backward(ctx, do):
            q, k, v, out = ctx.saved_tensors
            scale, acc = ctx.scale, torch.float32
            dq = torch.empty_like(q, dtype=acc)
            dk = torch.zeros_like(k, dtype=q.dtype if accumulate_in_dtype else acc)
            dv = torch.zeros_like(dk)
            kf, vf = k.float(), v.float()
            for i0 in range(0, q.shape[-2], block):
                qi, doi = q[..., i0:i0 + block, :].float(), do[..., i0:i0 + block, :].float()
                p = torch.softmax((qi @ kf.transpose(-1, -2)) * scale, dim=-1)
                dp = doi @ vf.transpose(-1, -2)
                d = (doi * out[..., i0:i0 + block, :].float()).sum(-1, keepdim=True)
                ds = p * (dp - d)
                dq[..., i0:i0 + block, :] = (ds @ kf) * scale
                dk = (dk.float() + (ds.transpose(-1, -2) @ qi) * scale).to(dk.dtype)
                dv = (dv.float() + p.transpose(-1, -2) @ doi).to(dv.dtype)
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None

    def kernel(q, k, v, *, scale=None):
        return Attention.apply(q, k, v, q.shape[-1] ** -0.5 if scale is None else scale)

    return kernel


def test_dk_dv_summed_in_the_dtype_over_query_blocks_fail_the_fused_bounds():
    """Declared fp32-accumulating, a backward that stores its running dK and dV in
    bfloat16 after each block of 64 queries fails the long-queries case (16384 queries:
    256 blocks); with float32 running sums the same loop passes it."""
    pytest.importorskip("torch")
    long_queries = [c for c in cases("softmax", "standard", grads=True) if c.tag == "long-queries"]
    assert long_queries
    sup = {"backward": "fp32-accumulate"}

    def rows(accumulate_in_dtype):
        rep = verify(_blockwise_backward_function(accumulate_in_dtype), "softmax",
                     backend="torch", dtypes=("bfloat16",), cases=long_queries, grads=True,
                     supports=sup, progress=False)
        return {r.output: r.verdict for r in rep.results}

    assert rows(False) == {"out": "pass", "dq": "pass", "dk": "pass", "dv": "pass"}
    assert rows(True) == {"out": "pass", "dq": "pass", "dk": "fail", "dv": "fail"}


# ------------------------------------------------ values the cases never varied (sparse audit)


def test_a_kernel_ignoring_the_alibi_slopes_it_is_given_fails():
    """Every ALiBi case passed exactly the paper's slopes 2^(-8h/H), so a kernel computing
    those itself and ignoring ``alibi_slopes`` passed them all; the cases' slopes are now
    drawn from the seed. It fails every ALiBi case, named; the definition passes."""

    def paper(q, k, v, *, bias=None, causal=False, scale=None, softcap=None, alibi_slopes=None):
        h = q.shape[1]
        own = 2.0 ** (-8.0 * np.arange(1, h + 1) / h)
        return _softmax(q, k, v, bias=bias, causal=causal, scale=scale, softcap=softcap,
                        alibi_slopes=own.astype(q.dtype))

    alibi = _case("softmax", lambda c: "alibi" in c.needs and "gqa" not in c.needs
                  and "seqlens_k" not in c.needs)
    bad = verify(paper, "softmax", backend="numpy", dtypes=("float32",), cases=alibi, progress=False)
    assert [r.verdict for r in bad.results] == ["fail"] * len(alibi), bad.table()
    assert all(r.diagnosis.startswith("the alibi_slopes argument ignored") for r in bad.results)
    assert verify(_cap_kernel(False), "softmax", backend="numpy", dtypes=("float32",), cases=alibi,
                  progress=False).passed


def test_a_window_left_side_of_minus_1_read_as_a_bound_fails():
    """FlashAttention's causal sliding window is (-1, 0); with no case's left side -1, a
    kernel reading it as the bound j >= i + Lk - Lq + 1 passed every case. It fails both
    such cases now, named."""

    def kernel(q, k, v, *, window=None, literal=True):
        left, right = window
        if not literal or left >= 0:
            return softmax_attention(q, k, v, window=window)
        nq, nk = q.shape[-2], k.shape[-2]
        i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
        pos = i + nk - nq
        allowed = (j >= pos + 1) & ((j <= pos + right) if right >= 0 else True)
        return softmax_attention(q, k, v, mask=np.broadcast_to(allowed, (nq, nk)))

    def right(q, k, v, *, window=None):
        return kernel(q, k, v, window=window, literal=False)

    unbounded = _case("softmax", lambda c: "window" in c.needs and c.param("window")[0] == -1)
    assert {c.nq == c.nk for c in unbounded} == {True, False}
    bad = verify(kernel, "softmax", backend="numpy", dtypes=("float32",), cases=unbounded,
                 progress=False)
    assert [r.verdict for r in bad.results] == ["fail"] * len(unbounded), bad.table()
    assert all(r.diagnosis.startswith("the window's left side -1 (unbounded) is read as")
               for r in bad.results), bad.table()
    assert verify(right, "softmax", backend="numpy", dtypes=("float32",), cases=unbounded,
                  progress=False).passed


SPARSE_PATTERNS = ("local", "longformer", "bigbird", "strided", "fixed", "block_sparse")


def _option_cases(variant, long=False):
    return [c for c in cases(variant, "standard") if c.tag == "options" and (c.nq >= 1000) == long]


@pytest.mark.parametrize("variant", SPARSE_PATTERNS)
def test_a_sparse_kernel_hard_coding_its_registered_options_fails(variant):
    """Every sparse case ran at the registered options, so a kernel that takes its options
    and ignores them (the audit's ``fixed`` with summary only the block's last position:
    the registered ``summary=1``) passed them all. Each variant's option cases set other
    values; the reference passes them, the kernel keeping the registered ones fails."""
    import inspect

    from attn_ref.registry import get

    v = get(variant)
    registered = dict(v.options) or {"block_size": 4}

    def hard_coded(q, k, v_, **kw):
        return v.fn(q, k, v_, **{**kw, **registered})

    hard_coded.__signature__ = inspect.signature(v.fn)
    few = _option_cases(variant)
    assert len(few) == 2
    bad = verify(hard_coded, variant, backend="numpy", dtypes=("float32",), cases=few, progress=False)
    assert all(r.verdict in ("fail", "error") for r in bad.results), bad.table()
    good = verify(v.fn, variant, backend="numpy", dtypes=("float32",), cases=few, progress=False)
    assert [r.verdict for r in good.results] == ["pass", "pass"], good.table()


def test_an_option_the_kernel_does_not_take_makes_its_cases_not_applicable():
    """A kernel without a ``summary`` parameter computes the function of its one value:
    the cases that set another are n/a for it, saying which option, not failed."""
    from attn_ref.sparse import fixed_attention

    def kernel(q, k, v, *, stride, causal=True, scale=None):
        return fixed_attention(q, k, v, stride=stride, causal=causal, scale=scale)

    rep = verify(kernel, "fixed", backend="numpy", dtypes=("float32",), cases=_option_cases("fixed"),
                 progress=False)
    assert [r.verdict for r in rep.results] == ["n/a", "n/a"]
    assert all("option summary=2" in r.diagnosis for r in rep.results), rep.table()


def test_causal_longformer_with_global_columns_in_the_future_fails():
    """The only registered global token is position 0, which no query has in its future:
    a causal kernel that lets every query see every global key passed. The option cases
    put a global token mid-sequence."""
    from attn_ref.sparse import longformer_weights

    def kernel(q, k, v, *, window, global_tokens, causal=False, scale=None, mistake=True):
        q, k, v = (np.asarray(x, np.float32) for x in (q, k, v))
        allowed = np.asarray(longformer_weights(q, k, window=window, global_tokens=global_tokens,
                                                causal=causal, scale=scale)) > 0
        if mistake:
            allowed = allowed | np.isin(np.arange(k.shape[-2]), global_tokens)
        scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
        s = np.where(allowed, scale * (q @ np.swapaxes(k, -1, -2)), -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        return ((p / p.sum(-1, keepdims=True)) @ v).astype(np.float32)

    def right(q, k, v, *, window, global_tokens, causal=False, scale=None):
        return kernel(q, k, v, window=window, global_tokens=global_tokens, causal=causal,
                      scale=scale, mistake=False)

    few = _option_cases("longformer")
    bad = verify(kernel, "longformer", backend="numpy", dtypes=("float32",), cases=few, progress=False)
    assert {r.case: r.verdict for r in bad.results} == {
        c.id: "fail" if c.causal else "pass" for c in few}, bad.table()
    assert verify(right, "longformer", backend="numpy", dtypes=("float32",), cases=few,
                  progress=False).passed


def _float16_sums(variant, in_float16):
    """A sparse kernel whose ``P V`` and row sum run over blocks of 16 keys, the running
    sums kept in float16 (``in_float16``) or float32; the logits and exponentials in
    float32 (the weights from the pattern's ``weights``, unnormalised by their row
    maximum)."""
    import inspect

    from attn_ref.registry import get

    ref = get(variant)

    def kernel(q, k, v, **kw):
        p = np.asarray(ref.weights(q.astype(np.float32), k.astype(np.float32), **kw), np.float32)
        p = p / p.max(-1, keepdims=True)
        acc = np.float16 if in_float16 else np.float32
        o = np.zeros(p.shape[:-1] + (v.shape[-1],), acc)
        row = np.zeros(p.shape[:-1] + (1,), acc)
        vf = v.astype(np.float32)
        for j0 in range(0, p.shape[-1], 16):
            pb = p[..., j0:j0 + 16]
            o = (o.astype(np.float32) + pb @ vf[..., j0:j0 + 16, :]).astype(acc)
            row = (row.astype(np.float32) + pb.sum(-1, keepdims=True)).astype(acc)
        return (o.astype(np.float32) / row.astype(np.float32)).astype(q.dtype)

    kernel.__signature__ = inspect.signature(ref.fn)
    return kernel


@pytest.mark.parametrize("variant", ["local", "bigbird"])
def test_sparse_sums_kept_in_float16_fail_the_wide_option_case(variant):
    """At the registered options a row has 7 (local) to about 24 (BigBird) keys, one or
    two roundings of a float16 accumulator: such a kernel passed every float16 case. The
    long option case (window 300; blocks of 48) gives rows hundreds of keys on
    offset values; the same loop with float32 sums passes."""
    (wide,) = _option_cases(variant, long=True)

    def verdict(in_float16):
        rep = verify(_float16_sums(variant, in_float16), variant, backend="numpy",
                     dtypes=("float16",), cases=[wide], progress=False)
        return rep.results[0].verdict

    assert verdict(True) == "fail"
    assert verdict(False) == "pass"


def _clustered(q, k, v, *, num_clusters, seed, iterations=10, scale=None, empty="keep", steps=0):
    """Clustered attention (Vyas et al. 2020) from its definition, k-means as attn_ref
    states it (initial rows ``permutation(N, seed)[:C]``, nearest centroid with ties to
    the lower index, a final assignment); ``empty``: what an empty cluster's centroid
    becomes ("keep" its position, "nan" from 0 / 0, "zero"); ``steps`` Lloyd steps more."""
    q, k, v = np.broadcast_arrays(q, k, v)
    scale = q.dtype.type(1 / np.sqrt(q.shape[-1]) if scale is None else scale)
    cent = q[..., np.random.default_rng(seed).permutation(q.shape[-2])[:num_clusters], :]

    def nearest(c):
        return np.argmin(np.sum(c * c, -1)[..., None, :] - 2 * q @ np.swapaxes(c, -1, -2), -1)

    for _ in range(iterations + steps):
        onehot = (nearest(cent)[..., None] == np.arange(num_clusters)).astype(q.dtype)
        count = np.sum(onehot, -2)[..., None]
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = (np.swapaxes(onehot, -1, -2) @ q) / count
        cent = {"keep": np.where(count > 0, mean, cent), "nan": mean,
                "zero": np.nan_to_num(mean, nan=0.0)}[empty]
    s = cent @ np.swapaxes(k, -1, -2) * scale
    p = np.exp(s - np.max(s, -1, keepdims=True))
    oc = (p / np.sum(p, -1, keepdims=True)) @ v
    return np.take_along_axis(oc, nearest(cent)[..., None], -2)


def test_an_empty_kmeans_cluster_and_an_iteration_more_or_fewer_fail():
    """On random queries no k-means cluster ever empties and ten Lloyd steps have mostly
    converged: an independent audit's kernels dividing 0 / 0 for an empty cluster, or
    resetting its centroid to the origin, passed every case, and one step more or fewer
    failed 5 or 6 standard cases and no quick one. The cases with a query repeated at two
    initial centroid rows, and at 1 and 2 iterations, fail them in the quick suite; the
    iteration mistakes are named."""
    import functools

    mine = _case("clustered", lambda c: c.tag in ("empty-cluster", "iterations"))
    assert [c.tag for c in mine] == ["empty-cluster", "iterations", "iterations"]
    assert mine == _case("clustered_topk", lambda c: c.tag in ("empty-cluster", "iterations"))
    quick = [c for c in cases("clustered", "quick") if c.tag in ("empty-cluster", "iterations")]
    assert [c.id for c in quick] == [c.id for c in mine]
    for seed in (0, 1):
        rep = verify(_clustered, "clustered", backend="numpy", dtypes=("float64", "float32"),
                     cases=mine, seed=seed, progress=False)
        assert rep.passed and max(r.ratio for r in rep.results) < 0.5, rep.table()
        for empty in ("nan", "zero"):
            rep = verify(functools.partial(_clustered, empty=empty), "clustered", backend="numpy",
                         dtypes=("float64",), cases=mine, seed=seed, progress=False)
            assert [r.case for r in rep.failures] == [mine[0].id], rep.table()
        for steps, words in ((1, "one Lloyd iteration more"), (-1, "one Lloyd iteration fewer")):
            rep = verify(functools.partial(_clustered, steps=steps), "clustered", backend="numpy",
                         dtypes=("float64",), cases=mine[1:], seed=seed, progress=False)
            assert rep.failures and all(words in r.diagnosis for r in rep.failures), rep.table()
