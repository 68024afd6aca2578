"""attn_ref.performer: FAVOR+ random features, exactness of the stabiliser, convergence to softmax."""

import numpy as np
import pytest

from attn_ref import (
    favor_features,
    performer_attention,
    performer_attention_weights,
    random_features,
    softmax_attention,
)
from attn_ref.performer import KERNELS
from conformance.backends import from_numpy
from tests.helpers import assert_close, call, host, randn
from tests.plain import naive_attention, np_favor, np_performer


def _proj(backend, d, m, seed=0, kind="orthogonal", dtype="float64"):
    w = random_features(d, m, kind=kind, seed=seed, dtype=getattr(backend.xp, dtype),
                        device=backend.device, xp=backend.xp)
    return w, host(w)


def _qkv(backend, batch, nq, nk, d, dv, dtype="float64", seed=0, scale=1.0):
    q, qh = randn(backend, batch + (nq, d), dtype, seed=seed + 1, scale=scale)
    k, kh = randn(backend, batch + (nk, d), dtype, seed=seed + 2, scale=scale)
    v, vh = randn(backend, batch + (nk, dv), dtype, seed=seed + 3)
    return (q, k, v), (qh, kh, vh)


# ---------------------------------------------------------------- random features


@pytest.mark.parametrize("d,m", [(4, 4), (4, 10), (6, 3)])
def test_random_features(backend, d, m):
    w, wh = _proj(backend, d, m, seed=3)
    assert tuple(w.shape) == (m, d)
    # Rows are orthogonal within each block of d.
    for b0 in range(0, m, d):
        blk = wh[b0:b0 + d]
        g = blk @ blk.T
        np.testing.assert_allclose(g - np.diag(np.diag(g)), 0, atol=1e-12)
    # Same seed -> same matrix on every backend (host-drawn); a new seed -> a new one.
    ref = host(random_features(d, m, seed=3, xp=np))
    np.testing.assert_array_equal(wh, ref)
    assert not np.allclose(wh, host(random_features(d, m, seed=4, xp=np)))
    iid = host(random_features(d, m, kind="iid", seed=3, xp=backend.xp, device=backend.device))
    np.testing.assert_array_equal(iid, np.random.default_rng(3).standard_normal((m, d)))
    w32 = random_features(d, m, seed=3, dtype=backend.xp.float32, xp=backend.xp, device=backend.device)
    assert str(w32.dtype).endswith("float32")


def test_orthogonal_rows_have_gaussian_norms():
    # Each row alone must be N(0, I): squared norms are chi^2_d (mean d, variance 2d).
    d = 8
    sq = np.concatenate([(host(random_features(d, 64, seed=s, xp=np)) ** 2).sum(1) for s in range(64)])
    assert abs(sq.mean() - d) < 4 * np.sqrt(2 * d / sq.size)
    assert abs(sq.var() - 2 * d) < 0.15 * 2 * d


# ---------------------------------------------------------------- features


@pytest.mark.parametrize("kernel", KERNELS)
def test_favor_features_formula(backend, kernel):
    x, xh = randn(backend, (2, 5, 4), seed=1, scale=0.5)
    w, wh = _proj(backend, 4, 6, seed=1)
    f = call(backend, favor_features, x, w, kernel=kernel)
    assert_close(f, np_favor(xh, wh, kernel), backend)
    off, offh = randn(backend, (2, 5, 1), seed=2)
    g = call(backend, favor_features, x, w, kernel=kernel, offset=off)
    assert_close(g, np_favor(xh, wh, kernel) * np.exp(-offh), backend)


