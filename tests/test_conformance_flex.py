"""The oracle on PyTorch's FlexAttention (``torch.nn.attention.flex_attention``).

FlexAttention takes no option flags: a model author writes each option as a
``mask_mod`` (causal, sliding window, boolean masks, document masks) or a ``score_mod``
(soft-capping, additive bias, ALiBi), and FlexAttention applies them to ``scale q.k``.
:func:`flex` writes every softmax option of the oracle that way, as the PyTorch blog
and attention-gym (pytorch-labs' collection of mods) write them; padded variable-length
batches (``seqlens_q``/``seqlens_k``) are packed into one sequence with a document mask,
the way FlexAttention users run packed batches. ``enable_gqa=True``, ``scale=`` and
``return_aux=AuxRequest(lse=True)`` are FlexAttention's own.

The eager path is run (PyTorch's unfused reference implementation of the same
function): FlexAttention's backward does not run on CPU, and ``torch.compile`` of it on
this CPU took 96 s for one shape and set of mods, and there takes neither ``return_lse``
nor float64 (docs/conformance.md, "Third-party kernels").

Outcomes (docs/conformance.md): the options pass, ``lse`` rows too, in float64, float32,
bfloat16 and float16; each small planted bug fails with a diagnosis that names it;
attention-gym's ALiBi ``score + slope * (kv_idx - q_idx)`` is another function off a
causal mask, and the failure names it.
"""

import functools
import os

import pytest
import torch

from conformance import cases, verify

# the eager path is what is calibrated (module docstring); it warns on its first call
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

# ATTN_REF_FLEX_FULL=1: the pass tests run the whole standard suite (minutes) instead of
# one case per option; the figures of docs/conformance.md come from that run
FULL = os.environ.get("ATTN_REF_FLEX_FULL", "") == "1"


def _documents(lens, device):
    """Document id and position in its document of each packed token."""
    lens = torch.tensor(lens, device=device)
    doc = torch.repeat_interleave(torch.arange(len(lens), device=device), lens)
    start = torch.cumsum(lens, 0) - lens
    return doc, torch.arange(int(lens.sum()), device=device) - start[doc]


def _pack(x, lens):
    """``(B, H, N, d)`` padded -> ``(1, H, sum(lens), d)``, each sequence's first tokens."""
    return torch.cat([x[b, :, :n] for b, n in enumerate(lens)], dim=-2)[None]


