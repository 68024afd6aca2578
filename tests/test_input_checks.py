"""Issue 21: array options from another library, Python/NumPy scalars, NaN from finite
input, and the VJP / feature-map contracts, on every backend.

Each check asserts the error type and that the message names the argument and both
libraries (or both dtypes), so a check that regressed to a crash deep in the backend,
or to a message naming one side only, fails here.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attn_ref.grad as G
from attn_ref import (
    attention_weights,
    compressed_attention,
    favor_features,
    linear_attention,
    linear_attention_state,
    linear_attention_step,
    linformer_attention,
    online_softmax_attention,
    performer_attention,
    random_features,
    softmax_attention,
)
from attn_ref.registry import get
from conformance.backends import from_numpy, load
from tests.helpers import host, property_test, randn
from tests.plain import naive_attention

H, N, D, DV = 2, 6, 4, 3


def _other(backend):
    """Another library than ``backend``'s, and its name as the messages spell it."""
    if backend.name != "numpy":
        return load("numpy"), "numpy"
    return load("array_api_strict"), "array_api_strict"


def _qkv(backend, dtype="float64"):
    q, _ = randn(backend, (H, N, D), dtype, seed=1)
    k, _ = randn(backend, (H, N, D), dtype, seed=2)
    v, _ = randn(backend, (H, N, DV), dtype, seed=3)
    return q, k, v


def _option_cases(backend):
    """``(name, call)`` pairs: ``call(mk)`` calls a public function with the option
    called ``name`` built by ``mk(host_array)`` and everything else from ``backend``."""
    xp = backend.xp
    q, k, v = _qkv(backend)
    do, _ = randn(backend, (H, N, DV), seed=4)
    vw = from_numpy(np.ones((3, DV, DV)) / 3, backend)
    w = np.random.default_rng(5).standard_normal((3, D, D))
    proj = np.random.default_rng(6).standard_normal((8, D))
    e = np.random.default_rng(7).standard_normal((3, N)) / 3
    mask = np.tril(np.ones((N, N), dtype=bool))
    keep = np.ones((N, N), dtype=bool)
    return [
        ("mask", lambda mk: softmax_attention(q, k, v, mask=mk(mask))),
        ("mask", lambda mk: online_softmax_attention(q, k, v, mask=mk(mask), block_q=2, block_k=2)),
        ("bias", lambda mk: softmax_attention(q, k, v, bias=mk(np.zeros((N, N))))),
        ("alibi_slopes", lambda mk: softmax_attention(q, k, v, alibi_slopes=mk(np.ones(H)))),
        ("dropout_mask", lambda mk: softmax_attention(q, k, v, dropout_p=0.1, dropout_mask=mk(keep))),
        ("seqlens_k", lambda mk: softmax_attention(*(xp.expand_dims(x, axis=0) for x in (q, k, v)),
                                                   seqlens_k=mk(np.array([N - 1])))),
        ("e_proj", lambda mk: linformer_attention(q, k, v, e_proj=mk(e))),
        ("f_proj", lambda mk: linformer_attention(q, k, v, e_proj=from_numpy(e, backend), f_proj=mk(e))),
        ("k_weight", lambda mk: compressed_attention(q, k, v, k_weight=mk(w), v_weight=vw)),
        ("v_weight", lambda mk: compressed_attention(q, k, v, k_weight=from_numpy(w, backend),
                                                     v_weight=mk(np.ones((3, DV, DV)) / 3))),
        ("projection", lambda mk: performer_attention(q, k, v, projection=mk(proj))),
        ("projection", lambda mk: favor_features(q, mk(proj))),
        ("do", lambda mk: G.softmax_attention(q, k, v, mk(host(do)))),
        ("do", lambda mk: G.online_softmax_attention(q, k, v, mk(host(do)), block_q=2, block_k=2)),
        ("do", lambda mk: G.linear_attention(q, k, v, mk(host(do)))),
        ("do", lambda mk: G.local_attention(q, k, v, mk(host(do)), window=1)),
        ("do", lambda mk: G.nystrom_attention(q, k, v, mk(host(do)), num_landmarks=2)),
        ("feature_map applied to", lambda mk: linear_attention(q, k, v, feature_map=lambda x: mk(host(x)))),
    ]


