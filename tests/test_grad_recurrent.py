"""attn_ref.grad.recurrent: the VJPs of retention, GLA, SSD, DeltaNet and Gated DeltaNet.

The reference gradients come from this file's own forward, :func:`plain_forward`: the
token-by-token recurrences written straight from their definitions (state ``S (dk, dv)``,
``o_t = scale q_t S_t``), once, over a module ``m`` that is NumPy, torch or jax.numpy.
That is independent of :mod:`attn_ref.recurrent` (and written without it) and is
differentiated three ways: central finite differences on NumPy float64 (directional,
several random directions per input), ``torch.autograd`` of its torch transcription and
``jax.vjp`` of its JAX transcription. The VJPs run on every backend and are compared
with all three (with JAX's on the first case of each variant, :data:`JAX_REFERENCE`).
"""

import numpy as np
import pytest

from attn_ref import grad
from attn_ref.grad import recurrent as rec
from conformance.backends import from_numpy, load
from tests.helpers import EPS, call, host
from tests.test_grad_common import assert_grads_close

L2NORM_EPS = 1e-6

#: variant -> (the VJP, the gate inputs it differentiates)
VARIANTS = {
    "retention": (rec.retention, ()),
    "gla": (rec.gated_linear_attention, ("g",)),
    "ssd": (rec.ssd, ("g",)),
    "delta": (rec.delta_rule, ("beta",)),
    "gated_delta": (rec.gated_delta_rule, ("g", "beta")),
}


# ---------------------------------------------------------------- the independent forward


def plain_forward(m, variant, q, k, v, *, gamma=None, g=None, beta=None, scale=None,
                  initial_state=None, cu_seqlens=None, qk_l2norm=False):
    """``(o, final_state)`` of ``variant`` by the definition, token by token.

    ``m`` is ``numpy``, ``torch`` or ``jax.numpy``; arrays are full-shaped except
    ``gamma`` (a float, or per leading index ``q.shape[:-2]``).
    """
    T, dk = q.shape[-2], q.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    if qk_l2norm:
        q = q / m.sqrt((q * q).sum(-1) + L2NORM_EPS)[..., None]
        k = k / m.sqrt((k * k).sum(-1) + L2NORM_EPS)[..., None]
    bounds = [0, T] if cu_seqlens is None else list(cu_seqlens)
    outs, finals = [], []
    for n in range(len(bounds) - 1):
        if initial_state is None:
            S = m.zeros(tuple(q.shape[:-2]) + (dk, v.shape[-1]), dtype=q.dtype)
        else:
            S = initial_state if cu_seqlens is None else initial_state[n:n + 1]
        for t in range(bounds[n], bounds[n + 1]):
            q_t, k_t, v_t = q[..., t, :], k[..., t, :], v[..., t, :]
            # Decay first, then the write: S_t = D_t S_{t-1} + k_t^T u_t.
            if variant == "retention":
                S = (gamma if isinstance(gamma, float) else gamma[..., None, None]) * S
            elif variant == "gla":
                S = m.exp(g[..., t, :])[..., :, None] * S
            elif variant in ("ssd", "gated_delta"):
                S = m.exp(g[..., t])[..., None, None] * S
            if variant in ("delta", "gated_delta"):
                # u_t = beta_t (v_t - k_t S), k_t S being the state's prediction of v_t.
                u = beta[..., t][..., None] * (v_t - (k_t[..., :, None] * S).sum(-2))
            else:
                u = v_t
            S = S + k_t[..., :, None] * u[..., None, :]
            outs.append(scale * (q_t[..., :, None] * S).sum(-2))
        finals.append(S)
    o = m.stack(outs, -2)
    final = finals[0] if cu_seqlens is None else m.concatenate(finals, 0)
    return o, final


def _definition(static):
    """The options of the definition: without the backward's form and chunking."""
    return {n: a for n, a in static.items() if n not in ("form", "chunk_size")}


