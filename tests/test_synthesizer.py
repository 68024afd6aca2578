"""attn_ref.synthesizer: dense, random, factorised Synthesizers and the mix with dot products."""

import array_api_compat.numpy as npx
import numpy as np
import pytest

from attn_ref.synthesizer import (
    dense_synthesizer_attention,
    dense_synthesizer_logits,
    dense_synthesizer_weights,
    factorized_dense_logits,
    random_synthesizer_attention,
    random_synthesizer_weights,
    synthesizer_attention,
    synthesizer_params,
)
from conformance.backends import from_numpy
from tests.helpers import assert_close, call, host, randn
from tests.plain import naive_attention, naive_dense_logits, naive_synthesizer

N, D, DV = 8, 4, 3


def _qkv(backend, dtype="float64", nq=N, nk=N, batch=(2, 3)):
    q, qh = randn(backend, batch + (nq, D), dtype, seed=1)
    k, kh = randn(backend, batch + (nk, D), dtype, seed=2)
    v, vh = randn(backend, batch + (nk, DV), dtype, seed=3)
    return (q, k, v), (qh, kh, vh)


def _params(backend, nq, nk, kind, dtype="float64", **kw):
    host_p = {n: np.asarray(a) for n, a in synthesizer_params(nq, nk, D, kind=kind, seed=7, xp=npx,
                                                               **kw).items()}
    return {n: from_numpy(a, backend, dtype) for n, a in host_p.items()}, host_p


# ------------------------------------------------------------------------------ limits


@pytest.mark.parametrize("causal", [False, True, "bottom-right"])
def test_random_with_r_the_scaled_dot_products_is_softmax(backend, causal):
    (q, k, v), (qh, kh, vh) = _qkv(backend, nq=5)
    r = from_numpy(qh @ np.swapaxes(kh, -1, -2) / np.sqrt(D), backend)
    out = call(backend, random_synthesizer_attention, q, k, v, r=r, causal=causal)
    align = {False: None, True: "top-left"}.get(causal, causal)
    assert_close(out, naive_attention(qh, kh, vh, causal=align)[0], backend, rtol=1e-12, atol=1e-12)


