"""attn_ref.grad.routing: the Routing Transformer VJP, routing held constant."""

import array_api_compat.numpy as npx
import numpy as np
import pytest

from attn_ref import grad
from attn_ref import routing as R
from conformance.backends import load
from tests.test_grad_common import assert_grads_close, jax_vjp, numeric_vjp, run_vjp, torch_vjp

FORMS = {
    "balanced": {},
    "balanced-causal-w4": {"causal": "bottom-right", "cluster_size": 4},
    "plain-causal": {"balanced": False, "causal": True},
}


def _case(seed=0, nq=7, nk=8):
    # A query chosen by several centroids, one by none, and keys of every cluster: the
    # average, the zeros and the scatter back all carry gradient.
    rng = np.random.default_rng(seed)
    args = {"q": rng.standard_normal((2, nq, 4)), "k": rng.standard_normal((2, nk, 4)),
            "v": rng.standard_normal((1, nk, 3))}
    mu = rng.standard_normal((3, 4))
    return args, rng.standard_normal((2, nq, 3)), mu / np.linalg.norm(mu, axis=-1, keepdims=True)


def _margin(q, mu):
    """Smallest gap between neighbours in any centroid's ranking of the unit rows: a
    finite-difference step far below it cannot change the routing."""
    s = np.sort(mu @ np.swapaxes(q / np.linalg.norm(q, axis=-1, keepdims=True), -1, -2), axis=-1)
    return float(np.min(np.diff(s, axis=-1)))


_FD = {}


@pytest.mark.parametrize("form", FORMS)
def test_matches_finite_differences(backend, form):
    args, do, mu = _case()
    assert min(_margin(args["q"], mu), _margin(args["k"], mu)) > 1e-4
    options = {"centroids": mu, **FORMS[form]}
    if form not in _FD:
        _FD[form] = numeric_vjp(R.routing_attention, args, do, options)
    got = run_vjp(backend, grad.routing_attention, args, do, options)
    assert_grads_close(got, _FD[form], backend, rtol=1e-6, atol=1e-8)


def test_given_routes_are_held_and_differentiated(backend):
    # conformance.ties' handle: a routing given (here one no score would choose, a query
    # in two clusters and one in none) is the routing the VJP holds constant
    args, do, mu = _case(3)
    rng = np.random.default_rng(4)
    qr = np.stack([np.stack([rng.permutation(7)[:3] for _ in range(3)]) for _ in range(2)])
    kr = np.stack([rng.permutation(8)[:3] for _ in range(3)])  # (C, w): every head
    assert np.any(np.bincount(qr[0].ravel(), minlength=7) == 0)
    assert np.any(np.bincount(qr[0].ravel(), minlength=7) > 1)
    options = {"centroids": mu, "query_routes": qr, "key_routes": kr, "causal": True}
    want = numeric_vjp(R.routing_attention, args, do, options)
    default = grad.routing_attention(args["q"], args["k"], args["v"], do, centroids=mu, causal=True)
    assert not np.allclose(default["k"], want["k"])
    got = run_vjp(backend, grad.routing_attention, args, do, options)
    assert_grads_close(got, want, backend, rtol=1e-6, atol=1e-8)


def test_given_plain_clusters_are_held_and_differentiated(backend):
    # conformance.ties' handle on plain routing: tokens' centroids given (two queries and a
    # key moved off their nearest) are the routing the VJP holds constant
    args, do, mu = _case(3)
    qc, kc = np.full((2, 7), -1), np.full((8,), -1)
    qc[0, 1], qc[1, 5], kc[3] = 2, 0, 1
    options = {"centroids": mu, "balanced": False, "causal": True, "query_clusters": qc,
               "key_clusters": kc}
    want = numeric_vjp(R.routing_attention, args, do, options)
    default = grad.routing_attention(args["q"], args["k"], args["v"], do, centroids=mu,
                                     balanced=False, causal=True)
    assert not np.allclose(default["k"], want["k"])
    got = run_vjp(backend, grad.routing_attention, args, do, options)
    assert_grads_close(got, want, backend, rtol=1e-6, atol=1e-8)


def test_the_average_over_clusters_is_differentiated():
    # w = 4 of N = 6 per centroid, 3 centroids: 12 places for 6 queries, so some sit in two;
    # dropping the 1/n of the average would double the gradients.
    args, do, mu = _case(1, nq=6, nk=6)
    options = {"centroids": mu, "cluster_size": 4}
    _, qrank = R.balanced_routes(npx, args["q"], mu, 4, (2,))
    assert np.any(np.sum(qrank < 4, axis=-2) > 1)
    want = numeric_vjp(R.routing_attention, args, do, options)
    got = grad.routing_attention(args["q"], args["k"], args["v"], do, **options)
    for n in "qkv":
        np.testing.assert_allclose(got[n], want[n], rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("form", ["balanced-causal-w4", "plain-causal"])
def test_matches_torch_autograd_and_jax_vjp_of_the_forward(form):
    args, do, mu = _case(2)
    options = {"centroids": mu, **FORMS[form]}
    for name, autodiff in (("torch", torch_vjp), ("jax", jax_vjp)):
        try:
            backend = load(name)
        except Exception as exc:  # pragma: no cover
            pytest.skip(str(exc))
        want = autodiff(R.routing_attention, args, do, options)
        assert_grads_close(run_vjp(backend, grad.routing_attention, args, do, options), want, backend,
                           rtol=1e-9, atol=1e-10)


def test_cotangent_of_the_wrong_shape_is_named():
    args, do, mu = _case()
    with pytest.raises(ValueError, match="do must have the output's shape"):
        grad.routing_attention(args["q"], args["k"], args["v"], do[:, :3], centroids=mu)
