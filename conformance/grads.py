"""Gradient checks: ``verify(..., grads=True)`` judges a kernel's ``dq``, ``dk``, ``dv``
(and ``dbias`` when the case has a bias the kernel takes).

For each case and dtype:

1. an output cotangent ``do`` (standard normal, drawn from the seed and the case id,
   rounded to the kernel dtype; zero on rows with no key to attend to unless the kernel
   declared ``fully_masked="zeros"``, so a ``"mean"`` or ``"excluded"`` convention does
   not leak into ``dk``/``dv``);
2. golden gradients: the reference VJP :data:`attn_ref.grad.VJPS` of the variant on the
   rounded inputs, in float64 (longdouble for float64 kernels), exactly like the
   forward golden;
3. a baseline per gradient: the same VJP run in the kernel dtype; each gradient's
   tolerance comes from :class:`conformance.tolerance.Tolerance` with its own baseline
   and magnitude (override one with ``tolerance={"dq": Tolerance(...)}``);
4. the kernel's gradients: from its own framework (``torch.autograd.grad`` on the torch
   backend, ``jax.vjp`` on JAX) or from an explicit ``backward(q, k, v, do, **kw)``
   returning ``(dq, dk, dv)`` or ``(dq, dk, dv, dbias)`` or a dict with those names
   (what a raw CUDA/Triton kernel provides); ``kw`` is what the forward got.

Each gradient is a report row of its own (``output`` ``dq``, ``dk``, ``dv``, ``dbias``).
A failing softmax gradient is compared with the known backward mistakes
(:data:`MISTAKES`) and the one that explains it is named.
"""

from __future__ import annotations

import zlib

import numpy as np

from .calling import call_kernel, changed_input, check_container, first_output, snapshot
from .features import NotApplicable, allowed_matrix
from .judging import BASE_KEYS, as_dtype, resolve_tolerance, verdict_of
from .layouts import from_layout, to_layout
from .report import CaseResult
from .tolerance import Tolerance, measure, param_dtype, round_to, ulp

__all__ = ["grad_results", "prepare_grads", "MISTAKES", "GRAD_OUTPUTS", "GRAD_DEFAULTS"]

GRAD_OUTPUTS = {"q": "dq", "k": "dk", "v": "dv", "bias": "dbias"}


def _np():
    import array_api_compat.numpy as npx

    return npx


def _vjp(prep):
    from attn_ref.grad import VJPS

    try:
        return VJPS[prep.variant.name]
    except KeyError:
        raise NotApplicable(f"no reference gradient for variant {prep.variant.name!r} "
                            f"(attn_ref.grad.VJPS has {sorted(VJPS)})") from None


def _cotangent(prep) -> np.ndarray:
    seed = zlib.crc32(f"{prep.case.id}/do".encode()) ^ prep.seed
    rng = np.random.default_rng(seed)
    do = rng.standard_normal(prep.golden.shape)
    if prep.dead_rows is not None and prep.semantics["fully_masked"] != "zeros":
        do = np.where(prep.dead_rows[..., None], 0.0, do)
    return round_to(do, prep.dtype)


def _reference_grads(prep, do, dtype, vjp=None):
    a = {n: as_dtype(x, dtype) for n, x in prep.arrays.items()}
    p = {n: as_dtype(x, param_dtype(n, dtype)) for n, x in prep.params.items()}
    g = (vjp or _vjp(prep))(a["q"], a["k"], a["v"], as_dtype(do, dtype),
                   **{n: x for n, x in a.items() if n not in BASE_KEYS},
                   **prep.kwargs, **p, **prep.options, xp=_np())
    return {n: np.asarray(x, dtype=np.float64) if dtype != "longdouble" else np.asarray(x)
            for n, x in g.items() if n in GRAD_OUTPUTS}


