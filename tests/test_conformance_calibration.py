"""Calibration of the oracle: real, correct kernels must pass every applicable case.

CI runs a few seeds per dtype. The full calibration (20 seeds of the standard suite)::

    ATTN_REF_CALIBRATION_SEEDS=20 .venv/bin/python -m pytest tests/test_conformance_calibration.py

Kernels: ``torch.nn.functional.scaled_dot_product_attention`` (float64, float32,
bfloat16, float16; masks, bias and causal through a thin wrapper),
``jax.nn.dot_product_attention`` (float32, bfloat16; layout ``bnhd``, rows with no key
give the mean of V, causal top-left, dv == d only) and attn_ref's own functions run on PyTorch and JAX.
"""

import functools
import math
import os

import pytest

from conformance import verify

SEEDS = int(os.environ.get("ATTN_REF_CALIBRATION_SEEDS", "0"))


def _seeds(ci):
    return list(range(SEEDS)) if SEEDS else ci


def sdpa(q, k, v, *, mask=None, bias=None, is_causal=False, scale=None):
    """PyTorch SDPA with separate mask and bias (SDPA takes one ``attn_mask``)."""
    import torch
    import torch.nn.functional as F

    attn = mask
    if bias is not None:
        attn = bias if mask is None else bias.masked_fill(~mask, -math.inf)
    if is_causal and attn is not None:
        nq, nk = q.shape[-2], k.shape[-2]
        tri = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril()
        attn = (attn & tri) if attn.dtype == torch.bool else attn.masked_fill(~tri, -math.inf)
        is_causal = False
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn, is_causal=is_causal, scale=scale)
    if attn is not None and attn.dtype != torch.bool:
        # SDPA gives NaN on a row whose float mask is all -inf; its boolean-mask path gives 0
        dead = torch.isinf(attn).all(-1, keepdim=True) if mask is None else ~(
            (attn > -math.inf).any(-1, keepdim=True))
        out = torch.where(dead, torch.zeros((), dtype=out.dtype), out)
    return out


@functools.cache
def _jitted_dpa(is_causal, scale):
    import jax

    return jax.jit(lambda q, k, v, bias, mask: jax.nn.dot_product_attention(
        q, k, v, bias=bias, mask=mask, scale=scale, is_causal=is_causal))


def jax_dpa(q, k, v, *, mask=None, bias=None, is_causal=False, scale=None):
    """``jax.nn.dot_product_attention``, jit-compiled (eager JAX compiles every op)."""
    return _jitted_dpa(is_causal, scale)(q, k, v, bias, mask)


# Calibration judges values, not speed: no per-call time limit (a loaded CI machine once
# took 68 s for online_softmax on torch at 1000 x 1000, over the default 60 s).


def max_ratios(rep):
    """``{(output, dtype): largest error/bound ratio}`` over the rows that ran; printed by
    the calibration tests (run with ``-s`` to read them) so a run reports its margin."""
    out = {}
    for r in rep.results:
        if r.verdict != "n/a" and r.ratio == r.ratio:
            key = (r.output, r.dtype)
            out[key] = max(out.get(key, 0.0), r.ratio)
    return out


def _check(rep, label="", seed=None):
    for (output, dtype), ratio in sorted(max_ratios(rep).items()):
        print(f"CALIBRATION {label} {output} {dtype} seed={seed} max_ratio={ratio:.4f}")
    assert rep.passed, rep.table()
    # every case of the suite ran or was skipped with a stated reason
    assert all(r.diagnosis for r in rep.results if r.verdict == "n/a")


# CI: one seed per dtype, a different one for each, so that CI sees four draws
@pytest.mark.parametrize("dtype,ci_seeds", [("float64", [0]), ("float32", [1]),
                                            ("bfloat16", [2]), ("float16", [3])])
def test_torch_sdpa_passes(dtype, ci_seeds):
    pytest.importorskip("torch")
    for seed in _seeds(ci_seeds):
        rep = verify(sdpa, "softmax", backend="torch", dtypes=(dtype,), seed=seed,
                     supports={"broadcast": True}, progress=False, time_limit=None)
        _check(rep, "torch-sdpa", seed)
        ran = rep.counts["pass"]
        assert ran >= 50, rep.summary()  # masks, bias and causal cases all ran


@pytest.mark.parametrize("dtype,ci_seeds", [("float32", [0]), ("bfloat16", [1])])
def test_jax_dot_product_attention_passes(dtype, ci_seeds):
    pytest.importorskip("jax")
    for seed in _seeds(ci_seeds):
        rep = verify(jax_dpa, "softmax", backend="jax", dtypes=(dtype,), layout="bnhd", seed=seed,
                     supports={"value_dim": False}, fully_masked="mean", causal="top-left",
                     progress=False, time_limit=None)
        # XLA's CPU backend cannot compile a bfloat16 1x1 dot (Nq = Nk = 1): the kernel
        # crashes there, which the oracle rightly reports as an error, not a value failure
        xla_bug = [r for r in rep.failures if r.verdict == "error"
                   and "ALG_DOT_BF16_BF16_F32" in r.diagnosis and "q1k1" in r.case]
        rep.results = [r for r in rep.results if r not in xla_bug]
        _check(rep, "jax-dpa", seed)
        assert rep.counts["pass"] >= 40, rep.summary()


