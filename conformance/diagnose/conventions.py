"""Conventions of widely used third-party code: another function than the registered
variant, which a kernel computes on purpose (performer-pytorch's feature floor, the
generalized kernel, efficient attention, window padding, Nystromformer at m = N and
lucidrains' front-padded landmarks, BigBird's and Reformer's in transformers). The
diagnosis names the package and how the function differs, so that a user does not hunt
for a rounding bug (tests/test_conformance_thirdparty.py). Last, the variant's own
choices the other way: another named feature map or kernel, a boolean option flipped -
the options that declare them."""

from __future__ import annotations

import inspect
import math

import numpy as np

from ..extras import boolean_options, flipped_option_words, named_choices
from .base import (
    Signature,
    host_logits,
    softmax_host,
)

# ------------------------------------------- conventions of widely used third-party code
# Each is another function than the registered variant, which the kernel computes on
# purpose: the diagnosis names the package and says how the function differs, so that a
# user does not hunt for a rounding bug (tests/test_conformance_thirdparty.py).


def _host_favor(x, w, over_rows, eps, scale):
    """performer-pytorch's ``softmax_kernel`` (google-research's FAVOR+ code) in float64:
    ``(exp(W x - |x|^2/2 - c) + eps) / sqrt(m)`` of ``x = sqrt(scale) q``, ``c`` the
    maximum of ``W x`` over each row's features (queries) or over every key and feature
    of the batch entry and head (``over_rows``, keys)."""
    x = x * math.sqrt(scale)
    u = x @ w.T
    c = np.max(u, axis=(-1, -2) if over_rows else -1, keepdims=True)
    return (np.exp(u - np.sum(x * x, axis=-1, keepdims=True) / 2 - c) + eps) / math.sqrt(w.shape[0])


#: the feature floors of the FAVOR+ code in use: performer-pytorch's ``softmax_kernel``
#: (1e-4) and google-research's ``numerical_stabilizer`` (1e-6)
FEATURE_FLOORS = (1e-4, 1e-6)


def _favor_floor(eps):
    """performer-pytorch's features in words, up to the source it names (parenthesis open)."""
    return (f"FAVOR+ features floored after the stabiliser, (exp(W x - |x|^2/2 - max W x) + "
            f"{eps:g}) / sqrt(m) (performer-pytorch's softmax_kernel, eps={eps:g}")


def _performer_eps_sigs(prep):
    """FAVOR+ features with a floor added after the stabiliser
    (:func:`attn_ref.performer_attention`'s ``feature_eps``), or without the declared
    one; causal, performer-pytorch's form, which has no option: its key stabiliser is
    taken over every key, and its denominator is ``q . (cumsum k + 1e-6)``."""
    if prep.variant.name != "performer" or prep.options.get("kernel", "positive") != "positive":
        return
    if prep.options.get("stabilize", True) and not prep.options.get("feature_eps", 0.0):
        # exp(W x - |x|^2/2) without max W x subtracted first: the same function in real
        # arithmetic, but every feature of a row of large |x| underflows in float32 (the
        # one-hot case), where the stabilised features do not (a floor is relative to
        # the stabiliser: without one there is none)
        acc = "float64" if prep.dtype == "float64" else "float32"
        yield (f"FAVOR+ features without the stabiliser: exp(W x - |x|^2/2) computed in {acc} "
               f"underflows on rows of large |x|, where the reference subtracts max W x first "
               f"(options={{'stabilize': False}} is that function)",
               prep.reference(acc, options={**prep.options, "stabilize": False}))
    declared = prep.options.get("feature_eps", 0.0)
    causal = prep.kwargs.get("causal") not in (None, False)
    if declared and not causal:
        yield (f"features without the declared floor feature_eps={declared:g} (FAVOR+ as the "
               f"paper defines it): drop options={{'feature_eps': {declared:g}}}",
               prep.reference("float64", options={**prep.options, "feature_eps": 0.0}))
        return
    if not causal:
        for eps in FEATURE_FLOORS:
            yield (f"{_favor_floor(eps)}; google-research's FAVOR+ code): pass "
                   f"options={{'feature_eps': {eps:g}}}",
                   prep.reference("float64", options={**prep.options, "feature_eps": eps}))
        return
    if prep.case.nq != prep.case.nk:
        return
    a, w = prep.arrays, np.asarray(prep.params["projection"], dtype=np.float64)
    for eps in FEATURE_FLOORS:
        fq = _host_favor(a["q"], w, False, eps, prep.scale)
        fk = _host_favor(a["k"], w, True, eps, prep.scale)
        att = np.tril(fq @ np.swapaxes(fk, -1, -2))
        den = np.sum(fq * (np.cumsum(fk, axis=-2) + 1e-6), -1, keepdims=True)
        yield (f"{_favor_floor(eps)}), in its "
               f"causal form: the key stabiliser is the maximum over every key, future ones "
               f"included, and the denominator q . (cumsum k + 1e-6); another function, which "
               f"attn_ref does not define (a later key changes an earlier output)",
               att @ a["v"] / den)


