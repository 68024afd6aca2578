"""attn_ref.grad.softmax: one-shot and blockwise gradients of exact softmax attention."""

import array_api_compat
import numpy as np
import pytest

import attn_ref
from attn_ref import grad
from conformance.backends import from_numpy
from tests.helpers import EPS, assert_close, call, host, randn
from tests.plain import naive_attention
from tests.test_grad_common import (
    assert_grads_close,
    jax_vjp,
    numeric_vjp,
    run_vjp,
    torch_vjp,
)

CAUSAL = [False, "top-left", "bottom-right"]
FORMS = {
    "oneshot": grad.softmax_attention,
    "blockwise": lambda *a, **kw: grad.online_softmax_attention(*a, block_q=8, block_k=4, **kw),
}


def _case(seed, nq=5, nk=7, d=3, dv=2, batch=(2,), bias_shape=(1, 5, 7), masked=True, dead_row=True):
    rng = np.random.default_rng(seed)
    args = {
        "q": rng.standard_normal(batch + (nq, d)),
        "k": rng.standard_normal(batch + (nk, d)),
        "v": rng.standard_normal(batch + (nk, dv)),
    }
    if bias_shape is not None:
        args["bias"] = rng.standard_normal(bias_shape)
    options = {}
    if masked:
        mask = rng.random((nq, nk)) < 0.7
        if dead_row:
            mask[1] = False
        options["mask"] = mask
    do = rng.standard_normal(batch + (nq, dv))
    return args, do, options


_FD = {}


def _fd(key, args, do, options):
    if key not in _FD:
        fwd = attn_ref.varlen_attention if key == ("varlen",) else attn_ref.softmax_attention
        _FD[key] = numeric_vjp(fwd, args, do, options)
    return _FD[key]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("causal", CAUSAL)
def test_matches_finite_differences(backend, form, causal):
    args, do, options = _case(0)
    options["causal"] = causal
    want = _fd(("mask-bias", causal), args, do, options)
    got = run_vjp(backend, FORMS[form], args, do, options)
    assert_grads_close(got, want, backend, rtol=1e-7, atol=1e-8)


@pytest.mark.parametrize("form", FORMS)
def test_broadcast_inputs_get_reduced_gradients(backend, form):
    # k shared over the batch, v over heads, bias over batch and query rows.
    rng = np.random.default_rng(3)
    args = {
        "q": rng.standard_normal((2, 2, 4, 3)),
        "k": rng.standard_normal((1, 2, 6, 3)),
        "v": rng.standard_normal((2, 1, 6, 2)),
        "bias": rng.standard_normal((2, 1, 6)),
    }
    do = rng.standard_normal((2, 2, 4, 2))
    options = {"causal": "bottom-right", "scale": 0.7}
    want = _fd(("broadcast",), args, do, options)
    got = run_vjp(backend, FORMS[form], args, do, options)
    assert_grads_close(got, want, backend, rtol=1e-7, atol=1e-8)
    assert {n: tuple(g.shape) for n, g in got.items()} == {n: a.shape for n, a in args.items()}


@pytest.mark.parametrize("causal", CAUSAL)
def test_matches_torch_autograd_of_the_forward(causal):
    pytest.importorskip("torch")
    from conformance.backends import load

    backend = load("torch")
    args, do, options = _case(1, nq=6, nk=9, batch=(2, 3), bias_shape=(3, 6, 9))
    options["causal"] = causal
    for form, fwd in (("oneshot", attn_ref.softmax_attention),
                      ("blockwise", lambda *a, **kw: attn_ref.online_softmax_attention(
                          *a, block_q=4, block_k=5, **kw))):
        want = torch_vjp(fwd, args, do, options)
        assert all(np.all(np.isfinite(g)) for g in want.values())
        got = run_vjp(backend, FORMS[form], args, do, options)
        assert_grads_close(got, want, backend)


