"""attn_ref.grad.performer: gradients of FAVOR+ attention, including the projection."""

import numpy as np
import pytest

import attn_ref
from attn_ref import grad
from conformance.backends import load
from tests.helpers import host
from tests.test_grad_common import assert_grads_close, jax_vjp, numeric_vjp, run_vjp, torch_vjp

FORMS = {
    "positive": {},
    "positive-causal": {"causal": "bottom-right", "chunk_size": 2},
    "positive-quadratic-unstabilized": {"order": "quadratic", "stabilize": False},
    "trigonometric": {"kernel": "trigonometric"},
    "trigonometric-causal": {"kernel": "trigonometric", "causal": True, "chunk_size": 3},
}


def _case(seed, nq=6, nk=5, d=3, dv=2, m=8):
    rng = np.random.default_rng(seed)
    args = {
        "q": rng.standard_normal((2, nq, d)),
        "k": rng.standard_normal((2, nk, d)),
        "v": rng.standard_normal((2, nk, dv)),
        "projection": rng.standard_normal((m, d)),
    }
    return args, rng.standard_normal((2, nq, dv))


_FD = {}


@pytest.mark.parametrize("form", FORMS)
def test_matches_finite_differences(backend, form):
    args, do = _case(0)
    if form not in _FD:
        _FD[form] = numeric_vjp(attn_ref.performer_attention, args, do, FORMS[form])
    got = run_vjp(backend, grad.performer_attention, args, do, FORMS[form])
    # The stabiliser offsets are held constant; finite differences move them, and
    # agree because they cancel in the normalised output. The causal key offset is
    # ~177 in float64, so the differences carry rounding noise ~ 177 eps / h ~ 1e-8.
    assert_grads_close(got, _FD[form], backend, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("form", ["positive", "trigonometric-causal"])
def test_matches_torch_autograd_and_jax_vjp_of_the_forward(form):
    args, do = _case(1, nq=5, nk=7)
    for name, autodiff in (("torch", torch_vjp), ("jax", jax_vjp)):
        try:
            backend = load(name)
        except Exception as exc:  # pragma: no cover
            pytest.skip(str(exc))
        want = autodiff(attn_ref.performer_attention, args, do, FORMS[form])
        got = run_vjp(backend, grad.performer_attention, args, do, FORMS[form])
        assert_grads_close(got, want, backend)


def test_stabilizer_does_not_change_the_gradient(backend):
    args, do = _case(2)
    a = run_vjp(backend, grad.performer_attention, args, do, {"stabilize": True})
    b = run_vjp(backend, grad.performer_attention, args, do, {"stabilize": False})
    assert_grads_close(a, {n: host(g) for n, g in b.items()}, backend, rtol=1e-12, atol=1e-12)
