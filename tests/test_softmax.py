"""attn_ref.softmax: one-shot and online softmax attention, on every backend."""

import itertools
import math

import mpmath
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from attn_ref import attention_weights, online_softmax_attention, softmax_attention
from conformance.backends import from_numpy
from tests.helpers import EPS, assert_close, call, host, property_test, randn
from tests.plain import naive_attention

CAUSAL = [False, "top-left", "bottom-right"]
FORMS = {
    "oneshot": softmax_attention,
    "online": lambda *a, **kw: online_softmax_attention(*a, block_q=5, block_k=7, **kw),
}


def _causal(c):
    return None if c is False else c


SHAPES = [
    ((2, 3), 17, 17, 8, 8),  # batch, heads, self-attention
    ((3,), 9, 23, 4, 6),  # cross-attention, Nq < Nk, dv != d
    ((), 31, 12, 16, 3),  # Nq > Nk, single head
]
# Every (causal, shapes) pair, the three of a diagonal first: JAX keeps those (the first
# case per alignment, form and dtype), each alignment on its own shape, 12 of 36 cases.
# Each is a compilation of ~0.5 s of CPU of the array-API code that NumPy,
# array-api-strict and torch run on all 36.
CAUSAL_SHAPES = [(c, s) for i in range(3) for c, s in zip(CAUSAL, SHAPES[i:] + SHAPES[:i])]


@pytest.mark.jax_subset("form", "dtype", "causal")
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("causal,shapes", CAUSAL_SHAPES)
def test_matches_plain_numpy(backend, form, dtype, causal, shapes):
    batch, nq, nk, d, dv = shapes
    q, qh = randn(backend, batch + (nq, d), dtype, seed=1)
    k, kh = randn(backend, batch + (nk, d), dtype, seed=2)
    v, vh = randn(backend, batch + (nk, dv), dtype, seed=3)
    out = call(backend, FORMS[form], q, k, v, causal=causal)
    want, _ = naive_attention(qh, kh, vh, causal=_causal(causal))
    assert_close(out, want, backend, dtype=dtype)


@pytest.mark.parametrize("form", FORMS)
def test_mask_bias_scale_and_broadcast(backend, form):
    rng = np.random.default_rng(7)
    q, qh = randn(backend, (2, 4, 11, 8), seed=4)
    k, kh = randn(backend, (1, 4, 13, 8), seed=5)  # batch broadcasts
    v, vh = randn(backend, (2, 1, 13, 5), seed=6)  # heads broadcast
    mask_h = rng.random((4, 11, 13)) < 0.7
    mask_h[1, 3, :] = False  # one fully masked row
    bias_h = rng.standard_normal((1, 11, 13))
    mask, bias = from_numpy(mask_h, backend), from_numpy(bias_h, backend)
    out = call(backend, FORMS[form], q, k, v, mask=mask, bias=bias, causal="bottom-right", scale=0.3)
    want, _ = naive_attention(qh, kh, vh, mask=mask_h, bias=bias_h, causal="bottom-right", scale=0.3)
    assert_close(out, want, backend)
    assert np.all(host(out)[:, 1, 3, :] == 0.0)


def test_weights_rows_sum_to_one_or_zero(backend):
    q, qh = randn(backend, (3, 10, 4), seed=8)
    k, kh = randn(backend, (3, 10, 4), seed=9)
    mask_h = np.ones((10, 10), dtype=bool)
    mask_h[2] = False
    p = call(backend, attention_weights, q, k, mask=from_numpy(mask_h, backend), causal=True)
    _, want = naive_attention(qh, kh, qh, mask=mask_h, causal="top-left")
    assert_close(p, want, backend)
    sums = host(p).sum(-1)
    assert np.allclose(sums[:, [i for i in range(10) if i != 2]], 1.0)
    assert np.all(sums[:, 2] == 0.0)


@pytest.mark.parametrize("form", FORMS)
def test_large_logits_float32(backend, form):
    # Logits of magnitude 1e4 overflow exp() unless the row maximum is subtracted.
    rng = np.random.default_rng(3)
    qh = rng.standard_normal((2, 16, 8)) * 40.0
    kh = rng.standard_normal((2, 16, 8)) * 40.0
    vh = rng.standard_normal((2, 16, 8))
    q, k, v = (from_numpy(a, backend, "float32") for a in (qh, kh, vh))
    qh, kh = host(q), host(k)
    out = call(backend, FORMS[form], q, k, v, scale=1.0)
    want, _ = naive_attention(qh, kh, host(v), scale=1.0)
    assert np.abs(qh @ np.swapaxes(kh, -1, -2)).max() > 1e3
    got = host(out)
    assert np.all(np.isfinite(got))
    # Peaked rows: the output is (nearly) one row of v; float32 logits carry relative
    # error ~1e-7 of 1e4, i.e. ~1e-3 absolute, which moves near-ties.
    assert np.abs(got - want).max() < 5e-2


@pytest.mark.parametrize("form", FORMS)
def test_no_key_to_attend_gives_zeros(backend, form):
    q, _ = randn(backend, (2, 5, 4), seed=1)
    k, _ = randn(backend, (2, 6, 4), seed=2)
    v, _ = randn(backend, (2, 6, 3), seed=3)
    none = from_numpy(np.zeros((5, 6), dtype=bool), backend)
    out = call(backend, FORMS[form], q, k, v, mask=none)
    assert np.all(host(out) == 0.0)
    # All logits -inf through the bias is the same situation.
    ninf = from_numpy(np.full((5, 6), -np.inf), backend)
    assert np.all(host(call(backend, FORMS[form], q, k, v, bias=ninf)) == 0.0)
    # Top-left causal with Nq > Nk: every query has key 0. Bottom-right: the first
    # Nq - Nk queries see nothing.
    q7, _ = randn(backend, (7, 4), seed=4)
    k3, _ = randn(backend, (3, 4), seed=5)
    v3, _ = randn(backend, (3, 2), seed=6)
    br = host(call(backend, FORMS[form], q7, k3, v3, causal="bottom-right"))
    assert np.all(br[:4] == 0.0) and np.all(br[4:] != 0.0)


@pytest.mark.parametrize("form", FORMS)
def test_empty_sequences(backend, form):
    xp = backend.xp
    q0 = xp.zeros((2, 0, 4), dtype=xp.float64, device=backend.device)
    k, _ = randn(backend, (2, 3, 4))
    v, _ = randn(backend, (2, 3, 5))
    assert tuple(call(backend, FORMS[form], q0, k, v).shape) == (2, 0, 5)
    q, _ = randn(backend, (2, 3, 4))
    k0 = xp.zeros((2, 0, 4), dtype=xp.float64, device=backend.device)
    v0 = xp.zeros((2, 0, 5), dtype=xp.float64, device=backend.device)
    out = call(backend, FORMS[form], q, k0, v0)
    assert tuple(out.shape) == (2, 3, 5) and np.all(host(out) == 0.0)
    assert tuple(call(backend, attention_weights, q, k0).shape) == (2, 3, 0)


@pytest.mark.parametrize("bq,bk", [(1, 7), (5, 1), (3, 64), (64, 3), (100, 100)])
@pytest.mark.parametrize("causal", CAUSAL)
def test_online_block_sizes(backend, bq, bk, causal):
    # Tiles are unrolled under jax.jit: 1-wide tiles get short sequences (7 x 11, ragged
    # against 5 and 7), the wider ones longer sequences with ragged tails.
    nq, nk = (7, 11) if min(bq, bk) == 1 else (19, 29)
    q, qh = randn(backend, (2, nq, 6), seed=11)
    k, kh = randn(backend, (2, nk, 6), seed=12)
    v, vh = randn(backend, (2, nk, 4), seed=13)
    out = call(backend, online_softmax_attention, q, k, v, causal=causal, block_q=bq, block_k=bk)
    assert_close(out, naive_attention(qh, kh, vh, causal=_causal(causal))[0], backend)


