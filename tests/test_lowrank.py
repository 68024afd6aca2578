"""attn_ref.lowrank: Linformer and its Gaussian projection, on every backend."""

import numpy as np
import pytest

from attn_ref import linformer_attention, linformer_projection, linformer_weights
from conformance.backends import from_numpy
from tests.helpers import assert_close, call, host, randn
from tests.plain import naive_attention, naive_linformer

SHAPE = (2, 3, 12, 8)  # batch, heads, N, d
DV = 6


def _qkv(backend, dtype="float64", nq=12, nk=12):
    q, qh = randn(backend, SHAPE[:2] + (nq, SHAPE[-1]), dtype, seed=1)
    k, kh = randn(backend, SHAPE[:2] + (nk, SHAPE[-1]), dtype, seed=2)
    v, vh = randn(backend, SHAPE[:2] + (nk, DV), dtype, seed=3)
    return (q, k, v), (qh, kh, vh)


@pytest.mark.parametrize("dtype,form", [("float32", "shared"), ("float64", "shared"),
                                        ("float64", "per_head")])
def test_identity_projection_is_softmax(backend, dtype, form):
    (q, k, v), (qh, kh, vh) = _qkv(backend, dtype)
    eye = np.eye(12)
    e = from_numpy(np.stack([eye] * 3) if form == "per_head" else eye, backend, dtype)
    f = None if form == "shared" else e
    out = call(backend, linformer_attention, q, k, v, e_proj=e, f_proj=f)
    assert_close(out, naive_attention(qh, kh, vh)[0], backend, dtype=dtype)


@pytest.mark.parametrize("per_head,nq", [(False, 12), (True, 7)])  # self- and cross-attention
def test_matches_plain_numpy(backend, per_head, nq):
    (q, k, v), (qh, kh, vh) = _qkv(backend, nq=nq)
    heads = 3 if per_head else None
    e = linformer_projection(5, 12, heads=heads, seed=4, dtype=backend.xp.float64,
                             device=backend.device, xp=backend.xp)
    f = linformer_projection(5, 12, heads=heads, seed=5, dtype=backend.xp.float64,
                             device=backend.device, xp=backend.xp)
    out = call(backend, linformer_attention, q, k, v, e_proj=e, f_proj=f, scale=0.5)
    want, want_w = naive_linformer(qh * 0.5 * np.sqrt(8), kh, vh, host(e), host(f))
    assert_close(out, want, backend)
    w = call(backend, linformer_weights, q, k, e_proj=e, f_proj=f, scale=0.5)
    assert_close(w, want_w, backend)
    # The implied matrix reproduces the output.
    np.testing.assert_allclose(host(w) @ vh, want, rtol=1e-13, atol=1e-13)


def test_shared_projection_is_f_equal_e(backend):
    # A square random projection (r = N) mixes the keys: the result is F = E Linformer,
    # and clearly not softmax, which guards the identity test against a function that
    # ignores its projection.
    (q, k, v), (qh, kh, vh) = _qkv(backend)
    e = linformer_projection(12, 12, seed=6, dtype=backend.xp.float64, device=backend.device,
                             xp=backend.xp)
    shared = call(backend, linformer_attention, q, k, v, e_proj=e)
    assert_close(shared, naive_linformer(qh, kh, vh, host(e), host(e))[0], backend)
    assert np.abs(host(shared) - naive_attention(qh, kh, vh)[0]).max() > 1e-2


def test_empty_queries(backend):
    xp = backend.xp
    q0 = xp.zeros((2, 0, 4), dtype=xp.float64, device=backend.device)
    k, _ = randn(backend, (2, 5, 4))
    v, _ = randn(backend, (2, 5, 3))
    e = linformer_projection(2, 5, seed=0, device=backend.device, xp=xp)
    assert tuple(call(backend, linformer_attention, q0, k, v, e_proj=e).shape) == (2, 0, 3)


