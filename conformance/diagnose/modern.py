"""Signatures of the features of modern kernels: sliding windows, chunked attention, GQA,
soft-capping, logits in the dtype, ALiBi, varlen batches, the recurrent family's gates,
states and WY correction, and Nystromformer's pseudo-inverse."""

from __future__ import annotations

import numpy as np

from ..features import allowed_matrix, sequence_lengths, window_off_by_one
from ..judging import option_names
from ..tolerance import (
    LOW_PRECISION,
    round_to,
)
from .base import (
    Signature,
    finish,
    fit_factor,
    nearest_output_rounding,
    off_by,
    ref_with,
)

# ---------------------------------------------- features of modern kernels (GQA, window, ...)


def _window_sigs(prep):
    w = prep.kwargs.get("window")
    if w is None:
        return
    for side, new, nonnegative in window_off_by_one(w):
        words = f"the sliding window's {side} extent is off by one (window {new} instead of {tuple(w)})"
        if nonnegative:
            yield words, ref_with(prep, window=new)
            continue
        # extent 0 - 1: the window also hides the query's own position i + Lk - Lq
        lq, lk = sequence_lengths(prep.case, prep.kwargs)
        i, j = np.arange(prep.case.nq)[:, None], np.arange(prep.case.nk)[None, :]
        al = (j <= i + lk - lq - 1) if side == "right" else (j >= i + lk - lq + 1)
        if "mask" in prep.arrays:
            al = np.logical_and(al, prep.arrays["mask"])
        yield words, ref_with(prep, mask=al)
    if w[0] == -1:
        # -1 read as a number: the left bound j >= i + Lk - Lq + 1 (past the query itself)
        lq, lk = sequence_lengths(prep.case, prep.kwargs)
        i, j = np.arange(prep.case.nq)[:, None], np.arange(prep.case.nk)[None, :]
        al = j >= i + lk - lq + 1
        if "mask" in prep.arrays:
            al = np.logical_and(al, prep.arrays["mask"])
        yield ("the window's left side -1 (unbounded) is read as the bound j >= i + Lk - Lq + 1",
               ref_with(prep, mask=al))