def flex(q, k, v, *, mask=None, bias=None, causal=False, scale=None, enable_gqa=False,
         window=None, chunk=None, softcap=None, alibi_slopes=None, seqlens_q=None, seqlens_k=None,
         plant=None, alibi="flash"):
    """Softmax attention with every option as a FlexAttention mod; ``(out, lse)``.

    ``causal`` is the oracle's alignment string (``causal="both"``): bottom-right is
    query ``i`` at key position ``i + Lk - Lq``, as the window, Llama 4's chunks
    (attention-gym's ``generate_chunked_mask`` on those positions) and ALiBi are. With
    ``seqlens_q``/``seqlens_k`` the batch is packed into one sequence and a document mask
    keeps each query in its own sequence. ``alibi="flash"``: ``-slope |i + Lk - Lq - j|``
    (FlashAttention's, the oracle's); ``"gym"``: attention-gym's ``generate_alibi_bias``,
    ``+ slope (j - i)``; ``"flipped"``: ``+ slope |i + Lk - Lq - j|``; ``"top-left"``:
    ``-slope |i - j|``. ``plant`` puts one small bug in (:data:`PLANTS`).
    """
    b_, h_, nq, _ = q.shape
    nk, dev = k.shape[-2], q.device
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scale = scale * 1.01 if plant == "scale" else scale
    if alibi_slopes is not None and plant == "alibi":
        alibi_slopes = alibi_slopes * 1.01
    if softcap is not None and plant == "softcap":
        softcap = softcap * 1.01
    if window is not None and plant == "window" and window[0] >= 0:
        window = (window[0] + 1, window[1])
    if chunk is not None and plant == "chunk":
        chunk = chunk + 1
    reach = 1 if plant == "causal" else 0
    mask = None if mask is None else mask.expand(b_, h_, nq, nk)
    bias = None if bias is None else bias.expand(b_, h_, nq, nk)
    # K, V with fewer heads than Q (one: the broadcast cases) are grouped-query heads to
    # FlexAttention; a batch of one broadcasts as it is
    enable_gqa = enable_gqa or k.shape[1] != h_
    packed = seqlens_q is not None or seqlens_k is not None
    lq = tuple(seqlens_q) if seqlens_q is not None else (nq,) * b_
    lk = tuple(seqlens_k) if seqlens_k is not None else (nk,) * b_
    if packed:
        # one sequence of documents: batch entry b of the oracle is document b
        doc_q, pos_q = _documents(lq, dev)
        doc_k, pos_k = _documents(lk, dev)
        same_q, same_k = doc_q, doc_k
        if plant == "document":
            # the boundary between sequences 0 and 1 ignored: one document for the mask
            same_q, same_k = torch.where(doc_q == 1, 0, doc_q), torch.where(doc_k == 1, 0, doc_k)
        off = torch.tensor(lk, device=dev) - torch.tensor(lq, device=dev)
        q, k, v = _pack(q, lq), _pack(k, lk), _pack(v, lk)

        def where(b, qi, ki):
            # (sequence, query position, key position) of a packed pair
            return doc_q[qi], pos_q[qi], pos_k[ki]
    else:
        off = torch.full((b_,), nk - nq, device=dev)

        def where(b, qi, ki):
            return b, qi, ki

    def mask_mod(b, h, qi, ki):
        s, i, j = where(b, qi, ki)
        ok = same_q[qi] == same_k[ki] if packed else i >= 0
        if causal:
            ok = ok & (j <= i + (0 if causal == "top-left" else off[s]) + reach)
        if window is not None:
            left, right = window
            if left >= 0:
                ok = ok & (j >= i + off[s] - left)
            if right >= 0:
                ok = ok & (j <= i + off[s] + right)
        if chunk is not None:
            ok = ok & ((i + off[s]) // chunk == j // chunk)
        if mask is not None:
            ok = ok & mask[s, h, i, j]
        return ok

    def score_mod(score, b, h, qi, ki):
        s, i, j = where(b, qi, ki)
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if bias is not None:
            score = score + bias[s, h, i, j]
        if alibi_slopes is not None:
            if alibi == "gym":
                score = score + alibi_slopes[h] * (j - i)
            elif alibi == "flipped":
                score = score + alibi_slopes[h] * (i + off[s] - j).abs()
            elif alibi == "top-left":
                score = score - alibi_slopes[h] * (i - j).abs()
            else:
                score = score - alibi_slopes[h] * (i + off[s] - j).abs()
        return score

    # imported here: FlexAttention's module loads torch's compiler stack (about a second),
    # which only the worker running these tests needs
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    block_mask = create_block_mask(mask_mod, 1 if packed else b_, h_, q.shape[-2], k.shape[-2],
                                   device=dev)
    out, aux = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                              enable_gqa=enable_gqa, return_aux=AuxRequest(lse=True))
    if not packed:
        return out, aux.lse
    # back to the padded batch: rows past a sequence's length see no key (zeros, lse -inf)
    o = out.new_zeros((b_, h_, nq, v.shape[-1]))
    lse = aux.lse.new_full((b_, h_, nq), -torch.inf)
    for b in range(b_):
        rows = doc_q == b
        o[b, :, :lq[b]], lse[b, :, :lq[b]] = out[0][:, rows], aux.lse[0][:, rows]
    return o, lse


def _kernel(**fixed):
    """:func:`flex` with some keywords fixed, under the signature the oracle reads."""
    @functools.wraps(flex)
    def kernel(q, k, v, *, mask=None, bias=None, causal=False, scale=None, enable_gqa=False,
               window=None, chunk=None, softcap=None, alibi_slopes=None, seqlens_q=None, seqlens_k=None):
        return flex(q, k, v, mask=mask, bias=bias, causal=causal, scale=scale, enable_gqa=enable_gqa,
                    window=window, chunk=chunk, softcap=softcap, alibi_slopes=alibi_slopes,
                    seqlens_q=seqlens_q, seqlens_k=seqlens_k, **fixed)
    return kernel


