"""attn_ref.grad.lowrank: Linformer gradients, including the projections."""

import numpy as np
import pytest

import attn_ref
from attn_ref import grad
from conformance.backends import load
from tests.helpers import host
from tests.test_grad_common import assert_grads_close, jax_vjp, numeric_vjp, run_vjp, torch_vjp


def _case(seed, shared=False, per_head=True):
    rng = np.random.default_rng(seed)
    args = {
        "q": rng.standard_normal((2, 3, 5, 4)),
        "k": rng.standard_normal((2, 3, 7, 4)),
        "v": rng.standard_normal((2, 3, 7, 2)),
        "e_proj": rng.standard_normal((3, 4, 7) if per_head else (4, 7)),
    }
    if not shared:
        args["f_proj"] = rng.standard_normal((4, 7))  # shared over heads
    return args, rng.standard_normal((2, 3, 5, 2))


_FD = {}


@pytest.mark.parametrize("shared", [False, True])
def test_matches_finite_differences(backend, shared):
    args, do = _case(0, shared=shared)
    if shared not in _FD:
        _FD[shared] = numeric_vjp(attn_ref.linformer_attention, args, do, {"scale": 0.4})
    got = run_vjp(backend, grad.linformer_attention, args, do, {"scale": 0.4})
    assert_grads_close(got, _FD[shared], backend, rtol=1e-7, atol=1e-8)


def test_matches_torch_autograd_and_jax_vjp_of_the_forward():
    args, do = _case(1, per_head=False)
    for name, autodiff in (("torch", torch_vjp), ("jax", jax_vjp)):
        try:
            backend = load(name)
        except Exception as exc:  # pragma: no cover
            pytest.skip(str(exc))
        want = autodiff(attn_ref.linformer_attention, args, do)
        assert_grads_close(run_vjp(backend, grad.linformer_attention, args, do), want, backend)


def test_identity_projection_gives_softmax_gradients(backend):
    args, do = _case(2, shared=True)
    args["e_proj"] = np.eye(7)
    lin = run_vjp(backend, grad.linformer_attention, args, do)
    soft = run_vjp(backend, grad.softmax_attention, {n: args[n] for n in "qkv"}, do)
    for n in "qkv":
        np.testing.assert_allclose(host(lin[n]), host(soft[n]), rtol=1e-12, atol=1e-13)


def test_refuses_what_the_forward_refuses(backend):
    args, do = _case(3)
    with pytest.raises(ValueError, match="does not support causal"):
        run_vjp(backend, grad.linformer_attention, args, do, {"causal": True})