# ---------------------------------------------------------------- 1. option arrays' library


def test_option_from_another_library_names_both(backend):
    other, other_name = _other(backend)
    for name, run in _option_cases(backend):
        with pytest.raises(TypeError) as info:
            run(lambda a: from_numpy(a, other))
        msg = str(info.value)
        assert name in msg and backend.name in msg and other_name in msg, (name, msg)


def test_option_from_the_same_library_is_accepted(backend):
    # The same calls with every option built on the backend run: the cases above fail
    # for the library alone.
    for name, run in _option_cases(backend):
        out = run(lambda a: from_numpy(a, backend))
        assert out is not None, name


def test_state_from_another_library_names_both(backend):
    other, other_name = _other(backend)
    q, k, v = _qkv(backend)
    s, z = linear_attention_state(k, v)
    with pytest.raises(TypeError) as info:
        linear_attention_step((from_numpy(host(s), other), z), q[:, 0, :], k[:, 0, :], v[:, 0, :])
    assert "S" in str(info.value) and backend.name in str(info.value) and other_name in str(info.value)


def test_option_dtype_mismatch_names_both_dtypes(backend):
    q, k, v = _qkv(backend)
    do32, _ = randn(backend, (H, N, DV), "float32", seed=4)
    e32 = from_numpy(np.ones((3, N)) / 3, backend, "float32")
    p32 = from_numpy(np.ones((8, D)), backend, "float32")
    cases = [
        ("do", lambda: G.softmax_attention(q, k, v, do32)),
        ("do", lambda: G.linear_attention(q, k, v, do32)),
        ("do", lambda: G.performer_attention(q, k, v, do32, projection=from_numpy(np.ones((8, D)), backend))),
        ("e_proj", lambda: linformer_attention(q, k, v, e_proj=e32)),
        ("projection", lambda: performer_attention(q, k, v, projection=p32)),
        ("feature_map applied to", lambda: linear_attention(
            q, k, v, feature_map=lambda x: backend.xp.astype(x, backend.xp.float32))),
    ]
    for name, run in cases:
        with pytest.raises(TypeError) as info:
            run()
        msg = str(info.value)
        assert name in msg and "float64" in msg and "float32" in msg, (name, msg)


# ---------------------------------------------------------------- 2. scalars


def test_numpy_scalars_are_accepted_like_python_ones(backend):
    q, k, v = _qkv(backend)
    want = host(softmax_attention(q, k, v, causal=False, scale=0.5))
    got = host(softmax_attention(q, k, v, causal=np.False_, scale=np.float32(0.5)))
    np.testing.assert_array_equal(got, want)
    want = host(online_softmax_attention(q, k, v, causal=True, block_q=4, block_k=2))
    got = host(online_softmax_attention(q, k, v, causal=np.True_, block_q=np.int64(4), block_k=np.int32(2)))
    np.testing.assert_array_equal(got, want)
    q4, k4, v4 = (backend.xp.expand_dims(x, axis=0) for x in (q, k, v))
    want = host(softmax_attention(q4, k4, v4, seqlens_k=[N - 2], gqa=False))
    got = host(softmax_attention(q4, k4, v4, seqlens_k=[np.int64(N - 2)], gqa=np.False_))
    np.testing.assert_array_equal(got, want)
    want = host(linear_attention(q, k, v, normalize=False, chunk_size=2))
    got = host(linear_attention(q, k, v, normalize=np.False_, chunk_size=np.int16(2)))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("call,name", [
    (lambda q, k, v: linear_attention(q, k, v, normalize="no"), "normalize"),
    (lambda q, k, v: linear_attention(q, k, v, normalize=1), "normalize"),
    (lambda q, k, v: softmax_attention(q, k, v, scale="0.5"), "scale"),
    (lambda q, k, v: softmax_attention(q, k, v, scale=np.True_), "scale"),
    (lambda q, k, v: softmax_attention(q, k, v, causal=np.int64(1)), "causal"),
    (lambda q, k, v: softmax_attention(q, k, v, gqa="yes"), "gqa"),
    (lambda q, k, v: softmax_attention(q, k, v, dropout_p="0.1"), "dropout_p"),
    (lambda q, k, v: online_softmax_attention(q, k, v, block_q=4.0), "block_q"),
    (lambda q, k, v: online_softmax_attention(q, k, v, block_k=np.float64(2)), "block_k"),
    (lambda q, k, v: linear_attention(q, k, v, eps="1e-6"), "eps"),
])
def test_wrong_scalar_type_is_a_type_error(backend, call, name):
    q, k, v = _qkv(backend)
    with pytest.raises(TypeError, match=rf"^{name} must be"):
        call(q, k, v)


