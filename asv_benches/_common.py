"""Shapes, backends, inputs and size limits shared by the benchmarks.

Every case is one batch of ``HEADS = 8`` heads of dimension ``HEAD_DIM = 64`` in
float32, for sequence lengths ``N`` in powers of two from 256 to 65536, cut at the
largest ``N`` that fits the machine for the variant (:func:`max_n`). Each variant is
called with the configuration its paper runs (:data:`BENCH_CONFIGS`: Linformer
k = 256, Nystrom 64 landmarks, a 512-key window, BigBird blocks of 64, ...), not with
the test-sized arguments of :mod:`attn_ref.registry`.

asv either imports this suite afresh for every benchmark process (its default) or
once in a server that forks them (``--launch-method forkserver``), and CUDA does not
survive a fork: nothing here touches a GPU at import. Whether one
is usable is asked of a child process (:func:`gpu_probe`); the device is opened in
``setup``, inside the forked process.

Environment variables (read at import, so discovery and runs agree):

``ATTN_REF_BENCH_BACKENDS``
    Comma-separated backends to benchmark, from ``numpy, torch, jax, cupy``
    (default: every one that is installed and usable here).
``ATTN_REF_BENCH_MIN_N``, ``ATTN_REF_BENCH_MAX_N``
    Limit the ``N`` values, e.g. ``ATTN_REF_BENCH_MAX_N=512`` for a quick check.
``ATTN_REF_BENCH_GPU``
    ``cupy,torch-cuda`` (or a part, or ``none``): the GPU libraries that work here,
    instead of probing. asv imports the suite afresh in every benchmark process, and
    a probe costs a CUDA initialisation each time.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .costs import cost_exponent

HEADS = 8
HEAD_DIM = 64
DTYPE = "float32"
ALL_NS = tuple(2**i for i in range(8, 17))  # 256 .. 65536
CPU_BACKENDS = ("numpy", "torch", "jax")
GPU_BACKENDS = ("cupy",)
SEED = 0

# Largest N per kind of cost (see max_n). One-shot softmax holds ~3 float32 copies of
# the (8, N, N) logits: 6.4 GB at N = 8192 on the host, which several benchmark
# processes on a 24 GB machine can share; 25.8 GB at 16384 on a GPU.
CAPS = {
    # (quadratic memory, quadratic time): (host, gpu)
    (True, True): (8192, 16384),
    (False, True): (16384, 65536),
    (False, False): (65536, 65536),
}


def _have(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


_PROBE = r"""
import json
out = {}
try:
    import cupy
    out["cupy"] = cupy.cuda.runtime.getDeviceCount() > 0
except Exception:
    out["cupy"] = False
try:
    import torch
    out["torch-cuda"] = bool(torch.cuda.is_available())
except Exception:
    out["torch-cuda"] = False