@pytest.mark.parametrize("form", FORMS)
def test_inputs_not_modified(backend, form):
    q, qh = randn(backend, (2, 9, 4), seed=1)
    k, kh = randn(backend, (2, 9, 4), seed=2)
    v, vh = randn(backend, (2, 9, 3), seed=3)
    bias, bh = randn(backend, (9, 9), seed=4)
    mh = np.random.default_rng(5).random((9, 9)) < 0.8
    mask = from_numpy(mh, backend)
    call(backend, FORMS[form], q, k, v, mask=mask, bias=bias, causal=True)
    for x, h in ((q, qh), (k, kh), (v, vh), (bias, bh)):
        assert np.array_equal(host(x), h)
    assert np.array_equal(host(mask).astype(bool), mh)


# ---------------------------------------------------------------- bad input


def _bad_cases(backend):
    xp = backend.xp
    r = lambda *s: randn(backend, s)[0]  # noqa: E731
    return [
        ((r(4), r(4, 2), r(4, 2)), {}, ValueError, "q must have shape"),
        ((r(3, 4), r(5, 3), r(5, 2)), {}, ValueError, "same head dimension d"),
        ((r(3, 4), r(5, 4), r(6, 2)), {}, ValueError, "same sequence length Nk"),
        ((r(2, 3, 4), r(3, 5, 4), r(3, 5, 2)), {}, ValueError, "do not broadcast"),
        (
            (r(3, 4), r(5, 4), r(5, 2)),
            {"mask": from_numpy(np.ones((3, 4), bool), backend)},
            ValueError,
            "mask must be",
        ),
        ((r(3, 4), r(5, 4), r(5, 2)), {"mask": r(3, 5)}, TypeError, "dtype bool"),
        (
            (r(3, 4), r(5, 4), r(5, 2)),
            {"mask": from_numpy(np.ones((2, 3, 5), bool), backend)},
            ValueError,
            "without adding batch",
        ),
        ((r(3, 4), r(5, 4), r(5, 2)), {"bias": r(5, 3)}, ValueError, "bias must be"),
        ((r(3, 4), r(5, 4), r(5, 2)), {"causal": "diagonal"}, ValueError, "causal must be"),
        ((r(3, 4), r(5, 4), r(5, 2)), {"scale": float("nan")}, ValueError, "scale"),
        (
            (xp.ones((3, 4), dtype=xp.int32, device=backend.device), r(5, 4), r(5, 2)),
            {},
            TypeError,
            "q must have a real floating dtype",
        ),
        ((r(3, 4), xp.astype(r(5, 4), xp.float32), r(5, 2)), {}, TypeError, "share one"),
    ]


@pytest.mark.parametrize("form", FORMS)
def test_bad_input(backend, form):
    for args, kwargs, exc, msg in _bad_cases(backend):
        with pytest.raises(exc, match=msg):
            FORMS[form](*args, **kwargs)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_bad_block_sizes(backend, bad):
    q, _ = randn(backend, (3, 4))
    # A negative or zero integer is a wrong value; a float or a bool a wrong type.
    exc = ValueError if isinstance(bad, int) and not isinstance(bad, bool) else TypeError
    with pytest.raises(exc, match="block_q must be a positive integer"):
        online_softmax_attention(q, q, q, block_q=bad)
    with pytest.raises(exc, match="block_k must be a positive integer"):
        online_softmax_attention(q, q, q, block_k=bad)


def test_mixed_libraries_rejected():
    import array_api_strict

    q = np.ones((3, 4))
    k = array_api_strict.ones((3, 4), dtype=array_api_strict.float64)
    with pytest.raises(TypeError, match="different array libraries.*k"):
        softmax_attention(q, k, q)


# ---------------------------------------------------------------- properties

shape_st = st.tuples(
    st.integers(1, 9), st.integers(1, 9), st.integers(1, 5), st.integers(1, 4), st.integers(0, 2**31 - 1)
)


def test_property_key_permutation_invariance(backend):
    @property_test(backend)
    @given(shape=shape_st)
    def check(shape):
        nq, nk, d, dv, seed = shape
        rng = np.random.default_rng(seed)
        q, k, v = (from_numpy(rng.standard_normal(s), backend) for s in ((nq, d), (nk, d), (nk, dv)))
        perm = rng.permutation(nk)
        kp, vp = (from_numpy(host(x)[perm], backend) for x in (k, v))
        a, b = (
            host(call(backend, softmax_attention, q, k, v)),
            host(call(backend, softmax_attention, q, kp, vp)),
        )
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)

    check()


def test_property_query_permutation_equivariance(backend):
    @property_test(backend)
    @given(shape=shape_st)
    def check(shape):
        nq, nk, d, dv, seed = shape
        rng = np.random.default_rng(seed)
        qh = rng.standard_normal((nq, d))
        k, v = (from_numpy(rng.standard_normal(s), backend) for s in ((nk, d), (nk, dv)))
        perm = rng.permutation(nq)
        a = host(call(backend, online_softmax_attention, from_numpy(qh, backend), k, v, block_q=3, block_k=2))
        b = host(
            call(backend, online_softmax_attention, from_numpy(qh[perm], backend), k, v, block_q=3, block_k=2)
        )
        np.testing.assert_allclose(a[perm], b, rtol=1e-12, atol=1e-12)

    check()


def test_property_row_constant_in_bias_changes_nothing(backend):
    @property_test(backend)
    @given(shape=shape_st, shift=st.floats(-50, 50))
    def check(shape, shift):
        nq, nk, d, dv, seed = shape
        rng = np.random.default_rng(seed)
        q, k, v = (from_numpy(rng.standard_normal(s), backend) for s in ((nq, d), (nk, d), (nk, dv)))
        row = rng.standard_normal((nq, 1)) * shift
        a = host(call(backend, softmax_attention, q, k, v, causal="bottom-right"))
        b = host(
            call(backend, softmax_attention, q, k, v, causal="bottom-right", bias=from_numpy(row, backend))
        )
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10)

    check()


def test_property_output_within_attended_values(backend):
    @property_test(backend)
    @given(shape=shape_st, causal=st.sampled_from(CAUSAL))
    def check(shape, causal):
        nq, nk, d, dv, seed = shape
        rng = np.random.default_rng(seed)
        qh, kh, vh = (rng.standard_normal(s) * 3 for s in ((nq, d), (nk, d), (nk, dv)))
        mask_h = rng.random((nq, nk)) < 0.6
        out = host(
            call(
                backend,
                softmax_attention,
                *(from_numpy(a, backend) for a in (qh, kh, vh)),
                mask=from_numpy(mask_h, backend),
                causal=causal,
            )
        )
        _, p = naive_attention(qh, kh, vh, mask=mask_h, causal=_causal(causal))
        for i in range(nq):
            seen = p[i] > 0 if p[i].sum() > 0 else None
            allowed = mask_h[i].copy()
            if causal:
                off = 0 if causal == "top-left" else nk - nq
                allowed &= np.arange(nk) <= i + off
            if not allowed.any():
                assert np.all(out[i] == 0)
                continue
            assert seen is not None
            lo, hi = vh[allowed].min(0), vh[allowed].max(0)
            assert np.all(out[i] >= lo - 1e-12) and np.all(out[i] <= hi + 1e-12)

    check()


