"""attn_ref.recurrent: retention, GLA, SSD, DeltaNet and Gated DeltaNet.

Each variant's three forms (recurrence, masked T x T matrix, chunks) against the plain
token loop of tests/plain.py, on every backend; the state carried across calls and
packed sequences; the limits where a variant becomes something simpler; long sequences
with strong decay; half-precision inputs; bad input.
"""

import functools
import math

import numpy as np
import pytest

from attn_ref.linear import linear_from_features
from attn_ref.recurrent import (
    delta_rule,
    gated_delta_rule,
    gated_linear_attention,
    retention,
    ssd,
)
from attn_ref.recurrent.common import working_dtype
from conformance.backends import from_numpy
from tests import plain
from tests.helpers import EPS, assert_close, call, fla_naive_module, host, jit

FNS = {"retention": retention, "gla": gated_linear_attention, "ssd": ssd,
       "deltanet": delta_rule, "gated_deltanet": gated_delta_rule}
BATCH, DK, DV = (2, 3), 4, 3


def _logsigmoid(x):
    return np.minimum(x, 0) - np.log1p(np.exp(-np.abs(x)))


def _host_inputs(name, T, batch=BATCH, seed=0):
    """Host float64 ``q, k, v``, the step inputs of ``name`` and a random initial state."""
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal(batch + (T, DK)), rng.standard_normal(batch + (T, DK))
    v = rng.standard_normal(batch + (T, DV))
    steps = {}
    if name == "retention":
        steps["gamma"] = 0.9
    if name == "gla":
        steps["g"] = _logsigmoid(rng.standard_normal(batch + (T, DK)))
    if name in ("ssd", "gated_deltanet"):
        steps["g"] = _logsigmoid(rng.standard_normal(batch + (T,)))
    if name in ("deltanet", "gated_deltanet"):
        steps["beta"] = 1 / (1 + np.exp(-rng.standard_normal(batch + (T,))))
        # unit keys, as DeltaNet layers normalise them: I - beta k^T k then contracts
        k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    s0 = rng.standard_normal(batch + (DK, DV))
    return (q, k, v), steps, s0


def _plain(name, q, k, v, steps, s0):
    """The token loop of tests/plain.py with these step inputs: ``(o, S_T)``."""
    T = q.shape[-2]
    alpha = beta = None
    if name == "retention":
        alpha = np.full(q.shape[:-2] + (T, 1), steps["gamma"])
    elif name == "gla":
        alpha = np.exp(steps["g"])
    elif "g" in steps:
        alpha = np.exp(steps["g"])[..., None]
    if "beta" in steps:
        beta = steps["beta"]
    return plain.np_recurrent(q, k, v, alpha=alpha, beta=beta, s0=s0)


def _to(backend, host_dict, dtype="float64"):
    return {n: from_numpy(a, backend, dtype) if isinstance(a, np.ndarray) else a
            for n, a in host_dict.items()}


def _all_forms(q, k, v, s0, *, of, chunk_size, forms, **steps):
    # One function for the forms, so JAX compiles one program per shape.
    return tuple(of(q, k, v, initial_state=s0, output_final_state=True, form=form,
                    chunk_size=chunk_size, **steps)
                 for form in forms)


def _forms(backend, T):
    """The forms to run at length ``T``. XLA compiles the loops unrolled (the token loop
    at ~0.2 s a step, 14 s at T = 65): under ``jax.jit`` the token loop runs only on
    short sequences, and the tests other than the three-form one check the chunk form."""
    if backend.name == "jax":
        return ("recurrent", "parallel", "chunk") if T <= 17 else ("parallel", "chunk")
    return ("recurrent", "parallel", "chunk")


# (T, chunk size): T = 1, a partial chunk, one past a chunk, a multiple and one past it
LENGTHS = ((1, 16), (15, 16), (17, 16), (64, 32), (65, 64))
# the same on JAX, fewer (each pair compiles three programs): still partial last chunks
JAX_LENGTHS = ((15, 16), (65, 32))


# --------------------------------------------------------------------- the three forms


@pytest.mark.parametrize("name", sorted(FNS))
def test_three_forms_are_the_token_loop(backend, name):
    for T, C in JAX_LENGTHS if backend.name == "jax" else LENGTHS:
        (qh, kh, vh), steps_h, s0h = _host_inputs(name, T)
        want_o, want_s = _plain(name, qh, kh, vh, steps_h, s0h)
        q, k, v, s0 = (from_numpy(a, backend) for a in (qh, kh, vh, s0h))
        forms = _forms(backend, T)
        outs = call(backend, _all_forms, q, k, v, s0, of=FNS[name], chunk_size=C, forms=forms,
                    **_to(backend, steps_h))
        for form, (o, s) in zip(forms, outs):
            for got, want in ((o, want_o), (s, want_s)):
                try:
                    assert_close(got, want, backend, rtol=1e-10, atol=1e-10 * np.abs(want).max())
                except AssertionError as exc:
                    raise AssertionError(f"form={form!r}, T={T}, chunk_size={C}: {exc}") from None


@pytest.mark.parametrize("name", sorted(FNS))
def test_chunk_size_does_not_change_the_function(name):
    (qh, kh, vh), steps, s0 = _host_inputs(name, 37, batch=(2,))
    ref = FNS[name](qh, kh, vh, form="recurrent", initial_state=s0, **steps)
    for C in (1, 2, 5, 36, 37, 100):
        got = FNS[name](qh, kh, vh, chunk_size=C, initial_state=s0, **steps)
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12, err_msg=f"chunk_size={C}")