print(json.dumps(out))
"""


@functools.cache
def gpu_probe() -> dict[str, bool]:
    """Which GPU libraries can run here, asked of a child process.

    Returns ``{"cupy": bool, "torch-cuda": bool}``; both False without an NVIDIA
    driver. The child keeps CUDA out of this (forking) process.
    """
    none = {"cupy": False, "torch-cuda": False}
    given = os.environ.get("ATTN_REF_BENCH_GPU")
    if given is not None:
        names = {g.strip() for g in given.split(",") if g.strip()} - {"none"}
        unknown = sorted(names - set(none))
        if unknown:
            raise ValueError(f"ATTN_REF_BENCH_GPU names {unknown}; known: cupy, torch-cuda, none")
        return {k: k in names for k in none}
    if not (os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi")):
        return none
    if not (_have("cupy") or _have("torch")):
        return none
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                              timeout=300, check=False)
        return {**none, **json.loads(done.stdout.strip().splitlines()[-1])}
    except (subprocess.SubprocessError, ValueError, IndexError, OSError):
        return none


def _env_list(name: str) -> list[str] | None:
    raw = os.environ.get(name, "").strip()
    return [s.strip() for s in raw.split(",") if s.strip()] if raw else None


def backends() -> list[str]:
    """The backends benchmarked here: installed, usable, and selected by the environment."""
    have = [b for b in CPU_BACKENDS if _have(b)]
    if gpu_probe()["cupy"]:
        have.append("cupy")
    wanted = _env_list("ATTN_REF_BENCH_BACKENDS")
    if wanted is not None:
        unknown = sorted(set(wanted) - set(CPU_BACKENDS + GPU_BACKENDS))
        if unknown:
            raise ValueError(f"ATTN_REF_BENCH_BACKENDS names unknown backends {unknown}; "
                             f"known: {CPU_BACKENDS + GPU_BACKENDS}")
        have = [b for b in have if b in wanted]
    return have


def ns() -> list[int]:
    """The sequence lengths benchmarked, limited by ``ATTN_REF_BENCH_MIN_N/MAX_N``."""
    lo = int(os.environ.get("ATTN_REF_BENCH_MIN_N", ALL_NS[0]))
    hi = int(os.environ.get("ATTN_REF_BENCH_MAX_N", ALL_NS[-1]))
    out = [n for n in ALL_NS if lo <= n <= hi]
    if not out:
        raise ValueError(f"no N in {ALL_NS} lies in [{lo}, {hi}] "
                         "(ATTN_REF_BENCH_MIN_N, ATTN_REF_BENCH_MAX_N)")
    return out


def is_quadratic(cost: str) -> bool:
    """True when an analytic cost string such as ``"O(N^2 d)"`` grows like ``N^2`` or faster."""
    e = cost_exponent(cost)
    return e is not None and e >= 2


def max_n(time_cost: str, memory_cost: str, *, gpu: bool) -> int:
    """Largest N benchmarked for a variant of the given analytic costs.

    Quadratic memory stops at 8192 on the host (16384 on a GPU), quadratic time at
    16384 (65536), everything else runs to 65536.
    """
    quad_mem = is_quadratic(memory_cost)
    host, device = CAPS[(quad_mem, quad_mem or is_quadratic(time_cost))]
    return device if gpu else host


# Analytic floating-point operations for the costs where the count is unambiguous:
# softmax attention does Q K^T and P V (2 N^2 d each, per head); linear attention
# does K^T V and Q (K^T V) (2 N d^2 each). Other costs carry free symbols (features,
# rank, window) that a plain count would have to guess.
FLOPS = {
    "O(N^2 d)": lambda n, d: 4 * n * n * d,
    "O(N d^2)": lambda n, d: 4 * n * d * d,
}


def analytic_flops(time_cost: str, n: int, d: int = HEAD_DIM, heads: int = HEADS) -> float | None:
    """Floating-point operations of one call, or None where the cost has no plain count."""
    f = FLOPS.get(" ".join(time_cost.split()))
    return None if f is None else float(heads * f(n, d))


@dataclass(frozen=True)
class Backend:
    name: str
    xp: Any
    device: Any
    gpu: bool

    def asarray(self, host: np.ndarray):
        return self.xp.asarray(host, device=self.device)

    def sync(self, x=None):
        """Wait for the device to finish, so a clock stopped next measures the work."""
        if self.name == "cupy":
            import cupy

            cupy.cuda.get_current_stream().synchronize()
        elif self.name == "jax" and x is not None:
            x.block_until_ready()
        elif self.name == "torch" and self.gpu:
            import torch

            torch.cuda.synchronize()


def load_backend(name: str) -> Backend:
    """Open backend ``name``; raises NotImplementedError (asv: skipped) when it cannot run."""
    if name == "numpy":
        import array_api_compat.numpy as xp

        return Backend(name, xp, "cpu", False)
    if name == "torch":
        import array_api_compat.torch as xp

        return Backend(name, xp, "cpu", False)
    if name == "jax":
        import jax

        device = jax.devices()[0]
        return Backend(name, importlib.import_module("jax.numpy"), device, device.platform != "cpu")
    if name == "cupy":
        try:
            import array_api_compat.cupy as xp
            import cupy

            return Backend(name, xp, cupy.cuda.Device(0), True)
        except Exception as exc:  # no CUDA runtime, no device
            raise NotImplementedError(f"cupy cannot run here: {exc}") from exc
    raise ValueError(f"unknown backend {name!r}; known: {CPU_BACKENDS + GPU_BACKENDS}")


def host_copy(x) -> np.ndarray:
    """A NumPy copy of any backend's array (for checks, never inside a timed region)."""
    if hasattr(x, "get") and type(x).__module__.startswith("cupy"):
        return x.get()
    if type(x).__module__.startswith("torch"):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def inputs(n: int, *, heads: int = HEADS, d: int = HEAD_DIM, seed: int = SEED):
    """Host float32 ``q, k, v`` of shape ``(heads, n, d)``, scaled like real activations."""
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((heads, n, d), dtype=np.float32) for _ in range(3))