@pytest.mark.parametrize("kernel", KERNELS)
def test_favor_kernel_is_unbiased(backend, kernel):
    # E[phi(x) . phi(y)] = exp(x . y): the mean over 64 fixed seeds lies within 4
    # standard errors (estimated from the same 64 draws) of the true kernel.
    x, xh = randn(backend, (3, 4), seed=5, scale=0.5)
    y, yh = randn(backend, (5, 4), seed=6, scale=0.5)
    est = []
    for s in range(64):
        w, _ = _proj(backend, 4, 16, seed=s, kind="iid")
        est.append(host(call(backend, favor_features, x, w, kernel=kernel))
                   @ host(call(backend, favor_features, y, w, kernel=kernel)).T)
    est = np.array(est)
    se = est.std(0, ddof=1) / np.sqrt(len(est))
    assert np.all(np.abs(est.mean(0) - np.exp(xh @ yh.T)) < 4 * se + 1e-12)


# ---------------------------------------------------------------- the estimator


@pytest.mark.parametrize("kernel,causal,dtype,order", [
    ("positive", False, "float64", "linear"),
    ("positive", "top-left", "float64", "linear"),
    ("positive", "bottom-right", "float64", "quadratic"),
    ("positive", "bottom-right", "float32", "linear"),
    ("trigonometric", False, "float64", "quadratic"),
    ("trigonometric", "bottom-right", "float64", "linear"),
    ("trigonometric", "top-left", "float32", "linear"),
])
def test_matches_plain_numpy(backend, kernel, causal, dtype, order):
    (q, k, v), (qh, kh, vh) = _qkv(backend, (2,), 11, 9, 4, 3, dtype=dtype, seed=10, scale=0.7)
    w, wh = _proj(backend, 4, 12, seed=2, dtype=dtype)
    want, _ = np_performer(qh, kh, vh, wh, kernel=kernel, causal=causal)
    out = call(backend, performer_attention, q, k, v, projection=w, kernel=kernel, causal=causal,
               order=order, chunk_size=4)
    tol = {"float32": 1e-4, "float64": 1e-11}[dtype]  # trig denominators amplify rounding
    assert_close(out, want, backend, dtype=dtype, rtol=tol, atol=tol)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("stabilize,dtype", [(True, "float64"), (False, "float64"), (True, "float32")])
def test_non_causal_features_block_by_block(backend, kernel, stabilize, dtype, monkeypatch):
    # Non-causal, linear order: the features are made 4 rows at a time and the key
    # stabiliser is the maximum of every block's exponents (a first pass over the keys).
    # For the positive kernel the last block's keys are 30x larger, so their exponents
    # lie far below the other blocks': a stabiliser taken from one block alone would
    # overflow the others' features in float32. (Trigonometric features of such keys
    # are too ill-conditioned to compare; they get 2x.)
    import attn_ref.performer as performer

    monkeypatch.setattr(performer, "DEFAULT_BLOCK_SIZE", 4)
    rng = np.random.default_rng(11)
    qh, kh, vh = (rng.standard_normal((2, n, d)) * 0.7 for n, d in ((9, 4), (11, 4), (11, 3)))
    kh[:, 8:, :] *= 30.0 if kernel == "positive" else 2.0
    w, wh = _proj(backend, 4, 12, seed=5, dtype=dtype)
    want, _ = np_performer(qh, kh, vh, wh, kernel=kernel)
    q, k, v = (from_numpy(x.astype(dtype), backend) for x in (qh, kh, vh))
    out = call(backend, performer_attention, q, k, v, projection=w, kernel=kernel, stabilize=stabilize)
    tol = {"float32": 1e-4, "float64": 1e-10}[dtype]
    assert_close(out, want, backend, dtype=dtype, rtol=tol, atol=tol)


@pytest.mark.parametrize("kernel,causals", [
    ("positive", (False, "bottom-right")), ("trigonometric", (False,))
])
def test_stabiliser_is_exact(backend, kernel, causals):
    # In float64 with moderate inputs both forms are accurate, so they must agree.
    (q, k, v), _ = _qkv(backend, (2,), 10, 10, 4, 3, seed=20)
    w, _ = _proj(backend, 4, 16, seed=3)
    for causal in causals:
        a = call(backend, performer_attention, q, k, v, projection=w, kernel=kernel, causal=causal)
        b = call(backend, performer_attention, q, k, v, projection=w, kernel=kernel, causal=causal,
                 stabilize=False)
        assert_close(a, host(b), backend, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [False, "top-left"])