def _run(ids, dtype, **fixed):
    """The rows of cases ``ids`` (None: the standard suite) that ran, ``out`` and ``lse``."""
    chosen = [c for c in cases("softmax", "standard") if ids is None or c.id in ids]
    assert ids is None or len(chosen) == len(ids), sorted(set(ids) - {c.id for c in chosen})
    rep = verify(_kernel(**fixed), "softmax", backend="torch", dtypes=(dtype,), cases=chosen,
                 causal="both", supports={"broadcast": True, "lse": True}, progress=False,
                 time_limit=None)
    return [r for r in rep.results if r.verdict != "n/a"]


# One case per option and per way they combine (ids of the standard suite); the whole
# suite's applicable cases pass too (docs/conformance.md), at minutes on a loaded CPU.
OPTIONS = (
    "mask:b2h2-q12k19-d8-mask-padding",
    "fully-masked:b2h2-q33k47-d32-mask-fully_masked_rows",
    "combo:b2h2-q65k129-d32-causal-tl-mask-random-bias",
    "combo:b1h2-q129k65-d32-causal-br-mask-padding-bias",
    "range:b3h5-q29k37-d16-causal-br",
    "broadcast:b2h3-q17k19-d16-kv2x1",
    "scale:b1h2-q65k65-d32-scale0.05",
    "large-logits:b1h2-q65k63-d64-large_logits-causal-tl",
    "gqa:b2h6-q63k63-d32-mask-random-kv_heads3",
    "window:b1h2-q65k129-d32-window0x5",
    "window:b1h2-q127k127-d32-causal-br-window31x-1",
    "softcap:b2h2-q65k65-d32-bias-softcap5",
    "softcap:b1h4-q65k65-d32-causal-br-softcap5",
    "alibi:b1h4-q65k129-d32",
    "varlen:b3h2-q64k64-d32-causal-br-seqlens_q5x64x33-seqlens_k5x64x33",
    "seqlens:b2h4-q4k200-d32-seqlens_k200x77-window16x1",
    "seqlens:b2h4-q4k200-d32-seqlens_k200x77",
    "decode:b2h8-q5k1000-d64-causal-br-kv_heads2-seqlens_k1000x205",
    "combo:b2h4-q65k65-d64-causal-br-kv_heads2-softcap30-window16x-1",
    "window-decode:b3h5-q5k300-d32-causal-br-window63x-1",
    "chunk:b1h2-q65k129-d32-chunk24",
    "chunk-decode:b2h8-q5k1000-d64-causal-br-kv_heads2-seqlens_k1000x205-chunk192",
    # q, k, v views of one packed QKV buffer (conformance.noncontiguous)
    "noncontiguous:b2h3-q37k37-d16-views_qkv",
)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_flex_attention_passes(dtype):
    rows = _run(None if FULL else OPTIONS, dtype)
    assert {r.output for r in rows} == {"out", "lse"}
    bad = [(r.case, r.output, r.verdict, r.ratio, r.diagnosis) for r in rows if r.verdict != "pass"]
    assert not bad, bad
    assert len(rows) == (234 if FULL else 2 * len(OPTIONS))
    print(f"FLEX {dtype} pass {len(rows)}/{len(rows)} worst {max(r.ratio for r in rows):.2f}")


# float16 and bfloat16: FlexAttention computes the logits and the softmax in float32 and
# rounds P to the input dtype before P V, as the oracle's low-precision baselines do
LOW = ("combo:b2h2-q65k129-d32-causal-tl-mask-random-bias", "gqa:b2h6-q63k63-d32-mask-random-kv_heads3",
       "softcap:b1h4-q65k65-d32-causal-br-softcap5", "alibi:b1h4-q65k129-d32",
       "varlen:b3h2-q64k64-d32-causal-br-seqlens_q5x64x33-seqlens_k5x64x33",
       "seqlens:b2h4-q4k200-d32-seqlens_k200x77-window16x1")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_flex_attention_passes_in_low_precision(dtype):
    rows = _run(None if FULL else LOW, dtype)
    bad = [(r.case, r.output, r.verdict, r.ratio, r.diagnosis) for r in rows if r.verdict != "pass"]
    assert not bad, bad
    assert len(rows) >= (194 if FULL else 2 * len(LOW))
    print(f"FLEX {dtype} pass {len(rows)}/{len(rows)} worst {max(r.ratio for r in rows):.2f}")