# ---------------------------------------------------------------- 3. finite in, finite out


def _softmax_forms():
    return [softmax_attention, online_softmax_attention,
            lambda q, k, v, **kw: attention_weights(q, k, **kw)]


def test_huge_scale_is_finite_and_picks_the_maximum(backend):
    # scale * q.k past float64's range: the clamped logits keep the row's argmax.
    q = from_numpy(np.array([[1.0, 0.0], [0.0, 2.0]]), backend)
    k = from_numpy(np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]]), backend)
    v = from_numpy(np.array([[1.0], [2.0], [3.0]]), backend)
    for f in _softmax_forms()[:2]:
        out = host(f(q, k, v, scale=1e308))
        np.testing.assert_array_equal(out, [[1.0], [2.0]])


def test_huge_scale_property(backend):
    @property_test(backend, examples=10)
    @given(seed=st.integers(0, 2**16), exponent=st.integers(1, 308), nq=st.integers(1, 5),
           nk=st.integers(1, 5), causal=st.sampled_from([False, True]))
    def check(seed, exponent, nq, nk, causal):
        rng = np.random.default_rng(seed)
        q, k, v = (from_numpy(rng.standard_normal(s), backend) for s in ((nq, 3), (nk, 3), (nk, 2)))
        for f in _softmax_forms():
            out = host(f(q, k, v, scale=10.0**exponent, causal=causal))
            assert np.all(np.isfinite(out)), (f, exponent)

    check()


def test_float16_logits_above_65504_are_finite_and_right(backend):
    xp = backend.xp
    if not hasattr(xp, "float16"):
        pytest.skip(f"{backend.name} has no float16")

    @property_test(backend, examples=10)
    @given(seed=st.integers(0, 2**16), size=st.floats(7e4, 6e5))
    def check(seed, size):
        rng = np.random.default_rng(seed)
        # |q.k| up to `size`, past float16's 65504; the entries themselves fit.
        qh = rng.standard_normal((4, 4)) * np.sqrt(size / 4)
        kh = rng.standard_normal((5, 4)) * np.sqrt(size / 4)
        vh = rng.standard_normal((5, 3))
        q, k, v = (from_numpy(a, backend, "float16") for a in (qh, kh, vh))
        want, _ = naive_attention(*(host(x) for x in (q, k, v)), scale=1.0)
        for f in _softmax_forms()[:2]:
            out = f(q, k, v, scale=1.0)
            assert out.dtype == xp.float16
            # The output is a convex combination of v's rows, so float16's rounding of
            # the weights and the result bounds the error by a few ulps of max|v|.
            assert np.max(np.abs(host(out) - want)) <= 8 * 2.0**-10 * np.max(np.abs(vh))

    check()


def test_linear_attention_finite_inside_its_documented_range(backend):
    # The docstring: finite while |scale| Nk max|phi(q)| max|phi(k)| d' max(1, |v|) is
    # below finfo.max; in float32 with d = 4, N <= 8 that allows |q|, |k| up to 1e17.
    @property_test(backend, examples=10)
    @given(seed=st.integers(0, 2**16), exponent=st.integers(0, 17),
           causal=st.sampled_from([False, True]), order=st.sampled_from(["linear", "quadratic"]))
    def check(seed, exponent, causal, order):
        rng = np.random.default_rng(seed)
        qh, kh = (rng.standard_normal((2, 8, 4)) * 10.0**exponent for _ in range(2))
        vh = rng.standard_normal((2, 8, 3))
        q, k, v = (from_numpy(a, backend, "float32") for a in (qh, kh, vh))
        out = host(linear_attention(q, k, v, causal=causal, order=order, chunk_size=3))
        assert np.all(np.isfinite(out)), exponent

    check()