def test_stabiliser_rescues_float32(backend, causal):
    # Queries of norm ~40: every unstabilised query feature exp(w.x - |x|^2/2) underflows
    # in float32 and the output collapses to zero; the stabilised one matches float64.
    (q, k, v), (qh, kh, vh) = _qkv(backend, (2,), 8, 8, 4, 3, dtype="float32", seed=30)
    q = q * 20.0
    w, wh = _proj(backend, 4, 32, seed=4, dtype="float32")
    want, _ = np_performer(qh * 20.0, kh, vh, wh, causal=causal)
    bad = host(call(backend, performer_attention, q, k, v, projection=w, causal=causal, stabilize=False))
    good = call(backend, performer_attention, q, k, v, projection=w, causal=causal)
    assert np.all(np.isfinite(bad)) and np.abs(bad - want).max() > 0.1
    assert_close(good, want, backend, dtype="float32", rtol=1e-3, atol=1e-3)


def test_causal_stabiliser_ignores_future_keys(backend):
    # A future key of huge norm must not move any past output by a single bit (NumPy,
    # array-api-strict); a max over all keys as the key stabiliser would.
    (q, k, v), (qh, kh, vh) = _qkv(backend, (2,), 12, 12, 4, 3, seed=40)
    w, _ = _proj(backend, 4, 16, seed=5)
    for causal, order in (("top-left", "linear"), ("bottom-right", "quadratic")):
        base = host(call(backend, performer_attention, q, k, v, projection=w, causal=causal, order=order,
                         chunk_size=4))
        for i in (2, 7):
            k2, v2 = kh.copy(), vh.copy()
            k2[:, i + 1:] *= 6.0
            v2[:, i + 1:] += 5.0
            out = host(call(backend, performer_attention, q, from_numpy(k2, backend),
                            from_numpy(v2, backend), projection=w, causal=causal, order=order,
                            chunk_size=4))
            if backend.name in ("numpy", "array_api_strict"):
                assert np.array_equal(out[:, : i + 1], base[:, : i + 1])
            else:
                np.testing.assert_allclose(out[:, : i + 1], base[:, : i + 1], rtol=1e-13, atol=1e-13)
            assert not np.allclose(out[:, i + 1:], base[:, i + 1:])


@pytest.mark.parametrize("kernel,nq,nk,causal,chunk", [
    ("positive", 13, 13, "top-left", 2),  # 7 chunks: a 3-step rescaled prefix scan, ragged tail
    ("positive", 13, 4, "bottom-right", 3),  # front padding fills whole chunks with empty keys
    ("trigonometric", 5, 12, "bottom-right", 2),
])
def test_causal_chunked_scan_equals_quadratic(backend, kernel, nq, nk, causal, chunk):
    w, _ = _proj(backend, 4, 8, seed=7)
    (q, k, v), _ = _qkv(backend, (2,), nq, nk, 4, 3, seed=nq + nk)
    k = k * 3.0  # spread the per-key offsets so the rescaling matters
    b = host(call(backend, performer_attention, q, k, v, projection=w, kernel=kernel, causal=causal,
                  order="quadratic"))
    assert np.all(np.isfinite(b))
    a = call(backend, performer_attention, q, k, v, projection=w, kernel=kernel, causal=causal,
             chunk_size=chunk)
    assert_close(a, b, backend, rtol=1e-11, atol=1e-11)


