"""attn_ref.grad.synthesizer: Synthesizer VJPs, including the weights' gradients."""

import numpy as np
import pytest

from attn_ref import grad
from attn_ref import synthesizer as S
from attn_ref.grad.synthesizer import dense_synthesizer_logits_vjp
from conformance.backends import load
from tests.test_grad_common import assert_grads_close, jax_vjp, numeric_vjp, run_vjp, torch_vjp


def _case(seed=0, nq=5, nk=6, kind="dense", rank=None, d=4):
    rng = np.random.default_rng(seed)
    import array_api_compat.numpy as npx

    args = {"q": rng.standard_normal((2, nq, d)), "k": rng.standard_normal((2, nk, d)),
            "v": rng.standard_normal((1, nk, 3))}
    params = S.synthesizer_params(nq, nk, d, kind=kind, rank=rank, seed=seed + 1, xp=npx)
    args.update({n: np.asarray(a) for n, a in params.items()})
    return args, rng.standard_normal((2, nq, 3))


FORMS = {
    "dense": (S.dense_synthesizer_attention, grad.dense_synthesizer_attention, "dense", None, {}),
    "dense-mixed-causal": (S.dense_synthesizer_attention, grad.dense_synthesizer_attention, "dense", None,
                           {"alpha": 0.4, "causal": "bottom-right"}),
    "random-causal": (S.random_synthesizer_attention, grad.random_synthesizer_attention, "random", None,
                      {"causal": True}),
    "factorised-random-mixed": (S.random_synthesizer_attention, grad.random_synthesizer_attention,
                                "random", 2, {"alpha": 0.7}),
}
_FD = {}


@pytest.mark.parametrize("form", FORMS)
def test_matches_finite_differences(backend, form):
    fwd, vjp, kind, rank, options = FORMS[form]
    args, do = _case(kind=kind, rank=rank)
    if kind == "dense":  # no hidden pre-activation at the relu's kink
        assert np.min(np.abs(args["q"] @ args["w1"] + args["b1"])) > 1e-4
    if form not in _FD:
        _FD[form] = numeric_vjp(fwd, args, do, options)
    got = run_vjp(backend, vjp, args, do, options)
    assert_grads_close(got, _FD[form], backend, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("form", ["dense-mixed-causal", "factorised-random-mixed"])
def test_matches_torch_autograd_and_jax_vjp_of_the_forward(form):
    fwd, vjp, kind, rank, options = FORMS[form]
    args, do = _case(2, kind=kind, rank=rank)
    for name, autodiff in (("torch", torch_vjp), ("jax", jax_vjp)):
        try:
            backend = load(name)
        except Exception as exc:  # pragma: no cover
            pytest.skip(str(exc))
        want = autodiff(fwd, args, do, options)
        assert_grads_close(run_vjp(backend, vjp, args, do, options), want, backend, rtol=1e-9, atol=1e-10)


def test_the_relu_gates_the_first_layer_gradient():
    # Hidden units that are off get no gradient through W1, b1 or x: a VJP that forgot
    # the relu's derivative would give them some.
    args, _ = _case(3)
    x, w1, b1, w2, b2 = (args[n] for n in ("q", "w1", "b1", "w2", "b2"))
    db = np.random.default_rng(4).standard_normal(x.shape[:-1] + (w2.shape[1],))
    g = dense_synthesizer_logits_vjp(x, w1, b1, w2, b2, db)
    off = (x @ w1 + b1) <= 0
    assert np.any(off)
    want = numeric_vjp(lambda x, w1, b1, w2, b2: S.dense_synthesizer_logits(x, w1, b1, w2, b2),
                       {"x": x, "w1": w1, "b1": b1, "w2": w2, "b2": b2}, db)
    for n in want:
        np.testing.assert_allclose(g[n], want[n], rtol=1e-6, atol=1e-8)