def discovered_params(key: str):
    """The parameter grid asv discovered for benchmark ``key``, inside an asv run; else None.

    asv discovers the suite once, with the newest commit of the run installed, and
    then imports it afresh for every benchmark at every commit; the grid must not
    change in between, but the registry does (an older commit has fewer variants).
    So a benchmark process reads the grid back from the ``benchmarks.json`` that the
    discovery wrote, and a variant missing at its commit is skipped in ``setup``.
    """
    if len(sys.argv) < 2 or sys.argv[1] not in ("run", "run_server"):
        return None
    conf_dir = os.environ.get("ASV_CONF_DIR")
    if not conf_dir:
        return None
    try:
        with open(os.path.join(conf_dir, "asv.conf.json")) as fh:
            conf = json.loads(re.sub(r"^\s*//.*$", "", fh.read(), flags=re.M))
        path = os.path.join(conf_dir, conf.get("results_dir", "results"), "benchmarks.json")
        with open(path) as fh:
            params = json.load(fh)[key]["params"]
        return [[ast.literal_eval(p) for p in values] for values in params]
    except (OSError, KeyError, TypeError, ValueError, SyntaxError):
        return None


def registry():
    """``attn_ref.registry`` of the installed commit."""
    return importlib.import_module("attn_ref.registry")


def variant_names() -> list[str]:
    return [v.name for v in registry().variants()]


# --------------------------------------------------------------------------------------
# Benchmark configurations: every variant as its paper runs it.
#
# ``Variant.options`` and ``Variant.params`` in attn_ref/ are sized for tests (rank 8,
# 4 landmarks, window 3, ...), which say little about what users run. The suite calls
# each variant with the configuration below instead; a variant missing here falls back
# to the registry's arguments (with a warning, and tests/test_variants.py fails so
# that it gets one).
#
# ``options`` are passed to the variant's function; ``sizes`` (a rank, a number of
# features) only to ``arrays``, the builder of the array arguments (projections,
# random features, layouts), which gets both as ``values``. Either maps a name to a
# value or to a function of N: for a value that N bounds (a rank, landmarks, clusters,
# a block: the functions reject more than N; ``min(value, N)`` states the bound even
# where N = 256 .. 65536 never reaches it) and for one the paper ties to N (a stride of
# about sqrt(N), a pooling stride giving N / s segments). ``time`` / ``memory``
# replace the registry's analytic cost where the configuration changes its order in N
# (N / s segments make pooling quadratic): they set the cap (``max_n``) and the FLOP
# count (``analytic_flops``).
#
# asv runs this suite against older commits of attn_ref too. A configuration that the
# commit cannot take (its function has no such parameter, requires one not set here,
# or a builder used below does not exist) is skipped with the reason
# (NotImplementedError), never run with other arguments under the same name.


