"""The native peers, in the same suite so that one asv run gives the ratios.

Each peer runs on its fastest documented path, and its name says which:

* ``TorchSDPA``: PyTorch's ``scaled_dot_product_attention`` on 4-D ``(1, H, N, d)``
  inputs. On CPU, 4-D float32 inputs take the fused flash kernel (``O(N)`` memory);
  3-D ``(H, N, d)`` inputs cannot (the flash kernel refuses them) and fall to the math
  path, which materialises the ``N x N`` logits (issue 15). Rows: ``cpu-float32``
  (torch's own choice), ``cpu-flash-float32`` and ``cpu-math-float32`` (forced with
  ``torch.nn.attention.sdpa_kernel``; torch 2.13's CPU build has no memory-efficient
  or cuDNN kernel), and on a GPU the fused kernels, also
  forced to flash and memory-efficient in half precision. ``tests/test_benchmarks.py``
  fails if the default or flash row's peak memory grows like ``N^2``.
* ``JaxDotProductAttention``: ``jax.nn.dot_product_attention`` under ``jax.jit``, its
  ``"xla"`` implementation (the only one on CPU: the ``N x N`` logits are materialised,
  XLA fuses the softmax).
* ``NumpyOneShot``: softmax attention written plainly in NumPy, one shot: the logits
  materialised, both products through NumPy's BLAS (batched over heads), in-place
  where NumPy allows it - what a NumPy user would write.
* ``Matmul``: the float32 matrix-product rate of each library, the floor that the
  arithmetic of attention sets.
* ``Baseline``: peak memory of a process that loaded a backend and did nothing, to
  subtract from ``peakmem_*`` before fitting exponents.
"""

import time

import numpy as np

from ._common import (
    HEADS,
    SingleCall,
    backends,
    gpu_probe,
    inputs,
    load_backend,
    max_n,
    ns,
)

# (device, dtype, forced SDPA backend or None)
SDPA_CONFIGS = {
    "cpu-float32": ("cpu", "float32", None),
    "cpu-flash-float32": ("cpu", "float32", "FLASH_ATTENTION"),
    "cpu-math-float32": ("cpu", "float32", "MATH"),
    "cuda-float32": ("cuda", "float32", None),
    "cuda-flash-bfloat16": ("cuda", "bfloat16", "FLASH_ATTENTION"),
    "cuda-flash-float16": ("cuda", "float16", "FLASH_ATTENTION"),
    "cuda-efficient-bfloat16": ("cuda", "bfloat16", "EFFICIENT_ATTENTION"),
}


def _sdpa_configs():
    wanted = set(backends())
    out = []
    if "torch" in wanted:
        out += [c for c in SDPA_CONFIGS if c.startswith("cpu")]
    if gpu_probe()["torch-cuda"] and ("cupy" in wanted or "torch" in wanted):
        out += [c for c in SDPA_CONFIGS if c.startswith("cuda")]
    return out


def sdpa_layout(host: np.ndarray) -> np.ndarray:
    """``(H, N, d) -> (1, H, N, d)``: the 4-D layout that SDPA's fused CPU kernel takes."""
    return host[None]


class TorchSDPA(SingleCall):
    """``torch.nn.functional.scaled_dot_product_attention`` on ``(1, 8, N, 64)``.

    ``config`` names the device, the kernel (none: torch's choice, the fused flash
    kernel on a CPU; ``flash``, ``math``, ``efficient``: forced) and the dtype.
    """

    heads = HEADS  # the memory test runs one head, to stay cheap
    params = (_sdpa_configs(), ns())
    param_names = ("config", "N")

    def setup(self, config, n):
        import torch

        device, dtype, forced = SDPA_CONFIGS[config]
        gpu = device == "cuda"
        # Fused SDPA needs O(N) memory and O(N^2) time; the math path O(N^2) memory.
        cap = max_n("O(N^2 d)", "O(N^2)" if forced == "MATH" else "O(N)", gpu=gpu)
        if n > cap:
            raise NotImplementedError(f"torch SDPA at N={n} exceeds the cap N={cap} on {device}")
        if gpu and not torch.cuda.is_available():
            raise NotImplementedError("torch has no CUDA device here")
        self.torch = torch
        self.gpu = gpu
        self.q, self.k, self.v = (
            torch.from_numpy(sdpa_layout(a)).to(device=device, dtype=getattr(torch, dtype))
            for a in inputs(n, heads=self.heads)
        )
        self.context = None
        if forced is not None:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            self.context = lambda: sdpa_kernel(getattr(SDPBackend, forced))
        if gpu:
            self.run()  # kernel selection and cuBLAS/cuDNN handles on the first call

    def run(self):
        f = self.torch.nn.functional.scaled_dot_product_attention
        if self.context is None:
            out = f(self.q, self.k, self.v)
        else:
            with self.context():
                out = f(self.q, self.k, self.v)
        if self.gpu:
            self.torch.cuda.synchronize()
        return out

    def time_forward(self, config, n):
        self.run()

    def peakmem_forward(self, config, n):
        self.run()