@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet"])
def test_qk_l2norm_is_normalising_first(backend, name, monkeypatch):
    # The chunk form normalises q and k group by group (the other forms up front): every
    # form with qk_l2norm=True is the token loop on q and k normalised beforehand, for
    # unnormalised inputs, a partial last chunk and groups of one and several chunks.
    from attn_ref.recurrent import delta

    (qh, kh, vh), steps_h, s0h = _host_inputs(name, 21)
    kh = 3.0 * kh  # _host_inputs gives unit keys: make the normalisation matter
    unit = [x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + delta.L2NORM_EPS)
            for x in (qh, kh)]
    want_o, want_s = _plain(name, *unit, vh, steps_h, s0h)
    q, k, v, s0 = (from_numpy(a, backend) for a in (qh, kh, vh, s0h))
    steps = _to(backend, steps_h)
    per_chunk = math.prod(BATCH) * 4 * max(4, DK + DV)
    for form in _forms(backend, 21):
        # the groups matter to the chunk form only
        for chunks in ((1, 1000) if form == "chunk" else (1000,)):
            monkeypatch.setattr(delta, "GROUP_ELEMENTS", chunks * per_chunk)
            o, s = FNS[name](q, k, v, initial_state=s0, output_final_state=True, chunk_size=4,
                             qk_l2norm=True, form=form, **steps)
            for got, want in ((o, want_o), (s, want_s)):
                assert_close(got, want, backend, rtol=1e-10, atol=1e-10 * np.abs(want).max())


@pytest.mark.jax_subset()
@pytest.mark.parametrize("name", sorted(FNS))
def test_groups_of_chunks_are_the_whole_batch(backend, name, monkeypatch):
    # The chunk form batches groups of chunks (GROUP_ELEMENTS); one chunk per group,
    # three per group (a short last group) and all at once compute the same function.
    from attn_ref.recurrent import decay, delta

    (qh, kh, vh), steps_h, s0h = _host_inputs(name, 70)
    want_o, want_s = _plain(name, qh, kh, vh, steps_h, s0h)
    q, k, v, s0 = (from_numpy(a, backend) for a in (qh, kh, vh, s0h))
    steps = _to(backend, steps_h)
    per_chunk = math.prod(BATCH) * 8 * max(8, DK + DV)
    # On JAX (eager: every operation compiled at each new shape, one chunk a group the
    # most shapes) three a group still joins several groups' outputs without writes.
    for chunks in ((3, 1000) if backend.name == "jax" else (1, 3, 1000)):
        monkeypatch.setattr(decay, "GROUP_ELEMENTS", chunks * per_chunk)
        monkeypatch.setattr(delta, "GROUP_ELEMENTS", chunks * per_chunk)
        o, s = FNS[name](q, k, v, initial_state=s0, output_final_state=True, chunk_size=8, **steps)
        for got, want in ((o, want_o), (s, want_s)):
            assert_close(got, want, backend, rtol=1e-10, atol=1e-10 * np.abs(want).max())


def test_per_key_scores_are_the_pairwise_sum(backend):
    # decayed_scores halves each block and factors the lower-left one through a
    # reference point; it must be the pairwise sum_e q_ie k_je exp(b_ie - b_je), and
    # finite where the pairwise exponents span far more than float32's range.
    from attn_ref.recurrent.common import decayed_scores

    scores = functools.partial(decayed_scores, backend.xp)
    if backend.name == "jax":
        # one compilation per block size and dtype instead of one per operation and
        # shape of the recursion (326 op-by-op compilations, 13 of the test's 23 s)
        scores = jit(scores)
    rng = np.random.default_rng(3)
    for c in (1, 2, 7, 16, 24):
        q, k = rng.standard_normal((2, c, DK)), rng.standard_normal((2, c, DK))
        b = np.cumsum(-20 * rng.random((2, c, DK)), axis=-2)  # up to -20 a step: exp(-480)
        want = np.einsum("...ie,...je,...ije->...ij", q, k,
                         np.exp(np.minimum(b[..., :, None, :] - b[..., None, :, :], 0)))
        want = want * np.tril(np.ones((c, c)))
        for dtype in ("float64", "float32"):
            got = scores(*(from_numpy(x, backend, dtype) for x in (q, k, b)))
            tol = 1e-12 if dtype == "float64" else 1e-5
            assert_close(got, want, backend, dtype=dtype, rtol=tol, atol=tol)


# ---------------------------------------------------------- state in, state out, varlen