def _generalized_kernel_sigs(prep):
    """performer-pytorch's ``generalized_attention=True``: features ``relu(W x) + 0.001`` of
    ``x = sqrt(scale) q`` (``generalized_kernel``, ``kernel_epsilon=0.001``), normalised
    linear attention on them: a kernel of its own, no estimator of softmax."""
    if prep.variant.name != "performer" or prep.kwargs.get("causal") not in (None, False):
        return
    a, w = prep.arrays, np.asarray(prep.params["projection"], dtype=np.float64)
    root = math.sqrt(prep.scale)
    fq, fk = (np.maximum((a[n] * root) @ w.T, 0.0) + 1e-3 for n in ("q", "k"))
    yield ("features relu(W x) + 0.001 (performer-pytorch's generalized_attention=True, "
           "generalized_kernel): linear attention with a ReLU random-feature kernel, another "
           "function than FAVOR+'s estimate of softmax, not registered in attn_ref",
           (fq @ (np.swapaxes(fk, -1, -2) @ a["v"])) / (fq @ np.sum(fk, axis=-2)[..., None]))


def _efficient_attention_sigs(prep):
    """Shen et al.'s efficient attention, ``softmax_d(Q) softmax_N(K)^T V`` (softmax of
    each query over its features, of the keys over the sequence), as lucidrains'
    linear-attention-transformer computes it (times ``d**-0.5``): no kernel feature map
    of :func:`attn_ref.linear_attention`, so no option of the ``linear`` variant."""
    if prep.variant.family != "linear" or prep.kwargs.get("causal") not in (None, False):
        return
    a = prep.arrays
    eq = np.exp(a["q"] - np.max(a["q"], axis=-1, keepdims=True))
    eq = eq / np.sum(eq, axis=-1, keepdims=True)
    ek = np.exp(a["k"] - np.max(a["k"], axis=-2, keepdims=True))
    ek = ek / np.sum(ek, axis=-2, keepdims=True)
    out = eq @ (np.swapaxes(ek, -1, -2) @ a["v"])
    for factor, words in ((prep.case.d ** -0.5, " times d**-0.5 (linear-attention-transformer's "
                                                 "linear_attn)"), (1.0, "")):
        yield ("efficient attention (Shen et al.): softmax of each query over its features and "
               "of the keys over the sequence, softmax_d(Q) softmax_N(K)^T V" + words + "; not a "
               "feature map of linear attention, which normalises phi(q) . phi(k) by its row "
               "sum: another function, not registered in attn_ref", out * factor)


def _window_padding_sigs(prep):
    """lucidrains' local-attention with ``autopad=True`` and no key mask: the sequence is
    zero-padded to a multiple of the window, and a non-causal window near the end reaches
    zero keys of logit 0 that only a key mask would hide."""
    if prep.variant.name != "local" or prep.kwargs.get("causal") not in (None, False):
        return
    w = prep.kwargs.get("window", prep.options.get("window"))
    n = prep.case.nk
    if not w or n % w == 0 or prep.case.nq != n:
        return
    size = n + (-n % w)
    s = (prep.arrays["q"] @ np.swapaxes(prep.arrays["k"], -1, -2)) * prep.scale
    lead = s.shape[:-2]
    s = np.concatenate([s, np.zeros(lead + (n, size - n))], axis=-1)
    v = prep.arrays["v"]
    v = np.concatenate([v, np.zeros(v.shape[:-2] + (size - n, v.shape[-1]))], axis=-2)
    near = np.abs(np.arange(n)[:, None] - np.arange(size)[None, :]) <= w
    yield (f"the keys are zero-padded from N = {n} to {size} (a multiple of the window, "
           f"{w}) and the padding is attended where a window reaches it (lucidrains' "
           f"local-attention with autopad=True and no key mask: pass mask=)",
           softmax_host(np.where(near, s, -np.inf), v))