def test_causal_float32_large_d(backend):
    # d = 128, inputs of norm ~23: a key shift from the projection alone (max |w|^2/2)
    # would push every key feature below float32's range; the running per-key maximum
    # keeps float32 within rounding of float64.
    d = 128
    (q, k, v), (qh, kh, vh) = _qkv(backend, (2,), 16, 16, d, 4, dtype="float32", seed=90, scale=2.0)
    w, wh = _proj(backend, d, 128, seed=8, dtype="float32")
    want, _ = np_performer(qh, kh, vh, wh, causal=True)
    for order in ("linear", "quadratic"):
        out = call(backend, performer_attention, q, k, v, projection=w, causal=True, order=order,
                   chunk_size=4)
        assert_close(out, want, backend, dtype="float32", rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel", KERNELS)
def test_weights(backend, kernel):
    (q, k, v), (qh, kh, vh) = _qkv(backend, (2,), 9, 7, 4, 3, seed=50, scale=0.7)
    w, wh = _proj(backend, 4, 12, seed=6)
    for causal in (False, "bottom-right"):
        p = call(backend, performer_attention_weights, q, k, projection=w, kernel=kernel, causal=causal)
        _, want = np_performer(qh, kh, vh, wh, kernel=kernel, causal=causal)
        assert_close(p, want, backend, rtol=1e-11, atol=1e-11)
        ph = host(p)
        seen = np.abs(ph).sum(-1) > 0
        np.testing.assert_allclose(ph.sum(-1)[seen], 1.0, rtol=0, atol=1e-12)
        if kernel == "positive":
            assert np.all(ph >= 0)
    out = call(backend, performer_attention, q, k, v, projection=w, kernel=kernel, causal=causal,
               chunk_size=3)
    assert_close(out, ph @ vh, backend, rtol=1e-11, atol=1e-11)
    # bottom-right with Nq > Nk: the first Nq - Nk queries see nothing.
    assert np.all(ph[:, :2] == 0) and np.allclose(ph[:, 2:].sum(-1), 1.0)


def test_empty_sequences(backend):
    xp = backend.xp
    z = lambda *s: xp.zeros(s, dtype=xp.float64, device=backend.device)  # noqa: E731
    (q, k, v), _ = _qkv(backend, (2,), 3, 4, 5, 6)
    w, _ = _proj(backend, 5, 7)
    for causal in (False, "top-left"):
        out = call(backend, performer_attention, z(2, 0, 5), k, v, projection=w, causal=causal)
        assert tuple(out.shape) == (2, 0, 6)
        out = call(backend, performer_attention, q, z(2, 0, 5), z(2, 0, 6), projection=w, causal=causal)
        assert tuple(out.shape) == (2, 3, 6) and np.all(host(out) == 0)


# ---------------------------------------------------------------- convergence (fixed seeds)


def _rms_error_vs_softmax(backend, q, k, v, ref, d, m, kind, seeds):
    errs = []
    for s in seeds:
        w, _ = _proj(backend, d, m, seed=s, kind=kind)
        out = host(call(backend, performer_attention, q, k, v, projection=w))
        errs.append(np.sqrt(np.mean((out - ref) ** 2)))
    return float(np.mean(errs))


def test_error_falls_as_m_grows(backend):
    # Mean RMS error against softmax over 16 fixed seeds; the error of a Monte-Carlo
    # estimate falls like 1/sqrt(m), so 4x the features should roughly halve it.
    (q, k, v), (qh, kh, vh) = _qkv(backend, (2,), 16, 16, 8, 4, seed=60, scale=0.5)
    ref, _ = naive_attention(qh, kh, vh)
    errs = [_rms_error_vs_softmax(backend, q, k, v, ref, 8, m, "orthogonal", range(16))
            for m in (16, 64, 256)]
    assert errs[1] < 0.75 * errs[0] and errs[2] < 0.75 * errs[1], errs
    assert errs[2] < 0.04, errs
    assert_close(call(backend, softmax_attention, q, k, v), ref, backend)


def test_orthogonal_beats_iid(backend):
    # At m = d, 64 fixed seeds, 8 heads of independent inputs: orthogonal features
    # have a clearly lower mean squared error (about 0.8x here).
    (q, k, v), (qh, kh, vh) = _qkv(backend, (8,), 16, 16, 8, 4, seed=70, scale=0.5)
    ref, _ = naive_attention(qh, kh, vh)
    mse = {}
    for kind in ("orthogonal", "iid"):
        errs = []
        for s in range(64):
            w, _ = _proj(backend, 8, 8, seed=s, kind=kind)
            errs.append(np.mean((host(call(backend, performer_attention, q, k, v, projection=w)) - ref) ** 2))
        mse[kind] = float(np.mean(errs))
    assert mse["orthogonal"] < 0.92 * mse["iid"], mse


# ---------------------------------------------------------------- bad input


def test_bad_input(backend):
    xp = backend.xp
    r = lambda *s: randn(backend, s)[0]  # noqa: E731
    q, k, v = r(3, 4), r(5, 4), r(5, 2)
    w, _ = _proj(backend, 4, 6)
    cases = [
        ({"projection": r(6, 5)}, ValueError,
         r"projection must have shape \(m, d\) = \(m, 4\).*got shape \(6, 5\)"),
        ({"projection": r(6)}, ValueError, "projection must have shape"),
        ({"projection": r(0, 4)}, ValueError, "m >= 1"),
        ({"projection": xp.astype(w, xp.float32)}, TypeError, "projection must have the dtype of q"),
        ({"projection": [[1.0] * 4]}, TypeError, "projection must be an array"),
        ({"projection": w, "kernel": "hyperbolic"}, ValueError, "kernel must be one of"),
        ({"projection": w, "causal": "diagonal"}, ValueError, "causal must be"),
        ({"projection": w, "scale": -1.0}, ValueError, "scale must be non-negative"),
        ({"projection": w, "eps": -1.0}, ValueError, "eps must be a positive"),
        ({"projection": w, "order": "cubic"}, ValueError, "order must be one of"),
        ({"projection": w, "causal": True, "chunk_size": 0}, ValueError, "chunk_size must be"),
    ]
    for kwargs, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            performer_attention(q, k, v, **kwargs)
    with pytest.raises(ValueError, match="projection must have shape"):
        performer_attention_weights(q, k, projection=r(6, 3))
    with pytest.raises(ValueError, match="q must have shape"):
        performer_attention(r(4), k, v, projection=w)
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., N, d\)"):
        favor_features(r(4), w)
    with pytest.raises(ValueError, match="projection must have shape"):
        favor_features(r(3, 5), w)
    for bad in (-1, 0, 2.5, True):
        # A negative or zero integer is a wrong value; a float or a bool a wrong type.
        exc = ValueError if isinstance(bad, int) and not isinstance(bad, bool) else TypeError
        with pytest.raises(exc, match="m must be a positive integer"):
            random_features(4, bad, seed=0, xp=xp)
        with pytest.raises(exc, match="d must be a positive integer"):
            random_features(bad, 4, seed=0, xp=xp)
    with pytest.raises(ValueError, match="kind must be one of"):
        random_features(4, 4, kind="sobol", seed=0, xp=xp)
    with pytest.raises(ValueError, match="seed must be a non-negative integer"):
        random_features(4, 4, seed=-3, xp=xp)