# Each planted bug, the cases where it shows, and the words its `out` rows must carry.
# The ALiBi and soft-cap factors were named "a plain bfloat16/float16 implementation"
# before the oracle fitted them (conformance.diagnose.modern._option_factor_sigs).
PLANTS = {
    "window": (("window:b1h2-q65k129-d32-window0x5",
                "seqlens:b2h4-q4k200-d32-seqlens_k200x77-window16x1"),
               "the sliding window's left extent is off by one"),
    "alibi": (("alibi:b1h4-q65k129-d32", "alibi:b2h4-q65k65-d32-causal-br"),
              "the ALiBi slopes are 1 % too large"),
    "softcap": (("softcap:b2h2-q65k65-d32-bias-softcap5",
                 "softcap:b1h2-q64k64-d64-large_logits-softcap50"),
                "the soft-cap is 1 % too large"),
    "causal": (("causal:b1h2-q13k21-d8-causal-tl", "range:b3h5-q29k37-d16-causal-br"),
               "the causal mask is off by one"),
    "scale": (("scale:b1h2-q65k65-d32-scale0.05", "basic:b2h3-q17k17-d16"),
              "the logit scale is 1 % too large"),
    "document": (("varlen:b3h2-q64k64-d32-seqlens_q64x17x1-seqlens_k64x17x1",),
                 "wrong only on batch entries 0..1"),
    "chunk": (("chunk:b3h5-q5k203-d16-causal-br-chunk64",
               "chunk-decode:b2h8-q5k1000-d64-causal-br-kv_heads2-seqlens_k1000x205-chunk192"),
              "the chunk size is off by one"),
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_flex_attention_planted_bug_fails(plant):
    ids, words = PLANTS[plant]
    rows = _run(ids, "float32", plant=plant)
    assert len(rows) == 2 * len(ids)
    # the bug changes the output and the log-sum-exp: both rows fail
    assert all(r.verdict == "fail" for r in rows), [(r.case, r.output, r.verdict) for r in rows]
    out = {r.case: r.diagnosis for r in rows if r.output == "out"}
    assert all(words in d for d in out.values()), out


def test_attention_gym_alibi_is_another_function_off_causal():
    """attention-gym's ALiBi ``score + slope * (kv_idx - q_idx)`` rewards later keys: it is
    ALiBi only under a causal mask (there the two differ by a constant per row, which the
    softmax cancels; Nq = Nk here, so the lse agrees too)."""
    causal = ("alibi:b2h4-q65k65-d32-causal-br", "softcap:b1h4-q65k65-d32-causal-br-softcap5")
    other = ("alibi:b1h4-q65k129-d32", "seqlens:b2h4-q4k200-d32-seqlens_k200x77")
    rows = _run(causal + other, "float32", alibi="gym")
    assert all(r.verdict == "pass" for r in rows if r.case in causal), rows
    failed = [r for r in rows if r.case in other]
    assert len(failed) == 4 and all(r.verdict == "fail" for r in failed), failed
    assert all("attention-gym's generate_alibi_bias" in r.diagnosis for r in failed if r.output == "out")


@pytest.mark.parametrize("form,words", [
    ("flipped", "ALiBi with the opposite sign"),
    ("top-left", "ALiBi distances from the top-left corner"),
])
def test_other_alibi_forms_are_named(form, words):
    """ALiBi written with the sign flipped, or with distances from the top-left corner
    (which differs from the reference only where Nq != Nk or lengths differ)."""
    rows = _run(("alibi:b1h4-q65k129-d32", "seqlens:b2h4-q4k200-d32-seqlens_k200x77"), "float32",
                alibi=form)
    out = [r for r in rows if r.output == "out"]
    assert len(out) == 2 and all(r.verdict == "fail" and words in r.diagnosis for r in out), \
        [(r.case, r.verdict, r.diagnosis) for r in out]
