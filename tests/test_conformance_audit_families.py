"""False passes and false fails found by an outside audit of the oracle on the families the
first audit did not cover (low-rank, reduced, sparse, routing, Synthesizer, hashing,
sorting), each pinned by a planted kernel that must fail and a correct kernel that must
pass the same cases.

The kernels are NumPy, written from the papers' definitions rather than through
``attn_ref``'s forms, as an outside kernel author's would be.
"""

import numpy as np

from conformance import cases, verify


def _masked_softmax(q, k, v, allowed, scale=None):
    """Softmax attention over the ``allowed (Nq, Nk)`` pairs; rows with no key give zeros."""
    scale = 1.0 / float(np.sqrt(q.shape[-1])) if scale is None else float(scale)
    s = np.where(allowed, scale * (q @ np.swapaxes(k, -1, -2)), -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    den = np.sum(p, axis=-1, keepdims=True)
    return (p @ v) / np.where(den > 0, den, 1.0)


def _strided_kernel(always_causal):
    """Child et al. (2019)'s strided pattern, both parts in one head: ``|i - j| <= l``
    (``0 <= i - j <= l`` causal) or ``(i - j) mod l == 0`` (``i >= j`` causal)."""
    def kernel(q, k, v, *, stride=4, causal=False, scale=None):
        causal = causal or always_causal
        i, j = np.arange(q.shape[-2])[:, None], np.arange(k.shape[-2])[None, :]
        diff = i - j
        local = (diff >= (0 if causal else -stride)) & (diff <= stride)
        strided = (diff % stride == 0) & ((diff >= 0) if causal else True)
        return _masked_softmax(q, k, v, local | strided, scale)
    return kernel


def _fixed_kernel(always_causal):
    """Child et al. (2019)'s fixed pattern: own block of ``l`` or the last ``c`` of a block."""
    def kernel(q, k, v, *, stride=4, summary=1, causal=False, scale=None):
        causal = causal or always_causal
        i, j = np.arange(q.shape[-2])[:, None], np.arange(k.shape[-2])[None, :]
        ok = (i // stride == j // stride) | (j % stride >= stride - summary)
        return _masked_softmax(q, k, v, ok & (j <= i) if causal else ok, scale)
    return kernel


def test_strided_and_fixed_cases_that_are_not_causal_are_not_causal():
    # Before: the references default to causal=True (the paper's autoregressive pattern)
    # and the oracle passed no causal= on a case that is not causal, so the golden of every
    # such case was causal: a kernel computing the non-causal pattern failed 31 of the 38
    # standard cases, and one that is always causal, whatever it is told, passed them all.
    for variant, make in (("strided", _strided_kernel), ("fixed", _fixed_kernel)):
        chosen = [c for c in cases(variant, "standard")
                  if c.id.startswith(("basic:", "causal:", "batch-heads:b3h5"))]
        assert any(c.causal is None for c in chosen) and any(c.causal for c in chosen)
        good = verify(make(False), variant, backend="numpy", dtypes=("float64",), cases=chosen,
                      progress=False)
        assert good.passed and all(r.verdict == "pass" for r in good.results), good.table()
        bad = verify(make(True), variant, backend="numpy", dtypes=("float64",), cases=chosen,
                     progress=False)
        verdicts = {r.case: r.verdict for r in bad.results}
        assert all(verdicts[c.id] == "fail" for c in chosen if c.causal is None), bad.table()
        assert all(verdicts[c.id] == "pass" for c in chosen if c.causal), bad.table()