def numpy_oneshot(q, k, v):
    """``softmax(q k^T / sqrt(d)) v`` in plain NumPy, reusing the logits buffer."""
    s = np.matmul(q, np.swapaxes(k, -1, -2))
    s *= np.float32(1.0 / np.sqrt(q.shape[-1]))
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s @ v


class JaxDotProductAttention(SingleCall):
    """``jax.jit(jax.nn.dot_product_attention)``, implementation ``"xla"``, ``(1, N, 8, 64)``.

    JAX's layout is ``(batch, length, heads, d)``. On CPU ``"xla"`` is the only
    implementation (``"cudnn"`` needs a GPU); it materialises the logits, so its cap
    is that of quadratic memory. Compiled in ``setup``, outside the timing.
    """

    params = (["cpu-float32"], ns())
    param_names = ("config", "N")

    def setup(self, config, n):
        if "jax" not in backends():
            raise NotImplementedError("JAX is not installed or not selected here")
        import jax

        cap = max_n("O(N^2 d)", "O(N^2)", gpu=False)
        if n > cap:
            raise NotImplementedError(f"jax.nn.dot_product_attention at N={n} exceeds the cap "
                                      f"N={cap} (its xla implementation holds the N x N logits)")
        self.q, self.k, self.v = (jax.device_put(np.ascontiguousarray(np.swapaxes(a, 0, 1))[None])
                                  for a in inputs(n))
        self.f = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v,
                                                                      implementation="xla"))
        self.run()  # compile

    def run(self):
        return self.f(self.q, self.k, self.v).block_until_ready()

    def time_forward(self, config, n):
        self.run()

    def peakmem_forward(self, config, n):
        self.run()


class NumpyOneShot(SingleCall):
    """Plain NumPy one-shot softmax attention, ``(8, N, 64)`` float32, BLAS products."""

    params = (ns(),)
    param_names = ("N",)

    def setup(self, n):
        cap = max_n("O(N^2 d)", "O(N^2)", gpu=False)
        if n > cap:
            raise NotImplementedError(f"NumPy one-shot at N={n} exceeds the cap N={cap}")
        self.q, self.k, self.v = inputs(n)

    def time_forward(self, n):
        numpy_oneshot(self.q, self.k, self.v)

    def peakmem_forward(self, n):
        numpy_oneshot(self.q, self.k, self.v)


def _matmul_targets():
    out = list(backends())
    if gpu_probe()["torch-cuda"]:
        out += ["torch-cuda-float32", "torch-cuda-bfloat16"]
    return out


class Matmul:
    """Matrix-product rate, GFLOP/s: square float32 products of size 2048 (8192 on a GPU).

    ``torch-cuda-bfloat16`` is the rate to hold half-precision SDPA against.
    """

    params = (_matmul_targets(),)
    param_names = ("target",)
    unit = "GFLOP/s"
    timeout = 300.0

    def setup(self, target):
        if target.startswith("torch-cuda"):
            import torch

            if not torch.cuda.is_available():
                raise NotImplementedError("torch has no CUDA device here")
            dtype = getattr(torch, target.rsplit("-", 1)[1])
            self.n = 8192
            a = torch.from_numpy(np.random.default_rng(0).standard_normal((self.n, self.n),
                                 dtype=np.float32)).to("cuda", dtype)
            self.a = a
            self.product = lambda: a @ a
            self.sync = torch.cuda.synchronize
        else:
            b = load_backend(target)
            self.n = 8192 if b.gpu else 2048
            a = b.asarray(np.random.default_rng(0).standard_normal((self.n, self.n),
                                                                   dtype=np.float32))
            self.product = lambda: a @ a
            self.sync = b.sync if b.name != "jax" else (lambda x=None: a.block_until_ready())
            if b.name == "jax":
                self.product = lambda: (a @ a).block_until_ready()
        self.product()
        self.sync()

    def track_gflops(self, target):
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            self.product()
            self.sync()
            times.append(time.perf_counter() - t0)
        return 2.0 * self.n**3 / sorted(times)[2] / 1e9


class Baseline:
    """Peak host memory of a process that loaded a backend and made tiny inputs."""

    params = (backends(),)
    param_names = ("backend",)
    # Importing torch or JAX on a busy machine can take a minute.
    timeout = 300.0

    def setup(self, backend):
        self.b = load_backend(backend)
        self.x = self.b.asarray(inputs(1)[0])

    def peakmem_loaded(self, backend):
        self.b.sync(self.x)