def _loss(m, variant, inputs, static, do, dfinal):
    o, final = plain_forward(m, variant, **inputs, **_definition(static))
    out = (o * do).sum()
    return out if dfinal is None else out + (final * dfinal).sum()


# ---------------------------------------------------------------- cases


def _case(variant, *, T=7, batch=(3, 5), dk=4, dv=3, h0=True, cu_seqlens=None, dfinal=False,
          scale=None, gamma_per_head=False, g_value=None, beta_value=None, qk_l2norm=False, seed=0,
          chunk_size=None, form=None):
    """Host inputs ``{name: array}`` (differentiated), static options, ``do`` and ``dS_T``."""
    rng = np.random.default_rng(seed)
    inputs = {"q": rng.standard_normal(batch + (T, dk)), "k": rng.standard_normal(batch + (T, dk)),
              "v": rng.standard_normal(batch + (T, dv))}
    static = {}
    if variant == "retention":
        static["gamma"] = rng.uniform(0.5, 0.99, batch) if gamma_per_head else 0.9
    if variant == "gla":
        inputs["g"] = -np.log1p(np.exp(-rng.standard_normal(batch + (T, dk))))  # logsigmoid
    if variant in ("ssd", "gated_delta"):
        inputs["g"] = -np.log1p(np.exp(-rng.standard_normal(batch + (T,))))
    if g_value is not None and "g" in inputs:
        inputs["g"] = np.full(inputs["g"].shape, g_value)
    if variant in ("delta", "gated_delta"):
        inputs["beta"] = 1.0 / (1.0 + np.exp(-rng.standard_normal(batch + (T,))))
        if beta_value is not None:
            inputs["beta"] = beta_value(inputs["beta"])
        if qk_l2norm:
            static["qk_l2norm"] = True
    n_seq = 1 if cu_seqlens is None else len(cu_seqlens) - 1
    state_shape = (batch if cu_seqlens is None else (n_seq,) + batch[1:]) + (dk, dv)
    if h0:
        inputs["initial_state"] = rng.standard_normal(state_shape)
    if cu_seqlens is not None:
        static["cu_seqlens"] = tuple(cu_seqlens)
    if scale is not None:
        static["scale"] = scale
    # The backward's chunking (unless form="recurrent", the token loop).
    if chunk_size is not None:
        static["chunk_size"] = chunk_size
    if form is not None:
        static["form"] = form
    do = rng.standard_normal(batch + (T, dv))
    dfin = rng.standard_normal(state_shape) if dfinal else None
    return inputs, static, do, dfin


def _beta_edges(beta):
    # Exactly 0 (nothing written) and exactly 1 (with the unit keys of qk_l2norm, the
    # old association of k_t replaced: k_t S_t = v_t up to the normaliser's eps).
    out = beta.copy()
    out[..., 0::3] = 0.0
    out[..., 1::3] = 1.0
    return out


#: The first case of each variant is the one a ``jax_subset`` sweep keeps on JAX: the
#: one with the most features (batch axes, initial state, dS_T, scale, a partial chunk).
CASES = {
    "T=7,batch=(3,5),h0,dS_T,scale": dict(dfinal=True, scale=0.7, gamma_per_head=True, chunk_size=3),
    "T=1": dict(T=1, batch=(2,), h0=False),
    "T=9,no-h0": dict(T=9, batch=(3, 5), h0=False, dk=3, dv=4, chunk_size=4),
    "cu_seqlens=(0,4,5,11)": dict(T=11, batch=(1, 2), cu_seqlens=(0, 4, 5, 11), dfinal=True, chunk_size=3),
    "cu_seqlens,no-h0": dict(T=11, batch=(1, 2), cu_seqlens=(0, 6, 7, 11), h0=False, form="recurrent"),
}
DELTA_CASES = {
    "beta-edges": dict(T=8, batch=(2, 3), beta_value=_beta_edges, qk_l2norm=True),
    "qk_l2norm": dict(T=6, batch=(2, 3), qk_l2norm=True),
}