@pytest.mark.parametrize("name", sorted(FNS))
def test_final_state_continues_the_sequence(backend, name):
    T, cut = 33, 17
    (qh, kh, vh), steps_h, s0h = _host_inputs(name, T)
    q, k, v, s0 = (from_numpy(a, backend) for a in (qh, kh, vh, s0h))
    steps = _to(backend, steps_h)
    fn = FNS[name]

    def part(x, a, b):
        return x if not hasattr(x, "shape") else x[..., a:b] if x.ndim == 3 else x[..., a:b, :]

    o, s = call(backend, fn, q, k, v, initial_state=s0, output_final_state=True, chunk_size=8,
                **steps)
    first = {n: part(x, 0, cut) for n, x in steps.items()}
    second = {n: part(x, cut, T) for n, x in steps.items()}
    o1, s1 = call(backend, fn, q[..., :cut, :], k[..., :cut, :], v[..., :cut, :],
                  initial_state=s0, output_final_state=True, chunk_size=8, **first)
    o2, s2 = call(backend, fn, q[..., cut:, :], k[..., cut:, :], v[..., cut:, :],
                  initial_state=s1, output_final_state=True, chunk_size=8, **second)
    assert_close(o1, host(o)[..., :cut, :], backend, rtol=1e-12, atol=1e-12)
    assert_close(o2, host(o)[..., cut:, :], backend, rtol=1e-12, atol=1e-12)
    assert_close(s2, host(s), backend, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", sorted(FNS))
def test_packed_sequences_are_separate_calls(backend, name):
    cu = (0, 5, 22, 23, 40)
    T, H = cu[-1], 3
    (qh, kh, vh), steps_h, _ = _host_inputs(name, T, batch=(1, H))
    s0h = np.random.default_rng(9).standard_normal((len(cu) - 1, H, DK, DV))
    q, k, v, s0 = (from_numpy(a, backend) for a in (qh, kh, vh, s0h))
    for form in ("chunk",) if backend.name == "jax" else _forms(backend, T):
        o, s = call(backend, FNS[name], q, k, v, initial_state=s0, output_final_state=True,
                    cu_seqlens=cu, form=form, chunk_size=4, **_to(backend, steps_h))
        for i, (a, b) in enumerate(zip(cu, cu[1:])):
            sl = {n: (x[..., a:b] if x.ndim == 3 else x[..., a:b, :]) if hasattr(x, "shape")
                  else x for n, x in steps_h.items()}
            want_o, want_s = _plain(name, qh[..., a:b, :], kh[..., a:b, :], vh[..., a:b, :], sl,
                                    s0h[i:i + 1])
            assert_close(o[..., a:b, :], want_o, backend, rtol=1e-10, atol=1e-10)
            assert_close(s[i:i + 1, ...], want_s, backend, rtol=1e-10, atol=1e-10)


def test_cu_seqlens_may_be_an_integer_array():
    (qh, kh, vh), steps, _ = _host_inputs("gla", 12, batch=(1, 2))
    a = gated_linear_attention(qh, kh, vh, cu_seqlens=np.asarray([0, 7, 12]), **steps)
    b = gated_linear_attention(qh, kh, vh, cu_seqlens=[0, 7, 12], **steps)
    np.testing.assert_array_equal(a, b)
    # and it is not the unpacked call: the state restarts at 7
    c = gated_linear_attention(qh, kh, vh, **steps)
    assert np.allclose(a[..., :7, :], c[..., :7, :]) and not np.allclose(a, c)


# ------------------------------------------------------------------------------ limits


def test_retention_gamma_to_zero_sees_only_the_current_token(backend):
    (qh, kh, vh), _, _ = _host_inputs("retention", 15)
    q, k, v = (from_numpy(a, backend) for a in (qh, kh, vh))
    want = np.sum(qh * kh, axis=-1, keepdims=True) / math.sqrt(DK) * vh
    for form in ("recurrent", "parallel", "chunk"):
        got = call(backend, retention, q, k, v, gamma=1e-30, form=form, chunk_size=4)
        assert_close(got, want, backend, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["retention", "gla", "ssd"])
def test_no_decay_is_causal_linear_attention(backend, name):
    (qh, kh, vh), steps_h, _ = _host_inputs(name, 17)
    steps_h = {"gamma": 1.0} if name == "retention" else {n: 0 * x for n, x in steps_h.items()}
    q, k, v = (from_numpy(a, backend) for a in (qh, kh, vh))
    # identity feature map, no normalisation, the scale folded into the queries
    want = host(call(backend, linear_from_features, q / math.sqrt(DK), k, v, causal=True,
                     normalize=False))
    got = call(backend, FNS[name], q, k, v, chunk_size=4, **_to(backend, steps_h))
    assert_close(got, want, backend, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet"])
def test_beta_zero_leaves_the_state_alone(backend, name):
    (qh, kh, vh), steps_h, s0h = _host_inputs(name, 17)
    steps_h["beta"] = 0 * steps_h["beta"]
    q, k, v, s0 = (from_numpy(a, backend) for a in (qh, kh, vh, s0h))
    for form in ("chunk",) if backend.name == "jax" else _forms(backend, 17):
        o, s = call(backend, FNS[name], q, k, v, initial_state=s0, output_final_state=True,
                    form=form, chunk_size=4, **_to(backend, steps_h))
        # only the gate acts: S_t = exp(b_t) S_0
        decay = np.exp(np.cumsum(steps_h.get("g", np.zeros(BATCH + (17,))), axis=-1))
        want_o = decay[..., None] * np.einsum("...tc,...ce->...te", qh, s0h) / math.sqrt(DK)
        assert_close(o, want_o, backend, rtol=1e-12, atol=1e-12)
        assert_close(s, decay[..., -1, None, None] * s0h, backend, rtol=1e-12, atol=1e-12)


def test_delta_rule_with_orthonormal_keys_stores_the_values(backend):
    # beta = 1 and orthonormal keys: each write replaces the prediction for its key by
    # the value exactly, and no write disturbs another key.
    rng = np.random.default_rng(3)
    kh = np.linalg.qr(rng.standard_normal((DK, DK)))[0].T  # rows orthonormal
    vh = rng.standard_normal((DK, DV))
    k, v = from_numpy(kh, backend), from_numpy(vh, backend)
    beta = from_numpy(np.ones(DK), backend)
    for form in ("recurrent", "parallel", "chunk"):
        o, s = call(backend, delta_rule, k, k, v, beta=beta, output_final_state=True, form=form,
                    chunk_size=3, scale=1.0)
        assert_close(s, kh.T @ vh, backend, rtol=1e-12, atol=1e-12)
        assert_close(k @ s, vh, backend, rtol=1e-12, atol=1e-12)  # k_t S_T = v_t
        assert_close(o, vh, backend, rtol=1e-12, atol=1e-12)  # q_t = k_t reads its own value


# ------------------------------------------------------------------- numerics


@pytest.mark.jax_subset()
@pytest.mark.parametrize("name", ["gla", "ssd", "gated_deltanet"])
def test_long_sequence_with_strong_decay_stays_finite(backend, name):
    # T = 4096 steps of g = -5: b_T = -20480, exp(-b_T) overflows every float type; the
    # forms never form it. With this decay the output is the current token's term. JAX
    # runs each form under jit: one compilation each (eagerly, every operation compiled
    # for each new block shape took 9 s at T = 256).
    T = 4096
    rng = np.random.default_rng(2)
    qh, kh = rng.standard_normal((T, 2)), rng.standard_normal((T, 2))
    kh = kh / np.linalg.norm(kh, axis=-1, keepdims=True)
    vh = rng.standard_normal((T, 2))
    steps = {"g": np.full((T, 2) if name == "gla" else (T,), -5.0)}
    if name == "gated_deltanet":
        steps["beta"] = np.full((T,), 0.5)
    want = _plain(name, qh, kh, vh, steps, None)[0]
    q, k, v = (from_numpy(a, backend, "float32") for a in (qh, kh, vh))
    st = _to(backend, steps, "float32")
    # the delta rule's parallel form solves a T x T system: checked at T = 1024
    forms = ("chunk",) if name == "gated_deltanet" else ("chunk", "parallel")
    for form in forms:
        fn = functools.partial(FNS[name], form=form)
        n = T
        if backend.name == "jax":
            fn = jit(fn)
            # XLA unrolls the parallel form's 64 row blocks of T = 4096 (16.6 s to
            # compile); 8 blocks of 64 rows (b_512 = -2560, past float64's exp) are the
            # same code, compiled in 1.3 s.
            n = 512 if form == "parallel" else T
        got = fn(q[:n, :], k[:n, :], v[:n, :], **{s: x[:n, ...] for s, x in st.items()})
        assert np.all(np.isfinite(host(got))), f"{form}: non-finite values"
        assert_close(got, want[:n], backend, dtype="float32", rtol=1e-5, atol=1e-5)
    if name == "gated_deltanet":
        n = min(T, 1024)
        sub = {s: x[:n, ...] for s, x in st.items()}
        got = gated_delta_rule(q[:n, :], k[:n, :], v[:n, :], form="parallel", **sub)
        assert_close(got, want[:n], backend, dtype="float32", rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(FNS))
def test_float16_inputs_accumulate_in_float32(backend, name):
    if not hasattr(backend.xp, "float16"):
        pytest.skip("array_api_strict has no float16")
    T = 200
    (qh, kh, vh), steps_h, s0h = _host_inputs(name, T, batch=(2,))
    if name == "retention":
        steps_h["gamma"] = 1.0 - 2.0 ** -8  # a long memory: many terms add up
    q, k, v = (from_numpy(a, backend, "float16") for a in (qh, kh, vh))
    steps = _to(backend, steps_h, "float16")
    # On JAX chunks of 16: the working dtype does not depend on the chunk size, and XLA
    # compiles the delta rule's 64 x 64 in-chunk solve for 5 s, a 16 x 16 one in 2 s.
    chunk = 16 if backend.name == "jax" else 64
    o, s = call(backend, FNS[name], q, k, v, output_final_state=True, chunk_size=chunk, **steps)
    assert str(o.dtype).endswith("float16") and str(s.dtype).endswith("float32")
    # The plain loop in float64 on the float16 values: only the final rounding of o to
    # float16 and float32 rounding inside may separate them.
    rounded = {n: host(x) if hasattr(x, "shape") else x for n, x in steps.items()}
    want_o, want_s = _plain(name, host(q), host(k), host(v), rounded, None)
    np.testing.assert_allclose(host(o), want_o, rtol=0, atol=2 * EPS["float16"] * np.abs(want_o).max())
    np.testing.assert_allclose(host(s), want_s, rtol=0, atol=64 * EPS["float32"] * np.abs(want_s).max())


def test_working_dtype():
    import array_api_strict as xps

    assert working_dtype(np, np.float16) == np.float32
    assert working_dtype(np, np.float64) == np.float64
    assert working_dtype(xps, xps.float32) == xps.float32


# ------------------------------------------------------------------------- bad input


def _small(name, T=6):
    (q, k, v), steps, s0 = _host_inputs(name, T, batch=(1, 2))
    return q, k, v, steps, s0


@pytest.mark.parametrize("name", sorted(FNS))
def test_bad_inputs_are_named(name):
    q, k, v, steps, s0 = _small(name)
    fn = FNS[name]
    with pytest.raises(ValueError, match=r"causal by construction.*causal=False"):
        fn(q, k, v, causal=False, **steps)
    with pytest.raises(ValueError, match=r"form must be one of .*'blocked'"):
        fn(q, k, v, form="blocked", **steps)
    with pytest.raises(ValueError, match=r"initial_state must have shape .*\(1, 2, 4, 3\).*\(1, 2, 3, 4\)"):
        fn(q, k, v, initial_state=np.zeros((1, 2, DV, DK)), **steps)
    with pytest.raises(ValueError, match=r"cu_seqlens must be strictly increasing.*\[0, 4, 4, 6\]"):
        fn(q, k, v, cu_seqlens=[0, 4, 4, 6], **steps)
    with pytest.raises(ValueError, match=r"cu_seqlens must start at 0 and end at T=6.*\[0, 4, 5\]"):
        fn(q, k, v, cu_seqlens=[0, 4, 5], **steps)
    with pytest.raises(ValueError, match=r"initial_state must have shape \(n_seq, \*rest, dk, dv\) "
                                         r"= \(2, 2, 4, 3\).*\(1, 2, 4, 3\)"):
        fn(q, k, v, cu_seqlens=[0, 4, 6], initial_state=s0, **steps)
    with pytest.raises(ValueError, match=r"packing axis of size 1.*\(2, 2\)"):
        q2 = np.concatenate([q, q]), np.concatenate([k, k]), np.concatenate([v, v])
        fn(*q2, cu_seqlens=[0, 6], **steps)
    with pytest.raises(ValueError, match=r"Nq == Nk"):
        fn(q[..., :3, :], k, v, **steps)
    for arg, x in steps.items():
        if not hasattr(x, "shape"):
            continue
        bad = {**steps, arg: x[..., :-1, :] if x.shape[-1] == DK and x.ndim == 4 else x[..., :-1]}
        with pytest.raises(ValueError, match=rf"{arg} must have shape .*got shape"):
            fn(q, k, v, **bad)
        with pytest.raises(TypeError, match=rf"{arg} must have a real floating dtype"):
            fn(q, k, v, **{**steps, arg: np.zeros(x.shape, dtype=np.int64)})


def test_gamma_is_a_decay():
    q, k, v, _, _ = _small("retention")
    for bad in (0.0, 1.5, -0.2):
        with pytest.raises(ValueError, match=rf"gamma must be a decay in \(0, 1\], got gamma={bad}"):
            retention(q, k, v, gamma=bad)
    with pytest.raises(TypeError, match="gamma must be a decay"):
        retention(q, k, v, gamma="0.9")
    with pytest.raises(ValueError, match=r"gamma must be .* \(1, 2\).*got shape \(3,\)"):
        retention(q, k, v, gamma=np.full(3, 0.9))


def test_per_head_gamma_is_per_head():
    q, k, v, _, _ = _small("retention")
    gam = np.asarray([0.5, 0.9])
    both = retention(q, k, v, gamma=gam)
    for h in range(2):
        one = retention(q[:, h], k[:, h], v[:, h], gamma=float(gam[h]))
        np.testing.assert_allclose(both[:, h], one, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("name", sorted(FNS))
def test_inputs_are_not_modified(backend, name):
    if backend.name == "jax":
        pytest.skip("JAX arrays are immutable")
    (qh, kh, vh), steps_h, s0h = _host_inputs(name, 9)
    arrays = [from_numpy(a, backend) for a in (qh, kh, vh, s0h)]
    steps = _to(backend, steps_h)
    before = [host(a) for a in arrays] + [host(x) for x in steps.values() if hasattr(x, "shape")]
    for form in ("recurrent", "parallel", "chunk"):
        FNS[name](*arrays[:3], initial_state=arrays[3], output_final_state=True, form=form,
                  chunk_size=4, **steps)
    after = [host(a) for a in arrays] + [host(x) for x in steps.values() if hasattr(x, "shape")]
    for b, a in zip(before, after):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------- calibration against fla
# flash-linear-attention's naive PyTorch references (fla-core 0.6.0, installed with
# --no-deps by .ci/run): loaded from their files, never through `import fla`, whose
# __init__ needs triton. Every convention of theirs is a keyword here (layout by
# transposes, scale, per-head gamma, initial state), never a tolerance.


def _fla_naive(family):
    """``fla/ops/<family>/naive.py`` as a module, or a skip naming what is missing."""
    try:
        return fla_naive_module(family)
    except ImportError as exc:
        pytest.skip(str(exc))


def _fla_case(name, seed, dtype):
    """Inputs drawn as fla's tests draw them, host float64 rounded to ``dtype``."""
    rng = np.random.default_rng(100 + seed)
    B, H, T, K, V = 2, 3, 45, 16, 8
    q, k = rng.standard_normal((B, H, T, K)), rng.standard_normal((B, H, T, K))
    v = rng.standard_normal((B, H, T, V))
    steps = {}
    if name == "gla":
        steps["g"] = _logsigmoid(rng.standard_normal((B, H, T, K)))
    if name in ("ssd", "gated_deltanet"):
        steps["g"] = _logsigmoid(rng.standard_normal((B, H, T)))
    if name in ("deltanet", "gated_deltanet"):
        steps["beta"] = 1 / (1 + np.exp(-rng.standard_normal((B, H, T))))
        k = k / np.linalg.norm(k, axis=-1, keepdims=True)  # fla's tests: F.normalize(k)
    s0 = rng.standard_normal((B, H, K, V))
    cast = {"float32": np.float32, "float64": np.float64}[dtype]
    rounded = {n: x.astype(cast).astype(np.float64) for n, x in steps.items()}
    return [x.astype(cast).astype(np.float64) for x in (q, k, v, s0)], rounded


def _run_fla(name, q, k, v, s0, steps, dtype):
    """fla's naive reference on these inputs: ``(o, S_T)`` as float64 NumPy, our layout."""
    import torch

    tdt = {"float32": torch.float32, "float64": torch.float64}[dtype]

    def t(x, bthk=False):  # (B, H, T, ...) -> fla's [B, T, H, ...] where it wants it
        x = torch.from_numpy(np.ascontiguousarray(x)).to(tdt)
        return x.transpose(1, 2) if bthk else x

    def back(o, bthk=False):
        o = o.transpose(1, 2) if bthk else o
        return o.detach().double().numpy()

    if name == "retention":  # [B, H, T, K], gamma_h = 1 - 2^(-5 - h), no state
        o = _fla_naive("retention").naive_retention(t(q), t(k), t(v))
        return back(o), None
    if name == "gla":
        o, s = _fla_naive("gla").naive_recurrent_gla(
            t(q, 1), t(k, 1), t(v, 1), t(steps["g"], 1), initial_state=t(s0),
            output_final_state=True)
        return back(o, 1), back(s)
    if name == "ssd":
        o, s = _fla_naive("simple_gla").naive_recurrent_simple_gla(
            t(q, 1), t(k, 1), t(v, 1), t(steps["g"], 1), initial_state=t(s0),
            output_final_state=True)
        return back(o, 1), back(s)
    if name == "deltanet":  # [B, H, T, K]
        o, s = _fla_naive("delta_rule").delta_rule_recurrence(
            t(q), t(k), t(v), t(steps["beta"]), initial_state=t(s0), output_final_state=True)
        return back(o), back(s)
    o, s = _fla_naive("gated_delta_rule").naive_recurrent_gated_delta_rule(
        t(q, 1), t(k, 1), t(v, 1), t(steps["beta"], 1), t(steps["g"], 1), initial_state=t(s0),
        output_final_state=True)
    return back(o, 1), back(s)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FNS))
def test_fla_naive_references_are_the_same_function(name):
    # fla's naive forms compute in float32 whatever the input dtype (`.float()`), so both
    # input dtypes are judged by a float32 bound: a sum of n terms computed in any order
    # is within n * eps32 * sum|terms| of the exact one (Higham's gamma_n), with n the
    # T * dk products each output adds up, and sum|terms| = (|W| |V|)_i + |q_i| |S_0|
    # from the implied matrix of the float64 reference. A convention difference
    # (scale, layout, gamma) would miss it by O(1), not by rounding.
    from attn_ref.registry import get

    for dtype in ("float32", "float64"):
        for seed in range(20):
            (q, k, v, s0), steps = _fla_case(name, seed, dtype)
            if name == "retention":
                steps, s0 = {"gamma": 1 - 2.0 ** (-5.0 - np.arange(q.shape[1]))}, None
            want_o, want_s = _run_fla(name, q, k, v, s0, steps, dtype)
            got_o, got_s = FNS[name](q, k, v, initial_state=s0, output_final_state=True,
                                     form="recurrent", **steps)
            T, dk = q.shape[-2], q.shape[-1]
            w = get(name).weights(q, k, **steps)
            mag = np.abs(w) @ np.abs(v)
            if s0 is not None:
                mag = mag + np.abs(q) @ np.abs(s0) / math.sqrt(dk)
            bound = T * dk * EPS["float32"] * mag
            err = np.abs(got_o - want_o)
            assert np.all(err <= bound), (
                f"{name} {dtype} seed {seed}: |ours - fla| {err.max():.3g} exceeds the float32 "
                f"summation bound at {np.unravel_index(np.argmax(err - bound), err.shape)}")
            # and not only by the bound's slack: the bulk agrees to float32 rounding
            assert np.median(err) <= 64 * EPS["float32"] * np.median(mag), (name, dtype, seed)
            if want_s is not None:
                np.testing.assert_allclose(got_s, want_s, rtol=0, atol=T * dk * EPS["float32"]
                                           * np.abs(want_s).max() + 1e-30)



def test_unit_triangular_solve_is_the_solve(backend):
    # The UT transform's triangular solve (halving into GEMMs) against LAPACK's general
    # solve, for even and odd sizes; a wrong block (C x1 left out, A for D) would not agree.
    from attn_ref.recurrent.common import forward_substitution

    rng = np.random.default_rng(4)
    for c in (1, 2, 5, 8, 13, 16):
        m = np.tril(0.5 * rng.standard_normal((2, 3, c, c)), -1) + np.eye(c)
        rhs = rng.standard_normal((2, 3, c, 5))
        want = np.linalg.solve(m, rhs)
        xm, xr = from_numpy(m, backend), from_numpy(rhs, backend)
        assert_close(forward_substitution(backend.xp, xm, xr), want, backend, rtol=1e-12, atol=1e-12)

def test_chunk_states_scan_is_the_loop(backend):
    # The hand-over both ways (the loop eager arrays run, the log-depth scan lazy graphs
    # run) against a plain host loop: chunk counts that are and are not powers of two,
    # per-key, scalar and one shared decay. A scan step folding in the wrong chunk (i - m
    # off by one) or a D_i not composed would not agree.
    from attn_ref.recurrent.common import chunk_states

    states = functools.partial(chunk_states, backend.xp)
    if backend.name == "jax":
        # one compilation per shape and path instead of one per operation and shape of
        # the loop and the scan (eagerly 7.6 s of compilations)
        states = jit(states, static_argnames="scan")
    rng = np.random.default_rng(5)
    for n in (1, 2, 3, 5, 8, 9):
        for e, nd in ((3, n), (1, n), (1, 1)):
            decay = np.exp(-rng.uniform(0, 2, (2, nd, e, 1)))
            inc, s0 = rng.standard_normal((2, n, 3, 4)), rng.standard_normal((2, 3, 4))
            want, s = [], s0
            for i in range(n):
                want.append(s)
                s = decay[:, i if nd > 1 else 0] * s + inc[:, i]
            args = [from_numpy(a, backend) for a in (decay, inc, s0)]
            for scan in (False, True):
                got, final = states(*args, scan=scan)
                assert_close(got, np.stack(want, axis=1), backend, rtol=1e-12, atol=1e-12)
                assert_close(final, s, backend, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", sorted(FNS))
def test_chunk_form_under_jit_over_many_chunks(name):
    # Under jax.jit the chunk forms hand the state over by a scan over all chunks (the
    # decay family's common.chunk_states, the delta rule's composed affine maps): 12
    # chunks, with an initial state, against the token loop.
    jax = pytest.importorskip("jax")
    from conformance import backends as B

    backend = B.load("jax")
    (qh, kh, vh), steps_h, s0h = _host_inputs(name, 24, batch=(2,))
    want_o, want_s = _plain(name, qh, kh, vh, steps_h, s0h)
    q, k, v, s0 = (from_numpy(a, backend) for a in (qh, kh, vh, s0h))
    steps = _to(backend, steps_h)
    arrays = {n: x for n, x in steps.items() if not isinstance(x, float)}
    rest = {n: x for n, x in steps.items() if isinstance(x, float)}
    run = jax.jit(lambda q, k, v, s0, a: FNS[name](q, k, v, initial_state=s0, chunk_size=2,
                                                   output_final_state=True, **a, **rest))
    o, s = run(q, k, v, s0, arrays)
    for got, want in ((o, want_o), (s, want_s)):
        assert_close(got, want, backend, rtol=1e-10, atol=1e-10 * np.abs(want).max())


def test_compiled_hand_over_grows_linearly_with_the_chunks():
    # The hand-over written as a Python loop, S <- exp(B) S + dS, is an elementwise chain
    # that XLA's CPU fusion copies into every fusion reading one of its states: the
    # compiled HLO then holds about n^2 / 2 multiplies for n chunks (GLA at T = 1000,
    # 62 chunks: 2049), and compile time follows. Four times the chunks may add at most
    # one multiply per added chunk here (the loop adds 496: 8 -> 32 chunks of 2).
    jax = pytest.importorskip("jax")
    import re

    from conformance import backends as B

    backend = B.load("jax")
    counts = []
    for T in (16, 64):
        (qh, kh, vh), steps_h, _ = _host_inputs("gla", T, batch=(1,))
        args = [from_numpy(a, backend, "float32") for a in (qh, kh, vh)]
        steps = _to(backend, steps_h, "float32")
        hlo = jax.jit(lambda q, k, v, a: gated_linear_attention(q, k, v, chunk_size=2, **a)).lower(
            *args, steps).compile().as_text()
        counts.append(len(re.findall(r"= \S+ multiply\(", hlo)))
    assert counts[1] - counts[0] <= 32 - 8, counts


# ------------------------------------------------------------------------- asv cases


@pytest.mark.parametrize("name", sorted(FNS))
def test_asv_recurrent_cases_run(name):
    # asv_benches/recurrent.py's cases at T = 256 (a quarter of its smallest: the code
    # path is the same, the test a sixteenth of the cost): the forward with the
    # benchmark configuration is the function (another chunking of it agrees), and the
    # chunked backward returns every gradient, finite.
    from asv_benches import recurrent as bench

    t = 256
    fwd = bench.RecurrentForward()
    fwd.setup(name, t, 128)
    out = fwd.run()
    assert out.shape == (8, t, 128) and out.dtype == np.float32
    other = fwd.variant.fn(fwd.q, fwd.k, fwd.v, **dict(fwd.kwargs, chunk_size=16))
    np.testing.assert_allclose(out, other, rtol=2e-3, atol=2e-3 * np.abs(other).max())
    bwd = bench.RecurrentBackward()
    bwd.setup(name, t)
    grads = bwd.run()
    assert {"q", "k", "v"} <= set(grads)
    for n, g in grads.items():
        assert g.dtype == np.float32 and np.isfinite(g).all(), n


def test_retention_roofline_counts_its_decay_matrix_once():
    # Retention's decay is the same at every step, so the chunk form computes its C x C
    # decay matrix once per head: the roofline's exponentials do not grow with T, while
    # SSD's (a data-dependent decay per step) grow as T log2 C (halved through
    # reference points).
    from asv_benches.costs import variant_work

    def exps(name, T):
        return variant_work(name, T, {"chunk_size": 64}, d=64, heads=1).transcendentals

    assert exps("retention", 4096) == exps("retention", 16384) == 64 * 64 / 2 + 2 * 64
    assert exps("ssd", 16384) == 16384 * math.log2(64) + 2 * 16384


# ------------------------------------------------- the chunk forms' kernels (performance)


def test_unit_lower_inverse_reads_only_the_strict_lower_part(backend):
    # The UT transform's (I + L)^{-1} by doubling against LAPACK's inverse, for sizes that
    # are and are not powers of two (padded), with a diagonal and an upper triangle full
    # of other values that must not be read. A level that swapped A^{-1} and D^{-1},
    # dropped the sign, or read C from the wrong block would not agree.
    from attn_ref.recurrent.common import unit_lower_inverse

    rng = np.random.default_rng(6)
    for c in (1, 2, 3, 5, 8, 13, 16, 64):
        m = 0.3 * rng.standard_normal((2, 3, c, c))
        want = np.linalg.inv(np.tril(m, -1) + np.eye(c))
        got = call(backend, unit_lower_inverse, backend.xp, from_numpy(m, backend))
        assert_close(got, want, backend, rtol=1e-12, atol=1e-12 * np.abs(want).max())


def test_scalar_decay_in_place_is_the_pairwise_decay(backend):
    # The scalar decay multiplied into scores in place, blocks over 64 steps halved
    # through reference points, against the pairwise masked exp(b_i - b_j) on the host:
    # leaves, odd halves, several levels; decays strong enough that exp(b_j - b_i) would
    # overflow float32 and float64 (sums down to -3000), which must stay finite.
    from attn_ref._common import owned_writeable
    from attn_ref.recurrent.common import scalar_decay_in_place

    rng = np.random.default_rng(7)
    for c in (1, 64, 65, 100, 128, 256):
        s = rng.standard_normal((2, c, c))
        b = np.cumsum(-rng.uniform(0, 12, (2, c, 1)), axis=-2)
        for dtype in ("float64", "float32"):
            # against the pairwise decay of the b it is given (rounded to float32, b_i -
            # b_j near -3000 carries float32's absolute error of 2^-13: that is b's, not
            # this function's)
            bd = b.astype(dtype).astype(np.float64)
            want = s * np.where(np.tril(np.ones((c, c))) > 0,
                                np.exp(np.minimum(bd - np.swapaxes(bd, -1, -2), 0)), 0)
            xs = from_numpy(s.copy(), backend, dtype)  # it may share s's memory: written
            if not owned_writeable(xs):  # the chunk forms call it on writeable arrays only
                assert backend.name == "jax", f"{backend.name} arrays should be writeable"
                pytest.skip("JAX arrays are immutable")
            got = scalar_decay_in_place(backend.xp, xs, from_numpy(bd, backend, dtype))
            tol = 1e-12 if dtype == "float64" else 1e-5
            assert_close(got, want, backend, dtype=dtype, rtol=tol, atol=tol)


def test_row_major_transpose_is_a_copy(backend):
    # The chunk forms scale this copy of K^T in place: it must hold the transpose and
    # share no memory with the input (else the caller's k would be scaled).
    import array_api_compat

    from attn_ref.recurrent.common import row_major_transpose

    x = np.arange(24.0).reshape(2, 3, 4)
    xb = from_numpy(x, backend)
    t = row_major_transpose(backend.xp, xb)
    assert_close(t, np.swapaxes(x, -1, -2), backend, rtol=0, atol=0)
    if array_api_compat.is_writeable_array(t):
        t *= 0
        assert_close(xb, x, backend, rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(FNS))
def test_long_chunks_are_the_token_loop(name):
    # Chunks longer than the 64-step leaves: SSD's block rows (C = 128, 256), the
    # halved decay, the doubling inverse of a 256-step UT transform, a chunk of 200
    # (not a power of two: padded inverse, full-square scores) and a last partial chunk.
    (qh, kh, vh), steps, s0 = _host_inputs(name, 600, batch=(2,))
    steps = {n: (x if np.isscalar(x) else 0.2 * x if n == "g" else x) for n, x in steps.items()}
    want_o, want_s = FNS[name](qh, kh, vh, form="recurrent", initial_state=s0,
                               output_final_state=True, **steps)
    for C in (128, 200, 256):
        o, s = FNS[name](qh, kh, vh, chunk_size=C, initial_state=s0, output_final_state=True,
                         **steps)
        for got, want in ((o, want_o), (s, want_s)):
            np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-11 * np.abs(want).max(),
                                       err_msg=f"chunk_size={C}")


@pytest.mark.parametrize("step", [0.5, 2.0])
def test_gla_chunks_factored_or_halved_are_the_token_loop(backend, step, monkeypatch):
    # GLA's chunk form factors each chunk through a reference point when its decay fits
    # the float range (2 factor_span: 88.7 in float32, 709.8 in float64) and halves it
    # otherwise. Gates of -0.5 a step decay a chunk of 64 by 31.5 (factored in both
    # dtypes); -2 by 126 (float32 halves, float64 factors). Both paths must be the
    # token loop, and the choice must be the one the span allows (the halving is the
    # only caller of decayed_scores here).
    from attn_ref.recurrent import decay

    halved = []
    real = decay.decayed_scores
    monkeypatch.setattr(decay, "decayed_scores", lambda *a, **k: halved.append(1) or real(*a, **k))
    rng = np.random.default_rng(11)
    T = 200  # three chunks of 64 and a partial one
    qh, kh, vh = (rng.standard_normal((2, T, DK)) for _ in range(3))
    gh = -step * (0.5 + rng.random((2, T, DK)))
    s0h = rng.standard_normal((2, DK, DK))
    want_o, want_s = plain.np_recurrent(qh, kh, vh, alpha=np.exp(gh), s0=s0h)
    for dtype in ("float64", "float32"):
        halved.clear()
        q, k, v, g, s0 = (from_numpy(a, backend, dtype) for a in (qh, kh, vh, gh, s0h))
        o, s = call(backend, gated_linear_attention, q, k, v, g=g, initial_state=s0,
                    output_final_state=True, chunk_size=64)
        tol = 1e-11 if dtype == "float64" else 2e-5
        for got, want in ((o, want_o), (s, want_s)):
            assert_close(got, want, backend, dtype=dtype, rtol=tol, atol=tol * np.abs(want).max())
        if backend.name != "jax":  # lazy arrays always halve; eager JAX reads the values
            assert bool(halved) == (dtype == "float32" and step == 2.0), (dtype, step)


def test_decayed_scores_factor_a_block_that_fits(backend):
    # A block whose decay fits 2 span is one GEMM through a midway reference point;
    # wider ones are halved until their blocks fit. Against the pairwise sum on the
    # host, with spans that fit whole (c = 16, about 8), fit after one or two halvings,
    # and span = 0 (always halved).
    from attn_ref.recurrent.common import decayed_scores, factor_span

    rng = np.random.default_rng(5)
    c = 16
    q, k = rng.standard_normal((3, c, DK)), rng.standard_normal((3, c, DK))
    b = np.cumsum(-rng.random((3, c, DK)), axis=-2)
    want = np.einsum("...ie,...je,...ije->...ij", q, k,
                     np.exp(np.minimum(b[..., :, None, :] - b[..., None, :, :], 0)))
    want = want * np.tril(np.ones((c, c)))
    for dtype in ("float64", "float32"):
        tol = 1e-12 if dtype == "float64" else 1e-5
        args = [from_numpy(x, backend, dtype) for x in (q, k, b)]
        assert factor_span(backend.xp, args[0].dtype) > 40
        for span in (None, 4.0, 1.0, 0.0):
            got = call(backend, decayed_scores, backend.xp, *args, span=span)
            assert_close(got, want, backend, dtype=dtype, rtol=tol, atol=tol)


def test_gla_roofline_counts_one_exponential_per_gate():
    # The factored form takes exp(b - r) once per gate element and exp(r), exp(B - r),
    # exp(B) once per chunk and dimension: n d (1 + 3 / C), not the halving's
    # n d log2 C.
    from asv_benches.costs import variant_work

    w = variant_work("gla", 16384, {"chunk_size": 64}, d=64, heads=1)
    assert w.transcendentals == 16384 * 64 * (1 + 3 / 64)