@pytest.mark.parametrize("causal", CAUSAL)
def test_matches_jax_vjp_of_the_forward(causal):
    pytest.importorskip("jax")
    from conformance.backends import load

    backend = load("jax")
    args, do, options = _case(1, nq=6, nk=9, batch=(2, 3), bias_shape=(3, 6, 9))
    options["causal"] = causal
    want = jax_vjp(attn_ref.softmax_attention, args, do, options)
    for form in FORMS:
        got = run_vjp(backend, FORMS[form], args, do, options)
        assert_grads_close(got, want, backend)


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("blocks", [(6, 7), (16, 5)])
def test_blockwise_equals_oneshot(backend, causal, blocks):
    args, do, options = _case(2, nq=11, nk=13, d=4, dv=3, batch=(2,), bias_shape=(11, 13))
    options["causal"] = causal
    a = run_vjp(backend, grad.softmax_attention, args, do, options)
    b = run_vjp(backend, grad.online_softmax_attention, args, do,
                dict(options, block_q=blocks[0], block_k=blocks[1]))
    for n in a:
        np.testing.assert_allclose(host(b[n]), host(a[n]), rtol=1e-12, atol=1e-13, err_msg=n)


@pytest.mark.parametrize("form", FORMS)
def test_float32_close_to_float64(backend, form):
    args, do, options = _case(5, nq=9, nk=10, d=8, dv=4, bias_shape=(9, 10))
    # Round the inputs to float32 first, so only the arithmetic differs; the float64
    # reference runs on host NumPy.
    args32 = {n: a.astype(np.float32).astype(np.float64) for n, a in args.items()}
    do32 = do.astype(np.float32).astype(np.float64)
    pos = [args32[n] for n in "qkv"]
    want = FORMS[form](*pos, do32, bias=args32["bias"], **options)
    got = run_vjp(backend, FORMS[form], args, do, options, dtype="float32")
    tol = 1e3 * EPS["float32"]
    assert_grads_close(got, want, backend, dtype="float32", rtol=tol, atol=tol)


@pytest.mark.parametrize("form", FORMS)
def test_fully_masked_rows_have_zero_gradients(backend, form):
    rng = np.random.default_rng(6)
    args = {n: rng.standard_normal(s) for n, s in (("q", (2, 5, 3)), ("k", (2, 6, 3)), ("v", (2, 6, 2)))}
    args["bias"] = rng.standard_normal((5, 6))
    args["bias"][3] = -np.inf  # a row killed through the bias
    do = rng.standard_normal((2, 5, 2))
    mask = np.ones((5, 6), dtype=bool)
    mask[1] = False
    got = {n: host(g) for n, g in run_vjp(backend, FORMS[form], args, do, {"mask": mask}).items()}
    for g in got.values():
        assert np.all(np.isfinite(g))
    assert np.all(got["q"][:, [1, 3]] == 0.0) and np.all(got["bias"][[1, 3]] == 0.0)
    # Dead rows contribute nothing to dk, dv: same gradients as with those rows' do = 0.
    do0 = do.copy()
    do0[:, [1, 3]] = 0.0
    ref = {n: host(g) for n, g in run_vjp(backend, FORMS[form], args, do0, {"mask": mask}).items()}
    for n in ("k", "v"):
        np.testing.assert_array_equal(got[n], ref[n])
    # Bottom-right causal with Nq > Nk: the first Nq - Nk queries see no key at all.
    args2 = {n: rng.standard_normal(s) for n, s in (("q", (7, 3)), ("k", (3, 3)), ("v", (3, 2)))}
    g2 = run_vjp(backend, FORMS[form], args2, rng.standard_normal((7, 2)), {"causal": "bottom-right"})
    dq = host(g2["q"])
    assert np.all(dq[:4] == 0.0) and np.all(np.isfinite(dq))
    # query 4 sees only key 0 (a one-hot row, so dS = 0 too); queries 5, 6 see more.
    assert np.all(dq[5:] != 0.0)


@pytest.mark.parametrize("form", FORMS)
def test_no_gradient_leaks_through_the_causal_mask(backend, form):
    # dk, dv of key j only see queries i that attend j: with bottom-right alignment
    # and Nq < Nk, perturbing do of query i changes no gradient of keys j > i + Nk - Nq.
    rng = np.random.default_rng(8)
    args = {n: rng.standard_normal(s) for n, s in (("q", (4, 3)), ("k", (9, 3)), ("v", (9, 2)))}
    do = rng.standard_normal((4, 2))
    do2 = do.copy()
    do2[0] += 1.0  # query 0 sees keys 0..5
    a = run_vjp(backend, FORMS[form], args, do, {"causal": "bottom-right"})
    b = run_vjp(backend, FORMS[form], args, do2, {"causal": "bottom-right"})
    for n in ("k", "v"):
        np.testing.assert_array_equal(host(a[n])[6:], host(b[n])[6:])
        assert not np.array_equal(host(a[n])[:6], host(b[n])[:6])