def _all_cases():
    for variant in VARIANTS:
        for name in CASES:
            yield variant, name
        if variant in ("delta", "gated_delta"):
            for name in DELTA_CASES:
                yield variant, name


def _make(variant, name):
    return _case(variant, **{**CASES, **DELTA_CASES}[name])


#: variant -> the case whose VJP is also checked against ``jax.vjp`` of the plain forward
#: (torch's autograd checks every case): the first, with the most features. The JAX
#: reference runs the token loop eagerly, ~16 XLA compilations a case (19 s of CPU for
#: all 29 cases), and a second autodiff of the same loop on the other cases checks the
#: autodiff systems more than the VJPs.
JAX_REFERENCE = {v: next(n for w, n in _all_cases() if w == v) for v in VARIANTS}


# ---------------------------------------------------------------- reference gradients

_REF = {}


def _torch_grads(variant, inputs, static, do, dfinal):
    import torch

    ts = {n: torch.tensor(a, dtype=torch.float64, requires_grad=True) for n, a in inputs.items()}
    st = {n: (torch.tensor(a) if isinstance(a, np.ndarray) else a) for n, a in _definition(static).items()}
    loss = _loss(torch, variant, ts, st, torch.tensor(do), None if dfinal is None else torch.tensor(dfinal))
    got = torch.autograd.grad(loss, list(ts.values()))
    return {n: x.detach().numpy() for n, x in zip(ts, got)}


def _jax_grads(variant, inputs, static, do, dfinal):
    import jax
    import jax.numpy as jnp

    load("jax")  # float64 enabled
    names = list(inputs)
    st = {n: (jnp.asarray(a) if isinstance(a, np.ndarray) else a) for n, a in _definition(static).items()}

    def f(*xs):
        o, final = plain_forward(jnp, variant, **dict(zip(names, xs)), **st)
        return o, final

    (o, final), pullback = jax.vjp(f, *(jnp.asarray(inputs[n]) for n in names))
    dfin = jnp.zeros_like(final) if dfinal is None else jnp.asarray(dfinal)
    got = pullback((jnp.asarray(do), dfin))
    return {n: np.asarray(x) for n, x in zip(names, got)}


def _reference(variant, name, kind):
    key = (variant, name, kind)
    if key not in _REF:
        try:
            load(kind)
        except Exception as exc:  # pragma: no cover - the matrix requires both in CI
            pytest.skip(str(exc))
        fn = _torch_grads if kind == "torch" else _jax_grads
        _REF[key] = fn(variant, *_make(variant, name))
    return _REF[key]


def _directional_fd(variant, inputs, static, do, dfinal, name, direction, h=1e-5):
    """Central difference of the loss along ``direction`` in input ``name``, float64."""

    def at(x):
        return float(_loss(np, variant, dict(inputs, **{name: x}), static, do, dfinal))

    x = inputs[name]
    return (at(x + h * direction) - at(x - h * direction)) / (2 * h)


def _run(backend, variant, inputs, static, do, dfinal, dtype="float64", jit=True):
    """The VJP on ``backend`` from host arrays; under ``jax.jit`` on JAX unless ``jit=False``."""
    vjp = VARIANTS[variant][0]
    conv = {n: from_numpy(a, backend, dtype) for n, a in inputs.items()}
    opts = {n: (from_numpy(a, backend, dtype) if isinstance(a, np.ndarray) else a) for n, a in static.items()}
    if dfinal is not None:
        opts["dfinal_state"] = from_numpy(dfinal, backend, dtype)
    pos = [conv.pop(n) for n in ("q", "k", "v")]
    if not jit:
        return vjp(*pos, from_numpy(do, backend, dtype), **conv, **opts)
    return call(backend, vjp, *pos, from_numpy(do, backend, dtype), **conv, **opts)


# ---------------------------------------------------------------- the checks


