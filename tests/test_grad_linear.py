"""attn_ref.grad.linear: gradients of linear attention in every order, and causal chunked."""

import numpy as np
import pytest

import attn_ref
from attn_ref import grad
from conformance.backends import from_numpy, load
from tests.helpers import call, host
from tests.test_grad_common import assert_grads_close, jax_vjp, numeric_vjp, run_vjp, torch_vjp

FORMS = {
    "linear": {},
    "quadratic": {"order": "quadratic"},
    "chunked-top-left": {"causal": "top-left", "chunk_size": 3},
    "chunked-bottom-right": {"causal": "bottom-right", "chunk_size": 2},
    "quadratic-bottom-right": {"causal": "bottom-right", "order": "quadratic"},
}


def _case(seed, nq=7, nk=5, d=3, dv=2):
    rng = np.random.default_rng(seed)
    args = {
        "q": rng.standard_normal((2, nq, d)),
        "k": rng.standard_normal((2, nk, d)),
        "v": rng.standard_normal((1, nk, dv)),  # broadcast over the batch
    }
    return args, rng.standard_normal((2, nq, dv))


_FD = {}


def _fd(key, args, do, options):
    if key not in _FD:
        _FD[key] = numeric_vjp(attn_ref.linear_attention, args, do, options)
    return _FD[key]


@pytest.mark.parametrize("form", FORMS)
def test_matches_finite_differences(backend, form):
    args, do = _case(0)
    options = dict(FORMS[form], scale=0.5)
    want = _fd(form, args, do, options)
    got = run_vjp(backend, grad.linear_attention, args, do, options)
    assert_grads_close(got, want, backend, rtol=1e-7, atol=1e-8)


@pytest.mark.parametrize("feature_map,normalize", [("relu", True), ("identity", False), ("elu+1", False)])
def test_other_feature_maps_match_finite_differences(backend, feature_map, normalize):
    args, do = _case(1, nq=6, nk=6)
    options = {"feature_map": feature_map, "normalize": normalize, "causal": True, "chunk_size": 4}
    want = _fd((feature_map, normalize), args, do, options)
    got = run_vjp(backend, grad.linear_attention, args, do, options)
    assert_grads_close(got, want, backend, rtol=1e-7, atol=1e-8)


@pytest.mark.parametrize("form", ["linear", "chunked-top-left", "quadratic-bottom-right"])
def test_matches_torch_autograd_and_jax_vjp_of_the_forward(form):
    args, do = _case(2, nq=6, nk=8)
    options = dict(FORMS[form])
    for name, autodiff in (("torch", torch_vjp), ("jax", jax_vjp)):
        try:
            backend = load(name)
        except Exception as exc:  # pragma: no cover - the matrix requires both in CI
            pytest.skip(str(exc))
        want = autodiff(attn_ref.linear_attention, args, do, options)
        assert_grads_close(run_vjp(backend, grad.linear_attention, args, do, options), want, backend)


def test_orders_and_chunk_sizes_agree(backend):
    args, do = _case(3, nq=11, nk=11, d=4, dv=3)
    for causal in (False, "bottom-right"):
        ref = run_vjp(backend, grad.linear_attention, args, do, {"order": "quadratic", "causal": causal})
        for chunk in (4,):
            got = run_vjp(backend, grad.linear_attention, args, do, {"causal": causal, "chunk_size": chunk})
            for n in ref:
                np.testing.assert_allclose(host(got[n]), host(ref[n]), rtol=1e-11, atol=1e-12, err_msg=n)


def _square_vjp(x, g):
    return 2.0 * x * g


def test_callable_feature_map_needs_its_vjp(backend):
    xp = backend.xp
    args, do = _case(4, nq=5, nk=5)
    conv = {n: from_numpy(a, backend) for n, a in args.items()}
    d = from_numpy(do, backend)

    def square_plus_one(x):
        return x * x + 1.0

    with pytest.raises(TypeError, match="pass feature_map_vjp"):
        grad.linear_attention(conv["q"], conv["k"], conv["v"], d, feature_map=square_plus_one)
    with pytest.raises(ValueError, match="feature_map_vjp must return the shape"):
        grad.linear_attention(conv["q"], conv["k"], conv["v"], d, feature_map=square_plus_one,
                              feature_map_vjp=lambda x, g: xp.sum(g, axis=-1))
    got = call(backend, grad.linear_attention, conv["q"], conv["k"], conv["v"], d,
               feature_map=square_plus_one, feature_map_vjp=_square_vjp, causal=True, chunk_size=2)
    want = numeric_vjp(attn_ref.linear_attention, args, do,
                       {"feature_map": lambda x: x * x + 1.0, "causal": True, "chunk_size": 2})
    assert_grads_close(got, want, backend, rtol=1e-7, atol=1e-8)


def test_floored_denominators_give_finite_gradients(backend):
    # relu features of all-negative queries are zero: den = 0 is floored to eps,
    # the output is 0 and its gradient is finite (zero for k and v).
    rng = np.random.default_rng(5)
    args = {"q": -np.abs(rng.standard_normal((4, 3))), "k": rng.standard_normal((4, 3)),
            "v": rng.standard_normal((4, 2))}
    do = rng.standard_normal((4, 2))
    got = {n: host(g) for n, g in run_vjp(backend, grad.linear_attention, args, do,
                                          {"feature_map": "relu"}).items()}
    for n in "qkv":
        assert np.all(got[n] == 0.0), n


def test_causal_gradients_do_not_leak(backend):
    # Keys after the last query's horizon get no gradient from earlier queries'
    # cotangents: changing do[0] (query 0 sees keys 0..2 bottom-right, Nq 4, Nk 6)
    # leaves dk, dv of keys 3.. unchanged.
    args, do = _case(6, nq=4, nk=6)
    do2 = do.copy()
    do2[:, 0] += 1.0
    opts = {"causal": "bottom-right", "chunk_size": 2}
    a = run_vjp(backend, grad.linear_attention, args, do, opts)
    b = run_vjp(backend, grad.linear_attention, args, do2, opts)
    for n in ("k", "v"):
        np.testing.assert_array_equal(host(a[n])[..., 3:, :], host(b[n])[..., 3:, :])
        assert not np.array_equal(host(a[n])[..., :3, :], host(b[n])[..., :3, :])


def test_empty_and_bad_input(backend):
    xp = backend.xp
    z = lambda *s: xp.zeros(s, dtype=xp.float64, device=backend.device)  # noqa: E731
    g = grad.linear_attention(z(2, 0, 3), z(2, 4, 3), z(2, 4, 2), z(2, 0, 2))
    assert tuple(g["k"].shape) == (2, 4, 3) and np.all(host(g["k"]) == 0)
    with pytest.raises(ValueError, match="do must have the output's shape"):
        grad.linear_attention(z(2, 3, 3), z(2, 4, 3), z(2, 4, 2), z(2, 3, 3))
    with pytest.raises(ValueError, match="order must be"):
        grad.linear_attention(z(2, 3, 3), z(2, 4, 3), z(2, 4, 2), z(2, 3, 2), order="cubic")