def test_mixing_weights_zero_and_one(backend):
    (q, k, v), (qh, kh, vh) = _qkv(backend)
    p, ph = _params(backend, N, N, "dense")
    soft = naive_attention(qh, kh, vh, causal="top-left")[0]
    out0 = call(backend, dense_synthesizer_attention, q, k, v, **p, alpha=0.0, causal=True)
    assert_close(out0, soft, backend, rtol=1e-12, atol=1e-12)
    # alpha = 1: the keys do not matter (reversed keys, same output)
    out1 = call(backend, dense_synthesizer_attention, q, k, v, **p, alpha=1.0)
    k_rev = from_numpy(kh[..., ::-1, :].copy(), backend)
    assert_close(call(backend, dense_synthesizer_attention, q, k_rev, v, **p), host(out1), backend,
                 rtol=1e-14, atol=1e-14)
    logits = naive_dense_logits(qh, *(ph[n] for n in ("w1", "b1", "w2", "b2")))
    assert_close(out1, naive_synthesizer(qh, kh, vh, logits)[0], backend, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------- forms against plain loops


@pytest.mark.parametrize("alpha,causal,nq", [(1.0, False, N), (0.3, True, N), (0.6, "bottom-right", 5)])
def test_dense_matches_plain_loops(backend, alpha, causal, nq):
    (q, k, v), (qh, kh, vh) = _qkv(backend, nq=nq)
    p, ph = _params(backend, nq, N, "dense")
    opts = dict(alpha=alpha, causal=causal)
    out = call(backend, dense_synthesizer_attention, q, k, v, **p, **opts)
    w = call(backend, dense_synthesizer_weights, q, k, **p, **opts)
    align = {False: None, True: "top-left"}.get(causal, causal)
    logits = naive_dense_logits(qh, *(ph[n] for n in ("w1", "b1", "w2", "b2")))
    want, want_w = naive_synthesizer(qh, kh, vh, logits, alpha, align)
    assert_close(out, want, backend, rtol=1e-12, atol=1e-12)
    assert_close(w, want_w, backend, rtol=1e-12, atol=1e-12)
    # the relu matters here: some hidden units are negative
    hidden = qh @ ph["w1"] + ph["b1"]
    assert np.any(hidden < 0) and np.any(hidden > 0)


@pytest.mark.parametrize("rank", [None, 2])
def test_random_and_factorised_random_match_plain_loops(backend, rank):
    (q, k, v), (qh, kh, vh) = _qkv(backend, nq=6)
    p, ph = _params(backend, 6, N, "random", rank=rank)
    r = ph["r"] if rank is None else ph["r"] @ ph["r2"].T
    for alpha, causal in ((1.0, True), (0.25, False)):
        out = call(backend, random_synthesizer_attention, q, k, v, **p, alpha=alpha, causal=causal)
        w = call(backend, random_synthesizer_weights, q, k, **p, alpha=alpha, causal=causal)
        want, want_w = naive_synthesizer(qh, kh, vh, r, alpha, "top-left" if causal else None)
        assert_close(out, want, backend, rtol=1e-12, atol=1e-12)
        assert_close(w, want_w, backend, rtol=1e-12, atol=1e-12)


def test_factorised_dense_is_the_outer_product_of_two_mlps(backend):
    (q, k, v), (qh, kh, vh) = _qkv(backend)
    a, ah = _params(backend, N, 2, "dense", hidden=3)  # a = 2 outputs
    b, bh = _params(backend, N, 4, "dense", hidden=5)  # b = 4 outputs: a b = 8 = N
    names = ("w1", "b1", "w2", "b2")
    c = call(backend, factorized_dense_logits, q, tuple(a[n] for n in names), tuple(b[n] for n in names))
    fa = naive_dense_logits(qh, *(ah[n] for n in names))
    fb = naive_dense_logits(qh, *(bh[n] for n in names))
    want = np.zeros(qh.shape[:-1] + (8,))
    for s in range(2):
        for t in range(4):
            want[..., s * 4 + t] = fa[..., s] * fb[..., t]
    assert_close(c, want, backend, rtol=1e-13, atol=1e-13)
    out = call(backend, synthesizer_attention, q, k, v, logits=c, causal=True)
    assert_close(out, naive_synthesizer(qh, kh, vh, want, causal="top-left")[0], backend, rtol=1e-12,
                 atol=1e-12)


def test_dense_logits_are_per_token(backend):
    (q, _, _), (qh, _, _) = _qkv(backend)
    p, ph = _params(backend, N, N, "dense")
    b = host(call(backend, dense_synthesizer_logits, q, p["w1"], p["b1"], p["w2"], p["b2"]))
    b_rev = host(call(backend, dense_synthesizer_logits, from_numpy(qh[..., ::-1, :].copy(), backend),
                      p["w1"], p["b1"], p["w2"], p["b2"]))
    np.testing.assert_allclose(b_rev, b[..., ::-1, :], rtol=1e-14, atol=1e-14)


def test_float32_and_inputs_untouched(backend):
    (q, k, v), (qh, kh, vh) = _qkv(backend, dtype="float32")
    p, ph = _params(backend, N, N, "dense", dtype="float32")
    before = [host(x) for x in (q, k, v, *p.values())]
    out = call(backend, dense_synthesizer_attention, q, k, v, **p, alpha=0.5, causal=True)
    assert str(out.dtype).endswith("float32")
    hp = {n: host(a) for n, a in p.items()}
    logits = naive_dense_logits(qh, hp["w1"], hp["b1"], hp["w2"], hp["b2"])
    np.testing.assert_allclose(host(out), naive_synthesizer(qh, kh, vh, logits, 0.5, "top-left")[0],
                               rtol=0, atol=1e-5)
    for b, x in zip(before, (q, k, v, *p.values())):
        np.testing.assert_array_equal(host(x), b)


def test_bad_input(backend):
    (q, k, v), (qh, kh, vh) = _qkv(backend)
    p, ph = _params(backend, N, N, "dense")
    r = from_numpy(np.zeros((N, N)), backend)
    with pytest.raises(ValueError, match=r"w2 must have shape \(h, Nk\) = \(4, 7\), got shape \(4, 8\)"):
        dense_synthesizer_attention(q, k[..., :7, :], v[..., :7, :], **p)
    with pytest.raises(ValueError, match=r"w1 must have shape \(d, h\) with d=4, got shape \(3, 4\)"):
        dense_synthesizer_attention(q, k, v, **{**p, "w1": p["w1"][:3, :]})
    with pytest.raises(ValueError, match=r"b1 must have shape \(h,\) = \(4,\), got shape \(3,\)"):
        dense_synthesizer_attention(q, k, v, **{**p, "b1": p["b1"][:3]})
    with pytest.raises(TypeError, match="w1 must have the dtype of q"):
        dense_synthesizer_attention(q, k, v, **{**p, "w1": from_numpy(ph["w1"], backend, "float32")})
    with pytest.raises(ValueError, match=r"r must have shape \(\.\.\., Nq, Nk\) = "
                                         r"\(\.\.\., 8, 8\), got shape \(8, 7\)"):
        random_synthesizer_attention(q, k, v, r=r[:, :7])
    with pytest.raises(ValueError, match=r"factorised: r must have shape \(\.\.\., Nq, k\) and r2"):
        random_synthesizer_attention(q, k, v, r=r[:, :2], r2=r[:, :3])
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\]"):
        random_synthesizer_attention(q, k, v, r=r, alpha=1.5)
    with pytest.raises(TypeError, match="alpha must be a finite real number"):
        random_synthesizer_attention(q, k, v, r=r, alpha="half")
    with pytest.raises(ValueError, match="causal must be False, True"):
        random_synthesizer_attention(q, k, v, r=r, causal="yes")
    with pytest.raises(TypeError, match="r must be an array"):
        random_synthesizer_attention(q, k, v, r=[[0.0]])
    with pytest.raises(ValueError, match=r"logits \(the synthetic logits B\) must have shape"):
        synthesizer_attention(q, k, v, logits=r[:, :7])
    with pytest.raises(TypeError, match="logits must be an array"):
        synthesizer_attention(q, k, v, logits=[[0.0]])
    with pytest.raises(ValueError, match="kind must be 'dense' or 'random'"):
        synthesizer_params(N, N, D, kind="factorised", seed=0, xp=npx)


def test_the_synthesizer_mutants_fail_because_of_their_mistake():
    # conformance.mutants' Synthesizer kernels without their mistake pass where, with
    # it, they fail (tests/test_conformance_tolerance.py runs them with it).
    from conformance.mutants import Mutant, first_failure, synthesizer_kernel

    for name, dense in (("synthesizer_dense", True), ("synthesizer_random_mix", False)):
        res, ran = first_failure(Mutant("no mistake", synthesizer_kernel(None, dense), "", variant=name),
                                 "float32", suite="quick")
        assert res is None and ran >= 5, (name, res, ran)