@pytest.mark.parametrize("backend", ["torch", "jax"])
@pytest.mark.parametrize("name", ["softmax", "online_softmax"])
def test_attn_ref_on_backends_passes(backend, name):
    from attn_ref.registry import get
    from conformance import backends as B
    from conformance.cli import reference_kernel

    be = B.load(backend)
    v = get(name)
    # JAX compiles every shape (and unrolls the online form's block loops): quick suite there
    suite = "quick" if backend == "jax" else "standard"
    for seed in _seeds([0]):
        rep = verify(reference_kernel(v, be), name, backend=backend, dtypes=("float32", "float64"),
                     suite=suite, seed=seed, causal="both", supports={"broadcast": True},
                     progress=False, time_limit=None)
        _check(rep, f"attn_ref-{name}-{backend}", seed)


def test_attn_ref_on_jax_passes_the_softcap_large_logit_case():
    # ``attn-ref verify --backend jax --suite standard``: the references compile with
    # conformance.cli.JAX_COMPILER_OPTIONS. XLA's backend optimisation level 0 (its
    # option until 2 December 2026) made softmax's soft-capped large logits err 1.11x
    # the RMS bound in float32 - our own reference failing our own oracle.
    from attn_ref.registry import get
    from conformance import backends as B
    from conformance.catalogue import cases
    from conformance.cli import reference_kernel

    be = B.load("jax")
    case = [c for c in cases("softmax") if c.id == "softcap:b1h2-q64k64-d64-large_logits-softcap50"]
    assert case, [c.id for c in cases("softmax") if c.id.startswith("softcap")]
    rep = verify(reference_kernel(get("softmax"), be), "softmax", backend="jax", dtypes=("float32",),
                 cases=case, progress=False, time_limit=None)
    assert rep.counts["pass"] == 1 and rep.passed, rep.summary()


# attn_ref's own approximate references on torch in float16 and bfloat16, on the standard
# cases each once failed (ratios before): the baselines had computed their softmax kernels,
# FAVOR+ features and pseudo-inverse in float32 (attn_ref's clip to the dtype's range
# dropped the emulated arrays' rounding), and the Performer's default denominator floor in
# float16 was its smallest normal, 6.1e-5, above 20 % of a d = 80 case's denominators.
HALF_CASES = [
    ("nystrom", "float16", ["scale:b1h1-q16k16-d8-scale0.3",                 # 1.01
                            "long:b1h1-q1000k1000-d64-offset_values"]),      # 1.23
    ("nystrom", "bfloat16", ["length:b1h2-q64k64-d32"]),                     # 1.09
    ("performer", "float16", ["headdim:b1h2-q33k33-d80",                     # 78
                              "headdim:b1h2-q33k33-d128",                    # 47
                              "length:b1h2-q2k2-d32",                        # 1.12
                              "large-logits:b1h2-q16k16-d8-large_logits"]),
    ("performer", "bfloat16", ["length:b1h2-q2k2-d32",                       # 1.08
                               "headdim:b1h2-q33k33-d1"]),                   # 1.60
    ("reformer", "float16", ["scale:b1h2-q65k65-d32-scale0.05"]),            # 1.03
    ("reformer", "bfloat16", ["basic:b2h3-q17k17-d16",                       # 1.05
                              "scale:b1h2-q65k65-d32-scale0.05"]),           # 1.04
]


@pytest.mark.parametrize("name, dtype, ids", HALF_CASES)
def test_attn_ref_in_half_precision_on_torch_passes(name, dtype, ids):
    from attn_ref.registry import get
    from conformance.catalogue import cases

    todo = [c for c in cases(name, "standard") if c.id in ids]
    assert len(todo) == len(ids)
    rep = verify(get(name).fn, name, backend="torch", dtypes=(dtype,), cases=todo, progress=False)
    assert rep.passed, rep.table()
    assert rep.counts["pass"] >= len(ids) - 1, rep.table()  # large logits: n/a in float16


@pytest.mark.parametrize("name, dtype, factor, least", [
    # rows failed of those judged, measured after the change (before): nystrom float16
    # x 1.01 42/43 (42/43), bfloat16 x 1.02 18/42 (21/42); reformer float16 x 1.01
    # 34/36 (34/36), bfloat16 x 1.01 24/25 (24/25). Nystrom's form with the logits in the
    # dtype (conformance.judging, 5 December 2026): float16 x 1.01 45/46 (45/46),
    # bfloat16 x 1.02 17/45 (18/45)
    ("nystrom", "float16", 1.01, 0.9), ("nystrom", "bfloat16", 1.02, 0.35),
    ("reformer", "float16", 1.01, 0.9), ("reformer", "bfloat16", 1.01, 0.9)])
def test_a_slightly_scaled_half_precision_output_still_fails(name, dtype, factor, least):
    import inspect

    from attn_ref.registry import get
    from conformance.catalogue import cases

    fn = get(name).fn

    def scaled(q, k, v, **kw):
        return fn(q, k, v, **kw) * factor

    scaled.__signature__ = inspect.signature(fn)
    rep = verify(scaled, name, backend="torch", dtypes=(dtype,), cases=cases(name, "standard"),
                 progress=False, diagnose=False)
    judged = rep.counts["pass"] + rep.counts["fail"]
    assert not rep.passed and rep.counts["fail"] >= least * judged, rep.summary()
