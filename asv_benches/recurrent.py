"""The recurrent family (issue 18): chunk forms at the papers' head sizes, and the backward.

``variants.Attention`` already times every registered variant's forward with
``HEADS = 8`` heads of ``HEAD_DIM = 64``. These add what that grid does not show:

* ``RecurrentForward``: the chunk form of retention, GLA, SSD, DeltaNet and Gated
  DeltaNet at ``d_k = d_v`` = 64 and 128 (the 1.3B models of GLA and DeltaNet use heads
  of 128), ``T`` = 1024, 4096, 16384, 8 heads, float32, NumPy: the sizes a 2-core host
  finishes in seconds (a ``T = 16384`` call takes about 0.3 s of CPU at ``d = 64``).
* ``RecurrentBackward``: the chunked VJP (``attn_ref.grad.recurrent``, ``form="chunk"``)
  of each, ``d = 64``, the same ``T``.

Each variant runs with its ``BENCH_CONFIGS`` entry (chunk size, gates drawn as fla's
tests draw them), built by ``_common.benchmark_kwargs``; a variant or option missing at
an older commit is a stated skip.
"""

import time

import numpy as np

from ._common import (
    HEADS,
    SingleCall,
    benchmark_kwargs,
    benchmark_version,
    load_backend,
    registry,
)

# Spelled out rather than read from conformance.extras.RECURRENT: asv runs this file
# against old commits (the history), where that name may not exist, and a benchmark's
# parameters are its identity across the history.
RECURRENT = ["retention", "gla", "ssd", "deltanet", "gated_deltanet"]
NS = [1024, 4096, 16384]


def _case(variant, n, d, *, arrays=3, seed=0):
    """The variant, its keyword arguments and host inputs ``(HEADS, n, d)`` on NumPy."""
    try:
        v = registry().get(variant)
    except KeyError:
        raise NotImplementedError(f"variant {variant!r} does not exist at this commit") from None
    backend = load_backend("numpy")
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal((HEADS, n, d), dtype=np.float32) for _ in range(arrays)]
    return v, benchmark_kwargs(v, backend, n, d), xs


class RecurrentForward(SingleCall):
    """CPU time and peak memory of one chunk-form call, ``(8, T, d)`` float32, NumPy."""

    params = (RECURRENT, NS, [64, 128])
    param_names = ("variant", "N", "head_dim")
    timer = time.process_time  # CPU seconds: on a shared host wall time counts the others

    def setup(self, variant, n, d):
        self.variant, self.kwargs, (self.q, self.k, self.v) = _case(variant, n, d)

    def run(self):
        return self.variant.fn(self.q, self.k, self.v, **self.kwargs)

    def time_chunk_forward(self, variant, n, d):
        self.run()

    def peakmem_chunk_forward(self, variant, n, d):
        self.run()

    version = benchmark_version(setup, run, time_chunk_forward, peakmem_chunk_forward)


class RecurrentBackward(SingleCall):
    """CPU time of the chunked VJP, ``(8, T, 64)`` float32, NumPy."""

    params = (RECURRENT, NS)
    param_names = ("variant", "N")
    timer = time.process_time

    def setup(self, variant, n):
        self.variant, self.kwargs, (self.q, self.k, self.v, self.do) = _case(variant, n, 64, arrays=4)
        if self.variant.vjp is None:
            raise NotImplementedError(f"{variant} has no VJP at this commit")

    def run(self):
        return self.variant.vjp(self.q, self.k, self.v, self.do, **self.kwargs, form="chunk")

    def time_chunk_backward(self, variant, n):
        self.run()

    version = benchmark_version(setup, run, time_chunk_backward)
