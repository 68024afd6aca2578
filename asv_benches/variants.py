"""Every variant of :mod:`attn_ref.registry`, on every backend, across N.

Each variant runs with its benchmark configuration (``_common.BENCH_CONFIGS``: the
parameters of its paper); the classes' asv ``version`` covers that table, so results
measured with other arguments are never compared with new ones.

The parameter grid is read from the registry (at discovery, of the newest commit of
the run), so a variant registered later is benchmarked without touching this file; a
variant missing from an older commit is reported as skipped there
(``_common.discovered_params``). Sizes beyond a variant's cap
(``_common.max_n``) are skipped with the reason; slower cases run into ``timeout``.
"""

from ._common import (
    HEAD_DIM,
    HEADS,
    SingleCall,
    VariantCase,
    analytic_flops,
    backends,
    benchmark_costs,
    benchmark_version,
    discovered_params,
    load_backend,
    ns,
    registry,
    variant_names,
)


class Attention(SingleCall):
    """Time and peak host memory of one forward call, ``(8, N, 64)`` float32."""

    params = discovered_params("variants.Attention.time_forward") or (variant_names(), backends(), ns())
    param_names = ("variant", "backend", "N")

    def setup(self, variant, backend, n):
        self.case = VariantCase(variant, backend, n)

    def teardown(self, variant, backend, n):
        self.case = None

    def time_forward(self, variant, backend, n):
        self.case.run()

    def peakmem_forward(self, variant, backend, n):
        self.case.run()

    version = benchmark_version(setup, time_forward, peakmem_forward)


def _countable():
    return [v.name for v in registry().variants()
            if analytic_flops(benchmark_costs(v)[0], 1024) is not None]


class FlopRate:
    """Achieved GFLOP/s of the variants whose cost is a plain FLOP count, at one N.

    Compare with ``peers.Matmul.track_gflops``, the machine's float32 matmul rate:
    the ratio is how close the reference runs to the floor its arithmetic sets.
    """

    params = discovered_params("variants.FlopRate.track_gflops") or (_countable(), backends())
    param_names = ("variant", "backend")
    unit = "GFLOP/s"
    timeout = 300.0
    N_HOST, N_GPU = 2048, 16384

    def setup(self, variant, backend):
        import time

        self._clock = time.perf_counter
        n = self.N_GPU if load_backend(backend).gpu else self.N_HOST
        self.case = VariantCase(variant, backend, n)
        # The count of the cost under the benchmark configuration (``case.time``).
        self.flops = analytic_flops(self.case.time, n, HEAD_DIM, HEADS)

    def track_gflops(self, variant, backend):
        times = []
        for _ in range(3):
            t0 = self._clock()
            self.case.run()
            times.append(self._clock() - t0)
        return self.flops / sorted(times)[1] / 1e9

    version = benchmark_version(setup, track_gflops)