def test_forward_lse_matches_logsumexp(backend):
    rng = np.random.default_rng(9)
    qh, kh, vh = (rng.standard_normal(s) for s in ((2, 7, 3), (2, 9, 3), (2, 9, 4)))
    mask = rng.random((7, 9)) < 0.6
    mask[2] = False
    q, k, v = (from_numpy(a, backend) for a in (qh, kh, vh))
    out, lse = call(backend, grad.online_softmax_forward, q, k, v, mask=from_numpy(mask, backend),
                    causal="top-left", block_q=3, block_k=4)
    want, _ = naive_attention(qh, kh, vh, mask=mask, causal="top-left")
    assert_close(out, want, backend)
    s = np.einsum("bid,bjd->bij", qh, kh) / np.sqrt(3)
    allowed = mask & np.tril(np.ones((7, 9), dtype=bool))
    s = np.where(allowed, s, -np.inf)
    with np.errstate(divide="ignore"):
        m = np.max(s, -1, keepdims=True)
        lse_want = (np.where(np.isfinite(m), m, 0) + np.log(np.exp(s - np.where(np.isfinite(m), m, 0)).sum(-1,
                    keepdims=True)))[..., 0]
    lse_want[:, 2] = np.inf
    assert tuple(lse.shape) == (2, 7)
    np.testing.assert_allclose(host(lse), lse_want, rtol=1e-13)


def test_saved_out_and_lse_are_used(backend):
    args, do, options = _case(10, bias_shape=None, masked=False)
    q, k, v = (from_numpy(args[n], backend) for n in "qkv")
    out, lse = call(backend, grad.online_softmax_forward, q, k, v, block_q=2, block_k=3)
    a = call(backend, grad.online_softmax_attention, q, k, v, from_numpy(do, backend), out=out, lse=lse,
             block_q=2, block_k=3)
    b = call(backend, grad.softmax_attention, q, k, v, from_numpy(do, backend))
    for n in "qkv":
        np.testing.assert_allclose(host(a[n]), host(b[n]), rtol=1e-12, atol=1e-13)
    # A wrong saved output changes D = rowsum(dO * O): the result must depend on it.
    c = call(backend, grad.online_softmax_attention, q, k, v, from_numpy(do, backend), out=out * 2.0,
             lse=lse, block_q=2, block_k=3)
    assert not np.allclose(host(c["q"]), host(b["q"]))


def test_float16_lse_is_float32_and_finite(backend):
    # Logits near float16's 65504 plus log(Nk) are past it: the lse stays in the logits'
    # float32 (as FlashAttention's softmax_lse), and the VJP takes it back.
    xp = backend.xp
    if not hasattr(xp, "float16") or backend.name == "array_api_strict":
        pytest.skip(f"{backend.name} has no float16")
    rng = np.random.default_rng(7)
    qh = np.full((1, 4, 2), 180.0)
    kh = np.full((1, 5, 2), 180.0)  # every logit 2 * 180^2 / sqrt(2) = 45820, near the top
    vh = rng.standard_normal((1, 5, 3))
    q, k, v = (xp.asarray(x, dtype=xp.float16, device=backend.device) for x in (qh, kh, vh))
    out, lse = call(backend, grad.online_softmax_forward, q, k, v, block_q=2, block_k=2)
    assert lse.dtype == xp.float32
    want = 2 * 180.0**2 / np.sqrt(2) + np.log(5)  # five equal logits
    np.testing.assert_allclose(host(lse), np.full((1, 4), want), rtol=1e-6)
    q2 = xp.asarray(np.full((1, 4, 2), 255.0), dtype=xp.float16, device=backend.device)
    k2 = xp.asarray(np.full((1, 5, 2), 255.0), dtype=xp.float16, device=backend.device)
    out2, lse2 = call(backend, grad.online_softmax_forward, q2, k2, v, block_q=2, block_k=2)
    # logits 2 * 255^2 / sqrt(2) = 91956 are past float16: computed in float32, finite.
    assert np.all(np.isfinite(host(lse2))) and np.all(np.isfinite(host(out2)))
    g = call(backend, grad.online_softmax_attention, q, k, v, xp.ones_like(out), out=out, lse=lse,
             block_q=2, block_k=2)
    assert all(g[n].dtype == xp.float16 for n in "qkv")
    with pytest.raises(TypeError, match="lse"):
        call(backend, grad.online_softmax_attention, q, k, v, xp.ones_like(out), out=out,
             lse=xp.astype(lse, xp.float16), block_q=2, block_k=2)


