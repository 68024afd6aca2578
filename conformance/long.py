"""The ``long`` suite: goldens past one tile's memory, computed on Dask.

Its cases (:data:`conformance.catalogue.CATALOGUE` ``["long"]``): self-attention at
``N = 8192`` with and without causal, ``4096`` queries on ``16384`` keys
bottom-right (KV-cache prefill), and Llama 4's chunked attention over ``8197`` positions
(chunks of 8192, causal: the last five queries see only keys 8192 on).

The Dask golden takes ``causal``, ``scale`` and ``chunk`` (each tile is
:func:`attn_ref.softmax.partial_attention`, which takes them). Not a window: the tile
function has none, and no case needs it here (the window cases reach ``4096 x 4096``,
not past :data:`LONG_THRESHOLD`); nor masks, biases, ALiBi or per-sequence lengths, which
no long case has (a case with them is n/a here; the standard suite checks them).

A case whose ``Nq * Nk`` exceeds :data:`LONG_THRESHOLD` gets its golden (and the
plain implementation behind its tolerance) from :func:`attn_ref.dask.dask_softmax_attention`:
the sequence chunked into :data:`CHUNK` rows, one task per visible (query chunk, key
chunk) pair, the key chunks merged by a tree. The golden is float64 (not
``np.longdouble``: extended precision has no BLAS, and the tree's ``O(log c)`` merges
keep float64 a few ulps from exact); the baseline is the same algorithm in the
kernel's dtype (bfloat16: on float32 tiles whose every result is rounded to bfloat16,
:class:`~conformance.tolerance.BF16Array`). The golden's row log-sum-exp comes with it,
for kernels that return one (:mod:`conformance.extras`).

The scheduler is Dask's threaded one unless :func:`dask_settings` names a
``distributed.Client`` (the CLI's ``--dask-scheduler ADDRESS``); ``progress`` shows
Dask's progress bar on stderr while a golden computes. Exact softmax attention (the
``softmax`` and ``online_softmax`` variants) only; another variant's long case is n/a.
"""

from __future__ import annotations

import contextlib
import sys

import numpy as np

from .features import NotApplicable
from .tolerance import lp_array

__all__ = ["LONG_THRESHOLD", "CHUNK", "is_long", "long_reference", "dask_settings"]

#: ``Nq * Nk`` above which a case's golden is computed on Dask (a 4096 x 4096 tile).
LONG_THRESHOLD = 4096 * 4096
#: Rows per chunk of the sequence axis (a 2048 x 2048 float64 tile is 32 MiB).
CHUNK = 2048
_VARIANTS = ("softmax", "online_softmax")
_SETTINGS = {"client": None, "progress": False}


def is_long(case) -> bool:
    return case.nq * case.nk > LONG_THRESHOLD


@contextlib.contextmanager
def dask_settings(*, client=None, progress=None):
    """Within the block, long goldens run on ``client`` (None: threads) with a progress bar
    when ``progress``."""
    old = dict(_SETTINGS)
    if client is not None:
        _SETTINGS["client"] = client
    if progress is not None:
        _SETTINGS["progress"] = bool(progress)
    try:
        yield
    finally:
        _SETTINGS.update(old)


def long_reference(prep, dtype="float64", *, reorder=False):
    """``(out, lse)`` of ``prep``'s case on Dask in ``dtype``, as float64 host arrays
    ``(B, H, Nq, dv)`` and ``(B, H, Nq)``; ``-inf`` lse on rows that see no key.

    ``reorder``: chunks of ``CHUNK // 2`` rows instead of :data:`CHUNK`, which sums the
    keys in another order, so it rounds differently while computing the same function.
    """
    try:
        import dask.array as da

        from attn_ref.dask import compute, dask_softmax_attention
    except ImportError as exc:
        raise NotApplicable(f"long cases need the dask extra ({exc})") from None
    if prep.variant.name not in _VARIANTS:
        raise NotApplicable(f"long cases: the Dask golden covers exact softmax ({', '.join(_VARIANTS)}), "
                            f"not {prep.variant.name}")
    extra = sorted(set(prep.arrays) - {"q", "k", "v"}) + sorted(
        set(prep.kwargs) - {"causal", "scale", "chunk"})
    if extra or prep.params:
        raise NotApplicable(f"long cases: the Dask golden takes causal, scale and chunk only, "
                            f"not {extra}")
    if dtype == "bfloat16":
        # NumPy has no bfloat16: float32 storage with every result rounded to bfloat16
        # (tolerance.BF16Array), the fp32-accumulating plain form the standard suite's
        # bfloat16 baselines are; Dask hands the tiles over as they are (asarray=False)
        q, k, v = (lp_array(prep.arrays[n], dtype) for n in ("q", "k", "v"))
    else:
        host = np.float16 if dtype == "float16" else np.dtype(dtype)
        q, k, v = (np.asarray(prep.arrays[n], dtype=host) for n in ("q", "k", "v"))
    b, h = q.shape[:2]
    k, v = np.broadcast_to(k, (b, h) + k.shape[2:]), np.broadcast_to(v, (b, h) + v.shape[2:])
    chunk = max(1, CHUNK // 2) if reorder else CHUNK
    qd, kd, vd = (da.from_array(x, chunks=(1, 1, chunk, x.shape[-1]), asarray=False)
                  for x in (q, k, v))
    out, lse = dask_softmax_attention(qd, kd, vd, causal=prep.kwargs.get("causal") or False,
                                      scale=prep.kwargs.get("scale"), chunk=prep.kwargs.get("chunk"))
    progress = _SETTINGS["progress"]
    if progress:
        sys.stderr.write(f"\r\x1b[Kgolden of {prep.case.id} in {dtype} on Dask\n")
    out, lse = compute(out, lse, client=_SETTINGS["client"], progress=progress)
    return np.asarray(out, dtype=np.float64), np.asarray(lse, dtype=np.float64)