def _baselines(prep):
    """The plain implementations whose error in the kernel dtype sets the baseline.

    Each is ``f(prep, do, dtype) -> grads``. For softmax there are three common ways to
    get ``dS``, which round differently, and the baseline is the largest error of them:
    autograd through a softmax (``P * (dP - rowsum(P * dP))``); FlashAttention's
    backward (``D = rowsum(dO * O)``, ``P`` recomputed from the saved log-sum-exp); and
    that backward with the saved ``out``/``lse`` correctly rounded from a float64
    forward, so that - as in a real kernel whose forward and backward tile differently
    - the recomputed logits do not round exactly like the ones ``lse`` came from (on
    peaked rows with logits of size ``L`` this moves ``P`` by ``ulp(L)``).
    """
    from attn_ref import grad

    if prep.variant.name not in ("softmax", "online_softmax"):
        return [lambda prep, do, dtype: _reference_grads(prep, do, dtype)]
    return [
        lambda prep, do, dtype: _reference_grads(prep, do, dtype, grad.softmax_attention),
        lambda prep, do, dtype: _reference_grads(prep, do, dtype, grad.online_softmax_attention),
        _flash_with_exact_lse,
    ]


def _flash_with_exact_lse(prep, do, dtype):
    from attn_ref import grad

    def call(fn, dt, *extra, **kw):
        a = {n: as_dtype(x, dt) for n, x in prep.arrays.items()}
        return fn(a["q"], a["k"], a["v"], *extra, **{n: x for n, x in a.items() if n not in BASE_KEYS},
                  **prep.kwargs, **prep.options, **kw, xp=_np())

    out, lse = call(grad.online_softmax_forward, "float64")
    g = call(grad.online_softmax_attention, dtype, as_dtype(do, dtype), out=as_dtype(np.asarray(out), dtype),
             lse=as_dtype(np.asarray(lse), dtype))
    return {n: np.asarray(x, dtype=np.float64) for n, x in g.items() if n in GRAD_OUTPUTS}


#: Default gradient tolerances: the forward's model with twice its fudge factors - a
#: backward pass rounds through about twice as many steps (recomputed logits, three
#: more matrix products, the ``dP - D`` cancellation) as the forward. Calibrated
#: against PyTorch SDPA's autograd over the standard suite (see the report).
GRAD_DEFAULTS = {dt: Tolerance(fudge=8.0, floor_ulps=4.0, fudge_rms=6.0, floor_rms_ulps=1.0)
                 for dt in ("float16", "bfloat16", "float32", "float64")}


def _term_magnitudes(prep, do):
    """Size of the largest single term of each gradient, for the ulp floor.

    For softmax, ``dS = P * (dP - D)`` cancels terms of size ``|dP| = |dO V^T|``; a
    gradient that is (near) zero because of that cancellation - a one-hot row, a query
    that sees one key - still carries rounding of that size, so the floor is taken at
    ``scale max|dP| max|K|`` for ``dq`` (``max|Q|`` for ``dk``), ``max|dO|`` for ``dv``
    and ``max|dP|`` for ``dbias``, when these exceed the gradient's own magnitude.
    Every other variant normalises weights formed from ``q`` and ``k`` the same way
    (a linear-attention row with one key gives ``dq = 0`` from ``phi(k) (v.do) / z -
    phi(k) (out.do) / z``), so the same products bound its terms, with the scale and
    the key/query sizes taken at least 1 (feature maps such as ``elu + 1`` add 1 and
    the default scale of linear attention is 1).
    """
    if do.size == 0:
        return {}
    a = prep.arrays
    if a["v"].size == 0 or a["q"].size == 0:
        return {}
    scale = prep.scale
    dp = float(np.max(np.abs(do))) * float(np.max(np.sum(np.abs(a["v"]), axis=-1)))
    qmax, kmax = float(np.max(np.abs(a["q"]))), float(np.max(np.abs(a["k"])))
    if prep.variant.name not in ("softmax", "online_softmax"):
        scale, qmax, kmax = max(abs(scale), 1.0), max(qmax, 1.0), max(kmax, 1.0)
    return {"q": scale * dp * kmax, "k": scale * dp * qmax,
            "v": float(np.max(np.abs(do))), "bias": dp}