def test_property_online_equals_oneshot(backend):
    @property_test(backend)
    @given(
        shape=shape_st,
        bq=st.integers(1, 12),
        bk=st.integers(1, 12),
        causal=st.sampled_from(CAUSAL),
        masked=st.booleans(),
    )
    def check(shape, bq, bk, causal, masked):
        nq, nk, d, dv, seed = shape
        rng = np.random.default_rng(seed)
        q, k, v = (from_numpy(rng.standard_normal(s), backend) for s in ((2, nq, d), (2, nk, d), (2, nk, dv)))
        mask = from_numpy(rng.random((nq, nk)) < 0.5, backend) if masked else None
        bias = from_numpy(rng.standard_normal((2, nq, nk)), backend)
        a = host(call(backend, softmax_attention, q, k, v, mask=mask, bias=bias, causal=causal))
        b = host(
            call(
                backend,
                online_softmax_attention,
                q,
                k,
                v,
                mask=mask,
                bias=bias,
                causal=causal,
                block_q=bq,
                block_k=bk,
            )
        )
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13)

    check()


# ---------------------------------------------------------------- accuracy of the oracle


def _mp_attention(qh, kh, vh, scale, allowed, bias=None):
    mpmath.mp.dps = 50
    nq, nk = qh.shape[0], kh.shape[0]
    out = np.zeros((nq, vh.shape[1]))
    for i in range(nq):
        logits = {}
        for j in range(nk):
            if allowed[i, j]:
                s = mpmath.fsum(mpmath.mpf(a) * mpmath.mpf(b) for a, b in zip(qh[i], kh[j]))
                s = s * mpmath.mpf(scale)
                if bias is not None:
                    s += mpmath.mpf(bias[i, j])
                logits[j] = s
        if not logits:
            continue
        m = max(logits.values())
        w = {j: mpmath.exp(s - m) for j, s in logits.items()}
        z = mpmath.fsum(w.values())
        for c in range(vh.shape[1]):
            out[i, c] = float(mpmath.fsum(w[j] * mpmath.mpf(vh[j, c]) for j in w) / z)
    return out


def _accuracy_cases():
    rng = np.random.default_rng(2024)
    cases = []
    n, d = 12, 6
    def base():
        return (
            rng.standard_normal((n, d)),
            rng.standard_normal((n, d)),  # noqa: E731
            rng.standard_normal((n, 4)),
        )
    q, k, v = base()
    cases.append(("random", q, k, v, np.ones((n, n), bool), 1 / np.sqrt(d)))
    q, k, v = base()
    cases.append(("extreme", q * 30, k * 30, v, np.ones((n, n), bool), 1.0))
    q, k, v = base()
    k2 = np.repeat(k[:1], n, 0) + rng.standard_normal((n, d)) * 1e-9
    cases.append(("near-ties", q, k2, v, np.ones((n, n), bool), 1 / np.sqrt(d)))
    q, k, v = base()
    cases.append(("masked", q, k, v, rng.random((n, n)) < 0.4, 1 / np.sqrt(d)))
    q, k, v = base()
    cases.append(("causal", q, k, v, np.tril(np.ones((n, n), bool)), 1 / np.sqrt(d)))
    return cases


@pytest.mark.parametrize("case", _accuracy_cases(), ids=lambda c: c[0])
@pytest.mark.parametrize("form", FORMS)
def test_float64_accuracy_against_mpmath(backend, case, form):
    _, qh, kh, vh, allowed, scale = case
    want = _mp_attention(qh, kh, vh, scale, allowed)
    q, k, v = (from_numpy(a, backend) for a in (qh, kh, vh))
    got = host(call(backend, FORMS[form], q, k, v, mask=from_numpy(allowed, backend), scale=scale))
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < 1e-13, err


def test_float64_accuracy_with_bias_and_causal_alignments():
    rng = np.random.default_rng(5)
    qh, kh, vh = rng.standard_normal((5, 3)), rng.standard_normal((9, 3)), rng.standard_normal((9, 2))
    bias = rng.standard_normal((5, 9)) * 5
    for causal, off in (("top-left", 0), ("bottom-right", 4)):
        allowed = np.arange(9)[None, :] <= np.arange(5)[:, None] + off
        want = _mp_attention(qh, kh, vh, 0.5, allowed, bias)
        got = softmax_attention(qh, kh, vh, bias=bias, causal=causal, scale=0.5)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-13


def test_eps_table_matches_dtypes():
    import ml_dtypes

    for name, eps in EPS.items():
        dt = ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)
        assert float(ml_dtypes.finfo(dt).eps) == eps


def test_all_causal_pairs_agree_when_square(backend):
    q, _ = randn(backend, (8, 3), seed=1)
    for form, (a, b) in itertools.product(FORMS, [("top-left", "bottom-right")]):
        x = host(call(backend, FORMS[form], q, q, q, causal=a))
        y = host(call(backend, FORMS[form], q, q, q, causal=b))
        z = host(call(backend, FORMS[form], q, q, q, causal=True))
        assert np.array_equal(x, y) and np.array_equal(x, z)


# ================================================================ modern kernel options
# GQA/MQA, sliding windows, soft-capping, ALiBi, dropout keep-masks, padded lengths,
# KV-cache decoding and packed variable-length batches, each against the loop below.


def _naive_modern(q, k, v, *, scale=None, causal=None, window=None, softcap=None, slopes=None,
                  keep=None, p=0.0, lens_q=None, lens_k=None, mask=None, bias=None, chunk=None):
    """Plain-loop float64 reference for ``q (B, Hq, Nq, d)``, ``k, v (B, Hkv, Nk, .)``.

    Written from the published definitions, one logit at a time: FlashAttention's
    window ``i + Lk - Lq - left <= j <= i + Lk - Lq + right`` (negative = unbounded),
    Llama 4's chunks (``chunked_overlay``: query position ``i + Lk - Lq`` and key ``j``
    in the same chunk of ``chunk`` positions counted from 0),
    Gemma 2's ``c tanh(s / c)`` on the scaled logit before the bias, ALiBi
    ``-slope |i + Lk - Lq - j|``, dropout ``P * keep / (1 - p)``, query head ``h`` on
    key/value head ``h // (Hq / Hkv)``, padding rows zero.
    """
    nb, hq, nq, d = q.shape
    hkv, nk, dv = k.shape[1], k.shape[2], v.shape[3]
    g = hq // hkv
    scale = 1 / np.sqrt(d) if scale is None else scale
    out, probs = np.zeros((nb, hq, nq, dv)), np.zeros((nb, hq, nq, nk))
    for b in range(nb):
        lq = nq if lens_q is None else int(lens_q[b])
        lk = nk if lens_k is None else int(lens_k[b])
        off = lk - lq
        for h in range(hq):
            r = h // g
            for i in range(lq):
                logits = {}
                for j in range(lk):
                    if mask is not None and not mask[b, h, i, j]:
                        continue
                    if causal == "top-left" and j > i or causal == "bottom-right" and j > i + off:
                        continue
                    if window is not None:
                        left, right = window
                        if left >= 0 and j < i + off - left or right >= 0 and j > i + off + right:
                            continue
                    if chunk is not None and math.floor((i + off) / chunk) != math.floor(j / chunk):
                        continue
                    s = scale * float(q[b, h, i] @ k[b, r, j])
                    if softcap is not None:
                        s = softcap * np.tanh(s / softcap)
                    if bias is not None:
                        s += bias[b, h, i, j]
                    if slopes is not None:
                        s -= slopes[b, h] * abs(i + off - j)
                    logits[j] = s
                if not logits:
                    continue
                m = max(logits.values())
                z = sum(np.exp(s - m) for s in logits.values())
                for j, s in logits.items():
                    w = np.exp(s - m) / z
                    if keep is not None:
                        w = w * keep[b, h, i, j] / (1 - p)
                    probs[b, h, i, j] = w
                out[b, h, i] = probs[b, h, i] @ v[b, r]
    return out, probs


MODERN_FORMS = {
    "oneshot": softmax_attention,
    # Two key tiles (10 + 9 keys): enough for the recurrence, cheap for JAX to compile;
    # the property test below varies the tiling.
    "online": lambda *a, **kw: online_softmax_attention(*a, block_q=16, block_k=10, **kw),
}
B, HQ, HKV, NQ, NK, D, DV = 2, 4, 2, 11, 19, 8, 5


