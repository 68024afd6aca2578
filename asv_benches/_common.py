"""Shapes, backends, inputs and size limits shared by the benchmarks.

Every case is one batch of ``HEADS = 8`` heads of dimension ``HEAD_DIM = 64`` in
float32, for sequence lengths ``N`` in powers of two from 256 to 65536, cut at the
largest ``N`` that fits the machine for the variant (:func:`max_n`).

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
import importlib
import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

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


_QUADRATIC = re.compile(r"N\s*\^\s*\(?\s*2\b|N²|N_?q\s*\*?\s*N_?k")


def cost_exponent(cost: str) -> float | None:
    """Exponent of N in an analytic cost (``conformance.scaling.cost_exponent``).

    Commits from before the scaling report lack that parser; for them a string that
    spells ``N^2`` counts as 2 and anything else as 1.
    """
    try:
        from conformance.scaling import cost_exponent as parse
    except ImportError:
        return 2.0 if _QUADRATIC.search(cost) else 1.0
    return parse(cost)


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


def benchmark_kwargs(variant, backend: Backend, n: int, d: int = HEAD_DIM) -> dict:
    """The extra arguments of one benchmark call.

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


class VariantCase:
    """One variant on one backend at one N, ready to call."""

    def __init__(self, name: str, backend_name: str, n: int):
        reg = registry()
        try:
            self.variant = reg.get(name)
        except KeyError:
            raise NotImplementedError(f"variant {name!r} does not exist at this commit") from None
        self.backend = load_backend(backend_name)
        cap = max_n(self.variant.time, self.variant.memory, gpu=self.backend.gpu)
        if n > cap:
            raise NotImplementedError(
                f"{name} at N={n} exceeds its cap N={cap} on {backend_name} "
                f"(time {self.variant.time}, memory {self.variant.memory})"
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
