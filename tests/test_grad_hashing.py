"""attn_ref.grad.hashing: the Reformer VJP (buckets held constant)."""

import numpy as np
import pytest

from attn_ref import grad
from attn_ref.hashing import lsh_rotations, reformer_attention
from conformance.backends import load
from tests.test_grad_common import assert_grads_close, jax_vjp, numeric_vjp, run_vjp, torch_vjp

ROT = lsh_rotations(4, 2, 4, seed=1, xp=np)
FORMS = {
    "reformer": {"rotations": ROT, "chunk_size": 3},
    "reformer-causal": {"rotations": ROT, "chunk_size": 2, "causal": True},
    "reformer-self-kept": {"rotations": ROT, "chunk_size": 4, "self_logit": None},
}


def _case(seed, n=9):
    rng = np.random.default_rng(seed)
    args = {"q": rng.standard_normal((2, n, 4)), "k": rng.standard_normal((2, n, 4)),
            "v": rng.standard_normal((1, n, 3))}
    return args, rng.standard_normal((2, n, 3))


_FD = {}


@pytest.mark.parametrize("form", FORMS)
def test_matches_finite_differences(backend, form):
    args, do = _case(0)
    if form not in _FD:
        # the differences are of one smooth function: h = 1e-6 moves no key across a
        # bucket boundary (the two largest entries of [kR, -kR] are further apart)
        u = args["k"] @ ROT.reshape(4, -1)
        u = np.sort(np.concatenate([u.reshape(2, 9, 2, 2), -u.reshape(2, 9, 2, 2)], axis=-1), axis=-1)
        assert np.min(u[..., -1] - u[..., -2]) > 1e-4
        _FD[form] = numeric_vjp(reformer_attention, args, do, FORMS[form])
    got = run_vjp(backend, grad.reformer_attention, args, do, FORMS[form])
    assert_grads_close(got, _FD[form], backend, rtol=1e-6, atol=1e-8)


def test_the_self_logit_is_constant():
    # replaced logits carry no gradient: with one chunk and causal, position 0's output is v_0
    args, do = _case(1, n=5)
    g = grad.reformer_attention(*(args[n] for n in "qkv"), do, rotations=ROT, chunk_size=5, causal=True)
    np.testing.assert_array_equal(g["q"][:, 0], 0.0)


@pytest.mark.parametrize("form", ["reformer", "reformer-causal"])
def test_matches_torch_autograd_and_jax_vjp_of_the_forward(form):
    args, do = _case(2)
    for name, autodiff in (("torch", torch_vjp), ("jax", jax_vjp)):
        try:
            backend = load(name)
        except Exception as exc:  # pragma: no cover
            pytest.skip(str(exc))
        want = autodiff(reformer_attention, args, do, FORMS[form])
        assert_grads_close(run_vjp(backend, grad.reformer_attention, args, do, FORMS[form]), want, backend,
                           rtol=1e-9, atol=1e-10)