@pytest.mark.jax_subset("variant")
@pytest.mark.parametrize("variant,name", list(_all_cases()))
def test_matches_autograd_of_the_plain_forward(backend, variant, name):
    inputs, static, do, dfinal = _make(variant, name)
    got = _run(backend, variant, inputs, static, do, dfinal)
    assert set(got) == set(inputs), f"gradients for {sorted(got)}, expected {sorted(inputs)}"
    for kind in ("torch", "jax") if JAX_REFERENCE[variant] == name else ("torch",):
        want = _reference(variant, name, kind)
        try:
            assert_grads_close(got, want, backend, rtol=1e-10, atol=1e-11)
        except AssertionError as exc:
            raise AssertionError(f"against {kind} autodiff: {exc}") from None


# On JAX one case per variant, the one test_matches_autograd_of_the_plain_forward keeps
# (the same compiled VJP): each other case is a new ~1.5 s compilation of the same
# array-API code that NumPy, array-api-strict and torch run on every case.
@pytest.mark.jax_subset("variant")
@pytest.mark.parametrize("variant,name", [(v, n) for v, n in _all_cases() if n != "T=9,no-h0"])
def test_matches_directional_finite_differences(backend, variant, name):
    inputs, static, do, dfinal = _make(variant, name)
    got = {n: host(x) for n, x in _run(backend, variant, inputs, static, do, dfinal).items()}
    rng = np.random.default_rng(1)
    for n, x in inputs.items():
        for _ in range(3):
            direction = rng.standard_normal(x.shape)
            fd = _directional_fd(variant, inputs, static, do, dfinal, n, direction)
            exact = float(np.sum(got[n] * direction))
            assert abs(exact - fd) <= 1e-7 * max(1.0, abs(fd)), (
                f"gradient of {n}: <grad, dir> = {exact!r}, finite differences {fd!r}")


def test_the_gradients_keys(backend):
    # initial_state's gradient only when it is given; each variant its own gate names.
    # The keys are Python bookkeeping, the same on every library: on JAX (eager, ~7
    # compilations a VJP) only Gated DeltaNet, which has both gates.
    for variant, (_, gates) in VARIANTS.items():
        if backend.name == "jax" and variant != "gated_delta":
            continue
        for h0 in (False, True):
            inputs, static, do, dfinal = _case(variant, T=3, batch=(2,), h0=h0)
            got = _run(backend, variant, inputs, static, do, dfinal, jit=False)
            want = {"q", "k", "v", *gates} | ({"initial_state"} if h0 else set())
            assert set(got) == want, (variant, h0, sorted(got))