@pytest.mark.parametrize("form", FORMS)
def test_empty_sequences(backend, form):
    xp = backend.xp
    z = lambda *s: xp.zeros(s, dtype=xp.float64, device=backend.device)  # noqa: E731
    k, _ = randn(backend, (2, 3, 4))
    v, _ = randn(backend, (2, 3, 5))
    g = FORMS[form](z(2, 0, 4), k, v, z(2, 0, 5))
    assert {n: tuple(a.shape) for n, a in g.items()} == {"q": (2, 0, 4), "k": (2, 3, 4), "v": (2, 3, 5)}
    assert np.all(host(g["k"]) == 0) and np.all(host(g["v"]) == 0)
    q, _ = randn(backend, (2, 3, 4))
    g = FORMS[form](q, z(2, 0, 4), z(2, 0, 5), z(2, 3, 5))
    assert tuple(g["q"].shape) == (2, 3, 4) and np.all(host(g["q"]) == 0)


@pytest.mark.parametrize("form", FORMS)
def test_inputs_not_modified(backend, form):
    if backend.name == "jax":
        pytest.skip("JAX arrays are immutable")
    args, do, options = _case(11, bias_shape=(5, 7))
    conv = {n: from_numpy(a, backend) for n, a in args.items()}
    d = from_numpy(do, backend)
    FORMS[form](conv["q"], conv["k"], conv["v"], d, bias=conv["bias"],
                mask=from_numpy(options["mask"], backend), causal=True)
    for n, a in args.items():
        assert np.array_equal(host(conv[n]), a)
    assert np.array_equal(host(d), do)


@pytest.mark.parametrize("form", FORMS)
def test_bad_input(backend, form):
    q, _ = randn(backend, (2, 5, 3))
    v, _ = randn(backend, (2, 5, 4))
    with pytest.raises(ValueError, match=r"do must have the output's shape .*\(2, 5, 4\)"):
        FORMS[form](q, q, v, q)
    with pytest.raises(ValueError, match="same head dimension"):
        FORMS[form](q, v, v, v)
    with pytest.raises(ValueError, match="causal must be"):
        FORMS[form](q, q, v, v, causal="diagonal")
    with pytest.raises(ValueError, match="give both out and lse"):
        grad.online_softmax_attention(q, q, v, v, out=v)
    with pytest.raises(ValueError, match="block_k must be a positive integer"):
        grad.online_softmax_attention(q, q, v, v, block_k=0)


# ---------------------------------------------------------------- the forward's options

_RNG = np.random.default_rng(12)
_KEEP = _RNG.random((2, 4, 7, 9)) < 0.8
OPTIONS = {
    "gqa-bias": ({"kv_heads": 2, "bias": True}, {"gqa": True}),
    "gqa-window": ({"kv_heads": 2}, {"gqa": True, "causal": "bottom-right", "window": (3, 1)}),
    "softcap": ({"bias": True, "q_scale": 3.0}, {"softcap": 2.0}),
    "alibi": ({}, {"alibi_slopes": np.array([0.5, 0.25, 0.1, 0.05]), "causal": True}),
    "dropout": ({}, {"dropout_p": 0.2, "dropout_mask": _KEEP}),
    "seqlens": ({}, {"seqlens_q": np.array([5, 7]), "seqlens_k": np.array([9, 4]),
                     "causal": "bottom-right"}),
    # Llama 4's chunks of 3 on 9 keys decoding 7 queries, and per-sequence chunks (from
    # each sequence's own key 0) with key lengths 9 and 5
    "chunk": ({"kv_heads": 2}, {"gqa": True, "causal": "bottom-right", "chunk": 3}),
    "chunk-seqlens": ({}, {"chunk": 2, "seqlens_k": np.array([9, 5]), "causal": "bottom-right"}),
}