def _chunk_sigs(prep):
    """Llama 4's chunked attention done wrong: the chunk size off by one, chunking ignored,
    and chunks placed on other positions than the absolute ones (query ``i`` at
    ``i + Lk - Lq``, chunks counted from key 0 of each sequence)."""
    c = prep.kwargs.get("chunk")
    if c is None:
        return
    for other in (c + 1, c - 1):
        if other >= 1:
            yield f"the chunk size is off by one (chunk {other} instead of {c})", ref_with(prep, chunk=other)
    yield (f"chunking is ignored (chunk {c} declared: every key the other masks allow is attended)",
           ref_with(prep, chunk=None))
    case = prep.case
    lq, lk = sequence_lengths(case, prep.kwargs)
    i, j = np.arange(case.nq)[:, None], np.arange(case.nk)[None, :]
    pos = i + lk - lq  # the queries' absolute positions
    wrong = (
        ("the chunks are measured from the query's own index i instead of its absolute position "
         "i + Lk - Lq (the cache offset left out of the chunk)", i // c == j // c),
        ("the chunks are measured from the last key backwards (the last chunk ends at key Lk - 1) "
         "instead of from position 0", (lk - 1 - pos) // c == (lk - 1 - j) // c),
        ("the chunks are counted from the padded start of a left-padded batch instead of each "
         "sequence's first token (HuggingFace's left_padding correction left out)",
         (pos + case.nk - lk) // c == (j + case.nk - lk) // c),
    )
    for words, al in wrong:
        if "mask" in prep.arrays:
            al = np.logical_and(al, prep.arrays["mask"])
        yield words, ref_with(prep, chunk=None, mask=al)


def _gqa_sigs(prep):
    if not prep.kwargs.get("gqa"):
        return
    a = prep.arrays
    hq, hkv = a["q"].shape[1], a["k"].shape[1]
    g = hq // hkv
    if g > 1 and hkv > 1:
        yield (f"query head h reads key/value head h % Hkv instead of h // (Hq / Hkv) "
               f"(Hq={hq}, Hkv={hkv})",
               ref_with(prep, k=np.tile(a["k"], (1, g, 1, 1)), v=np.tile(a["v"], (1, g, 1, 1)), gqa=None))


def _softcap_sigs(prep):
    c = prep.kwargs.get("softcap")
    if c is None:
        return
    s = prep.scale
    # c' tanh(s' q.k / c') with the reference's (softcap, scale) = (c', s')
    yield "the soft-cap is ignored", ref_with(prep, softcap=None)
    yield "the scale is applied again after the soft-cap", ref_with(prep, softcap=c * s, scale=s * s)
    yield "the soft-cap is applied before the scale", ref_with(prep, softcap=c * s)
    if "bias" in prep.arrays or "alibi_slopes" in prep.arrays:
        yield ("the soft-cap is applied after the bias/ALiBi (it caps the biased logits)",
               _capped_after_bias(prep, c, s))
    yield ("the soft-cap's factor c is dropped: tanh(s q.k / c) instead of c tanh(s q.k / c)",
           _capped_without_factor(prep, c, s))


def eager_softmax(prep, dtype):
    """HuggingFace's ``eager_attention_forward`` on ``dtype`` tensors, emulated on the host.

    The logits are a tensor operation each - ``q.k``, the scale, the soft-cap's divide,
    ``tanh`` and multiply, the bias - rounded to ``dtype`` after every step, then
    ``softmax(..., dtype=torch.float32)``, ``P`` back in ``dtype``, ``P V``. Returns
    ``(output, steps)``, ``steps`` naming the roundings of the logits; None where the
    case has ALiBi or dropout, which that function does not take."""
    a, c = prep.arrays, prep.kwargs.get("softcap")
    if "alibi_slopes" in a or "dropout_mask" in a:
        return None

    def rnd(x):
        return round_to(x, dtype)

    q, k, v = a["q"], a["k"], a["v"]
    if prep.kwargs.get("gqa"):
        k, v = (np.repeat(x, q.shape[1] // k.shape[1], axis=1) for x in (k, v))
    s = rnd(rnd(q @ np.swapaxes(k, -1, -2)) * prep.scale)
    steps = ["q.k", "the scale"]
    if c is not None:
        s = rnd(rnd(np.tanh(rnd(s / c))) * c)
        steps.append("the soft-cap's divide, tanh and multiply")
    if "bias" in a:
        s = rnd(s + a["bias"])
        steps.append("the bias")
    al = allowed_matrix(prep.case, a, prep.kwargs)
    if al is not None:
        s = np.where(al, s, -np.inf)
    # float32 softmax, P rounded to the dtype. Half-dtype logits: the float64 softmax
    # rounded once gives the same P but where a float32 rounding lands on a tie of the
    # dtype. Float64 logits: taken to float32 first, as softmax(..., dtype=float32) does.
    if dtype not in LOW_PRECISION:
        s = s.astype(np.float32)
    m = np.max(s, axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, s.dtype.type(0)))
    den = np.sum(e, axis=-1, keepdims=True)
    p = rnd((e / np.where(den > 0, den, 1)).astype(np.float64))
    return rnd(p @ v), steps


def _logits_in_dtype_sigs(prep):
    """A float16/bfloat16 kernel whose logits are rounded to its dtype after every step
    (:func:`eager_softmax`) before a float32 softmax. The plain implementations of the
    baseline keep the logits in float32 (:func:`attn_ref.softmax.tiles.logit_dtype`);
    with a soft-cap of ``c`` each rounding there is ``c`` times the dtype's epsilon."""
    if prep.dtype not in LOW_PRECISION:
        return
    emulated = eager_softmax(prep, prep.dtype)
    if emulated is not None:
        out, steps = emulated
        yield (f"the logits are rounded to {prep.dtype} after every step ({', '.join(steps)}) "
               f"before a float32 softmax, where a plain implementation keeps them in float32 "
               f"(HuggingFace's eager attention on {prep.dtype} tensors)", out)


def _alibi_paper_slopes(h):
    """The ALiBi paper's slopes for ``h`` heads: those of the power of two ``c`` below it,
    then every other slope of ``2 c`` heads (Press et al.'s code, BLOOM's)."""
    c = 2 ** int(np.floor(np.log2(h)))
    geo = [2.0 ** (-8.0 * np.arange(1, n + 1) / n) for n in (c, 2 * c)]
    return np.concatenate([geo[0], geo[1][0::2][: h - c]])


def _alibi_sigs(prep):
    """ALiBi's other forms: attention-gym's signed distance (FlexAttention's usual
    ``score_mod``), the sign flipped, distances from the top-left corner."""
    slopes = prep.arrays.get("alibi_slopes")
    if slopes is None:
        return
    lq, lk = sequence_lengths(prep.case, prep.kwargs)
    i, j = np.arange(prep.case.nq)[:, None], np.arange(prep.case.nk)[None, :]
    m = np.asarray(slopes, dtype=np.float64).reshape((1, -1, 1, 1))

    def as_bias(add):
        # the ALiBi term replaced by a bias at the same place in the pipeline (after the cap)
        a = {n: x for n, x in prep.arrays.items() if n != "alibi_slopes"}
        a["bias"] = a.get("bias", 0.0) + add
        return prep.reference("float64", arrays=a, kwargs=dict(prep.kwargs))

    yield ("ALiBi as the signed distance + slope (j - i) (attention-gym's generate_alibi_bias, "
           "the usual FlexAttention score_mod: score + slope * (kv_idx - q_idx)), not "
           "-slope |i + Lk - Lq - j|: the same function under a causal mask, another one where "
           "a query sees later keys (it favours them, the farther the more); no option: for "
           "non-causal attention use -slope * abs(q_idx + Lk - Lq - kv_idx)", as_bias(m * (j - i)))
    yield ("ALiBi with the opposite sign (+slope |i + Lk - Lq - j|: distant keys favoured)",
           as_bias(m * np.abs(i + lk - lq - j)))
    h = m.shape[1]
    own = [("the paper's 2^(-8 h / H)", 2.0 ** (-8.0 * np.arange(1, h + 1) / h))]
    if h & (h - 1):
        own.append(("the paper's rule for H not a power of two (BLOOM's build_alibi_tensor)",
                    _alibi_paper_slopes(h)))
    for name, table in own:
        if not np.allclose(table, slopes, rtol=1e-3, atol=0.0):
            a = {**prep.arrays, "alibi_slopes": table}
            yield (f"the alibi_slopes argument ignored: the kernel computes {name} itself "
                   f"instead of the slopes it is given",
                   prep.reference("float64", arrays=a, kwargs=dict(prep.kwargs)))
    if prep.case.nq != prep.case.nk or "seqlens_k" in prep.kwargs or "seqlens_q" in prep.kwargs:
        yield ("ALiBi distances from the top-left corner (-slope |i - j|), not from query i's key "
               "position i + Lk - Lq of its sequence", as_bias(-m * np.abs(i - j)))


def _option_factor_sigs(prep, got):
    """The ALiBi slopes or the soft-cap off by a factor (a slope table or cap constant
    rounded, copied wrong): fitted as the scale is, else named as low precision."""
    slopes, cap = prep.arrays.get("alibi_slopes"), prep.kwargs.get("softcap")
    if slopes is not None:
        def at(a):
            arrays = {**prep.arrays, "alibi_slopes": np.asarray(slopes) * a}
            return finish(prep, prep.reference("float64", arrays=arrays, kwargs=dict(prep.kwargs)))
        fit = fit_factor(prep, got, at)
        if fit is not None:
            yield f"the ALiBi slopes are {off_by(fit[0])} (a factor of {fit[0]:.5g})", fit[1]
    if cap is not None:
        fit = fit_factor(prep, got, lambda a: finish(prep, ref_with(prep, softcap=cap * a)))
        if fit is not None:
            yield (f"the soft-cap is {off_by(fit[0])}: c tanh(s / c) with c = {cap * fit[0]:.6g} "
                   f"where the case's is {cap:.6g}", fit[1])


def _capped_after_bias(prep, c, s):
    """The output of ``c tanh((s q.k + bias + alibi) / c)``: the reference fed, with no
    cap and no slopes, the bias that turns its ``s q.k + bias`` into those logits."""
    a = dict(prep.arrays)
    q, k = a["q"], a["k"]
    if prep.kwargs.get("gqa"):
        k = np.repeat(k, q.shape[1] // k.shape[1], axis=1)
    z = s * (q @ np.swapaxes(k, -1, -2))
    add = a.get("bias", 0.0)
    slopes = a.pop("alibi_slopes", None)
    if slopes is not None:
        lq, lk = sequence_lengths(prep.case, prep.kwargs)
        i, j = np.arange(prep.case.nq)[:, None], np.arange(prep.case.nk)[None, :]
        add = add - np.asarray(slopes, dtype=np.float64).reshape(1, -1, 1, 1) * np.abs(i + lk - lq - j)
    a["bias"] = c * np.tanh((z + add) / c) - z
    kwargs = {n: x for n, x in prep.kwargs.items() if n != "softcap"}
    return prep.reference("float64", arrays=a, kwargs=kwargs)


def _capped_without_factor(prep, c, s):
    """The output of ``tanh(s q.k / c)`` (+ bias, ALiBi): the reference fed, with no cap,
    the bias that turns its ``s q.k`` into those logits."""
    a = dict(prep.arrays)
    q, k = a["q"], a["k"]
    if prep.kwargs.get("gqa"):
        k = np.repeat(k, q.shape[1] // k.shape[1], axis=1)
    z = s * (q @ np.swapaxes(k, -1, -2))
    a["bias"] = a.get("bias", 0.0) + np.tanh(z / c) - z
    kwargs = {n: x for n, x in prep.kwargs.items() if n != "softcap"}
    return prep.reference("float64", arrays=a, kwargs=kwargs)


def _varlen_sigs(prep):
    lq, lk = prep.kwargs.get("seqlens_q"), prep.kwargs.get("seqlens_k")
    if lq is None or lk is None:
        return
    from attn_ref.softmax import varlen_attention

    a = prep.arrays

    def pack(x, lens):
        return np.concatenate([np.swapaxes(x[b, :, :n], 0, 1) for b, n in enumerate(lens)])

    kw = {n: prep.kwargs[n] for n in ("window", "chunk", "softcap") if n in prep.kwargs}
    if "alibi_slopes" in a:
        kw["alibi_slopes"] = a["alibi_slopes"]
    o = varlen_attention(pack(a["q"], lq), pack(a["k"], lk), pack(a["v"], lk),
                         cu_seqlens_q=[0, sum(lq)], cu_seqlens_k=[0, sum(lk)],
                         causal=prep.kwargs.get("causal") or False, scale=prep.scale, **kw)
    out = np.zeros(prep.golden.shape)
    start = 0
    for b, n in enumerate(lq):
        out[b, :, :n] = np.swapaxes(o[start:start + n], 0, 1)
        start += n
    yield "tokens attend across sequence boundaries (the packed batch is one sequence)", out


def _recurrent_sigs(prep):
    """The recurrent family's state mistakes (issue 18): an initial state dropped, packed
    sequences whose state is not restarted at their boundaries, the gate applied after the
    update (the current token decays too), the state reset at every chunk."""
    if prep.variant.family != "recurrent":
        return
    a, kw = prep.arrays, prep.kwargs
    s0, cu = a.get("initial_state"), kw.get("cu_seqlens")
    if s0 is not None:
        arrays = {n: x for n, x in a.items() if n != "initial_state"}
        yield ("the initial state is ignored (the output computed from S_0 = 0)",
               prep.reference("float64", arrays=arrays))
    if cu is not None:
        arrays = dict(a) if s0 is None else {**a, "initial_state": s0[:1]}
        yield ("the state is not reset at the packed sequences' boundaries (cu_seqlens): each "
               "sequence starts from the previous one's state, decay included",
               prep.reference("float64", arrays=arrays,
                              kwargs={n: x for n, x in kw.items() if n != "cu_seqlens"}))
    from ..extras import reference_on

    p = prep.params
    decay = None
    if "gamma" in p:
        gamma = np.asarray(p["gamma"], dtype=np.float64)
        decay = gamma[..., None, None] if gamma.ndim else gamma
    elif "g" in p and "beta" not in p:
        g = np.exp(np.asarray(p["g"], dtype=np.float64))
        decay = g if g.ndim == a["k"].ndim else g[..., None]
    if decay is not None:
        yield ("the gate is applied after the update (S_t = diag(alpha_t) (S_{t-1} + k_t^T v_t): "
               "the current token decays too)",
               prep.reference("float64", arrays={**a, "k": a["k"] * decay}))
    elif "g" in p and "beta" in p:
        # Gated DeltaNet: alpha_t (S_{t-1} - beta_t (S_{t-1} k_t - v_t) k_t^T) is, with
        # S' = alpha_t S_{t-1}, S' - beta_t (S' k_t - alpha_t v_t) k_t^T: the gated delta
        # rule on values alpha_t v_t (an audit's JAX kernel so read "no known mistake")
        alpha = np.exp(np.asarray(p["g"], dtype=np.float64))[..., None]
        yield ("the gate is applied after the delta-rule update (S_t = alpha_t (S_{t-1} - "
               "beta_t (S_{t-1} k_t - v_t) k_t^T): the correction reads the undecayed state and "
               "the write decays too)",
               prep.reference("float64", arrays={**a, "v": a["v"] * alpha}))
    T = prep.case.nq
    segs = list(zip(cu, cu[1:])) if cu is not None else [(0, T)]
    rows = [s0] if cu is None else [None if s0 is None else s0[i:i + 1] for i in range(len(segs))]
    for c in (16, 32, 64):
        if all(hi - lo <= c for lo, hi in segs):
            break
        # each chunk from S = 0 (a sequence's initial state enters its first chunk only)
        out = np.concatenate([reference_on(prep, "float64", c0, min(c0 + c, hi),
                                           s if c0 == lo else None, output=True)
                              for (lo, hi), s in zip(segs, rows) for c0 in range(lo, hi, c)],
                             axis=-2)
        yield f"the state is not carried across chunks of {c} (reset to 0 at each chunk)", out
        # the hand-over decay taken as 0: the state entering a chunk is the previous
        # chunk's own contribution alone (an audit's JAX retention read "the error lives
        # only in the last partial query block")
        parts = []
        for (lo, hi), s in zip(segs, rows):
            for c0 in range(lo, hi, c):
                entering = s if c0 == lo else reference_on(prep, "float64", max(lo, c0 - c), c0,
                                                           None)
                parts.append(reference_on(prep, "float64", c0, min(c0 + c, hi), entering,
                                          output=True))
        yield (f"the state reaches one chunk of {c} back (the decay handed from chunk to chunk "
               f"taken as 0: each chunk starts from the previous chunk's own contribution)",
               np.concatenate(parts, axis=-2))
    # a chunked kernel whose grid covers the full chunks only: each sequence's last partial
    # chunk is never computed and its outputs stay zero. Chunk sizes that cut at the same
    # tokens give one output, named once with every size.
    cuts: dict[tuple, list] = {}
    for c in (16, 32, 64):
        cut = tuple((lo + (hi - lo) // c * c, hi) for lo, hi in segs if (hi - lo) % c)
        if cut:
            cuts.setdefault(cut, []).append(c)
    for cut, sizes in cuts.items():
        out = np.array(prep.reference("float64"), dtype=np.float64)
        for lo, hi in cut:
            out[..., lo:hi, :] = 0.0
        where = ", ".join(f"{lo}..{hi - 1}" for lo, hi in cut)
        yield (f"the last partial chunk of each sequence is dropped (chunks of "
               f"{' or '.join(map(str, sizes))}): the outputs of tokens {where} are zero", out)


def _changed_function_sigs(prep):
    """Another function of the recurrent family, each as a ``prep'`` whose reference
    computes it: mistakes in the log gates (:func:`conformance.extras.gate_mistakes`:
    clipped, or their decays flushed to 0 below a threshold), the delta rule's
    ``qk_l2norm`` taken another way (:func:`conformance.extras.l2norm_conventions`), a
    per-head decay held in a half dtype (:func:`conformance.extras.decays_in_dtype`)."""
    if prep.variant.family != "recurrent":
        return
    from ..extras import decays_in_dtype, gate_mistakes, l2norm_conventions

    for changes in (gate_mistakes, decays_in_dtype, l2norm_conventions):
        for message, changed in changes(prep):
            yield message, changed.reference("float64")


def _rounding_sigs(prep, got):
    """Roundings of the recurrent function the bound does not take
    (:func:`conformance.extras.known_roundings`: decays from running sums over windows
    longer than fla's chunks, ``q`` and ``k`` normalised in a half dtype): the one
    nearest the kernel's output alone (:func:`conformance.diagnose.base.nearest_output_rounding`)."""
    if prep.variant.family != "recurrent":
        return
    near = nearest_output_rounding(prep, got)
    if near is not None:
        yield near


def _wy_sigs(prep):
    """The delta rule's chunk form without the WY correction
    (:func:`conformance.extras.delta_rule_without_wy`), at the chunk sizes of
    :func:`conformance.extras.wy_chunks`."""
    if prep.variant.family != "recurrent" or "beta" not in prep.params:
        return
    from ..extras import without_wy, wy_chunks

    for c in wy_chunks(prep):
        yield (f"the WY correction dropped (chunks of {c}): each chunk writes U = T beta V instead "
               f"of U - W S, its delta-rule corrections computed as if it started from S = 0 "
               f"while its queries read the carried state", without_wy(prep, c)[0])


def _pinv_init_sigs(prep):
    """Nystromformer's pseudo-inverse started from the other convention of ``pinv_init``
    (:func:`attn_ref.reduced.iterative_pinv`): after 6 iterations the start still shows.
    One scale for the whole batch couples its matrices, so only a case with two or more
    (batch entries or heads) tells the two apart."""
    if "pinv_init" not in option_names(prep.variant):
        return
    if prep.options.get("pinv_init", "matrix") == "matrix":
        yield ("the pseudo-inverse started from a batch-global scale (HuggingFace's "
               "init_option='original', lucidrains' nystrom-attention): pass "
               "options={'pinv_init': 'global'}",
               prep.reference("float64", options={**prep.options, "pinv_init": "global"}))
    else:
        yield ("the pseudo-inverse started from a scale per matrix (Razavi et al.'s start, "
               "HuggingFace's init_option other than 'original'), not from the declared "
               "batch-global one: drop options={'pinv_init': 'global'}",
               prep.reference("float64", options={**prep.options, "pinv_init": "matrix"}))


def _pinv_iterations_sigs(prep):
    """Nystromformer's pseudo-inverse iterated once more or once less than declared
    (``pinv_iterations``, 6 by default): a loop bound off by one. Each iteration changes
    ``Z`` by the previous one's residual, so the two counts differ wherever the iteration
    has not converged - at ``m == N`` too, where one more iteration moves the output
    towards exact softmax, HuggingFace's convention there (:func:`_nystrom_exact_sigs`)."""
    if prep.variant.name != "nystrom":
        return
    declared = prep.options.get("pinv_iterations", 6)
    if declared is None:
        return
    for n in (declared - 1, declared + 1):
        if n >= 1:
            yield (f"the pseudo-inverse is iterated {n} times instead of {declared} (a loop "
                   f"bound off by one): pass options={{'pinv_iterations': {n}}} if that is "
                   f"the kernel's count",
                   prep.reference("float64", options={**prep.options, "pinv_iterations": n}))


#: this module's signatures, in the order they are tried (registered by the package)
MODERN = (
    Signature("window", _window_sigs),
    Signature("chunk", _chunk_sigs),
    Signature("gqa", _gqa_sigs),
    Signature("softcap", _softcap_sigs),
    Signature("logits in the dtype", _logits_in_dtype_sigs, exact_only=True),
    Signature("alibi", _alibi_sigs),
    Signature("alibi or soft-cap factor", _option_factor_sigs, needs_output=True, fit=True),
    Signature("varlen", _varlen_sigs),
    Signature("recurrent", _recurrent_sigs),
    Signature("wy", _wy_sigs),
    Signature("changed function", _changed_function_sigs, functional=True),
    Signature("known roundings", _rounding_sigs, needs_output=True, fit=True),
    Signature("pinv init", _pinv_init_sigs),
    Signature("pinv iterations", _pinv_iterations_sigs),
)