def test_linear_attention_float16_runs_in_float32(backend):
    xp = backend.xp
    if not hasattr(xp, "float16"):
        pytest.skip(f"{backend.name} has no float16")
    rng = np.random.default_rng(0)
    # phi(q) . sum_j phi(k_j) about 1e6 here: past float16's 65504, fine in float32.
    qh, kh = (rng.standard_normal((2, 16, 16)) * 30 for _ in range(2))
    vh = rng.standard_normal((2, 16, 3))
    q, k, v = (from_numpy(a, backend, "float16") for a in (qh, kh, vh))
    want = linear_attention(*(xp.astype(x, xp.float32) for x in (q, k, v)), causal=True)
    out = linear_attention(q, k, v, causal=True)
    assert out.dtype == xp.float16
    np.testing.assert_array_equal(host(out), host(xp.astype(want, xp.float16)))


# ---------------------------------------------------------------- 4. VJP and feature-map contracts


def test_feature_map_cannot_corrupt_q_or_k(backend):
    q, k, v = _qkv(backend)
    before = host(q), host(k)

    def scribbling(x):
        f = backend.xp.exp(x)
        try:
            x[..., 0] = 0.0  # a careless map writing into its argument
        except (TypeError, ValueError, AttributeError):  # JAX arrays are immutable
            pass
        return f

    linear_attention(q, k, v, feature_map=scribbling)
    G.linear_attention(q, k, v, from_numpy(np.ones((H, N, DV)), backend), feature_map=scribbling,
                       feature_map_vjp=lambda x, g: g * backend.xp.exp(x))
    np.testing.assert_array_equal(host(q), before[0])
    np.testing.assert_array_equal(host(k), before[1])


def test_feature_map_that_mixes_rows_is_refused(backend):
    xp = backend.xp
    q, k, v = _qkv(backend)

    def over_sequence(x):  # a softmax over the sequence axis, not per row
        e = xp.exp(x)
        return e / xp.sum(e, axis=-2, keepdims=True)

    with pytest.raises(ValueError, match=r"feature_map applied to [qk] .* is not row-wise"):
        linear_attention(q, k, v, feature_map=over_sequence)
    # A row-wise map of the same cost passes.
    row_wise = lambda x: xp.exp(x) / xp.sum(xp.exp(x), axis=-1, keepdims=True)  # noqa: E731
    assert np.all(np.isfinite(host(linear_attention(q, k, v, feature_map=row_wise))))


def test_compressed_params_at_d_zero():
    import array_api_compat.numpy as npx

    p = get("compressed").params(0, 4, 4, 0, 3, dtype=npx.float64, device="cpu", xp=npx)
    assert tuple(p["k_weight"].shape) == (3, 0, 0)
    assert np.all(np.isfinite(p["v_weight"]))


def test_random_features_takes_numpy_integers(backend):
    w = random_features(np.int64(4), np.int32(8), seed=np.int64(0), xp=backend.xp)
    assert tuple(w.shape) == (8, 4)


def test_jax_differentiation_with_concrete_mask_and_keys_closed_over():
    # Under jax.vjp a traced q has no device (None) where the mask, k and v closed over
    # are placed on cpu:0: "mask must live on the device of q (None), got cpu:0" before.
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from attn_ref import softmax_attention

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 5, 4))) for _ in range(3))
    mask = jnp.asarray(rng.random((1, 5, 5)) > 0.3)
    out, pull = jax.vjp(lambda q: softmax_attention(q, k, v, mask=mask), q)
    (dq,) = pull(jnp.ones_like(out))
    assert dq.shape == q.shape and bool(jnp.all(jnp.isfinite(dq)))

def test_arrays_on_different_devices_are_refused_by_name():
    # torch's "meta" device stands in for a second device on a CPU-only machine
    torch = pytest.importorskip("torch")
    from attn_ref import softmax_attention

    q = torch.zeros(2, 5, 4, dtype=torch.float64)
    on_meta = torch.ones(1, 5, 5, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match=r"mask must live on the device of q \(cpu\), got meta"):
        softmax_attention(q, q, q, mask=on_meta)
    with pytest.raises(ValueError, match="q, k and v live on different devices"):
        softmax_attention(q, q, torch.zeros(2, 5, 4, dtype=torch.float64, device="meta"))