def _option_case(name):
    spec, options = OPTIONS[name]
    rng = np.random.default_rng(13)
    hkv = spec.get("kv_heads", 4)
    args = {
        "q": rng.standard_normal((2, 4, 7, 3)) * spec.get("q_scale", 1.0),
        "k": rng.standard_normal((2, hkv, 9, 3)),
        "v": rng.standard_normal((2, hkv, 9, 2)),
    }
    if spec.get("bias"):
        args["bias"] = rng.standard_normal((4, 7, 9))
    return args, rng.standard_normal((2, 4, 7, 2)), dict(options)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", OPTIONS)
def test_options_match_finite_differences(backend, form, name):
    args, do, options = _option_case(name)
    want = _fd(("option", name), args, do, options)
    got = run_vjp(backend, FORMS[form], args, do, options)
    assert_grads_close(got, want, backend, rtol=1e-7, atol=1e-8)


def test_options_match_torch_autograd():
    pytest.importorskip("torch")
    from conformance.backends import load

    backend = load("torch")
    args, do, options = _option_case("gqa-bias")
    options.update(softcap=1.5, dropout_p=0.1, dropout_mask=_KEEP, causal=True)
    want = torch_vjp(attn_ref.softmax_attention, args, do, options)
    for form in FORMS:
        assert_grads_close(run_vjp(backend, FORMS[form], args, do, options), want, backend)