# ---------------------------------------------------------------- catalogue



def test_default_eps_floors_only_a_zero_denominator_in_float16():
    # float16's smallest normal (6.1e-5) floored real denominators: FAVOR+ features are at
    # most 1/sqrt(m) after the stabiliser, and on a 33-token d = 80 case 20 % of them were
    # below it (an output error of 1.17 on outputs of 2.3 on torch). The floor is now the
    # least float16 number, 2^-24, which only a zero denominator is below.
    import sys

    import array_api_compat.numpy as npx

    from attn_ref.performer import default_eps

    assert default_eps(npx, npx.float16) == 2.0 ** -24
    assert default_eps(npx, npx.float32) == 2.0 ** -126
    assert default_eps(npx, npx.float64) == sys.float_info.min
    torch = pytest.importorskip("torch")
    import array_api_compat.torch as tx

    assert default_eps(tx, torch.bfloat16) == 2.0 ** -126  # its smallest subnormal is not float32-normal
    pytest.importorskip("jax")
    import jax.numpy as jnp

    # XLA flushes subnormals on CPU, float16's too: a floor of 2^-24 would be 0 (0 / 0)
    assert default_eps(jnp, jnp.float16) == 2.0 ** -14
    q16 = jnp.zeros((1, 4, 8), dtype=jnp.float16)
    w16 = jnp.ones((4, 8), dtype=jnp.float16) * 30  # every feature underflows: den = 0
    assert bool(jnp.all(jnp.isfinite(performer_attention(q16 - 1, q16 - 1, q16 + 1, projection=w16,
                                                         stabilize=False))))
    rng = np.random.default_rng(0)
    d, m = 80, 351
    q, k, v = (rng.standard_normal((33, d)) for _ in range(3))
    w = random_features(d, m, seed=0, xp=npx)
    gold = performer_attention(q, k, v, projection=w)
    half = performer_attention(*(x.astype(np.float16) for x in (q, k, v)), projection=w.astype(np.float16))
    # float16's rounding, not a floored denominator (which erred by up to 3x of |out|)
    assert np.max(np.abs(half.astype(np.float64) - gold)) < 0.02 * np.max(np.abs(gold))


