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


@pytest.mark.parametrize("options", [
    {"causal": "top-left", "chunk_size": 4}, {"causal": "bottom-right", "chunk_size": 3},
    {"causal": "top-left", "order": "quadratic"},
    {"causal": "bottom-right", "kernel": "trigonometric", "chunk_size": 4}],
    ids=["top-left", "bottom-right", "quadratic", "trigonometric"])
def test_causal_gradient_on_large_logits_matches_torch_autograd(backend, options):
    """Queries and keys 30 times the usual size: every key's feature exponents lie
    hundreds below the others' (the oracle's large-logits cases). The VJP keeps each
    key's log-scale apart, as the forward does; with one offset for all keys it had
    every key's features underflow, NaN ``dq``, ``dk`` and ``dprojection`` and
    ``dv = 0`` where torch autograd of the forward gives ``dv`` up to 15 (the oracle's
    ``large-logits:b1h2-q65k63-d64-large_logits-causal-tl`` in float64 failed correct
    kernels)."""
    args, do = _case(3, nq=11, nk=9, d=8, dv=4, m=16)
    args = {**args, "q": 30 * args["q"], "k": 30 * args["k"]}
    want = torch_vjp(attn_ref.performer_attention, args, do, options)
    assert np.max(np.abs(want["v"])) > 0.5
    got = run_vjp(backend, grad.performer_attention, args, do, options)
    # dq, dk and dprojection are about 1e-13 where a row is one key's, rounding of terms ~1
    assert_grads_close(got, want, backend, rtol=1e-8, atol=1e-9)


def test_stabilizer_does_not_change_the_gradient(backend):
    args, do = _case(2)
    a = run_vjp(backend, grad.performer_attention, args, do, {"stabilize": True})
    b = run_vjp(backend, grad.performer_attention, args, do, {"stabilize": False})
    assert_grads_close(a, {n: host(g) for n, g in b.items()}, backend, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("options", [{}, {"order": "quadratic"}, {"stabilize": False}],
                         ids=["chunked", "quadratic", "unstabilized"])
def test_queries_without_keys_have_zero_finite_gradients(options):
    """Bottom-right causal with more queries than keys: the first ``Nq - Nk`` queries see
    no key and output 0 (``0 / eps``). Autograd of the forward and the VJP give their
    rows ``dq = 0`` and every gradient finite; before, torch autograd returned NaN ``dq``
    and ``dk`` (the division's ``1 / eps`` times ``V`` overflowing before the causal
    mask's zero) and the VJP a non-finite ``dq`` on the oracle's
    ``causal:b2h1-q129k63-d32-causal-br``."""
    args, do = _case(2, nq=40, nk=20, d=16, dv=16, m=32)
    opts = {"causal": "bottom-right", **options}
    # x 10: |do| |v| / eps past float64's largest number, the VJP's overflow
    for v_scale in (1.0, 10.0):
        a = {**args, "v": v_scale * args["v"]}
        ref = grad.performer_attention(*(a[n] for n in ("q", "k", "v")), do,
                                       projection=a["projection"], **opts)
        assert all(np.all(np.isfinite(g)) for g in ref.values()), v_scale
        assert np.all(ref["q"][:, :20] == 0) and np.any(ref["q"][:, 20:] != 0)
        for name, autodiff in (("torch", torch_vjp), ("jax", jax_vjp)):
            try:
                load(name)
            except Exception as exc:  # pragma: no cover
                pytest.skip(str(exc))
            want = autodiff(attn_ref.performer_attention, a, do, opts)
            assert all(np.all(np.isfinite(host(g))) for g in want.values()), (name, v_scale)
            assert_grads_close(ref, want, load("numpy"), rtol=1e-10, atol=1e-12)