def _qkv(backend, hkv=HKV, nq=NQ, nk=NK, seed=0, dtype="float64"):
    q, qh = randn(backend, (B, HQ, nq, D), dtype, seed=seed)
    k, kh = randn(backend, (B, hkv, nk, D), dtype, seed=seed + 1)
    v, vh = randn(backend, (B, hkv, nk, DV), dtype, seed=seed + 2)
    return (q, k, v), (qh, kh, vh)


@pytest.mark.parametrize("form", MODERN_FORMS)
@pytest.mark.parametrize("hkv", [1, 2, 4])  # MQA, GQA with g = 2, MHA
def test_gqa_matches_plain_loops(backend, form, hkv):
    (q, k, v), (qh, kh, vh) = _qkv(backend, hkv=hkv)
    mask_h = np.random.default_rng(3).random((B, HQ, NQ, NK)) < 0.8
    out = call(backend, MODERN_FORMS[form], q, k, v, gqa=True, causal="bottom-right",
               mask=from_numpy(mask_h, backend))
    want, _ = _naive_modern(qh, kh, vh, causal="bottom-right", mask=mask_h)
    assert_close(out, want, backend)
    # The group mapping h -> h // g, checked against an explicit copy of the kv heads.
    g = HQ // hkv
    kx, vx = (from_numpy(np.repeat(a, g, axis=1), backend) for a in (kh, vh))
    plain = call(backend, MODERN_FORMS[form], q, kx, vx, causal="bottom-right",
                 mask=from_numpy(mask_h, backend))
    np.testing.assert_allclose(host(out), host(plain), rtol=1e-13, atol=1e-14)


def test_gqa_broadcasts_batch_and_weights(backend):
    # q's batch axis broadcasts against k's; masks/bias/slopes are per query head.
    q, qh = randn(backend, (2, 6, 7, 4), seed=1)
    k, kh = randn(backend, (1, 3, 9, 4), seed=2)
    v, vh = randn(backend, (1, 3, 9, 3), seed=3)
    bias_h = np.random.default_rng(0).standard_normal((6, 7, 9))
    out = call(backend, online_softmax_attention, q, k, v, gqa=True, bias=from_numpy(bias_h, backend),
               block_q=4, block_k=4)
    kb, vb = (np.broadcast_to(a, (2,) + a.shape[1:]) for a in (kh, vh))
    want, probs = _naive_modern(qh, kb, vb, bias=np.broadcast_to(bias_h, (2, 6, 7, 9)))
    assert_close(out, want, backend)
    p = call(backend, attention_weights, q, k, gqa=True, bias=from_numpy(bias_h, backend))
    assert_close(p, probs, backend)


WINDOWS = [(3, 0), (0, 2), (4, -1), (-1, 1), (0, 0), (30, 30)]


def _few(backend, items, n=2):
    """All of ``items``, or the first ``n`` on JAX, which compiles every static option set."""
    return items[:n] if backend.name == "jax" else items


@pytest.mark.parametrize("form", MODERN_FORMS)
@pytest.mark.parametrize("causal", CAUSAL)
def test_window_matches_plain_loops(backend, form, causal):
    (q, k, v), (qh, kh, vh) = _qkv(backend, hkv=HQ)
    for window in _few(backend, WINDOWS if causal != "top-left" else WINDOWS[::-1]):
        out = call(backend, MODERN_FORMS[form], q, k, v, window=window, causal=causal)
        want, _ = _naive_modern(qh, kh, vh, window=window, causal=_causal(causal))
        assert_close(out, want, backend)


def test_window_limits(backend):
    (q, k, v), _ = _qkv(backend, hkv=HQ)
    full = host(call(backend, softmax_attention, q, k, v))
    for window in _few(backend, [(NK, NK), (None, NK + NQ), (-1, -1), (None, None), [NK + NQ, -1]]):
        got = host(call(backend, online_softmax_attention, q, k, v, window=tuple(window) if window
                        else None, block_q=4, block_k=8))
        np.testing.assert_allclose(got, full, rtol=1e-13, atol=1e-14)
    # Right extent 0 is FlashAttention's causal (bottom-right).
    a = host(call(backend, softmax_attention, q, k, v, window=(-1, 0)))
    b = host(call(backend, softmax_attention, q, k, v, causal="bottom-right"))
    np.testing.assert_array_equal(a, b)


CHUNKS = [4, 1, 7, 10, 30]  # straddling the online form's key tiles of 10, dividing none of Nq, Nk but 1


@pytest.mark.parametrize("form", MODERN_FORMS)
@pytest.mark.parametrize("causal", CAUSAL)
def test_chunk_matches_plain_loops(backend, form, causal):
    (q, k, v), (qh, kh, vh) = _qkv(backend, hkv=HQ)
    for chunk in _few(backend, CHUNKS):
        out = call(backend, MODERN_FORMS[form], q, k, v, chunk=chunk, causal=causal)
        want, _ = _naive_modern(qh, kh, vh, chunk=chunk, causal=_causal(causal))
        assert_close(out, want, backend)