@dataclass(frozen=True)
class BenchConfig:
    """How one variant is benchmarked: its arguments, the paper they come from, its cost."""

    source: str
    options: dict = field(default_factory=dict)
    sizes: dict = field(default_factory=dict)
    arrays: Callable[..., dict] | None = None
    time: str | None = None
    memory: str | None = None

    def resolve(self, n: int) -> tuple[dict, dict]:
        """``(options, sizes)`` at sequence length ``n``: every function of N evaluated."""
        def at(values):
            return {k: (v(n) if callable(v) else v) for k, v in values.items()}

        return at(self.options), at(self.sizes)

    def describe(self, n: int) -> dict:
        """The plain values of the configuration at ``n`` (no arrays built)."""
        options, sizes = self.resolve(n)
        return {**options, **sizes}


def _at_most_n(value: int) -> Callable[[int], int]:
    """``n -> min(value, n)``: a count (rank, landmarks, clusters) or block that N bounds."""
    return lambda n: min(value, n)


def sqrt_stride(n: int) -> int:
    """``2^ceil(log2(n) / 2)``: the power of two at or just above ``sqrt(n)`` (16 at 256).

    Child et al. (2019) take ``l ~ sqrt(N)`` (an image row for images), which makes
    the strided pattern ``O(N sqrt(N))``; a power of two tiles a power-of-two ``N``
    evenly, as a row does.
    """
    return 1 << (((n - 1).bit_length() + 1) // 2)


def ceil_div(n: int, s: int) -> int:
    """``ceil(n / s)``: segments of a stride ``s`` that cover ``n`` positions."""
    return -(-n // s)


def _builder(module: str, name: str):
    """``attn_ref.<module>.<name>`` of the installed commit, or a stated skip."""
    try:
        return getattr(importlib.import_module(f"attn_ref.{module}"), name)
    except (ImportError, AttributeError):
        raise NotImplementedError(
            f"attn_ref.{module}.{name} does not exist at this commit; the benchmark "
            "configuration builds its arguments with it") from None


def _linformer_arrays(n, d, values, *, seed, dtype, device, xp):
    projection = _builder("lowrank", "linformer_projection")
    r = values["rank"]
    return {"e_proj": projection(r, n, seed=seed, dtype=dtype, device=device, xp=xp),
            "f_proj": projection(r, n, seed=seed + 1, dtype=dtype, device=device, xp=xp)}


def _performer_arrays(n, d, values, *, seed, dtype, device, xp):
    features = _builder("performer", "random_features")
    return {"projection": features(d, values["features"], kind="orthogonal", seed=seed,
                                   dtype=dtype, device=device, xp=xp)}


def _compressed_arrays(n, d, values, *, seed, dtype, device, xp):
    # Drawn here rather than by attn_ref (the kernel size is the configuration's); the
    # values do not change the cost: a near-averaging key kernel, an averaging value one.
    c = values["kernel_size"]
    rng = np.random.default_rng(seed)
    kw = np.eye(d) / c + rng.standard_normal((c, d, d)) * (0.1 / np.sqrt(d))
    vw = np.stack([np.eye(d) / c] * c)
    return {"k_weight": xp.asarray(kw, dtype=dtype, device=device),
            "v_weight": xp.asarray(vw, dtype=dtype, device=device)}


def _reformer_arrays(n, d, values, *, seed, dtype, device, xp):
    rotations = _builder("hashing", "lsh_rotations")
    return {"rotations": rotations(d, values["n_hashes"], values["n_buckets"], seed=seed, dtype=dtype,
                                   device=device, xp=xp)}


def _sinkhorn_arrays(n, d, values, *, seed, dtype, device, xp):
    # the sorting network's output, drawn: its values do not change the cost
    nb = n // values["block_size"]
    rng = np.random.default_rng(seed)
    return {"sort_logits": xp.asarray(rng.standard_normal((nb, nb)), dtype=dtype, device=device)}


def _recurrent_arrays(params: str):
    """Gates (and ``beta``) per head and step from ``attn_ref.recurrent.<params>``: the
    draws of fla's tests, ``(HEADS, n, ...)``."""
    def build(n, d, values, *, seed, dtype, device, xp):
        make = _builder("recurrent", params)
        return make(seed, n, n, d, d, dtype=dtype, device=device, xp=xp, batch=(HEADS,))
    build.__qualname__ = f"_recurrent_arrays({params!r})"
    return build


def _block_sparse_arrays(n, d, values, *, seed, dtype, device, xp):
    layout = _builder("sparse", "random_block_layout")
    nb = ceil_div(n, values["block_size"])
    # The diagonal plus, on average, ``blocks_per_row - 1`` random blocks per row.
    density = min(1.0, (values["blocks_per_row"] - 1) / max(1, nb - 1))
    return {"layout": layout(nb, nb, density=density, seed=seed)}


def _routing_arrays(n, d, values, *, seed, dtype, device, xp):
    centroids = _builder("routing", "routing_centroids")
    return {"centroids": centroids(values["num_clusters"], d, seed=seed, dtype=dtype,
                                   device=device, xp=xp)}


def _synthesizer_arrays(kind):
    def arrays(n, d, values, *, seed, dtype, device, xp):
        params = _builder("synthesizer", "synthesizer_params")
        return params(n, n, d, kind=kind, seed=seed, dtype=dtype, device=device, xp=xp)

    return arrays


BENCH_CONFIGS: dict[str, BenchConfig] = {
    "softmax": BenchConfig(
        "Vaswani et al. 2017: no parameters"),
    "online_softmax": BenchConfig(
        "Rabe & Staats 2021, Dao et al. 2022: the function's default tiles (sized for a "
        "host cache, not FlashAttention's GPU SRAM)"),
    "compressed": BenchConfig(
        "Liu et al. 2018 (memory-compressed attention): kernel 3, stride 3",
        options={"stride": 3}, sizes={"kernel_size": 3}, arrays=_compressed_arrays),
    "linear": BenchConfig(
        "Katharopoulos et al. 2020: elu+1 features, non-causal (the function's defaults)"),
    "retention": BenchConfig(
        "Sun et al. 2023 (RetNet): gamma_h = 1 - 2^(-5-h) over the 8 heads; chunks of 64 "
        "(flash-linear-attention's chunk kernels); C <= N",
        options={"chunk_size": _at_most_n(64)}, arrays=_recurrent_arrays("retention_params")),
    "gla": BenchConfig(
        "Yang et al. 2024 (GLA): per-key-dimension gates logsigmoid(randn), chunks of 64; C <= N",
        options={"chunk_size": _at_most_n(64)}, arrays=_recurrent_arrays("gla_params")),
    "ssd": BenchConfig(
        "Dao & Gu 2024 (Mamba-2): one decay per head and step, chunks of 256 (Mamba-2's "
        "chunk_size); C <= N",
        options={"chunk_size": _at_most_n(256)}, arrays=_recurrent_arrays("ssd_params")),
    "deltanet": BenchConfig(
        "Yang et al. 2024 (DeltaNet): beta = sigmoid(randn), l2-normalised q and k, chunks "
        "of 64; C <= N",
        options={"chunk_size": _at_most_n(64), "qk_l2norm": True},
        arrays=_recurrent_arrays("delta_params")),
    "gated_deltanet": BenchConfig(
        "Yang et al. 2025 (Gated DeltaNet): logsigmoid decay, beta = sigmoid(randn), "
        "l2-normalised q and k, chunks of 64; C <= N",
        options={"chunk_size": _at_most_n(64), "qk_l2norm": True},
        arrays=_recurrent_arrays("gated_delta_params")),
    "linformer": BenchConfig(
        "Wang et al. 2020: projected length k = 256, separate E and F; k <= N",
        sizes={"rank": _at_most_n(256)}, arrays=_linformer_arrays),
    "performer": BenchConfig(
        "Choromanski et al. 2021: FAVOR+, m = 256 positive orthogonal random features",
        sizes={"features": 256}, arrays=_performer_arrays),
    "pooled": BenchConfig(
        "stride 3 of Liu et al. 2018 (pooling is the averaging kernel of memory-compressed "
        "attention): m = ceil(N / 3) segments, as many as `compressed` has blocks",
        options={"num_segments": lambda n: ceil_div(n, 3)},
        time="O(N^2 d / s)", memory="O(N^2 / s)"),
    "query_reduced": BenchConfig(
        "Dai et al. 2020 (Funnel-Transformer): queries pooled with stride 2, "
        "m = ceil(N / 2) segments",
        options={"num_segments": lambda n: ceil_div(n, 2)},
        time="O(N^2 d / s)", memory="O(N^2 / s)"),
    "nystrom": BenchConfig(
        "Xiong et al. 2021: m = 64 landmarks, 6 pseudo-inverse iterations (the default); m <= N",
        options={"num_landmarks": _at_most_n(64)}),
    "clustered": BenchConfig(
        "Vyas et al. 2020: C = 100 query clusters, 10 Lloyd iterations (the default); C <= N",
        options={"num_clusters": _at_most_n(100)}),
    "clustered_topk": BenchConfig(
        "Vyas et al. 2020 (improved clustered): C = 100 clusters, top k = 32 keys; C, k <= N",
        options={"num_clusters": _at_most_n(100), "topk": _at_most_n(32)}),
    "block_sparse": BenchConfig(
        "block 64 as in BigBird (Zaheer et al. 2020); a random layout of the diagonal and "
        "~7 more blocks per row, BigBird's budget of 8 blocks = 512 keys per query",
        options={"block_size": _at_most_n(64)}, sizes={"blocks_per_row": 8},
        arrays=_block_sparse_arrays, time="O(N B c d)", memory="O(N B c)"),
    "local": BenchConfig(
        "Beltagy et al. 2020 (Longformer): window w = 512, i.e. 256 keys per side",
        options={"window": 256}),
    "longformer": BenchConfig(
        "Beltagy et al. 2020: 256 keys per side, global attention on the first 16 tokens "
        "([CLS] and a short question: Longformer's QA setting makes question tokens global)",
        options={"window": 256, "global_tokens": tuple(range(16))}),
    "bigbird": BenchConfig(
        "Zaheer et al. 2020 (BigBird-ITC): block 64, 3 sliding blocks (window 1 per side), "
        "2 global, 3 random; block <= N",
        options={"block_size": _at_most_n(64), "window": 1, "global_blocks": 2,
                 "random_blocks": 3}),
    "strided": BenchConfig(
        "Child et al. 2019: stride l ~ sqrt(N) (`sqrt_stride`: 16 at N = 256, 256 at 65536), "
        "causal (the function's default)",
        options={"stride": sqrt_stride}, time="O(N sqrt(N) d)", memory="O(N sqrt(N))"),
    "fixed": BenchConfig(
        "Child et al. 2019 (enwik8): stride l = 128, c = 32 summary positions, causal; l <= N",
        options={"stride": _at_most_n(128), "summary": 32}),
    "routing": BenchConfig(
        "Roy et al. 2021: C ~ sqrt(N) balanced clusters of w = N / C queries and keys "
        "(`sqrt_stride`: 16 at N = 256; the paper's 8192-token PG-19 model: 16 clusters of 512)",
        sizes={"num_clusters": lambda n: min(n, sqrt_stride(n))}, arrays=_routing_arrays,
        time="O(N sqrt(N) d)", memory="O(N sqrt(N))"),
    "synthesizer_dense": BenchConfig(
        "Tay et al. 2021: dense Synthesizer, W1 d x d, W2 d x N (the paper's two layers)",
        arrays=_synthesizer_arrays("dense")),
    "synthesizer_random": BenchConfig(
        "Tay et al. 2021: random Synthesizer, one N x N matrix R per head",
        arrays=_synthesizer_arrays("random")),
    "synthesizer_random_mix": BenchConfig(
        "Tay et al. 2021 (Random + Vanilla): R mixed with the dot-product logits, alpha = 1/4",
        options={"alpha": 0.25}, arrays=_synthesizer_arrays("random")),
    "reformer": BenchConfig(
        "Kitaev et al. 2020: chunks of 64 sorted positions, 4 hashing rounds, a fixed "
        "128 buckets (N / 64 buckets would make the hashing N^2 d / 64)",
        options={"chunk_size": _at_most_n(64)}, sizes={"n_buckets": 128, "n_hashes": 4},
        arrays=_reformer_arrays),
    "sinkhorn": BenchConfig(
        "Tay et al. 2020: 8 Sinkhorn iterations at temperature 0.75, block b = sqrt(N) "
        "(`sqrt_stride`), which balances the N b local logits against the (N / b)^2 sort matrix",
        options={"block_size": sqrt_stride, "n_iters": 8, "temperature": 0.75},
        arrays=_sinkhorn_arrays, time="O(N sqrt(N) d)", memory="O(N sqrt(N))"),
}


def missing_configs() -> list[str]:
    """Registered variants of the installed commit that have no benchmark configuration."""
    return [n for n in variant_names() if n not in BENCH_CONFIGS]


def config_table() -> str:
    """The configurations as a Markdown table (the README's, kept equal by a test)."""
    rows = ["| variant | benchmarked as |", "| --- | --- |"]
    rows += [f"| `{name}` | {c.source} |" for name, c in BENCH_CONFIGS.items()]
    return "\n".join(rows)


def benchmark_costs(variant) -> tuple[str, str]:
    """``(time, memory)`` under the benchmark configuration (else the registry's)."""
    config = BENCH_CONFIGS.get(variant.name)
    time = config.time if config is not None and config.time else variant.time
    memory = config.memory if config is not None and config.memory else variant.memory
    return time, memory


def config_fingerprint() -> str:
    """A hash of every configuration: its values at each N of ``ALL_NS``, its costs and
    the source of its builders. Part of the benchmarks' asv ``version``."""
    table = {}
    for name, c in sorted(BENCH_CONFIGS.items()):
        table[name] = {
            "values": {n: c.describe(n) for n in ALL_NS},
            "costs": [c.time, c.memory],
            "arrays": inspect.getsource(c.arrays) if c.arrays is not None else None,
        }
    text = json.dumps(table, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def benchmark_version(*methods) -> str:
    """asv ``version`` of a benchmark that calls the variants with :data:`BENCH_CONFIGS`.

    asv's default version hashes only the benchmark's own methods, which do not show
    the arguments the variants get here; results measured with other arguments would
    be compared with new ones. This hashes the methods and :func:`config_fingerprint`,
    so a change of either starts a new series (asv ignores results of another version).
    """
    src = "".join(inspect.getsource(m) for m in methods)
    digest = hashlib.sha256((src + config_fingerprint()).encode()).hexdigest()
    return f"paper-configs-{digest[:16]}"


def _accepts(fn, name: str, kwargs: dict, source: str, *, complete: bool = True) -> None:
    """Skip (NotImplementedError) when this commit's ``fn`` cannot take ``kwargs`` as is.

    ``complete=False`` checks only that every name is accepted (before the arrays are
    built); otherwise also that no required keyword is left unset.
    """
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return
    kinds = {p.kind for p in params.values()}
    if inspect.Parameter.VAR_KEYWORD not in kinds:
        named = {k for k, p in params.items() if p.kind in (
            inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)}
        unknown = sorted(set(kwargs) - named)
        if unknown:
            raise NotImplementedError(
                f"{name}: this commit's {fn.__name__} takes no {unknown}, which its benchmark "
                f"configuration sets ({source}); skipped rather than run with other arguments")
    required = sorted(k for k, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY
                      and p.default is inspect.Parameter.empty and k not in kwargs)
    if complete and required:
        raise NotImplementedError(
            f"{name}: this commit's {fn.__name__} requires {required}, which its benchmark "
            f"configuration does not set ({source})")


def registry_kwargs(variant, backend: Backend, n: int, d: int = HEAD_DIM) -> dict:
    """The registry's arguments, for a variant without a benchmark configuration.

    ``variant.options`` are sized for tests (small tiles, so that the tests walk many
    of them); an option that the function has a default for is left to that default,
    which is what a user gets. Parameters (projections, features) come from
    ``variant.params`` as in ``Variant.extra``.
    """
    sig = inspect.signature(variant.fn).parameters
    out = {k: v for k, v in variant.options.items()
           if k not in sig or sig[k].default is inspect.Parameter.empty}
    if variant.params is not None:
        out.update(variant.params(SEED, n, n, d, d, dtype=getattr(backend.xp, DTYPE),
                                  device=backend.device, xp=backend.xp))
    return out


def benchmark_kwargs(variant, backend: Backend, n: int, d: int = HEAD_DIM) -> dict:
    """The extra arguments of one benchmark call: the variant's :data:`BENCH_CONFIGS` entry.

    A variant without one gets :func:`registry_kwargs` and a warning. Raises
    NotImplementedError (asv: skipped, with the reason) when this commit's function
    cannot take the configuration.
    """
    config = BENCH_CONFIGS.get(variant.name)
    if config is None:
        warnings.warn(f"variant {variant.name!r} has no benchmark configuration in "
                      "asv_benches/_common.py (BENCH_CONFIGS); benchmarked with the "
                      "registry's test-sized arguments", stacklevel=2)
        return registry_kwargs(variant, backend, n, d)
    options, sizes = config.resolve(n)
    _accepts(variant.fn, variant.name, options, config.source, complete=False)
    out = dict(options)
    if config.arrays is not None:
        try:
            out.update(config.arrays(n, d, {**options, **sizes}, seed=SEED,
                                     dtype=getattr(backend.xp, DTYPE), device=backend.device,
                                     xp=backend.xp))
        except TypeError as exc:  # a builder of another signature at this commit
            raise NotImplementedError(
                f"{variant.name}: building the arguments of its benchmark configuration "
                f"failed at this commit ({exc})") from exc
    _accepts(variant.fn, variant.name, out, config.source)
    return out


class SingleCall:
    """asv sampling for a benchmark whose call at large N takes seconds: single calls
    (no calibration loop), no extra round in a second process, at most 10 samples in
    10 s per case, no warm-up run (``setup`` compiles or warms what needs it)."""

    timeout = 900.0
    number = 1
    repeat = (1, 10, 10.0)
    rounds = 1
    warmup_time = 0.0


class VariantCase:
    """One variant on one backend at one N, ready to call."""

    def __init__(self, name: str, backend_name: str, n: int):
        reg = registry()
        try:
            self.variant = reg.get(name)
        except KeyError:
            raise NotImplementedError(f"variant {name!r} does not exist at this commit") from None
        self.backend = load_backend(backend_name)
        # The costs under the benchmark configuration (a stride of N / s is quadratic).
        self.time, self.memory = benchmark_costs(self.variant)
        cap = max_n(self.time, self.memory, gpu=self.backend.gpu)
        if n > cap:
            raise NotImplementedError(
                f"{name} at N={n} exceeds its cap N={cap} on {backend_name} "
                f"(time {self.time}, memory {self.memory})"
            )
        self.n = n
        self.q, self.k, self.v = (self.backend.asarray(a) for a in inputs(n))
        self.kwargs = benchmark_kwargs(self.variant, self.backend, n)
        self.backend.sync(self.q)
        # Compilers (JAX's per-op kernels, CuPy's elementwise kernels) work on the
        # first call; the host libraries need no warm-up, and skipping it saves a
        # long call at large N.
        if self.backend.name in ("jax", "cupy"):
            self.run()

    def run(self):
        out = self.variant.fn(self.q, self.k, self.v, **self.kwargs)
        self.backend.sync(out)
        return out