def prepare_grads(prep, tolerance=None) -> dict:
    """``{"do": do, name: (golden, keep, tol_max, tol_rms, baseline or None)}``, cached on ``prep``."""
    cache = prep.__dict__.setdefault("_grads", {})
    key = repr(tolerance)
    if key in cache:
        return cache[key]
    do = _cotangent(prep)
    try:
        gold = _reference_grads(prep, do, prep.golden_dtype)
    except NotApplicable:
        raise
    except Exception as exc:
        raise NotApplicable(f"the reference gradient cannot take this case: "
                            f"{type(exc).__name__}: {exc}") from exc
    gold = {n: np.asarray(x, dtype=np.float64) for n, x in gold.items()}
    bases = []
    for plain in _baselines(prep):
        try:
            with np.errstate(all="ignore"):
                bases.append(plain(prep, do, prep.dtype))
        except Exception:
            pass
    out = {"do": do}
    terms = _term_magnitudes(prep, do)
    for n, g in gold.items():
        keep = None
        if n == "q" and prep.keep is not None and prep.keep.shape[:-1] == g.shape[:-1]:
            # fully_masked="excluded": a dead row's dq is as arbitrary as its output.
            keep = np.broadcast_to(prep.keep[..., :1], g.shape)
        ms = [measure(b[n], g, keep) for b in bases if n in b]
        ms = [m for m in ms if not m.nonfinite]
        bm = max(ms, key=lambda m: (m.max_err, m.rms_err)) if ms else None
        mag = max(float(np.max(np.abs(g))) if g.size else 0.0, terms.get(n, 0.0))
        tol = (GRAD_DEFAULTS[prep.dtype] if tolerance is None
               else resolve_tolerance(tolerance, prep.dtype, GRAD_OUTPUTS[n]))
        if bm is None:
            b_max = b_rms = 16 * ulp(mag, prep.dtype)
        else:
            b_max, b_rms = bm.max_err, bm.rms_err
        tmax, trms = tol.bounds(b_max, b_rms, mag, prep.dtype)
        out[n] = (g, keep, tmax, trms, bm)
    cache[key] = out
    return out


# ------------------------------------------------------------- the kernel's gradients