def test_gqa_gradients_sum_over_the_group(backend):
    # GQA equals plain attention on keys/values repeated to Hq heads; the repeated
    # heads' gradients summed over each group are the GQA gradients.
    args, do, options = _option_case("gqa-bias")
    rep = dict(args, k=np.repeat(args["k"], 2, axis=1), v=np.repeat(args["v"], 2, axis=1))
    a = run_vjp(backend, grad.softmax_attention, args, do, options)
    b = run_vjp(backend, grad.softmax_attention, rep, do, {})
    for n in ("k", "v"):
        summed = host(b[n]).reshape(2, 2, 2, *host(b[n]).shape[2:]).sum(2)
        np.testing.assert_allclose(host(a[n]), summed, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("online", [False, True])
def test_varlen_matches_finite_differences_and_keeps_sequences_apart(backend, online):
    rng = np.random.default_rng(14)
    args = {"q": rng.standard_normal((9, 4, 3)), "k": rng.standard_normal((11, 2, 3)),
            "v": rng.standard_normal((11, 2, 2))}
    do = rng.standard_normal((9, 4, 2))
    options = {"cu_seqlens_q": (0, 4, 9), "cu_seqlens_k": (0, 6, 11), "causal": "bottom-right"}
    want = _fd(("varlen",), args, do, options)
    got = run_vjp(backend, grad.varlen_attention, args, do, dict(options, online=online, block_q=4,
                                                                 block_k=4))
    assert_grads_close(got, want, backend, rtol=1e-7, atol=1e-8)
    # do of the second sequence only: no gradient reaches the first sequence's keys.
    do2 = do.copy()
    do2[:4] = 0.0
    g = run_vjp(backend, grad.varlen_attention, args, do2, options)
    assert np.all(host(g["k"])[:6] == 0.0) and np.all(host(g["v"])[:6] == 0.0)


# ---------------------------------------------------------------- the lse's cotangent

# Cases for dlse: the masked, biased case with a dead row (mask row 1) in each causal
# alignment, and every option of the forward (GQA, window, soft-cap, ALiBi, dropout,
# padded varlen lengths, chunks).
LSE_CASES = [f"mask-bias-{c}" for c in CAUSAL] + list(OPTIONS)


def _lse_case(name):
    if name.startswith("mask-bias-"):
        args, do, options = _case(15, nq=6, nk=7, batch=(2,), bias_shape=(6, 7))
        c = name.removeprefix("mask-bias-")
        options["causal"] = False if c == "False" else c
    else:
        args, do, options = _option_case(name)
    dlse = np.random.default_rng(16).standard_normal(do.shape[:-1])
    return args, do, dlse, options


def _out_and_lse(*pos, **kw):
    """The forward's output and lse flattened into one vector (the lse's +inf on rows
    with no key replaced by 0): ``<[do, dlse], this>`` is ``<do, O> + <dlse, lse>``."""
    out, lse = grad.online_softmax_forward(*pos, block_q=4, block_k=5, **kw)
    xp = array_api_compat.array_namespace(out)
    lse = xp.where(lse < xp.inf, lse, xp.zeros_like(lse))
    return xp.concat([xp.reshape(out, (-1,)), xp.reshape(lse, (-1,))])


def _dead_rows(args, options):
    """Rows with no key to attend to: where the forward's lse is +inf."""
    _, lse = grad.online_softmax_forward(*(args[n] for n in "qkv"), bias=args.get("bias"), **options)
    return np.isposinf(lse)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", LSE_CASES)
def test_dlse_matches_finite_differences_of_the_forwards_lse(backend, form, name):
    args, do, dlse, options = _lse_case(name)
    if ("lse", name) not in _FD:
        _FD[("lse", name)] = numeric_vjp(_out_and_lse, args, np.concatenate([do.ravel(), dlse.ravel()]),
                                         options)
    want = _FD[("lse", name)]
    # A row with no key ignores its dlse, whatever it holds (NaN here).
    dead = _dead_rows(args, options)
    if name.startswith("mask-bias-") or name == "seqlens":  # a masked row; varlen padding rows
        assert dead.any()
    dlse = np.where(np.broadcast_to(dead, dlse.shape), np.nan, dlse)
    got = run_vjp(backend, FORMS[form], args, do, dict(options, dlse=from_numpy(dlse, backend)))
    assert_grads_close(got, want, backend, rtol=1e-7, atol=1e-8)
    # The term is there: without dlse, dq differs by far more than the tolerance.
    without = run_vjp(backend, FORMS[form], args, do, options)
    assert np.max(np.abs(host(without["q"]) - want["q"])) > 1e-2


@pytest.mark.parametrize("name", ["mask-bias-bottom-right", "softcap", "seqlens", "gqa-window"])
def test_dlse_matches_torch_autograd_of_the_forwards_lse(name):
    pytest.importorskip("torch")
    from conformance.backends import load

    backend = load("torch")
    args, do, dlse, options = _lse_case(name)
    want = torch_vjp(_out_and_lse, args, np.concatenate([do.ravel(), dlse.ravel()]), options)
    assert all(np.all(np.isfinite(g)) for g in want.values())
    for form in FORMS:
        got = run_vjp(backend, FORMS[form], args, do, dict(options, dlse=from_numpy(dlse, backend)))
        assert_grads_close(got, want, backend)


@pytest.mark.parametrize("name", ["mask-bias-top-left", "gqa-bias", "chunk"])
def test_dlse_matches_jax_vjp_of_the_forwards_lse(name):
    pytest.importorskip("jax")
    from conformance.backends import load

    backend = load("jax")
    args, do, dlse, options = _lse_case(name)
    want = jax_vjp(_out_and_lse, args, np.concatenate([do.ravel(), dlse.ravel()]), options)
    for form in FORMS:
        got = run_vjp(backend, FORMS[form], args, do, dict(options, dlse=from_numpy(dlse, backend)))
        assert_grads_close(got, want, backend)


@pytest.mark.parametrize("form", FORMS)
def test_dlse_of_the_wrong_shape_or_dtype_is_named(backend, form):
    q, _ = randn(backend, (2, 5, 3))
    v, _ = randn(backend, (2, 5, 4))
    do = backend.xp.ones((2, 5, 4), dtype=q.dtype, device=backend.device)
    with pytest.raises(ValueError, match=r"dlse must have .*\(2, 5\), got shape \(2, 5, 1\)"):
        FORMS[form](q, q, v, do, dlse=backend.xp.ones((2, 5, 1), dtype=q.dtype, device=backend.device))
    with pytest.raises(TypeError, match="dlse"):
        FORMS[form](q, q, v, do, dlse=backend.xp.ones((2, 5), dtype=backend.xp.float32,
                                                      device=backend.device))