def _nystrom_exact_sigs(prep):
    """HuggingFace's ``NystromformerSelfAttention`` computes exact softmax attention when
    ``num_landmarks`` equals the sequence length (its ``segment_means_seq_len``), where the
    reference still runs the iterative pseudo-inverse, which has not converged."""
    if prep.variant.name != "nystrom" or prep.params.get("num_landmarks") != prep.case.nk:
        return
    yield ("exact softmax attention where num_landmarks == N (HuggingFace's "
           "NystromformerSelfAttention skips the Nystrom approximation there; the reference "
           "runs the 6-step iterative pseudo-inverse at every m): declare such cases "
           "unsupported (supports={'cases': ...})", softmax_host(host_logits(prep), prep.arrays["v"]))


def _nystrom_front_padded_sigs(prep):
    """lucidrains' nystrom-attention pads the sequence at the front with zero tokens to a
    multiple ``m l`` of the landmarks (``l = ceil(N / m)``) and takes each landmark as the
    mean of ``l`` consecutive tokens; with its key mask the zero tokens are left out
    (``segments="front-padded"`` of :func:`attn_ref.nystrom_attention`), without it they
    are averaged in and attended as keys of logit 0 (no option: a misuse). The default
    segments are the ``m`` balanced ones; the two agree when ``m`` divides ``N``."""
    if prep.variant.name != "nystrom" or prep.case.nq != prep.case.nk:
        return
    import array_api_compat.numpy as xnp

    from attn_ref.reduced import iterative_pinv

    m, n = prep.params["num_landmarks"], prep.case.nk
    size = -(-n // m)
    pad = m * size - n
    if pad == 0:
        return
    declared = prep.options.get("segments", "balanced")
    if declared == "front-padded":
        yield ("landmarks of m balanced segments (attn_ref's default), not of the declared "
               "front-padded ones: drop options={'segments': 'front-padded'}",
               prep.reference("float64", options={**prep.options, "segments": "balanced"}))
    elif pad < size:
        yield ("landmarks of the sequence zero-padded at the front to a multiple of m, the "
               f"padding masked (lucidrains' nystrom-attention, N = {n} not a multiple of "
               f"m = {m}): pass options={{'segments': 'front-padded'}}",
               prep.reference("float64", options={**prep.options, "segments": "front-padded"}))
    a = prep.arrays
    z = lambda x: np.concatenate([np.zeros(x.shape[:-2] + (pad, x.shape[-1])), x], -2)  # noqa: E731
    q, k, v = z(a["q"] * prep.scale), z(a["k"]), z(a["v"])
    ql = q.reshape(q.shape[:-2] + (m, size, q.shape[-1])).mean(-2)
    kl = k.reshape(k.shape[:-2] + (m, size, k.shape[-1])).mean(-2)
    k1 = softmax_host(q @ np.swapaxes(kl, -1, -2), np.eye(m))
    k2 = softmax_host(ql @ np.swapaxes(kl, -1, -2), np.eye(m))
    zinv = iterative_pinv(k2, iterations=prep.options.get("pinv_iterations", 6) or 6,
                          pinv_init=prep.options.get("pinv_init", "matrix"), xp=xnp)
    out = (k1 @ zinv @ softmax_host(ql @ np.swapaxes(k, -1, -2), v))[..., pad:, :]
    yield ("landmarks of the sequence zero-padded at the front to a multiple of m, the padding "
           "unmasked: averaged into the landmarks and attended as keys (lucidrains' "
           f"nystrom-attention without its key mask, N = {n} not a multiple of m = {m}; no "
           "option computes this: pass it a mask)", out)




# ------------------------------------- BigBird and Reformer conventions (transformers)


def _bigbird_sigs(prep):
    """BigBird's global blocks at both ends (``last_global_blocks`` of
    :func:`attn_ref.sparse.bigbird_attention`: google-research's and HuggingFace's ITC
    layout) against the declared ones; and HuggingFace's ``BigBirdBlockSparseAttention``
    in ``eval()``, whose random blocks are a constant all-zero list: each of a row's
    ``r`` random blocks is block 0 again, so block 0's keys enter the softmax ``1 + r``
    times (its logits raised by ``log(1 + r)``) in every row that is not global."""
    if prep.variant.name != "bigbird" or prep.kwargs.get("causal") not in (None, False):
        return
    from attn_ref.sparse import bigbird_mask

    o = {"window": 1, "global_blocks": 1, "random_blocks": 1, **prep.options}
    declared = o.get("last_global_blocks", 0)
    if declared == 0:
        yield ("the last block is global too, rows and columns, and the random blocks are drawn "
               "past it (the ITC layout of google-research's BigBird and HuggingFace's "
               "BigBirdBlockSparseAttention: global blocks first and last): pass "
               "options={'last_global_blocks': 1}",
               prep.reference("float64", options={**prep.options, "last_global_blocks": 1}))
    else:
        yield (f"the last {declared} block(s) not global (the declared last_global_blocks="
               f"{declared} missing): drop options={{'last_global_blocks': {declared}}}",
               prep.reference("float64", options={**prep.options, "last_global_blocks": 0}))
    r, B, n = o["random_blocks"], o["block_size"], prep.case.nk
    if not r:
        return
    for lg in sorted({declared, 1}):
        keep = np.asarray(bigbird_mask(n, block_size=B, window=o["window"], global_blocks=o["global_blocks"],
                                       random_blocks=0, last_global_blocks=lg, xp=np))
        nb = -(-n // B)
        rows = np.arange(n) // B
        plain = (rows >= o["global_blocks"]) & (rows < nb - lg)  # rows that are not global
        extra = np.where(plain[:, None] & (np.arange(n)[None, :] < B), math.log(1 + r), 0.0)
        how = "" if lg == declared else ", and the last block global (pass options={'last_global_blocks': 1})"
        yield (f"every random block is block 0 again, its keys counted 1 + r = {1 + r} times in each "
               f"row that is not global (HuggingFace's BigBirdBlockSparseAttention in eval(): "
               f"'During inference (eval) no randomness', its random blocks a constant all-zero "
               f"list{how}); another function, which attn_ref does not define: run it with "
               f"num_random_blocks' draw replaced by the layout's random blocks",
               softmax_host(host_logits(prep, allowed=keep) + extra, prep.arrays["v"]))


def _bigbird_window_sigs(prep):
    """BigBird's sliding window one block wider or narrower than declared (``window``
    blocks on each side). On short cases it can give the output of the last block made
    global (a window that reaches the last block), and the two are then named together."""
    if prep.variant.name != "bigbird":
        return
    w = {"window": 1, **prep.options}["window"]
    for other, how in ((w + 1, "wider"), (w - 1, "narrower")):
        if other >= 0:
            yield (f"the window one block {how} than declared (window={other}, declared {w})",
                   prep.reference("float64", options={**prep.options, "window": other}))


def _reformer_sigs(prep):
    """The Reformer's look-back over the rounds as one sequence and its pairs counted as
    often as found (``look_back`` and ``dedup`` of
    :func:`attn_ref.hashing.reformer_attention`), against the declared ones: trax,
    HuggingFace's ``LSHSelfAttention`` and reformer-pytorch sort all rounds as one
    sequence; HuggingFace and reformer-pytorch's default do not de-duplicate."""
    if prep.variant.name != "reformer":
        return
    declared = {"look_back": prep.options.get("look_back", "round"), "dedup": prep.options.get("dedup", True)}
    say = {("look_back", "sequence"): "the first chunk of each round looks back at the last chunk of the "
                                      "round before (the rounds sorted as one sequence: trax, "
                                      "HuggingFace's LSHSelfAttention, reformer-pytorch)",
           ("look_back", "round"): "the first chunk of each round looks back at the same round's last chunk",
           ("dedup", False): "a pair found in several rounds (or twice in a window) counted as often as "
                             "found, not once (HuggingFace's LSHSelfAttention, reformer-pytorch's "
                             "allow_duplicate_attention=True)",
           ("dedup", True): "each pair counted once however often found (the duplicate correction)"}
    other = {"look_back": {"round": "sequence", "sequence": "round"}, "dedup": {True: False, False: True}}
    for names in (("look_back", "dedup"), ("look_back",), ("dedup",)):
        change = {n: other[n][declared[n]] for n in names}
        what = "; ".join(say[(n, change[n])] for n in names)
        yield (f"{what}: pass options={change!r}",
               prep.reference("float64", options={**prep.options, **change}))


def _reformer_weights_sigs(prep):
    """The rounds combined with ``exp(lse_r - logsumexp_r lse)`` in the kernel's dtype and
    not divided by their sum (trax, HuggingFace's ``LSHSelfAttention``, reformer-pytorch):
    the weights then err by ``|lse| eps``, which is large where a round's log-sum-exp is
    (``self_logit`` for a token alone in its windows, large logits)."""
    if prep.variant.name != "reformer" or prep.dtype not in ("float32", "float64"):
        return
    from attn_ref.hashing import reformer_rounds

    t = np.dtype(prep.dtype)

    def unnormalised(q, k, v, /, *, xp, **kw):
        o, lse = reformer_rounds(q, k, v, xp=xp, **kw)
        lse = np.asarray(lse).astype(t)
        top = np.max(lse, axis=-2, keepdims=True)
        with np.errstate(invalid="ignore"):
            total = top + np.log(np.sum(np.exp(lse - top), axis=-2, keepdims=True))
            w = np.exp(lse - total)
        return np.sum(np.asarray(o) * np.nan_to_num(w)[..., None].astype(np.float64), axis=-3)

    yield ("the rounds combined with weights exp(lse_r - logsumexp(lse)) computed in the kernel's dtype "
           "and not divided by their sum (HuggingFace's LSHSelfAttention, trax, reformer-pytorch): they "
           "err by |lse| eps, large where a round's log-sum-exp is (a token alone in its windows has "
           "lse = self_logit; large logits); another computation than the reference's normalised "
           "weights, less accurate, not another function: no option",
           prep.reference("float64", fn=unnormalised))


def _kmeans_iteration_sigs(prep):
    """k-means (``clustered``, ``clustered_topk``) run one Lloyd iteration more or fewer
    than ``iterations`` (the cases at 1 and 2 iterations, where one step always shows)."""
    if prep.variant.name not in ("clustered", "clustered_topk"):
        return
    default = inspect.signature(prep.variant.fn).parameters["iterations"].default
    it = prep.options.get("iterations", default)
    for other, words in ((it + 1, "one Lloyd iteration more"), (it - 1, "one Lloyd iteration fewer")):
        if other >= 0:
            yield (f"k-means runs {words} than iterations={it} ({other})",
                   prep.reference("float64", options={**prep.options, "iterations": other}))


def _named_choice_sigs(prep):
    """Another of a variant's named functions than the case's: linear attention's feature
    map (``elu+1``, ``relu``, ``identity``) or Performer's kernel (``positive``,
    ``trigonometric``). A kernel written for the other choice computes another function
    on purpose; a linear-attention kernel with ``relu`` features read "no known mistake"."""
    for name, value, others in named_choices(prep):
        for alt in others:
            yield (f"the kernel's {name} is {alt!r}, not the case's {value!r}: pass "
                   f"options={{{name!r}: {alt!r}}} if that is its convention",
                   prep.reference("float64", options={**prep.options, name: alt}))


def _option_flip_sigs(prep):
    """A boolean option of the variant the other way
    (:func:`conformance.extras.boolean_options`): the delta rule without its ``q, k``
    normalisation, its error up to ``1e27`` times the tolerance, linear attention without
    its denominator, routing without balanced clusters read "no known mistake". An option
    whose other value the reference refuses for the case is skipped, not the rest."""
    for name, value in boolean_options(prep):
        try:
            cand = prep.reference("float64", options={**prep.options, name: not value})
        except Exception:  # this value cannot be computed for the case: no candidate
            continue
        yield flipped_option_words(name, value), cand


#: this module's signatures, in the order they are tried (registered by the package)
CONVENTIONS = (
    Signature("named feature map or kernel", _named_choice_sigs),
    Signature("performer eps", _performer_eps_sigs),
    Signature("performer generalized kernel", _generalized_kernel_sigs),
    Signature("efficient attention", _efficient_attention_sigs),
    Signature("window padding", _window_padding_sigs),
    Signature("nystrom exact at m == N", _nystrom_exact_sigs),
    Signature("nystrom front-padded landmarks", _nystrom_front_padded_sigs),
    Signature("bigbird global blocks and eval draw", _bigbird_sigs),
    Signature("bigbird window width", _bigbird_window_sigs),
    Signature("reformer round weights", _reformer_weights_sigs),
    Signature("reformer look-back and duplicates", _reformer_sigs),
    Signature("k-means iterations", _kmeans_iteration_sigs),
    # last: a convention above that gives the same function names it more precisely
    # (Performer's stabilize=False is "FAVOR+ features without the stabiliser")
    Signature("boolean option flipped", _option_flip_sigs),
)