@pytest.mark.jax_subset()
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_strong_decay_over_512_tokens_gives_finite_exact_gradients(backend, variant):
    # exp(-5) per step: after a few dozen steps the state's memory of a token is below
    # float64's resolution; gradients stay finite (log-space gates: no division by
    # exp(g)) and still match autograd.
    T = 512
    kw = dict(T=T, batch=(2,), dk=3, dv=2, g_value=-5.0)
    inputs, static, do, dfinal = _case(variant, **kw)
    if variant == "retention":
        static["gamma"] = float(np.exp(-5.0))
    vjp = VARIANTS[variant][0]
    # Eager on every backend: a jit of a 512-step Python loop compiles for minutes.
    conv = {n: from_numpy(a, backend) for n, a in inputs.items()}
    pos = [conv.pop(n) for n in ("q", "k", "v")]
    got = vjp(*pos, from_numpy(do, backend), **conv, **static)
    want = _torch_grads(variant, inputs, static, do, dfinal)
    for n in inputs:
        assert np.all(np.isfinite(host(got[n]))), n
    assert_grads_close(got, want, backend, rtol=1e-10, atol=1e-11)
    if "g" in inputs:
        # The last token's gate scales only the read of S_{T-1}: a non-zero gradient.
        assert np.any(host(got["g"])[..., -1] != 0.0)
    # In float32 a chunk of 64 steps spans exponents down to -315 (exp underflows to 0)
    # and, above the diagonal, up to +315 (exp overflows to inf): masking after the exp
    # would give inf * 0 = NaN there.
    conv = {n: from_numpy(a, backend, "float32") for n, a in inputs.items()}
    pos = [conv.pop(n) for n in ("q", "k", "v")]
    got = vjp(*pos, from_numpy(do, backend, "float32"), **conv, **static)
    for n in inputs:
        g32 = host(got[n])
        assert np.all(np.isfinite(g32)), n
        np.testing.assert_allclose(g32, want[n], rtol=0, atol=2**10 * EPS["float32"] * np.abs(want[n]).max(),
                                   err_msg=n)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sequences_of_cu_seqlens_are_independent(backend, variant):
    # Packed = each sequence on its own: the packed VJP equals the per-sequence VJPs
    # concatenated, and the initial states' gradients are per sequence.
    # Under jax.jit on JAX (cu_seqlens static): four programs a variant compiled whole
    # took 3.1 s for the five variants, their operations compiled one by one 11.5 s; the
    # eager JAX backward is test_chunked_backward_is_the_token_loop's.
    cu = (0, 4, 5, 11)
    inputs, static, do, dfinal = _case(variant, T=11, batch=(1, 2), cu_seqlens=cu, dfinal=True, seed=3)
    packed = {n: host(x) for n, x in _run(backend, variant, inputs, static, do, dfinal).items()}
    # Per-token arrays whose last axis is a feature axis (sliced [..., sl, :]); the
    # others ((..., T): beta, a scalar g) are sliced [..., sl].
    featured = {"q", "k", "v"} | ({"g"} if variant == "gla" else set())

    def piece(n, a, i, sl):
        if n == "initial_state":
            return a[i:i + 1]
        return a[..., sl, :] if n in featured else a[..., sl]

    st = {n: a for n, a in static.items() if n != "cu_seqlens"}
    for i in range(3):
        sl = slice(cu[i], cu[i + 1])
        one = {n: piece(n, a, i, sl) for n, a in inputs.items()}
        alone = _run(backend, variant, one, st, do[..., sl, :], dfinal[i:i + 1])
        for n in inputs:
            np.testing.assert_allclose(piece(n, packed[n], i, sl), host(alone[n]), rtol=1e-12, atol=1e-12,
                                       err_msg=f"{variant}: {n} of sequence {i}")


@pytest.mark.parametrize("variant", ["delta", "gated_delta"])
def test_beta_zero_writes_nothing(backend, variant):
    # beta = 0 everywhere: S_t = D_t S_{t-1}, so v gets no gradient, and k only through
    # nothing (the write is multiplied by beta): both exactly zero; beta's gradient is
    # <k_t dS_t, v_t - k_t P_t> and not zero.
    inputs, static, do, dfinal = _case(variant, T=5, batch=(2,), beta_value=np.zeros_like)
    got = {n: host(x) for n, x in _run(backend, variant, inputs, static, do, dfinal).items()}
    assert np.all(got["v"] == 0.0) and np.all(got["k"] == 0.0)
    assert np.all(got["beta"] != 0.0)


def test_half_precision_inputs_get_their_dtype_back():
    torch_backend = load("torch")
    inputs, static, do, dfinal = _case("gated_delta", T=6, batch=(2,))
    got = _run(torch_backend, "gated_delta", inputs, static, do, dfinal, dtype="float16")
    want = _torch_grads("gated_delta", {n: host(from_numpy(a, torch_backend, "float16"))
                                        for n, a in inputs.items()}, static,
                        host(from_numpy(do, torch_backend, "float16")), None)
    for n in inputs:
        assert str(got[n].dtype).endswith("float16"), n
        # float32 states: the only float16 rounding is of the final gradient.
        np.testing.assert_allclose(host(got[n]), want[n], rtol=2e-3, atol=2e-3, err_msg=n)