def test_projection_statistics_and_seed():
    import array_api_strict as xp

    a = linformer_projection(64, 4096, seed=3, xp=xp)
    b = linformer_projection(64, 4096, seed=3, xp=xp)
    c = linformer_projection(64, 4096, seed=4, xp=xp)
    ah, bh, ch = host(a), host(b), host(c)
    assert ah.shape == (64, 4096)
    assert np.array_equal(ah, bh) and not np.array_equal(ah, ch)
    # Entries N(0, 1/k): 262144 samples put the variance within 1% of 1/64.
    assert abs(ah.var() * 64 - 1) < 0.01 and abs(ah.mean()) < 1e-3
    # Johnson-Lindenstrauss: norms of fixed vectors are kept to within ~1/sqrt(k).
    x = np.random.default_rng(0).standard_normal((4096, 20))
    ratio = np.linalg.norm(ah @ x, axis=0) / np.linalg.norm(x, axis=0)
    assert np.all(np.abs(ratio - 1) < 0.5) and abs(ratio.mean() - 1) < 0.1
    per_head = host(linformer_projection(3, 10, heads=4, seed=1, xp=xp))
    assert per_head.shape == (4, 3, 10) and not np.array_equal(per_head[0], per_head[1])
    assert linformer_projection(2, 5, seed=0, dtype=xp.float32, xp=xp).dtype == xp.float32


@pytest.mark.parametrize("args,msg", [
    ((0, 5), "k must be a positive integer"),
    ((6, 5), "k .the projected length. must be at most n=5"),
    ((2, 0), "n must be a positive integer"),
])
def test_projection_bad_arguments(args, msg):
    import array_api_strict as xp

    with pytest.raises(ValueError, match=msg):
        linformer_projection(*args, seed=0, xp=xp)
    with pytest.raises(ValueError, match="seed must be a non-negative integer"):
        linformer_projection(2, 5, seed=-1, xp=xp)
    with pytest.raises(ValueError, match="heads must be a positive integer"):
        linformer_projection(2, 5, heads=0, seed=0, xp=xp)
    # k and n are positional-only, as the data arguments of every public function.
    with pytest.raises(TypeError, match="positional-only"):
        linformer_projection(k=2, n=5, seed=0, xp=xp)


@pytest.mark.parametrize("fn", [linformer_attention, linformer_weights])
@pytest.mark.parametrize("causal", [True, "top-left", "bottom-right"])
def test_refuses_causal(backend, fn, causal):
    (q, k, v), _ = _qkv(backend)
    e = from_numpy(np.eye(12), backend)
    args = (q, k, v) if fn is linformer_attention else (q, k)
    with pytest.raises(ValueError, match=f"{fn.__name__} does not support causal masking"):
        fn(*args, e_proj=e, causal=causal)


def test_refuses_mask(backend):
    (q, k, v), _ = _qkv(backend)
    e = from_numpy(np.eye(12), backend)
    mask = from_numpy(np.ones((12, 12), dtype=bool), backend)
    with pytest.raises(ValueError, match="does not support mask=.*zero the padded keys"):
        linformer_attention(q, k, v, e_proj=e, mask=mask)


def _bad_cases(backend):
    xp = backend.xp

    def arr(shape, dtype="float64"):
        return from_numpy(np.ones(shape), backend, dtype)

    return [
        (dict(e_proj=arr((4, 11))), ValueError, r"e_proj must have shape .*Nk=12.*got shape \(4, 11\)"),
        (dict(e_proj=arr((13, 12))), ValueError, r"e_proj .*r=13 must lie in \[1, Nk=12\]"),
        (dict(e_proj=arr((0, 12))), ValueError, r"e_proj .*r=0 must lie in \[1, Nk=12\]"),
        (dict(e_proj=arr((12,))), ValueError, r"e_proj must have shape .*got shape \(12,\)"),
        (dict(e_proj=arr((2, 4, 12))), ValueError, r"e_proj has per-head shape .*h=2 does not match"),
        (dict(e_proj=arr((4, 12), "float32")), TypeError, "e_proj must have the dtype of q"),
        (dict(e_proj=arr((4, 12)), f_proj=arr((3, 12))), ValueError,
         "e_proj and f_proj must project to the same length r"),
        (dict(e_proj=arr((4, 12)), f_proj=arr((4, 10))), ValueError, "f_proj must have shape"),
        (dict(e_proj=np.eye(12).tolist()), TypeError, "e_proj must be an array"),
        (dict(e_proj=xp.ones((4, 12), dtype=xp.float64, device=backend.device), scale=float("nan")),
         ValueError, "scale must be a finite real number"),
    ]


def test_bad_input(backend):
    (q, k, v), _ = _qkv(backend)
    for kwargs, exc, msg in _bad_cases(backend):
        with pytest.raises(exc, match=msg):
            linformer_attention(q, k, v, **kwargs)