@pytest.mark.parametrize("nq", [1, 3, 19])
def test_chunk_equals_an_explicit_mask(backend, nq):
    """``chunk=c`` is Llama 4's boolean mask, built as ``transformers.masking_utils``
    builds it (``chunked_causal_mask_function``: ``kv_idx // c == q_idx // c`` and
    ``kv_idx <= q_idx`` on absolute positions, the queries the cache's last ``nq``),
    decoding against a cache of 19 keys (a multiple of none of the chunk sizes),
    with tiles of 4 x 5 that straddle the chunk boundaries."""
    q, qh = randn(backend, (B, HQ, nq, D), seed=41)
    k, kh = randn(backend, (B, HKV, NK, D), seed=42)
    v, vh = randn(backend, (B, HKV, NK, DV), seed=43)
    q_idx, kv_idx = np.arange(NK - nq, NK)[:, None], np.arange(NK)[None, :]
    for chunk in _few(backend, [4, 6, 3]):
        mask_h = (kv_idx // chunk == q_idx // chunk) & (kv_idx <= q_idx)
        want = host(call(backend, softmax_attention, q, k, v, gqa=True, mask=from_numpy(mask_h, backend)))
        for form in (softmax_attention, lambda *a, **kw: online_softmax_attention(*a, block_q=4, block_k=5,
                                                                                  **kw)):
            got = host(call(backend, form, q, k, v, gqa=True, chunk=chunk, causal="bottom-right"))
            np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-14)
        # the chunk is fixed by absolute positions: measured from the queries' own index
        # (i // c, no cache offset), decoding would see other keys
        local = (kv_idx // chunk == np.arange(nq)[:, None] // chunk) & (kv_idx <= q_idx)
        if nq < NK:
            assert not np.array_equal(local, mask_h)


def test_chunk_limits(backend):
    (q, k, v), _ = _qkv(backend, hkv=HQ)
    # one chunk holding every position is no chunking
    full = host(call(backend, softmax_attention, q, k, v, causal="bottom-right"))
    got = host(call(backend, online_softmax_attention, q, k, v, chunk=NK, causal="bottom-right",
                    block_q=4, block_k=8))
    np.testing.assert_allclose(got, full, rtol=1e-13, atol=1e-14)
    # chunks of one position: each query sees only its own position i + Nk - Nq
    one = host(call(backend, softmax_attention, q, k, v, chunk=1))
    np.testing.assert_allclose(one, np.broadcast_to(host(v)[..., NK - NQ:, :], one.shape), rtol=1e-13, atol=0)


def _brute_coverage(spec, q0, q1, k0, k1):
    # Decide from the definition which (i, j) of the tile are visible.
    off = spec.nk - spec.nq
    ok = np.ones((q1 - q0, k1 - k0), bool)
    i, j = np.arange(q0, q1)[:, None], np.arange(k0, k1)[None, :]
    if spec.alignment is not None:
        ok &= j <= i + (0 if spec.alignment == "top-left" else off)
    if spec.window is not None:
        left, right = spec.window
        if left is not None:
            ok &= j >= i + off - left
        if right is not None:
            ok &= j <= i + off + right
    if spec.chunk is not None:
        ok &= (i + off) // spec.chunk == j // spec.chunk
    return "none" if not ok.any() else "all" if ok.all() else "partial"


def test_tile_coverage_skips_exactly_the_hidden_tiles():
    from attn_ref.softmax import TileSpec, check_window, tile_coverage

    rng = np.random.default_rng(0)
    for _ in range(600):
        nq, nk = rng.integers(1, 40, 2)
        w = [int(x) if x >= 0 else -1 for x in rng.integers(-3, 12, 2)]
        spec = TileSpec(nq=int(nq), nk=int(nk), alignment=[None, "top-left", "bottom-right"][rng.integers(3)],
                        window=check_window(w) if rng.random() < 0.8 else None,
                        chunk=int(rng.integers(1, 12)) if rng.random() < 0.5 else None)
        q0, k0 = int(rng.integers(0, nq)), int(rng.integers(0, nk))
        q1, k1 = int(rng.integers(q0 + 1, nq + 1)), int(rng.integers(k0 + 1, nk + 1))
        assert tile_coverage(spec, q0, q1, k0, k1) == _brute_coverage(spec, q0, q1, k0, k1)


@pytest.mark.parametrize("form", MODERN_FORMS)
def test_softcap_and_alibi_match_plain_loops(backend, form):
    (q, k, v), (qh, kh, vh) = _qkv(backend, hkv=2, seed=5)
    qh3 = qh * 3
    q3 = from_numpy(qh3, backend)
    slopes_h = np.random.default_rng(1).random((B, HQ))
    bias_h = np.random.default_rng(2).standard_normal((B, HQ, NQ, NK))
    for kw, ref in _few(backend, [
        ({"softcap": 1.5, "alibi_slopes": from_numpy(slopes_h, backend), "bias": from_numpy(bias_h, backend),
          "window": (5, 2)},
         {"softcap": 1.5, "slopes": slopes_h, "bias": bias_h, "window": (5, 2)}),
        ({"alibi_slopes": from_numpy(slopes_h[0], backend), "causal": True},
         {"slopes": np.broadcast_to(slopes_h[0], (B, HQ)), "causal": "top-left"}),
        ({"softcap": 2.5}, {"softcap": 2.5}),
        ({"alibi_slopes": from_numpy(slopes_h, backend)}, {"slopes": slopes_h}),
    ]):
        out = call(backend, MODERN_FORMS[form], q3, k, v, gqa=True, **kw)
        assert_close(out, _naive_modern(qh3, kh, vh, **ref)[0], backend)


def test_softcap_limits(backend):
    (q, k, v), (qh, _, _) = _qkv(backend, hkv=HQ)
    plain = host(call(backend, softmax_attention, q, k, v))
    # c tanh(s / c) = s - s^3 / (3 c^2) + ...: for |s| < 10 and c = 1e8 that is < 1e-13.
    huge = host(call(backend, online_softmax_attention, q, k, v, softcap=1e8, block_q=4, block_k=8))
    np.testing.assert_allclose(huge, plain, rtol=1e-12, atol=1e-12)
    # A tiny cap squashes every logit into (-c, c): the weights of a row differ by at
    # most a factor exp(2c) even for logits of size 1e3.
    big = from_numpy(qh * 1e3, backend)
    p = host(call(backend, attention_weights, big, k, softcap=0.01))
    ratio = p.max(-1) / p.min(-1)
    assert np.all(ratio <= np.exp(0.02) * (1 + 1e-12)) and ratio.max() > 1.01


def test_alibi_is_a_bias(backend):
    # ALiBi equals passing the bias -slope |i + Nk - Nq - j| built independently here.
    (q, k, v), (qh, kh, vh) = _qkv(backend, hkv=HQ, seed=2)
    slopes_h = 2.0 ** -np.arange(1, HQ + 1)  # the ALiBi paper's slopes for 4 heads, 2^(-8h/H)/16
    dist = np.abs(np.arange(NQ)[:, None] + NK - NQ - np.arange(NK)[None, :])
    bias_h = -slopes_h[:, None, None] * dist
    for form in _few(backend, ["online", "oneshot"], 1):
        a = host(call(backend, MODERN_FORMS[form], q, k, v, alibi_slopes=from_numpy(slopes_h, backend)))
        b = host(call(backend, MODERN_FORMS[form], q, k, v, bias=from_numpy(bias_h, backend)))
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-14)
    zero = host(call(backend, softmax_attention, q, k, v, alibi_slopes=from_numpy(np.zeros(HQ), backend)))
    np.testing.assert_allclose(zero, host(call(backend, softmax_attention, q, k, v)), rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("form", MODERN_FORMS)
def test_dropout_keep_mask(backend, form):
    (q, k, v), (qh, kh, vh) = _qkv(backend, hkv=2, seed=7)
    keep_h = np.random.default_rng(4).random((B, HQ, NQ, NK)) < 0.7
    keep = from_numpy(keep_h, backend)
    out = call(backend, MODERN_FORMS[form], q, k, v, gqa=True, dropout_p=0.3, dropout_mask=keep,
               causal="bottom-right")
    want, probs = _naive_modern(qh, kh, vh, keep=keep_h, p=0.3, causal="bottom-right")
    assert_close(out, want, backend)
    p = call(backend, attention_weights, q, k, gqa=True, dropout_p=0.3, dropout_mask=keep,
             causal="bottom-right")
    assert_close(p, probs, backend)
    # Keeping everything only rescales by 1 / (1 - p).
    ones = from_numpy(np.ones((NQ, NK), bool), backend)
    a = host(call(backend, MODERN_FORMS[form], q, k, v, gqa=True, dropout_p=0.25, dropout_mask=ones))
    b = host(call(backend, MODERN_FORMS[form], q, k, v, gqa=True))
    np.testing.assert_allclose(a, b / 0.75, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("form", MODERN_FORMS)
def test_padded_lengths_equal_each_sequence_alone(backend, form):
    (q, k, v), (qh, kh, vh) = _qkv(backend, hkv=2, seed=9)
    lq_h, lk_h = np.array([7, 11]), np.array([19, 4])
    lq, lk = from_numpy(lq_h, backend), (19, 4)  # an array, and static ints
    slopes_h = np.array([0.5, 0.25, 0.125, 0.0625])
    for kw in _few(backend, [{"causal": "bottom-right"}, {"window": (3, 1)}, {"causal": "top-left"}, {},
                             {"causal": "bottom-right", "chunk": 3}]):
        out = host(call(backend, MODERN_FORMS[form], q, k, v, gqa=True, seqlens_q=lq, seqlens_k=lk,
                        alibi_slopes=from_numpy(slopes_h, backend), **kw))
        for b in range(B):
            a, c = lq_h[b], lk_h[b]
            alone = _naive_modern(qh[b:b + 1, :, :a], kh[b:b + 1, :, :c], vh[b:b + 1, :, :c],
                                  slopes=slopes_h[None], **{"causal": kw.get("causal"),
                                                            "window": kw.get("window"),
                                                            "chunk": kw.get("chunk")})[0]
            np.testing.assert_allclose(out[b, :, :a], alone[0], rtol=1e-13, atol=1e-14)
            assert np.all(out[b, :, a:] == 0.0)  # padding query rows


@pytest.mark.parametrize("nq", [1, 5, 16])
def test_kv_cache_decode(backend, nq):
    # A few new queries against a long cache of per-sequence length; the last query of
    # each sequence sees its whole cache (bottom-right alignment).
    nk = 250
    q, qh = randn(backend, (B, HQ, nq, D), seed=11)
    k, kh = randn(backend, (B, 1, nk, D), seed=12)  # MQA cache
    v, vh = randn(backend, (B, 1, nk, DV), seed=13)
    cache_h = np.array([nk, 37])
    cache = from_numpy(cache_h, backend)
    out = call(backend, online_softmax_attention, q, k, v, gqa=True, causal="bottom-right",
               seqlens_k=cache, block_q=16, block_k=128)
    want, _ = _naive_modern(qh, kh, vh, causal="bottom-right", lens_k=cache_h)
    assert_close(out, want, backend)
    one = call(backend, softmax_attention, q, k, v, gqa=True, causal="bottom-right", seqlens_k=cache)
    np.testing.assert_allclose(host(one), host(out), rtol=1e-13, atol=1e-14)


VARLEN = ((0, 3, 3, 12, 17), (0, 5, 9, 9, 26))  # four sequences, one with no queries, one with no keys


@pytest.mark.parametrize("online", [False, True])
def test_varlen_equals_each_sequence_alone(backend, online):
    from attn_ref import varlen_attention

    cq, ck = VARLEN
    q, qh = randn(backend, (cq[-1], HQ, D), seed=21)
    k, kh = randn(backend, (ck[-1], HKV, D), seed=22)
    v, vh = randn(backend, (ck[-1], HKV, DV), seed=23)
    slopes_h = np.array([0.3, 0.2, 0.1, 0.05])
    for kw in _few(backend, [{"causal": "bottom-right", "softcap": 3.0},
                             {"alibi_slopes": slopes_h, "window": (2, 1)}, {}, {"causal": "top-left"},
                             {"causal": "bottom-right", "chunk": 4}]):
        args = {n: from_numpy(a, backend) if isinstance(a, np.ndarray) else a for n, a in kw.items()}
        out = call(backend, varlen_attention, q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, online=online,
                   block_q=8, block_k=6, **args)
        assert tuple(out.shape) == (cq[-1], HQ, DV)
        got = host(out)
        for b in range(len(cq) - 1):
            qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
            t = lambda a, s: np.swapaxes(a[s], 0, 1)[None]  # noqa: E731  (n, H, d) -> (1, H, n, d)
            alone = _naive_modern(t(qh, qs), t(kh, ks), t(vh, ks), causal=kw.get("causal"),
                                  window=kw.get("window"), softcap=kw.get("softcap"), chunk=kw.get("chunk"),
                                  slopes=None if "alibi_slopes" not in kw else slopes_h[None])[0]
            np.testing.assert_allclose(got[qs], np.swapaxes(alone[0], 0, 1), rtol=1e-13, atol=1e-14)


def test_varlen_offsets_as_arrays_and_dropout(backend):
    from attn_ref import varlen_attention
    from attn_ref.softmax import cu_offsets

    cq, ck = (0, 4, 9), (0, 6, 8)
    q, qh = randn(backend, (9, 2, 4), seed=31)
    k, kh = randn(backend, (8, 1, 4), seed=32)
    v, vh = randn(backend, (8, 1, 3), seed=33)
    keep_h = np.random.default_rng(0).random((2, 2, 5, 6)) < 0.6  # (B, Hq, max Lq, max Lk)
    cu_q, cu_k = from_numpy(np.array(cq, np.int32), backend), from_numpy(np.array(ck), backend)
    assert cu_offsets("cu_seqlens_q", cu_q, 9, "q") == list(cq)
    if backend.name == "jax":  # offsets are read on the host: under jit they must be static
        cu_q, cu_k = cq, ck
    out = host(call(backend, varlen_attention, q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, dropout_p=0.4,
                    dropout_mask=from_numpy(keep_h, backend), causal="bottom-right"))
    for b in range(2):
        a, c = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        t = lambda x, s: np.swapaxes(x[s], 0, 1)[None]  # noqa: E731
        alone = _naive_modern(t(qh, slice(cq[b], cq[b + 1])), t(kh, slice(ck[b], ck[b + 1])),
                              t(vh, slice(ck[b], ck[b + 1])), keep=keep_h[b:b + 1, :, :a, :c], p=0.4,
                              causal="bottom-right")[0]
        np.testing.assert_allclose(out[cq[b]:cq[b + 1]], np.swapaxes(alone[0], 0, 1), rtol=1e-13, atol=1e-14)


def test_property_online_equals_oneshot_with_modern_options(backend):
    @property_test(backend, examples=12)
    @given(
        seed=st.integers(0, 2**31 - 1),
        bq=st.sampled_from([4, 7, 11]),
        bk=st.sampled_from([5, 8, 19]),
        causal=st.sampled_from(CAUSAL),
        window=st.sampled_from([None, (2, 0), (0, 3), (5, -1)]),
        chunk=st.sampled_from([None, 3, 8]),
        softcap=st.sampled_from([None, 0.7, 20.0]),
        lengths=st.booleans(),
    )
    def check(seed, bq, bk, causal, window, chunk, softcap, lengths):
        (q, k, v), _ = _qkv(backend, hkv=2, seed=seed % 1000)
        rng = np.random.default_rng(seed)
        kw = dict(gqa=True, causal=causal, window=window, chunk=chunk, softcap=softcap,
                  alibi_slopes=from_numpy(rng.random(HQ), backend),
                  dropout_p=0.2, dropout_mask=from_numpy(rng.random((B, HQ, NQ, NK)) < 0.8, backend))
        if lengths:
            kw.update(seqlens_q=from_numpy(rng.integers(0, NQ + 1, B), backend),
                      seqlens_k=from_numpy(rng.integers(0, NK + 1, B), backend))
        a = host(call(backend, softmax_attention, q, k, v, **kw))
        b = host(call(backend, online_softmax_attention, q, k, v, block_q=bq, block_k=bk, **kw))
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13)

    check()


def _bad_modern_cases(backend):
    r = lambda *s: randn(backend, s)[0]  # noqa: E731
    i = lambda *a: from_numpy(np.array(a), backend)  # noqa: E731
    q, k, v = r(2, 4, 3, 8), r(2, 2, 5, 8), r(2, 2, 5, 6)
    qkv = (q, k, v)
    gq = dict(gqa=True)
    return [
        (qkv, {**gq, "window": 3}, TypeError, "window must be None or a pair"),
        (qkv, {**gq, "window": (1, 2, 3)}, TypeError, "window must be None or a pair"),
        (qkv, {**gq, "window": (2.5, 1)}, TypeError, "left extent is 2.5"),
        (qkv, {**gq, "window": (1, -2)}, ValueError, "right extent is -2"),
        (qkv, {**gq, "window": (True, 1)}, TypeError, "left extent is True"),
        (qkv, {**gq, "chunk": 0}, ValueError, "chunk must be None .off. or a positive integer"),
        (qkv, {**gq, "chunk": 2.0}, TypeError, "chunk must be None .off. or a positive integer"),
        (qkv, {**gq, "chunk": True}, TypeError, "chunk must be None .off. or a positive integer .*got True"),
        ((r(2, 3, 3, 8), k, v), gq, ValueError, "Hq must be a multiple of the key/value heads Hkv"),
        ((q, k, r(2, 1, 5, 6)), gq, ValueError, "k and v must have the same number of heads"),
        ((r(3, 8), r(5, 8), r(5, 6)), gq, ValueError, "with gqa=True, q must have shape"),
        (qkv, {}, ValueError, "pass gqa=True"),
        (qkv, {"gqa": 1}, TypeError, "gqa must be True or False"),
        (qkv, {**gq, "softcap": 0.0}, ValueError, "softcap must be None"),
        (qkv, {**gq, "softcap": -1.0}, ValueError, "softcap must be None"),
        (qkv, {**gq, "softcap": float("inf")}, ValueError, "softcap must be None"),
        (qkv, {**gq, "softcap": "2"}, TypeError, "softcap must be None"),
        (qkv, {**gq, "alibi_slopes": r(3)}, ValueError, r"alibi_slopes must have shape \(H,\)"),
        (qkv, {**gq, "alibi_slopes": r(4, 1)}, ValueError, "alibi_slopes must have shape"),
        (qkv, {**gq, "alibi_slopes": i(1, 2, 3, 4)}, TypeError, "alibi_slopes must have a real floating"),
        (qkv, {**gq, "dropout_p": 1.0, "dropout_mask": i(True)}, ValueError,
         r"dropout_p must be a real number in \[0, 1\)"),
        (qkv, {**gq, "dropout_p": -0.1}, ValueError, "dropout_p must be"),
        (qkv, {**gq, "dropout_p": 0.1}, ValueError, "needs dropout_mask"),
        (qkv, {**gq, "dropout_p": 0.1, "dropout_mask": r(3, 5)}, TypeError, "dropout_mask must have dtype"),
        (qkv, {**gq, "dropout_p": 0.1, "dropout_mask": from_numpy(np.ones((3, 4), bool), backend)},
         ValueError, "dropout_mask must be"),
        (qkv, {**gq, "seqlens_k": r(2)}, TypeError, "seqlens_k must have an integer dtype"),
        (qkv, {**gq, "seqlens_k": i(3, 4, 5)}, ValueError, r"seqlens_k must have shape \(B,\)"),
        (qkv, {**gq, "seqlens_q": i(1, 2, 3, 4)}, ValueError, r"seqlens_q must have shape \(B,\)"),
        (qkv, {**gq, "seqlens_q": [1.5, 2]}, TypeError, "seqlens_q must be an integer array or a sequence"),
    ]


@pytest.mark.parametrize("form", MODERN_FORMS)
def test_bad_modern_input(backend, form):
    for args, kwargs, exc, msg in _bad_modern_cases(backend):
        with pytest.raises(exc, match=msg):
            MODERN_FORMS[form](*args, **kwargs)


def test_bad_varlen_input(backend):
    from attn_ref import varlen_attention

    r = lambda *s: randn(backend, s)[0]  # noqa: E731
    q, k, v = r(6, 4, 8), r(7, 2, 8), r(7, 2, 3)
    ok = dict(cu_seqlens_q=(0, 2, 6), cu_seqlens_k=(0, 3, 7))
    cases = [
        ({"cu_seqlens_q": (0, 4, 2, 6)}, ValueError, "cu_seqlens_q must be non-decreasing.*4 > .*2"),
        ({"cu_seqlens_q": (0, 2, 5)}, ValueError, r"must end at the number of packed tokens, q.shape.0. = 6"),
        ({"cu_seqlens_k": (1, 3, 7)}, ValueError, "cu_seqlens_k must be cumulative offsets .* starting at 0"),
        ({"cu_seqlens_k": (0, 7)}, ValueError, "same number of sequences, got 2 and 1"),
        ({"cu_seqlens_q": from_numpy(np.array([0.0, 2.0, 6.0]), backend)}, TypeError, "integer dtype"),
        ({"cu_seqlens_q": from_numpy(np.array([[0, 2, 6]]), backend)}, ValueError, r"1-D, shape \(B \+ 1,\)"),
        ({"cu_seqlens_q": "0,2,6"}, TypeError, "cu_seqlens_q must be a 1-D integer array"),
        ({"cu_seqlens_q": from_numpy(np.array([0, 3, 2, 6]), backend)}, ValueError, "non-decreasing"),
        ({"online": True, "block_k": 0}, ValueError, "block_k must be a positive integer"),
        ({"window": (-3, 0)}, ValueError, "window"),
    ]
    for kw, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            varlen_attention(q, k, v, **{**ok, **kw})
    with pytest.raises(ValueError, match=r"q must have the packed shape \(total_q, Hq, d\)"):
        varlen_attention(r(2, 6, 4, 8), k, v, **ok)
    with pytest.raises(ValueError, match="Hq must be a multiple"):
        varlen_attention(r(6, 3, 8), k, v, **ok)


def test_modern_inputs_not_modified(backend):
    if backend.name == "jax":
        pytest.skip("JAX arrays are immutable")
    (q, k, v), (qh, kh, vh) = _qkv(backend, hkv=2)
    keep_h = np.random.default_rng(1).random((NQ, NK)) < 0.5
    slopes, sh = randn(backend, (HQ,), seed=3)
    lens = from_numpy(np.array([5, 9]), backend)
    for form in MODERN_FORMS.values():
        form(q, k, v, gqa=True, window=(3, 2), softcap=2.0, alibi_slopes=slopes, dropout_p=0.1,
             dropout_mask=from_numpy(keep_h, backend), seqlens_k=lens)
    for x, h in ((q, qh), (k, kh), (v, vh), (slopes, sh)):
        assert np.array_equal(host(x), h)


# ---------------------------------------------------------------- the fast path


# On JAX the pool never runs (pool_helps: its arrays count as lazy), so each case is
# the serial form, which test_online_block_sizes (causal) and the FORMS tests (masks,
# bias) check there: one case (the eager form's ~16 compilations a case).
@pytest.mark.jax_subset()
@pytest.mark.parametrize("opts", [{}, {"causal": "bottom-right"}, {"mask": "random"}])
def test_online_thread_pool_is_deterministic(backend, monkeypatch, opts):
    # Every call here is "large": on a library whose elementwise operations run on one
    # thread (NumPy) each query block is cut into row ranges whose steps run on the
    # pool, one range per CPU. The result repeats bit for bit for each number of CPUs
    # (the scheduling changes nothing) and equals the serial form's up to rounding (a
    # GEMM of fewer rows may round differently).
    from attn_ref.softmax import online

    q, qh = randn(backend, (2, 3, 37, 8), seed=21)
    k, kh = randn(backend, (2, 3, 41, 8), seed=22)
    v, vh = randn(backend, (2, 3, 41, 5), seed=23)
    kw = dict(opts)
    mask_h = None
    if kw.get("mask") == "random":
        mask_h = np.random.default_rng(24).random((3, 37, 41)) < 0.6
        kw["mask"] = from_numpy(mask_h, backend)
    serial = host(call(backend, online_softmax_attention, q, k, v, block_q=8, block_k=16, **kw))
    monkeypatch.setattr(online, "POOL_MIN_LOGITS", 1)
    want, _ = naive_attention(qh, kh, vh, mask=mask_h, causal=kw.get("causal"))
    import attn_ref._common as common

    for cpus in (2, 3):
        monkeypatch.setattr(common, "cpu_count", lambda cpus=cpus: cpus)
        pooled = [host(online_softmax_attention(q, k, v, block_q=8, block_k=16, **kw))
                  for _ in range(3)]
        assert all(np.array_equal(p, pooled[0]) for p in pooled[1:])
        assert_close(from_numpy(pooled[0], backend), want, backend)
    assert_close(from_numpy(serial, backend), want, backend)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_online_huge_products_keep_the_clamp(backend, dtype):
    # The scale is folded into q only when no product q . k can overflow; here the
    # products do (scale q stays finite; positive entries, so no inf - inf inside a
    # product), so the clamped logits must decide: each row's hardmax, the same as the
    # one-shot form, never NaN.
    xp = backend.xp
    big = 1e30 if dtype == "float32" else 1e300
    q, _ = randn(backend, (2, 6, 4), dtype, seed=31)
    k, _ = randn(backend, (2, 9, 4), dtype, seed=32)
    v, _ = randn(backend, (2, 9, 3), dtype, seed=33)
    q, k = xp.abs(q) * big, xp.abs(k) * big
    out = host(call(backend, online_softmax_attention, q, k, v, block_q=4, block_k=4))
    want = host(call(backend, softmax_attention, q, k, v))
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- the heads pool


def _spy_pool(monkeypatch, module):
    """Record, for each ``parallel_map`` call of ``module``, whether it pooled, the
    items' count and the BLAS thread counts its workers saw."""
    import attn_ref._common as common

    calls = []

    def spy(fn, items, *, pooled):
        items = list(items)
        seen = []

        def watched(item):
            seen.append([lib["num_threads"] for lib in common.blas_one_thread().controller().info()])
            return fn(item)

        out = common.parallel_map(watched, items, pooled=pooled)
        calls.append((pooled, len(items), seen))
        return out

    monkeypatch.setattr(module, "parallel_map", spy)
    return calls


@pytest.mark.parametrize("opts", [{}, {"causal": True}, {"mask": "heads"}, {"mask": "shared"},
                                  {"alibi": True, "window": (3, 2)}, {"dropout": True},
                                  {"seqlens": True, "causal": "bottom-right"}])
def test_online_heads_pool_gives_the_unpooled_bits(backend, monkeypatch, opts):
    # POOL_MIN_LOGITS = 1: every call with several heads is "large". On NumPy (and
    # array-api-strict) the heads run in groups on the pool, BLAS on one thread in each
    # worker, and the result is the unpooled call's bit for bit; on torch and JAX
    # (jitted: traced arrays) nothing is pooled. Spec arrays are cut with the heads.
    from threadpoolctl import threadpool_limits

    import attn_ref._common as common
    from attn_ref.softmax import online

    rng = np.random.default_rng(25)
    q, _ = randn(backend, (2, 3, 37, 8), seed=26)
    k, _ = randn(backend, (2, 3, 41, 8), seed=27)
    v, _ = randn(backend, (2, 3, 41, 5), seed=28)
    kw = {key: val for key, val in opts.items() if key in ("causal", "window")}
    if opts.get("mask") == "heads":
        kw["mask"] = from_numpy(rng.random((2, 3, 37, 41)) < 0.6, backend)
    elif opts.get("mask") == "shared":
        kw["mask"] = from_numpy(rng.random((37, 41)) < 0.6, backend)
    if opts.get("alibi"):
        kw["alibi_slopes"] = from_numpy(np.array([0.5, 0.25, 0.125]), backend)
    if opts.get("dropout"):
        kw.update(dropout_p=0.25, dropout_mask=from_numpy(rng.random((2, 3, 37, 41)) < 0.75, backend))
    if opts.get("seqlens"):
        kw.update(seqlens_q=from_numpy(np.array([30, 37]), backend),
                  seqlens_k=from_numpy(np.array([41, 20]), backend))
    serial = host(call(backend, online_softmax_attention, q, k, v, block_q=8, block_k=16, **kw))
    monkeypatch.setattr(online, "POOL_MIN_LOGITS", 1)
    monkeypatch.setattr(common, "cpu_count", lambda: 2)
    calls = _spy_pool(monkeypatch, online)
    with threadpool_limits(2, "blas"):
        pooled = host(call(backend, online_softmax_attention, q, k, v, block_q=8, block_k=16, **kw))
    assert np.array_equal(pooled, serial)
    if backend.name in ("numpy", "array_api_strict"):
        assert [(p, n) for p, n, _ in calls] == [(True, 2)]  # two groups of heads, pooled
        assert all(set(t) == {1} for t in calls[0][2]) and len(calls[0][2]) == 2
    else:
        assert calls == []


@pytest.mark.parametrize("pool", [True, False])
@pytest.mark.parametrize("tile_logits, groups", [(1 << 19, 2), (8 * 16, 6), (2 * 8 * 16, 3)])
def test_online_heads_pool_groups_keep_tiles_small(monkeypatch, tile_logits, groups, pool):
    # A group of heads holds at most GROUP_TILE_LOGITS logits per tile (here 8 x 16 per
    # head), at least one group per CPU; any grouping gives the unpooled call's bits.
    # Without the pool (a BLAS threadpoolctl cannot hold) the groups run one after
    # another when all heads' tiles exceed the limit.
    import attn_ref._common as common
    from attn_ref.softmax import online

    rng = np.random.default_rng(30)
    q, k, v = (rng.standard_normal((2, 3, n, 8)) for n in (37, 41, 41))
    serial = online_softmax_attention(q, k, v, block_q=8, block_k=16, causal=True)
    monkeypatch.setattr(online, "POOL_MIN_LOGITS", 1)
    monkeypatch.setattr(online, "GROUP_TILE_LOGITS", tile_logits)
    monkeypatch.setattr(common, "cpu_count", lambda: 2)
    if not pool:
        monkeypatch.setattr(online, "pool_helps", lambda *arrays: False)
    calls = _spy_pool(monkeypatch, online)
    pooled = online_softmax_attention(q, k, v, block_q=8, block_k=16, causal=True)
    if pool:
        assert [(p, n) for p, n, _ in calls] == [(True, groups)]
    else:  # all six heads' tiles (768 logits) within the limit: one call, no groups
        assert [(p, n) for p, n, _ in calls] == ([(False, groups)] if tile_logits < 6 * 8 * 16 else [])
    assert np.array_equal(pooled, serial)


@pytest.mark.parametrize("tile_logits, groups", [(8 * 16, 6), (2 * 8 * 16, 3), (6 * 8 * 16, 0)])
def test_online_torch_heads_run_in_groups_with_the_same_bits(monkeypatch, tile_logits, groups):
    # PyTorch CPU tensors are never pooled, but their heads run in groups one after
    # another when all heads' tiles exceed TORCH_TILE_LOGITS (0: one group, no split),
    # with the bits of all heads at once.
    import torch

    from attn_ref.softmax import online

    rng = np.random.default_rng(31)
    q, k, v = (torch.from_numpy(rng.standard_normal((2, 3, n, 8), dtype=np.float32)) for n in (37, 41, 41))
    mask = torch.from_numpy(rng.random((2, 3, 37, 41)) < 0.6)
    whole = online_softmax_attention(q, k, v, block_q=8, block_k=16, mask=mask)
    monkeypatch.setattr(online, "TORCH_TILE_LOGITS", tile_logits)
    calls = _spy_pool(monkeypatch, online)
    grouped = online_softmax_attention(q, k, v, block_q=8, block_k=16, mask=mask)
    assert [(p, n) for p, n, _ in calls] == ([(False, groups)] if groups else [])
    assert torch.equal(grouped, whole)
    assert torch.equal(whole, torch.cat([online_softmax_attention(
        q[:, h:h + 1], k[:, h:h + 1], v[:, h:h + 1], block_q=8, block_k=16, mask=mask[:, h:h + 1])
        for h in range(3)], dim=1))


def test_online_heads_pool_restores_blas_after_an_error(monkeypatch):
    # An exception inside a worker reaches the caller, and BLAS has its threads back.
    from threadpoolctl import threadpool_limits

    import attn_ref._common as common
    from attn_ref.softmax import online

    monkeypatch.setattr(online, "POOL_MIN_LOGITS", 1)
    monkeypatch.setattr(common, "cpu_count", lambda: 2)
    real = online._query_blocks

    def failing(xp, spec, q, *args):
        if q.shape[0] == 1:  # the first group of heads (rows 0:1 of 3, on 2 CPUs)
            raise FloatingPointError("head group failed")
        return real(xp, spec, q, *args)

    monkeypatch.setattr(online, "_query_blocks", failing)
    q = np.random.default_rng(29).standard_normal((3, 16, 4))
    with threadpool_limits(2, "blas"):
        with pytest.raises(FloatingPointError, match="head group failed"):
            online_softmax_attention(q, q, q)
        assert {lib["num_threads"] for lib in common.blas_one_thread().controller().info()} == {2}
