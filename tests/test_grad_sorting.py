"""attn_ref.grad.sorting: the sparse Sinkhorn VJP, through the Sinkhorn iterations to the sort logits."""

import numpy as np
import pytest

from attn_ref import grad
from attn_ref.sorting import sinkhorn_attention, sinkhorn_sort_matrix
from conformance.backends import load
from tests.test_grad_common import assert_grads_close, jax_vjp, numeric_vjp, run_vjp, torch_vjp

FORMS = {
    "sinkhorn": {"block_size": 3},
    "sinkhorn-causal": {"block_size": 3, "causal": True, "n_iters": 5, "temperature": 0.5},
    # unnormalised P = exp(R / temperature): a larger temperature keeps its entries near 1
    "sinkhorn-no-iterations": {"block_size": 2, "n_iters": 0, "temperature": 3.0},
}


def _case(seed, n=12, block_size=3):
    rng = np.random.default_rng(seed)
    nb = n // block_size
    args = {"q": rng.standard_normal((2, n, 4)), "k": rng.standard_normal((2, n, 4)),
            "v": rng.standard_normal((1, n, 3)), "sort_logits": rng.standard_normal((nb, nb))}
    return args, rng.standard_normal((2, n, 3))


_FD = {}


@pytest.mark.parametrize("form", FORMS)
def test_matches_finite_differences(backend, form):
    args, do = _case(0, block_size=FORMS[form]["block_size"])
    if form not in _FD:
        _FD[form] = numeric_vjp(sinkhorn_attention, args, do, FORMS[form])
    got = run_vjp(backend, grad.sinkhorn_attention, args, do, FORMS[form])
    assert_grads_close(got, _FD[form], backend, rtol=1e-6, atol=1e-8)


def test_sort_matrix_gradient_through_many_iterations():
    # d/dR of <G, P(R)> by the VJP's backward Sinkhorn, against differences, 30 iterations
    rng = np.random.default_rng(4)
    r, g = rng.standard_normal((4, 4)), rng.standard_normal((4, 4))
    n, bsz = 8, 2
    # zero logits: each output is the mean of its 2 b own and sorted values; with
    # v_(J, t) = e_J and do = (2 / b) G[I] on block I, <do, out> = sum P * G + const
    q = np.zeros((n, 1))
    v = np.kron(np.eye(4), np.ones((bsz, 1)))
    do = np.kron(g, np.ones((bsz, 1))) * (2 / bsz)
    opts = {"block_size": bsz, "n_iters": 30}
    want = numeric_vjp(lambda sort_logits: np.sum(sinkhorn_sort_matrix(sort_logits, n_iters=30) * g),
                       {"sort_logits": r}, np.array(1.0))["sort_logits"]
    got = grad.sinkhorn_attention(q, q, v, do, sort_logits=r, **opts)["sort_logits"]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("form", ["sinkhorn", "sinkhorn-causal"])
def test_matches_torch_autograd_and_jax_vjp_of_the_forward(form):
    args, do = _case(2, block_size=FORMS[form]["block_size"])
    for name, autodiff in (("torch", torch_vjp), ("jax", jax_vjp)):
        try:
            backend = load(name)
        except Exception as exc:  # pragma: no cover
            pytest.skip(str(exc))
        want = autodiff(sinkhorn_attention, args, do, FORMS[form])
        assert_grads_close(run_vjp(backend, grad.sinkhorn_attention, args, do, FORMS[form]), want, backend,
                           rtol=1e-9, atol=1e-10)