# ---------------------------------------------------------------- bad input


def _bad_args(backend, variant="gated_delta", **kw):
    inputs, static, do, _ = _case(variant, T=4, batch=(2,), **kw)
    conv = {n: from_numpy(a, backend) for n, a in inputs.items()}
    pos = [conv.pop(n) for n in ("q", "k", "v")]
    return pos, from_numpy(do, backend), {**conv, **static}


def test_do_with_the_wrong_shape_dtype_or_library_is_named(backend):
    xp = backend.xp
    pos, do, kw = _bad_args(backend)
    for variant, (vjp, _) in VARIANTS.items():
        p, d, k = _bad_args(backend, variant)
        with pytest.raises(ValueError, match=r"do must have the output's shape .*\(2, 4, 3\).*\(2, 3, 3\)"):
            vjp(*p, d[:, :3, :], **k)
    with pytest.raises(TypeError, match=r"do must have the dtype of q \(.*float64\), got .*float32"):
        rec.gated_delta_rule(*pos, xp.astype(do, xp.float32), **kw)
    with pytest.raises(TypeError, match=r"do must be an array of the library of q"):
        other = "numpy" if backend.name != "numpy" else "array_api_strict"
        rec.gated_delta_rule(*pos, from_numpy(host(do), load(other)), **kw)
    with pytest.raises(TypeError, match=r"do must be an array"):
        rec.gated_delta_rule(*pos, host(do).tolist(), **kw)


def test_bad_gates_states_and_offsets_are_named(backend):
    xp = backend.xp
    pos, do, kw = _bad_args(backend)
    with pytest.raises(ValueError, match=r"g must have shape \(\.\.\., T\) = \(2, 4\) .*got shape \(2, 3\)"):
        rec.gated_delta_rule(*pos, do, **dict(kw, g=kw["g"][:, :3]))
    with pytest.raises(ValueError, match=r"beta must have shape .* got shape \(3, 4\)"):
        rec.gated_delta_rule(*pos, do, **dict(kw, beta=xp.concat([kw["beta"], kw["beta"][:1, :]], axis=0)))
    with pytest.raises(ValueError, match=r"initial_state must have shape \(\.\.\., dk, dv\) = \(2, 4, 3\)"):
        rec.gated_delta_rule(*pos, do, **dict(kw, initial_state=kw["initial_state"][..., :2]))
    with pytest.raises(ValueError, match=r"cu_seqlens must start at 0 and end at T=4"):
        rec.gated_delta_rule(*pos, do, **dict(kw, cu_seqlens=[0, 2, 3]))
    with pytest.raises(ValueError, match=r"with cu_seqlens, q, k and v must be \(1, \*rest, T, d\)"):
        rec.gated_delta_rule(*pos, do, **dict(kw, cu_seqlens=[0, 2, 4]))
    with pytest.raises(ValueError, match=r"gated_delta_rule is causal by construction .* got causal=False"):
        rec.gated_delta_rule(*pos, do, **dict(kw, causal=False))
    with pytest.raises(ValueError, match="form must be one of"):
        rec.gated_delta_rule(*pos, do, **dict(kw, form="chunked"))
    p, d, k = _bad_args(backend, "gla")
    with pytest.raises(ValueError, match=r"g must have shape \(\.\.\., T, dk\) = \(2, 4, 4\)"):
        rec.gated_linear_attention(*p, d, **dict(k, g=k["g"][..., 0]))
    p, d, k = _bad_args(backend, "retention")
    with pytest.raises(ValueError, match=r"gamma must be a decay in \(0, 1\], got gamma=1.5"):
        rec.retention(*p, d, **dict(k, gamma=1.5))
    with pytest.raises(TypeError, match="gamma must be a decay"):
        rec.retention(*p, d, **dict(k, gamma="0.9"))