def _autodiff(ctx, inputs, kw, bias_name, do_k):
    """``{name: kernel-layout gradient}`` from the kernel's own framework."""
    name = getattr(ctx.backend, "name", "custom")
    names = ["q", "k", "v"] + (["bias"] if bias_name else [])
    if name == "torch":
        import torch

        leaves = {n: inputs[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v")}
        kw = dict(kw)
        if bias_name:
            leaves["bias"] = kw[bias_name].detach().clone().requires_grad_(True)
            kw[bias_name] = leaves["bias"]
        out = ctx.kernel.fn(leaves["q"], leaves["k"], leaves["v"], **kw)
        out = first_output(out)
        grads = torch.autograd.grad(out, [leaves[n] for n in names], grad_outputs=do_k,
                                    allow_unused=True)
        return dict(zip(names, grads))
    if name == "jax":
        import jax

        def f(*xs):
            kw2 = dict(kw)
            if bias_name:
                kw2[bias_name] = xs[3]
            out = ctx.kernel.fn(xs[0], xs[1], xs[2], **kw2)
            return first_output(out)

        vals = [inputs["q"], inputs["k"], inputs["v"]] + ([kw[bias_name]] if bias_name else [])

        def vjp(*args):
            return jax.vjp(f, *args[:-1])[1](args[-1])

        # One compilation of forward + backward instead of one per operation; a kernel
        # that cannot be traced runs eagerly.
        try:
            grads = jax.jit(vjp)(*vals, do_k)
        except (jax.errors.ConcretizationTypeError, jax.errors.TracerBoolConversionError,
                jax.errors.TracerIntegerConversionError):
            grads = vjp(*vals, do_k)
        return dict(zip(names, grads))
    raise NotApplicable(_NO_AUTODIFF.format(name=name))


_NO_AUTODIFF = ("backend {name!r} has no automatic differentiation: pass "
                "verify(..., backward=fn) with fn(q, k, v, do, **kw) -> (dq, dk, dv)")


def _explicit(backward, inputs, kw, do_k, bias_name):
    got = backward(inputs["q"], inputs["k"], inputs["v"], do_k, **kw)
    if isinstance(got, dict):
        return {n.removeprefix("d") if n.startswith("d") and n[1:] in GRAD_OUTPUTS else n: x
                for n, x in got.items()}
    names = ["q", "k", "v", "bias"]
    if not isinstance(got, (tuple, list)) or len(got) not in (3, 4):
        raise TypeError(f"backward must return (dq, dk, dv), (dq, dk, dv, dbias) or a dict, "
                        f"got {type(got).__name__}")
    return dict(zip(names, got))


def grad_results(ctx, prep, inputs, kw, shapes, dtype) -> list:
    """The gradient rows of one case (see the module docstring); never raises for a kernel's fault."""
    base = {"case": prep.case.id, "dtype": dtype}
    try:
        g = prepare_grads(prep, ctx.tolerance)
    except NotApplicable as exc:
        return [CaseResult.na(reason=str(exc), output="grads", **base)]
    do = g["do"]
    bias_name = None
    if "bias" in g and "bias" in prep.arrays:
        pname = ctx.kernel.names.get("bias")
        if pname in kw:
            bias_name = pname
    backward = ctx.extra.get("backward")
    name = getattr(ctx.backend, "name", "custom")
    if backward is None and name not in ("torch", "jax"):
        return [CaseResult.na(reason=_NO_AUTODIFF.format(name=name), output="grads", **base)]
    do_k = ctx.to_kernel(to_layout(do, ctx.layout), dtype)
    # what the backward is handed and must leave unchanged: q, k, v, do and the forward's
    # array arguments (autodiff differentiates copies, so only backward= can write)
    given = {**inputs, "do": do_k, **kw}
    snaps = {n: snapshot(ctx, x) for n, x in given.items() if hasattr(x, "shape")}
    if backward is not None:
        call = call_kernel(_explicit, backward, inputs, kw, do_k, bias_name,
                           time_limit=ctx.time_limit, what="kernel backward")
    else:
        call = call_kernel(_autodiff, ctx, inputs, kw, bias_name, do_k,
                           time_limit=ctx.time_limit, what="kernel backward")
    elapsed = call.elapsed
    if not call.ok:  # raised (an error) or stopped at the time limit (a failure)
        return [CaseResult.error(call.fault, verdict="fail" if call.timed_out else "error",
                                 output="grads", time_s=elapsed, shapes=shapes, **base)]
    changed = changed_input(ctx, given, snaps)
    if changed:
        return [CaseResult.error(f"the kernel backward modified its input {changed!r} in place",
                                 verdict="fail", output="grads", time_s=elapsed, shapes=shapes,
                                 **base)]
    got = call.value
    rows = []
    hosts = {}
    for n in ("q", "k", "v", "bias"):
        if n not in g or (n == "bias" and bias_name is None):
            continue
        gold, keep, tmax, trms, bm = g[n]
        out_name = GRAD_OUTPUTS[n]
        row = {"output": out_name, "time_s": elapsed, "shapes": shapes, **base}
        x = got.get(n)
        if x is None:
            rows.append(CaseResult.error(f"the kernel returned no gradient for {n}", verdict="fail",
                                         **row))
            continue
        like = kw[bias_name] if n == "bias" else inputs[n]
        want = (gold.shape[2:] if ctx.layout == "nd" else gold.shape) if n == "bias" else \
            to_layout(np.empty(gold.shape, dtype=np.int8), ctx.layout).shape
        problem = check_container(ctx, x, like, want, name=out_name)
        h = None
        if not problem:
            try:
                h = np.asarray(ctx.to_host(x), dtype=np.float64)
            except Exception as exc:  # e.g. an object array, or strings via a custom to_host
                problem = f"{out_name} is not numeric: {type(exc).__name__}: {exc}"
        if problem:
            rows.append(CaseResult.error(problem, verdict="fail", **row))
            continue
        h = (h[None, None] if ctx.layout == "nd" else h) if n == "bias" else from_layout(h, ctx.layout)
        if h.shape != gold.shape:
            rows.append(CaseResult.error(f"{out_name} has shape {h.shape}, expected {gold.shape}",
                                         verdict="fail", **row))
            continue
        hosts[n] = h
        m = measure(h, gold, keep)
        res = _judge(prep, m, out_name, tmax, trms, bm)
        res.time_s, res.shapes = elapsed, shapes
        rows.append(res)
    if ctx.diagnose and any(r.verdict == "fail" and not r.diagnosis for r in rows):
        with np.errstate(all="ignore"):
            words = diagnose_grads(prep, do, hosts, {n: g[n] for n in hosts})
        for r in rows:
            n = r.output[1:]
            if r.verdict == "fail" and not r.diagnosis and words.get(n):
                r.diagnosis = words[n]
    return rows


def _judge(prep, m, output, tmax, trms, bm):
    verdict, why, ratio = verdict_of(m, tmax, trms, output)
    return CaseResult(case=prep.case.id, dtype=prep.dtype, output=output, max_err=m.max_err,
                      rms_err=m.rms_err, tol_max=tmax, tol_rms=trms, ratio=ratio, worst=m.worst[:3],
                      verdict=verdict, diagnosis=why,
                      baseline_max=bm.max_err if bm else float("nan"),
                      baseline_rms=bm.rms_err if bm else float("nan"))


# ---------------------------------------------------------------------- diagnosis

#: Known backward-pass mistakes of softmax attention, tested in this order.
MISTAKES = {
    "no_rowsum_term": "the rowsum(dO * O) term is missing from dS (dS = P * dP instead of "
                      "P * (dP - rowsum(dO * O)))",
    "ds_not_transposed": "dS is applied untransposed (dK = scale dS Q instead of scale dS^T Q)",
    "dk_no_scale": "dK is missing the softmax scale",
    "dq_no_scale": "dQ is missing the softmax scale",
    "p_unnormalised": "P is recomputed with the row maximum instead of the log-sum-exp "
                      "(unnormalised exp(S - max) in the backward)",
    "mask_leak": "gradients leak through the mask: the backward recomputes P without the "
                 "mask/causal restriction",
    "dq_dk_swapped": "dq and dk are swapped",
}


def _softmax_grads(q, k, v, do, scale, bias, allowed, mistake=None):
    """Plain float64 softmax-attention gradients, optionally with one known mistake."""
    s = np.einsum("...id,...jd->...ij", q, k) * scale
    if bias is not None:
        s = s + bias
    if allowed is not None:
        s_un = s
        s = np.where(allowed, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    den = e.sum(-1, keepdims=True)
    p = e / np.where(den > 0, den, 1.0)
    out = p @ v
    pb = p
    if mistake == "p_unnormalised":
        pb = e
    elif mistake == "mask_leak" and allowed is not None:
        mu = np.max(s_un, axis=-1, keepdims=True)
        eu = np.exp(s_un - mu)
        pb = eu / eu.sum(-1, keepdims=True)
    dv = np.swapaxes(pb, -1, -2) @ do
    dp = do @ np.swapaxes(v, -1, -2)
    dcoef = 0.0 if mistake == "no_rowsum_term" else np.sum(do * out, -1, keepdims=True)
    ds = pb * (dp - dcoef)
    dq = ds @ k * (1.0 if mistake == "dq_no_scale" else scale)
    if mistake == "ds_not_transposed":
        dk = ds @ q * scale if ds.shape[-1] == ds.shape[-2] else None
    else:
        dk = np.swapaxes(ds, -1, -2) @ q * (1.0 if mistake == "dk_no_scale" else scale)
    if mistake == "dq_dk_swapped":
        dq, dk = dk, dq
    return {"q": dq, "k": dk, "v": dv, "bias": ds}


def _reduce(x, shape):
    if x is None:
        return None
    x = np.asarray(x)
    while x.ndim > len(shape):
        x = x.sum(0)
    axes = tuple(i for i, s in enumerate(shape) if s == 1 and x.shape[i] != 1)
    return x.sum(axes, keepdims=True) if axes else x


def diagnose_grads(prep, do, got: dict, gold: dict) -> dict:
    """``{name: words}`` for failing softmax gradients that a known mistake explains."""
    if prep.variant.name not in ("softmax", "online_softmax"):
        return {}
    a = prep.arrays
    scale = prep.scale
    allowed = allowed_matrix(prep.case, a, prep.kwargs)
    out = {}
    for mistake, words in MISTAKES.items():
        try:
            cand = _softmax_grads(a["q"], a["k"], a["v"], do, scale, a.get("bias"), allowed, mistake)
        except ValueError:
            continue
        for n, h in got.items():
            if n in out or cand.get(n) is None:
                continue
            c = _reduce(cand[n], gold[n][0].shape)
            if c.shape != h.shape:
                continue
            _, keep, tmax, trms, _ = gold[n]
            mt = measure(h, c, keep)
            mg = measure(h, gold[n][0], keep)
            if not mt.nonfinite and mt.max_err <= tmax and mt.max_err < mg.max_err:
                out[n] = f"matches a known mistake: {words}"
    return out
