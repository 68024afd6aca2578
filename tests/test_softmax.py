"""attn_ref.softmax: one-shot and online softmax attention, on every backend."""

import itertools

import mpmath
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from attn_ref import attention_weights, online_softmax_attention, softmax_attention
from conformance.backends import from_numpy
from tests.helpers import EPS, assert_close, call, host, naive_attention, property_test, randn

CAUSAL = [False, "top-left", "bottom-right"]
FORMS = {
    "oneshot": softmax_attention,
    "online": lambda *a, **kw: online_softmax_attention(*a, block_q=5, block_k=7, **kw),
}


def _causal(c):
    return None if c is False else c


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize(
    "shapes",
    [
        ((2, 3), 17, 17, 8, 8),  # batch, heads, self-attention
        ((3,), 9, 23, 4, 6),  # cross-attention, Nq < Nk, dv != d
        ((), 31, 12, 16, 3),  # Nq > Nk, single head
    ],
)
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
    q, qh = randn(backend, (2, 19, 6), seed=11)
    k, kh = randn(backend, (2, 29, 6), seed=12)
    v, vh = randn(backend, (2, 29, 4), seed=13)
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
    with pytest.raises(ValueError, match="block_q must be a positive integer"):
        online_softmax_attention(q, q, q, block_q=bad)
    with pytest.raises(ValueError, match="block_k must be a positive integer"):
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
