"""attn_ref.grad.compressed: gradients of memory-compressed attention and its strided convolution."""

import numpy as np
import pytest

import attn_ref
from attn_ref import grad
from attn_ref.compressed import compressed_attention
from tests.helpers import host
from tests.test_grad_common import assert_grads_close, numeric_vjp, run_vjp, torch_vjp

FORMS = {
    "paper-3-3": (10, 3, 3, False, False),
    "ragged-causal": (11, 3, 2, "top-left", False),
    "shared-kernel-bottom-right": (9, 2, 1, "bottom-right", True),
    "gap-stride": (8, 3, 4, False, False),
}


def _case(form):
    nk, c, s, causal, shared = FORMS[form]
    rng = np.random.default_rng(len(form))
    args = {"q": rng.standard_normal((2, 5, 4)), "k": rng.standard_normal((2, nk, 4)),
            "v": rng.standard_normal((2, nk, 4 if shared else 3)),
            "k_weight": rng.standard_normal((c, 4, 4))}
    if not shared:
        args["v_weight"] = rng.standard_normal((c, 3, 2))
    return args, rng.standard_normal((2, 5, 4 if shared else 2)), {"stride": s, "causal": causal}


_FD = {}


@pytest.mark.parametrize("form", FORMS)
def test_matches_finite_differences(backend, form):
    args, do, options = _case(form)
    if form not in _FD:
        _FD[form] = numeric_vjp(compressed_attention, args, do, options)
    assert_grads_close(run_vjp(backend, grad.compressed_attention, args, do, options), _FD[form], backend,
                       rtol=1e-7, atol=1e-8)


def test_matches_torch_autograd_of_the_forward():
    pytest.importorskip("torch")
    from conformance.backends import load

    args, do, options = _case("ragged-causal")
    want = torch_vjp(attn_ref.compressed_attention, args, do, options)
    backend = load("torch")
    assert_grads_close(run_vjp(backend, grad.compressed_attention, args, do, options), want, backend)


def test_identity_kernel_stride_one_is_softmax(backend):
    rng = np.random.default_rng(5)
    args = {n: rng.standard_normal(s) for n, s in (("q", (6, 4)), ("k", (6, 4)), ("v", (6, 4)))}
    do = rng.standard_normal((6, 4))
    a = run_vjp(backend, grad.compressed_attention, dict(args, k_weight=np.eye(4)[None]), do,
                {"stride": 1, "causal": True})
    b = run_vjp(backend, grad.softmax_attention, args, do, {"causal": True})
    for n in "qkv":
        np.testing.assert_allclose(host(a[n]), host(b[n]), rtol=1e-12, atol=1e-13)