def test_inputs_are_not_modified(backend):
    if backend.name == "jax":
        pytest.skip("JAX arrays are immutable")
    pos, do, kw = _bad_args(backend)
    before = [host(x) for x in (*pos, do, *(a for a in kw.values() if not isinstance(a, (float, bool))))]
    rec.gated_delta_rule(*pos, do, **kw, qk_l2norm=True)
    after = [host(x) for x in (*pos, do, *(a for a in kw.values() if not isinstance(a, (float, bool))))]
    for b, a in zip(before, after):
        np.testing.assert_array_equal(a, b)


def test_retention_with_gamma_one_is_causal_linear_attention(backend):
    # gamma = 1: no decay, so retention is causal linear attention with identity features
    # and no normaliser, whose VJP (attn_ref.grad.linear) was derived independently.
    inputs, static, do, _ = _case("retention", T=9, batch=(2, 3), h0=False, seed=7)
    got = _run(backend, "retention", inputs, dict(static, gamma=1.0, scale=0.6), do, None)
    conv = [from_numpy(inputs[n], backend) for n in "qkv"]
    want = call(backend, grad.linear_attention, *conv, from_numpy(do, backend), feature_map="identity",
                normalize=False, causal=True, scale=0.6)
    assert_grads_close(got, {n: host(x) for n, x in want.items()}, backend, rtol=1e-12, atol=1e-12)


def test_the_forwards_options_are_accepted_and_change_nothing(backend):
    # The registry and the oracle call a VJP with the forward's options:
    # output_final_state and the causal alignment do not change the function, and
    # "parallel" takes the chunked backward as "chunk" does (same chunk_size).
    inputs, static, do, dfinal = _case("gla", T=5, batch=(2,))
    base = _run(backend, "gla", inputs, dict(static, chunk_size=2), do, dfinal)
    for opts in ({"form": "parallel"}, {"output_final_state": True, "causal": "bottom-right"}):
        got = _run(backend, "gla", inputs, dict(static, chunk_size=2, **opts), do, dfinal)
        assert_grads_close(got, {n: host(x) for n, x in base.items()}, backend, rtol=0, atol=0)


#: The backward is chunked unless form="recurrent" (the token loop): for the decay
#: variants as a decayed linear attention run from the end, for the delta rules through
#: the WY/UT form. Every token its own chunk; a partial last chunk; one chunk longer
#: than T.
CHUNKINGS = [{"chunk_size": 1}, {"chunk_size": 3}, {"chunk_size": 64}]


def _chunking_cases():
    for variant in VARIANTS:
        for name in ("T=7,batch=(3,5),h0,dS_T,scale", "cu_seqlens=(0,4,5,11)"):
            yield variant, name
        if variant in ("delta", "gated_delta"):
            for name in DELTA_CASES:
                yield variant, name


@pytest.mark.jax_subset("variant")
@pytest.mark.parametrize("variant,name", list(_chunking_cases()))
def test_chunked_backward_is_the_token_loop(backend, variant, name):
    inputs, static, do, dfinal = _make(variant, name)
    static = {n: a for n, a in static.items() if n != "chunk_size"}
    # Eager on JAX: one jit per chunking compiles longer than it runs (the other tests
    # check that both backwards trace). There chunk_size=3 alone: in the case JAX keeps
    # (T = 7) its chunks of 3, 3 and 1 take the branches of the other two (a one-token
    # chunk; the odd and even blocks that _decayed_products halves, as the one chunk of
    # 64 does), which cost ~15 eager compilations each a variant.
    loop = {n: host(x) for n, x in _run(backend, variant, inputs, dict(static, form="recurrent"),
                                        do, dfinal, jit=False).items()}
    for opts in CHUNKINGS[1:2] if backend.name == "jax" else CHUNKINGS:
        got = _run(backend, variant, inputs, dict(static, **opts), do, dfinal, jit=False)
        try:
            assert_grads_close(got, loop, backend, rtol=1e-12, atol=1e-12)
        except AssertionError as exc:
            raise AssertionError(f"{opts}: {exc}") from None