def test_half_precision_input_takes_the_floor_of_float32_that_it_is_computed_in():
    """float16 input is computed in float32; its default denominator floor was float16's
    (2^-24 on NumPy and torch, 2^-14 on JAX), which floors real float32 denominators on
    large logits: the output was off by 0.99 of its size here (and JAX's float16 Performer
    failed 10 of the oracle's 60 standard float16 cases at 4.6-88x). With float32's floor
    it is float16's rounding of the float64 function of the same rounded inputs."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 16, 8)) for _ in range(3))
    q, k = 8 * q, 8 * k  # large logits: most features vanish next to the stabiliser's maximum
    w = random_features(8, 17, seed=0, xp=np)
    half = [x.astype(np.float16) for x in (q, k, v, w)]
    gold = performer_attention(*(x.astype(np.float64) for x in half[:3]),
                               projection=half[3].astype(np.float64))
    size = np.max(np.abs(gold))
    got = performer_attention(*half[:3], projection=half[3])
    assert got.dtype == np.float16
    assert np.max(np.abs(got.astype(np.float64) - gold)) < 2.0 ** -10 * size
    floored = performer_attention(*half[:3], projection=half[3], eps=2.0 ** -24)  # the old default
    assert np.max(np.abs(floored.astype(np.float64) - gold)) > 0.5 * size
    jnp = pytest.importorskip("jax.numpy")
    got = performer_attention(*(jnp.asarray(x) for x in half[:3]), projection=jnp.asarray(half[3]))
    assert got.dtype == jnp.float16
    assert np.max(np.abs(np.asarray(got, dtype=np.float64) - gold)) < 2.0 ** -10 * size


def test_half_precision_input_is_computed_in_float32_and_differentiates_finitely():
    """float16/bfloat16 input runs in float32 (as linear attention's does) and returns its
    dtype: the features' exponentials and the sums over keys stay in float32's range.
    In float16 torch autograd of the forward had non-finite gradients on 11 of the
    oracle's 64 standard cases (``headdim:b1h2-q33k33-d80``...)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    d, m = 80, 351
    q, k, v = (rng.standard_normal((2, 33, d)) for _ in range(3))
    w = random_features(d, m, seed=0, xp=np)
    gold = performer_attention(*(x.astype(np.float32) for x in (q, k, v)), projection=w.astype(np.float32))
    for dtype in (torch.float16, torch.bfloat16):
        qt, kt, vt = (torch.tensor(x, dtype=dtype, requires_grad=True) for x in (q, k, v))
        for causal in (False, True):
            out = performer_attention(qt, kt, vt, projection=torch.tensor(w, dtype=dtype), causal=causal)
            assert out.dtype == dtype
            out.float().square().sum().backward()
            for x in (qt, kt, vt):
                assert bool(torch.isfinite(x.grad).all()), (dtype, causal)
                x.grad = None
            if not causal:
                # the float32 computation of the inputs rounded to the dtype, rounded once
                got = out.detach().double().numpy()
                u = 2.0 ** -(10 if dtype == torch.float16 else 7)
                assert np.max(np.abs(got - gold)) < 8 * u * np.max(np.abs(gold)), dtype