@pytest.mark.parametrize("variant", ["gla", "ssd"])
def test_log_gate_gradient_is_a_reverse_cumsum_of_q_dq_minus_k_dk(backend, variant):
    # The output depends on the cumulative log gate b_t = g_1 + ... + g_t only through
    # q_t exp(b_t) and k_t exp(-b_t) (and S_T = exp(b_T) (...)), so
    # dL/db_t = q_t dq_t - k_t dk_t (+ rowsum(dS_T * S_T) at t = T) and dg_t is its sum
    # over s >= t: an identity between the VJP's outputs that the reverse recurrence
    # never uses (fla's chunked backward computes dg this way).
    inputs, static, do, dfinal = _case(variant, T=9, batch=(2, 3), dfinal=True, seed=11)
    got = {n: host(x) for n, x in _run(backend, variant, inputs, static, do, dfinal).items()}
    _, final = plain_forward(np, variant, **inputs, **_definition(static))
    db = inputs["q"] * got["q"] - inputs["k"] * got["k"]
    db[..., -1, :] += np.sum(dfinal * final, axis=-1)
    if variant == "ssd":
        db = db.sum(-1)
        want = np.flip(np.cumsum(np.flip(db, -1), -1), -1)
    else:
        want = np.flip(np.cumsum(np.flip(db, -2), -2), -2)
    np.testing.assert_allclose(got["g"], want, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_float32_in_float32_out(backend, variant):
    # float32 inputs are differentiated in float32 (no float64 detour, no half-precision
    # shortcut): within 2^10 float32 epsilons of the gradient's scale, autograd in float64
    # of the same (rounded) inputs.
    inputs, static, do, dfinal = _case(variant, T=9, batch=(2, 3), dfinal=True, chunk_size=4, seed=13)
    rounded = {n: a.astype(np.float32).astype(np.float64) for n, a in inputs.items()}
    static = {n: (a.astype(np.float32).astype(np.float64) if isinstance(a, np.ndarray) else a)
              for n, a in static.items()}
    do, dfinal = (x.astype(np.float32).astype(np.float64) for x in (do, dfinal))
    got = _run(backend, variant, rounded, static, do, dfinal, dtype="float32")
    want = _torch_grads(variant, rounded, static, do, dfinal)
    for n in want:
        assert str(got[n].dtype).endswith("float32"), (n, got[n].dtype)
        np.testing.assert_allclose(host(got[n]), want[n], rtol=0,
                                   atol=2**10 * EPS["float32"] * np.abs(want[n]).max(), err_msg=n)


# ---------------------------------------------------------------- the real forwards

_FORWARDS = {"retention": "retention", "gla": "gated_linear_attention", "ssd": "ssd",
             "delta": "delta_rule", "gated_delta": "gated_delta_rule"}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("form", ["recurrent", "parallel", "chunk"])
def test_the_plain_forward_here_is_attn_ref_recurrent(variant, form):
    # The VJPs are checked against plain_forward's derivatives: plain_forward must be
    # the function attn_ref.recurrent computes, in each of its forms, output and final state.
    import attn_ref.recurrent as forward

    for cu in (None, (0, 4, 5, 11)):
        inputs, static, _, _ = _case(variant, T=11, batch=(1, 2) if cu else (3, 2), cu_seqlens=cu,
                                     qk_l2norm=True, seed=4)
        want_o, want_s = plain_forward(np, variant, **inputs, **static)
        got_o, got_s = getattr(forward, _FORWARDS[variant])(
            *(inputs[n] for n in "qkv"), **{n: x for n, x in inputs.items() if n not in "qkv"},
            **static, form=form, chunk_size=3, output_final_state=True)
        np.testing.assert_allclose(got_o, want_o, rtol=1e-11, atol=1e-12, err_msg=f"{variant} {form}")
        np.testing.assert_allclose(got_s, want_s, rtol=1e-11, atol=1e-12, err_msg=f"{variant} {form}")
