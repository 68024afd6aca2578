"""The asv suite (asv_benches/): it imports, its grid is well formed, every case runs.

Speed is not measured here; each benchmark body runs once at the smallest N so that a
variant that breaks under the benchmark's shapes fails in CI, not in the next asv run.
"""

import importlib
import importlib.util
import inspect
import json
import math
import os
import pkgutil
import re
import shutil
import subprocess
import sys
import warnings

import array_api_compat
import numpy as np
import pytest

import asv_benches
from asv_benches import _common as C
from asv_benches import peers, variants

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _benchmark_classes():
    for info in pkgutil.iter_modules(asv_benches.__path__):
        mod = importlib.import_module(f"asv_benches.{info.name}")
        for name, obj in vars(mod).items():
            if inspect.isclass(obj) and obj.__module__ == mod.__name__ and any(
                    m.startswith(("time_", "peakmem_", "track_")) for m in vars(obj)):
                yield f"{info.name}.{name}", obj


CLASSES = dict(_benchmark_classes())


def test_suite_has_the_expected_benchmarks():
    assert {"variants.Attention", "variants.FlopRate", "peers.TorchSDPA", "peers.NumpyOneShot",
            "peers.JaxDotProductAttention", "peers.Matmul", "peers.Baseline"} <= set(CLASSES)
    assert {"time_forward", "peakmem_forward"} <= set(vars(variants.Attention))


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_params_are_well_formed(name):
    cls = CLASSES[name]
    params, names = cls.params, cls.param_names
    assert len(params) == len(names) and len(set(names)) == len(names)
    for values in params:
        assert isinstance(values, (list, tuple)) and values, (name, values)
        assert len(set(map(repr, values))) == len(values), f"{name}: repeated values {values}"
    if "N" in names:
        n = params[names.index("N")]
        assert all(v & (v - 1) == 0 and 256 <= v <= 65536 for v in n), n
    # asv's default of 60 s is less than an import of torch takes on a busy machine.
    assert getattr(cls, "timeout", 60) >= 300, f"{name}: timeout below 300 s"
    if hasattr(cls, "unit"):
        assert cls.unit == "GFLOP/s"


def test_grid_covers_the_registry_and_the_backends():
    from attn_ref.registry import variants as registered

    names, backends, ns = variants.Attention.params
    assert names == [v.name for v in registered()]
    assert "numpy" in backends and set(backends) <= {"numpy", "torch", "jax", "cupy"}
    assert ns[0] == 256 and ns[-1] == 65536


def test_caps_follow_the_analytic_cost():
    from attn_ref.registry import variants as registered

    assert C.max_n("O(N^2 d)", "O(N^2)", gpu=False) == 8192
    assert C.max_n("O(N^2 d)", "O(N)", gpu=False) == 16384
    assert C.max_n("O(N^2 d)", "O(N)", gpu=True) == 65536
    assert C.max_n("O(N (l + N/l) d)", "O(N (l + N/l))", gpu=False) == 8192
    for v in registered():
        exp_t = C.cost_exponent(v.time)
        exp_m = C.cost_exponent(v.memory)
        if exp_t is not None and exp_t < 2 and (exp_m is None or exp_m < 2):
            assert C.max_n(v.time, v.memory, gpu=False) >= 65536, v.name


def test_over_the_cap_is_a_stated_skip():
    with pytest.raises(NotImplementedError, match="exceeds its cap N=8192"):
        C.VariantCase("softmax", "numpy", 16384)
    with pytest.raises(NotImplementedError, match="does not exist at this commit"):
        C.VariantCase("no_such_variant", "numpy", 256)


def test_environment_narrows_the_grid(monkeypatch):
    monkeypatch.setenv("ATTN_REF_BENCH_MIN_N", "1024")
    monkeypatch.setenv("ATTN_REF_BENCH_MAX_N", "4096")
    assert C.ns() == [1024, 2048, 4096]
    monkeypatch.setenv("ATTN_REF_BENCH_MAX_N", "512")
    with pytest.raises(ValueError, match="no N in"):
        C.ns()
    monkeypatch.setenv("ATTN_REF_BENCH_BACKENDS", "numpy")
    assert C.backends() == ["numpy"]
    monkeypatch.setenv("ATTN_REF_BENCH_BACKENDS", "numpy,tpu")
    with pytest.raises(ValueError, match="unknown backends \\['tpu'\\]"):
        C.backends()


def test_runs_reuse_the_discovered_grid(monkeypatch, tmp_path):
    conf = tmp_path / "asv.conf.json"
    conf.write_text('{\n  // comment\n  "version": 1, "results_dir": "res"\n}')
    (tmp_path / "res").mkdir()
    grid = [["'softmax'", "'not_yet'"], ["'numpy'"], ["256", "512"]]
    (tmp_path / "res" / "benchmarks.json").write_text(
        json.dumps({"variants.Attention.time_forward": {"params": grid}}))
    monkeypatch.setenv("ASV_CONF_DIR", str(tmp_path))
    monkeypatch.setattr("sys.argv", ["benchmark.py", "discover"])
    assert C.discovered_params("variants.Attention.time_forward") is None
    monkeypatch.setattr("sys.argv", ["benchmark.py", "run", "x"])
    assert C.discovered_params("variants.Attention.time_forward") == [
        ["softmax", "not_yet"], ["numpy"], [256, 512]]
    assert C.discovered_params("variants.Other.time_x") is None


def test_gpu_probe_can_be_given(monkeypatch):
    C.gpu_probe.cache_clear()
    try:
        monkeypatch.setenv("ATTN_REF_BENCH_GPU", "torch-cuda")
        assert C.gpu_probe() == {"cupy": False, "torch-cuda": True}
        C.gpu_probe.cache_clear()
        monkeypatch.setenv("ATTN_REF_BENCH_GPU", "none")
        assert C.gpu_probe() == {"cupy": False, "torch-cuda": False}
        C.gpu_probe.cache_clear()
        monkeypatch.setenv("ATTN_REF_BENCH_GPU", "tpu")
        with pytest.raises(ValueError, match="ATTN_REF_BENCH_GPU names \\['tpu'\\]"):
            C.gpu_probe()
    finally:
        C.gpu_probe.cache_clear()


def _probe_with(monkeypatch, *, driver, child=None):
    """``C.gpu_probe()`` on a machine with or without an NVIDIA driver, its child faked."""
    monkeypatch.delenv("ATTN_REF_BENCH_GPU", raising=False)
    exists = os.path.exists
    monkeypatch.setattr(C.os.path, "exists", lambda p: driver if p == "/dev/nvidiactl" else exists(p))
    monkeypatch.setattr(C.shutil, "which", lambda n: "/usr/bin/nvidia-smi" if driver else None)
    pytest.importorskip("torch")  # gpu_probe asks a child only where a GPU library is installed

    def run(*args, **kwargs):
        if child is None:
            raise AssertionError("gpu_probe started a child without an NVIDIA driver")
        return subprocess.CompletedProcess(args, 0, stdout=child, stderr="")

    monkeypatch.setattr(C.subprocess, "run", run)
    C.gpu_probe.cache_clear()
    try:
        return C.gpu_probe()
    finally:
        C.gpu_probe.cache_clear()


def test_gpu_probe_reads_the_childs_answer(monkeypatch):
    none = {"cupy": False, "torch-cuda": False}
    # No driver: no GPU library can run, and no child is started.
    assert _probe_with(monkeypatch, driver=False) == none
    # A driver: the child's last line is the answer (CUDA may print warnings before it).
    got = _probe_with(monkeypatch, driver=True, child='warning\n{"cupy": true, "torch-cuda": false}\n')
    assert got == {"cupy": True, "torch-cuda": False}
    got = _probe_with(monkeypatch, driver=True, child='{"torch-cuda": true}\n')
    assert got == {"cupy": False, "torch-cuda": True}
    # A child that crashed before answering: no GPU.
    assert _probe_with(monkeypatch, driver=True, child="") == none


def test_gpu_probe_agrees_with_the_gpu_libraries_here(monkeypatch):
    # The real probe on this machine, against each library asked directly: on a machine
    # without a GPU both are False, on a GPU machine each is what its library says.
    monkeypatch.delenv("ATTN_REF_BENCH_GPU", raising=False)
    C.gpu_probe.cache_clear()
    try:
        probe = C.gpu_probe()
    finally:
        C.gpu_probe.cache_clear()
    asks = {"cupy": "import cupy; print(cupy.cuda.runtime.getDeviceCount() > 0)",
            "torch-cuda": "import torch; print(torch.cuda.is_available())"}
    driver = os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi")
    truth = {}
    for name, code in asks.items():
        if not driver:
            truth[name] = False  # CUDA cannot run without the NVIDIA driver
            continue
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        truth[name] = out.stdout.strip().splitlines()[-1:] == ["True"]
    assert probe == truth


def test_benchmarks_use_the_functions_default_tiles():
    from attn_ref.registry import Variant, get

    b = C.load_backend("numpy")
    online = get("online_softmax")
    assert online.options.get("block_q", 512) < 512  # test-sized in the registry
    assert C.benchmark_kwargs(online, b, 256) == {}

    def fn(q, k, v, *, window, block=64):
        return q

    # Without a configuration: the registry's options, less those with a default.
    v = Variant(name="fake", fn=fn, family="x", exact=False, causal=False, time="O(N w d)",
                memory="O(N w)", options={"window": 3, "block": 4})
    with pytest.warns(UserWarning, match="'fake' has no benchmark configuration"):
        assert C.benchmark_kwargs(v, b, 256) == {"window": 3}


# ------------------------------------------------------------- benchmark configurations


def test_every_configuration_is_of_a_registered_variant():
    # That every variant has a configuration is checked per variant in
    # tests/test_variants.py; here the converse, and missing_configs() agreeing.
    from attn_ref.registry import variants as registered

    names = [v.name for v in registered()]
    assert C.missing_configs() == [n for n in names if n not in C.BENCH_CONFIGS]
    assert sorted(set(C.BENCH_CONFIGS) - set(names)) == [], "configurations of no variant"
    for name, config in C.BENCH_CONFIGS.items():
        assert re.search(r"(19|20)\d\d", config.source), f"{name}: source names no paper"


def test_benchmark_arguments_are_the_configuration_not_the_registry():
    from attn_ref.registry import get

    b = C.load_backend("numpy")
    kw = C.benchmark_kwargs(get("linformer"), b, 1024)
    assert kw["e_proj"].shape == kw["f_proj"].shape == (256, 1024)
    assert C.benchmark_kwargs(get("performer"), b, 256)["projection"].shape == (256, C.HEAD_DIM)
    assert C.benchmark_kwargs(get("nystrom"), b, 256) == {"num_landmarks": 64}
    assert C.benchmark_kwargs(get("local"), b, 256) == {"window": 256}
    assert C.benchmark_kwargs(get("bigbird"), b, 256) == {
        "block_size": 64, "window": 1, "global_blocks": 2, "random_blocks": 3}
    assert C.benchmark_kwargs(get("strided"), b, 4096) == {"stride": 64}
    assert C.benchmark_kwargs(get("pooled"), b, 256) == {"num_segments": 86}
    compressed = C.benchmark_kwargs(get("compressed"), b, 256)
    assert compressed["stride"] == 3 and compressed["k_weight"].shape == (3, C.HEAD_DIM, C.HEAD_DIM)
    layout = C.benchmark_kwargs(get("block_sparse"), b, 4096)["layout"]
    assert len(layout) == 64 and all(row[a] for a, row in enumerate(layout))
    mean = sum(map(sum, layout)) / len(layout)
    assert 6 <= mean <= 10, mean  # the diagonal and ~7 random blocks


def test_sqrt_stride():
    assert [C.sqrt_stride(n) for n in (256, 512, 1024, 65536)] == [16, 32, 32, 256]
    for n in C.ALL_NS:
        s = C.sqrt_stride(n)
        assert s * s >= n and (s // 2) ** 2 < n and n % s == 0


# What each parameter must satisfy at sequence length N (the functions' own checks,
# and the papers' constraints); every integer parameter of a configuration needs a rule.
_VALID = {
    "rank": lambda v, n, c: 1 <= v <= n,
    "features": lambda v, n, c: v >= 1,
    "num_landmarks": lambda v, n, c: 1 <= v <= n,
    "num_clusters": lambda v, n, c: 1 <= v <= n,
    "topk": lambda v, n, c: 1 <= v <= n,
    "num_segments": lambda v, n, c: 1 <= v <= n,
    "kernel_size": lambda v, n, c: 1 <= v <= n,
    "stride": lambda v, n, c: 1 <= v <= n,
    "summary": lambda v, n, c: 1 <= v <= c["stride"],
    "window": lambda v, n, c: v >= 0,
    "block_size": lambda v, n, c: 1 <= v <= n,
    "blocks_per_row": lambda v, n, c: v >= 1,  # a budget; a short sequence has fewer
    "global_blocks": lambda v, n, c: 0 <= v <= -(-n // c["block_size"]),
    "random_blocks": lambda v, n, c: v >= 0,
    "chunk_size": lambda v, n, c: 1 <= v <= n,
    "n_buckets": lambda v, n, c: v >= 2 and v % 2 == 0,
    "n_hashes": lambda v, n, c: v >= 1,
    "n_iters": lambda v, n, c: v >= 0,
    "qk_l2norm": lambda v, n, c: isinstance(v, bool),
}


@pytest.mark.parametrize("name", sorted(C.BENCH_CONFIGS))
def test_configuration_is_valid_at_every_n(name):
    config = C.BENCH_CONFIGS[name]
    for n in C.ALL_NS:
        values = config.describe(n)
        for key, value in values.items():
            if key == "global_tokens":
                assert all(0 <= t < n for t in value) and len(set(value)) == len(value)
            elif isinstance(value, int):
                assert key in _VALID, f"{name}: no validity rule for {key!r}"
                assert _VALID[key](value, n, values), (name, key, value, n)


def test_configured_costs_set_the_caps():
    from attn_ref.registry import get

    def cap(name):
        return C.max_n(*C.benchmark_costs(get(name)), gpu=False)

    # N / s segments are quadratic; a stride of sqrt(N) is N^1.5, not N^2.
    assert cap("pooled") == cap("query_reduced") == cap("compressed") == 8192
    assert C.cost_exponent(C.benchmark_costs(get("strided"))[0]) == 1.5
    assert cap("strided") == 65536
    assert cap("fixed") == 8192  # l = 128, c = 32: N (l + c N / l) grows as N^2
    assert C.benchmark_costs(get("linformer")) == (get("linformer").time, get("linformer").memory)
    with pytest.raises(NotImplementedError, match="pooled at N=16384 exceeds its cap N=8192"):
        C.VariantCase("pooled", "numpy", 16384)


def test_flop_counts_hold_under_the_configurations():
    # FlopRate's counts assume full non-causal attention (4 N^2 d) or the linear order
    # of linear attention (4 N d^2): a configuration of those variants must keep that.
    from attn_ref.registry import get

    b = C.load_backend("numpy")
    assert variants.FlopRate.params[0] == ["softmax", "online_softmax", "linear"]
    for name in variants.FlopRate.params[0]:
        v = get(name)
        assert C.benchmark_costs(v) == (v.time, v.memory)
        kw = C.benchmark_kwargs(v, b, 256)
        assert kw.get("causal", False) is False and kw.get("order", "linear") == "linear"
        assert "window" not in kw and "mask" not in kw


def test_asv_version_covers_the_configurations(monkeypatch):
    for cls in (variants.Attention, variants.FlopRate):
        assert str(cls.version).startswith("paper-configs-")
    assert variants.Attention.version != variants.FlopRate.version

    def bench(self):
        pass

    before = C.benchmark_version(bench)
    assert C.benchmark_version(bench) == before
    monkeypatch.setitem(C.BENCH_CONFIGS, "local", C.BenchConfig("test", options={"window": 128}))
    assert C.benchmark_version(bench) != before


def test_readme_lists_the_configurations():
    with open(os.path.join(ROOT, "README.md")) as fh:
        readme = fh.read()
    assert C.config_table() in readme


def _fake(name, fn, **kw):
    from attn_ref.registry import Variant

    return Variant(name=name, fn=fn, family="x", exact=False, causal=False, time="O(N w d)",
                   memory="O(N w)", **kw)


def test_an_older_function_skips_with_the_reason(monkeypatch):
    # asv runs the suite against older commits: a function without a configured
    # parameter, or requiring one the configuration does not set, is a stated skip.
    b = C.load_backend("numpy")

    def no_window(q, k, v, *, width):
        return q

    def more_required(q, k, v, *, window, block_size):
        return q

    with pytest.raises(NotImplementedError, match=r"no_window takes no \['window'\]"):
        C.benchmark_kwargs(_fake("local", no_window), b, 256)
    with pytest.raises(NotImplementedError, match=r"requires \['block_size'\]"):
        C.benchmark_kwargs(_fake("local", more_required), b, 256)

    def linformer(q, k, v, *, e_proj, f_proj=None):
        return q

    import attn_ref.lowrank

    monkeypatch.delattr(attn_ref.lowrank, "linformer_projection")
    with pytest.raises(NotImplementedError, match="linformer_projection does not exist"):
        C.benchmark_kwargs(_fake("linformer", linformer), b, 256)

    def old_projection(k, n, seed):
        raise AssertionError("not called")

    monkeypatch.setattr(attn_ref.lowrank, "linformer_projection", old_projection, raising=False)
    with pytest.raises(NotImplementedError, match="building the arguments .* failed at this commit"):
        C.benchmark_kwargs(_fake("linformer", linformer), b, 256)


def test_a_skip_reaches_asv_from_setup(monkeypatch):
    from attn_ref import registry

    def no_window(q, k, v, *, width):
        return q

    monkeypatch.setattr(registry, "get", lambda name: _fake("local", no_window))
    with pytest.raises(NotImplementedError, match="takes no"):
        variants.Attention().setup("local", "numpy", 256)


def test_analytic_flops():
    assert C.analytic_flops("O(N^2 d)", 1024) == 8 * 4 * 1024**2 * 64
    assert C.analytic_flops("O(N  d^2)", 1024) == 8 * 4 * 1024 * 64**2
    assert C.analytic_flops("O(N m d)", 1024) is None


def _run_cases():
    """Every variant on NumPy; two (one quadratic, one linear) on the other CPU backends."""
    names, backends = variants.Attention.params[0], variants.Attention.params[1]
    out = [(n, "numpy") for n in names]
    for b in backends:
        if b not in ("numpy", "cupy"):
            out += [(n, b) for n in ("softmax", "linear") if n in names]
    return out


@pytest.mark.parametrize("name, backend", _run_cases())
def test_variant_runs_in_the_benchmark(name, backend):
    # With its benchmark configuration (the papers' parameters) at the smallest N.
    bench = variants.Attention()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to the registry's arguments
        bench.setup(name, backend, 256)
    options, _ = C.BENCH_CONFIGS[name].resolve(256)
    assert {k: bench.case.kwargs[k] for k in options} == options
    out = C.host_copy(bench.case.run())
    assert out.shape == (C.HEADS, 256, C.HEAD_DIM) and out.dtype == np.float32
    assert np.isfinite(out).all()
    bench.peakmem_forward(name, backend, 256)
    bench.teardown(name, backend, 256)


def test_flop_rate_and_matmul_track_positive_rates(monkeypatch):
    monkeypatch.setattr(variants.FlopRate, "N_HOST", 256)
    fr = variants.FlopRate()
    fr.setup("softmax", "numpy")
    assert fr.flops == 8 * 4 * 256**2 * 64
    assert fr.track_gflops("softmax", "numpy") > 0
    mm = peers.Matmul()
    mm.setup("numpy")
    rate = mm.track_gflops("numpy")
    assert 0 < rate < 1e5


def test_numpy_peer_is_softmax_attention():
    from attn_ref import softmax_attention

    q, k, v = C.inputs(256)
    got = peers.numpy_oneshot(q, k, v)
    want = softmax_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_torch_sdpa_peer_matches_numpy():
    pytest.importorskip("torch")
    configs = peers.TorchSDPA.params[0]
    assert {"cpu-float32", "cpu-flash-float32", "cpu-math-float32"} <= set(configs)
    want = peers.numpy_oneshot(*C.inputs(256))
    for config in (c for c in configs if c.startswith("cpu")):
        bench = peers.TorchSDPA()
        bench.setup(config, 256)
        assert tuple(bench.q.shape) == (1, C.HEADS, 256, C.HEAD_DIM), config  # 4-D: fused path
        got = bench.run().numpy()[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=config)
    with pytest.raises(NotImplementedError, match="exceeds the cap"):
        bench.setup("cpu-float32", 65536)
    with pytest.raises(NotImplementedError, match="exceeds the cap N=8192"):
        bench.setup("cpu-math-float32", 16384)  # the math path holds N x N logits


# Peak memory of one SDPA call per CPU configuration, one head at N = 8192, in a fresh
# process: torch's allocator is invisible to tracemalloc, the RSS high-water mark is
# not. The math configuration runs last, as the high-water mark only rises.
# The peak is the process's own VmHWM: getrusage's ru_maxrss survives exec, so a child
# of a large pytest worker starts at the worker's peak and shows no growth at all.
_SDPA_PEAK = r"""
import json, sys
from asv_benches import peers

def peak():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

out = {}
for config in sys.argv[2:]:
    bench = peers.TorchSDPA()
    bench.heads = 1
    bench.setup(config, int(sys.argv[1]))
    before = peak()
    bench.run()
    out[config] = peak() - before
print(json.dumps(out))
"""


def test_torch_sdpa_peer_stays_on_the_fused_path():
    # A configuration that falls to SDPA's math path (3-D inputs did, silently: 5.5x
    # slower at N = 8192) holds the N x N logits; the fused kernel holds O(N). The
    # forced math row shows that the measurement sees the logits.
    pytest.importorskip("torch")
    import subprocess
    import sys

    n = 8192
    logits = n * n * 4  # one head's float32 N x N: 256 MiB
    done = subprocess.run([sys.executable, "-c", _SDPA_PEAK, str(n), "cpu-float32",
                           "cpu-flash-float32", "cpu-math-float32"], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    peak = json.loads(done.stdout.strip().splitlines()[-1])
    mib = {c: round(b / 2**20) for c, b in peak.items()}
    assert peak["cpu-float32"] < logits / 8, f"default SDPA holds O(N^2) memory (MiB): {mib}"
    assert peak["cpu-flash-float32"] < logits / 8, mib
    # measured 587-616 MiB (the logits and their softmax) against 256 MiB for one matrix
    assert peak["cpu-math-float32"] > 0.9 * logits, f"the math path's logits were not seen: {mib}"


def test_jax_peer_matches_numpy():
    pytest.importorskip("jax")
    bench = peers.JaxDotProductAttention()
    bench.setup("cpu-float32", 256)
    assert tuple(bench.q.shape) == (1, 256, C.HEADS, C.HEAD_DIM)  # JAX's (B, T, H, d)
    got = np.swapaxes(np.asarray(bench.run())[0], 0, 1)
    np.testing.assert_allclose(got, peers.numpy_oneshot(*C.inputs(256)), rtol=1e-4, atol=1e-5)
    with pytest.raises(NotImplementedError, match="exceeds the cap N=8192"):
        bench.setup("cpu-float32", 16384)


def test_baseline_loads_each_backend():
    # Every installed CPU library is a Baseline case; each loads and holds the tiny input.
    cases = peers.Baseline.params[0]
    installed = [b for b in C.CPU_BACKENDS if importlib.util.find_spec(b) is not None]
    assert [b for b in cases if b != "cupy"] == installed
    want = C.inputs(1)[0]
    for backend in cases:
        if backend == "cupy":
            continue
        bench = peers.Baseline()
        bench.setup(backend)
        assert bench.b.name == backend
        assert array_api_compat.array_namespace(bench.x) is array_api_compat.array_namespace(
            bench.b.xp.asarray(want)), backend
        np.testing.assert_array_equal(C.host_copy(bench.x), want)
        bench.peakmem_loaded(backend)


def _asv_conf():
    with open(os.path.join(ROOT, "asv.conf.json")) as fh:
        text = fh.read()
    return json.loads(re.sub(r"^\s*//.*$", "", text, flags=re.M))


def test_asv_conf_points_at_the_suite():
    conf = _asv_conf()
    assert conf["benchmark_dir"] == "asv_benches" and conf["repo"] == "."
    assert conf["environment_type"] == "virtualenv"
    assert conf["matrix"]["req"]["torch"] == ["2.13.0"]
    assert os.path.isdir(os.path.join(ROOT, conf["benchmark_dir"]))
    with open(os.path.join(ROOT, "pyproject.toml")) as fh:
        assert '"asv==0.6.6"' in fh.read()


def test_timeouts_cover_the_slowest_cases():
    # A case at its cap must be able to finish: the per-case timeout is generous,
    # and the time benchmarks do not loop (number = 1).
    assert variants.Attention.timeout >= 600 and variants.Attention.number == 1
    assert math.isclose(variants.Attention.repeat[2], 10.0)


# ------------------------------------------------------------------------- roofline


def test_every_registered_variant_has_a_work_count():
    # A new variant needs its least work in asv_benches/costs.py WORK (the roofline).
    from asv_benches.costs import WORK
    from attn_ref.registry import variants as registered

    names = [v.name for v in registered()]
    assert sorted(set(names) - set(WORK)) == [], "add these to WORK in asv_benches/costs.py"
    assert sorted(set(WORK) - set(names)) == [], "work counts of no variant"


def test_softmax_work_is_the_textbook_count():
    from asv_benches.costs import variant_work

    n, d, h = 4096, C.HEAD_DIM, C.HEADS
    w = variant_work("online_softmax", n, C.BENCH_CONFIGS["online_softmax"].describe(n))
    assert w.gemm_flops == 4 * n * n * d * h and w.transcendentals == n * n * h
    assert w.bytes == 4 * n * d * h * 4
    lin = variant_work("linear", n, C.BENCH_CONFIGS["linear"].describe(n))
    # the normaliser rides along as a column of ones after V (asv_benches/costs.py)
    assert lin.gemm_flops == 4 * n * d * (d + 1) * h
    assert lin.transcendentals == 2 * n * d * h and lin.bytes == 4 * n * d * h * 4


def test_causal_linear_work_adds_the_causal_half_of_each_chunk():
    # The causal count is the non-causal one plus the in-chunk products' causal half,
    # counted here pair by pair: key j <= query i of the same chunk, 2 d flops for the
    # score and 2 (d + 1) for its product with [V, 1] (a count of the whole C x C
    # products, or of the strict half, fails).
    from dataclasses import astuple

    from asv_benches.costs import Work, linear_causal_work, variant_work

    n, d, c, h = 256, 8, 16, 3
    pairs = sum(1 for i in range(n) for j in range(n) if j // c == i // c and j <= i)
    causal = linear_causal_work(n, d, chunk_size=c, heads=h)
    plain = variant_work("linear", n, {}, d=d, heads=h)
    extra = Work(*(a - b for a, b in zip(astuple(causal), astuple(plain))))
    assert extra.gemm_flops == pytest.approx(h * pairs * (2 * d + 2 * (d + 1)))
    assert extra.transcendentals == 0 and extra.bytes == 0
    assert extra.elementwise == pytest.approx(h * (n * c / 2 + n * d * (d + 1) / c))


@pytest.mark.parametrize("name", sorted(C.BENCH_CONFIGS))
def test_work_grows_as_the_benchmarked_cost(name):
    # The count's growth in N between the two largest benchmarked sizes is the
    # configured cost's exponent (a count that forgot a term, or counted a
    # quadratic variant as linear, fails).
    from asv_benches.costs import variant_work
    from attn_ref.registry import get

    time_cost, memory_cost = C.benchmark_costs(get(name))
    cap = C.max_n(time_cost, memory_cost, gpu=False)
    config = C.BENCH_CONFIGS[name]

    def total(n):
        w = variant_work(name, n, config.describe(n))
        assert min(w.gemm_flops, w.transcendentals, w.elementwise, w.bytes) >= 0, name
        return w.gemm_flops + w.transcendentals + w.elementwise

    exponent = math.log2(total(cap) / total(cap // 4)) / 2
    want = C.cost_exponent(time_cost)
    if want is None:  # block_sparse: nnz blocks grow with N at a fixed budget per row
        want = 1.0
    assert abs(exponent - want) < 0.2, (name, exponent, time_cost)


def test_roofline_is_compute_or_memory_bound():
    from asv_benches.costs import Work

    rates = {"gemm_flops": 1e11, "exp": 1e9, "elementwise": 1e10, "bandwidth": 1e10}
    assert Work(1e11, 1e9, 1e10, 0.0).seconds(rates) == pytest.approx(3.0)
    assert Work(1e11, 0.0, 0.0, 5e10).seconds(rates) == pytest.approx(5.0)
    assert (Work(1.0, 2.0, 3.0, 4.0) + Work(1.0, 1.0, 1.0, 1.0)) * 2 == Work(4.0, 6.0, 8.0, 10.0)


def test_targets_measure_the_roofline_rates(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("targets", os.path.join(ROOT, "tools", "targets.py"))
    targets = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(targets)
    rates = targets.roofline_rates(("numpy",), reps=1)["numpy"]
    assert set(rates) == {"gemm_flops", "exp", "elementwise", "bandwidth"}
    assert all(0 < r < 1e14 for r in rates.values()), rates
    with pytest.raises(ValueError, match="backends must be among"):
        targets.roofline_rates(("tpu",))


def test_targets_linear_phases_name_every_phase(capsys):
    # The phase table of ``tools/targets.py linear --phases`` re-spells the block loop of
    # attn_ref.linear; every phase must be timed, and the pool row must run.
    import importlib.util

    spec = importlib.util.spec_from_file_location("targets", os.path.join(ROOT, "tools", "targets.py"))
    targets = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(targets)
    targets.main(["linear", "--ns", "600", "--reps", "1", "--phases", "--block-size", "256", "--pool"])
    out = capsys.readouterr().out
    for phase in ("phi(K): min, exp", "phi(K): + max", "[V | 1] copy", "fold GEMM", "phi(Q): min, exp",
                  "phi(Q): + max", "read GEMM", "output write", "times 1 / den (in place)"):
        assert f"    {phase} " in out, phase
    assert "blocks of 256 rows" in out and "causal, heads on the pool" in out


def test_targets_roofline_rates_are_the_better_of_one_caller_and_all_cores():
    # The roofline must stay below any implementation's time however it spreads its work
    # over the cores: each rate is the better of one caller (the library's threads) and
    # one caller per CPU at once, and both are reported.
    import contextlib
    import importlib.util
    import time

    spec = importlib.util.spec_from_file_location("targets", os.path.join(ROOT, "tools", "targets.py"))
    targets = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(targets)
    held = []

    @contextlib.contextmanager
    def hold():
        held.append(True)
        yield

    detail = {}
    # one caller: 1 unit in 40 ms; two callers at once: 1 unit each in 10 ms (sleeping
    # threads overlap): the spread rate is the better, about 8x
    rate = targets._best_rate(lambda: time.sleep(0.04), 1.0, [lambda: time.sleep(0.01)] * 2, 1.0,
                              1, time.perf_counter, hold, detail, "x")
    single, spread = detail["x"]
    assert held == [True] and rate == spread == max(single, spread) and spread > 3 * single
    rate = targets._best_rate(lambda: time.sleep(0.01), 1.0, [lambda: time.sleep(0.04)] * 2, 1.0,
                              1, time.perf_counter, hold, detail, "y")
    assert rate == detail["y"][0] > detail["y"][1]
    detail = {}
    rates = targets.roofline_rates(("numpy",), reps=1, detail=detail)["numpy"]
    assert set(detail["numpy"]) == set(rates)
    assert all(rates[k] == max(detail["numpy"][k]) for k in rates)
    old = targets.one_caller_rates({"numpy": rates}, detail)["numpy"]
    assert all(old[k] == detail["numpy"][k][0] <= rates[k] for k in rates)


def test_targets_buffered_linear_is_the_library_loop_bit_for_bit(monkeypatch):
    # ``tools/targets.py linear --buffered`` prices attn_ref.linear's non-causal loop
    # with NumPy's out= buffers: it must re-spell the same operations in the same order,
    # so any change to the library's loop that it misses shows here as different bits.
    import importlib.util

    import attn_ref._common as common
    from attn_ref import linear_attention

    spec = importlib.util.spec_from_file_location("targets", os.path.join(ROOT, "tools", "targets.py"))
    targets = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(targets)
    rng = np.random.default_rng(40)
    q, k, v = (rng.standard_normal((4, 1024, 64), dtype=np.float32) for _ in range(3))
    want = linear_attention(q, k, v)
    for cpus in (1, 2):
        monkeypatch.setattr(common, "cpu_count", lambda cpus=cpus: cpus)
        assert np.array_equal(targets._buffered_linear(q, k, v), want)
    # and it is not trivially equal: elu+1 with the maximum left out differs
    monkeypatch.setattr(targets.np, "maximum", lambda x, y, out: np.multiply(x, 0.0, out=out))
    assert not np.array_equal(targets._buffered_linear(q, k, v), want)


def test_targets_softmax_passes_follow_the_library(capsys):
    # ``tools/targets.py softmax --passes`` re-spells the online softmax's tile loop:
    # NumPy with the row sums in P [V | 1], one head at a time at these tiles; torch with
    # a row-sum pass, in groups of TORCH_TILE_LOGITS.
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("targets", os.path.join(ROOT, "tools", "targets.py"))
    targets = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(targets)
    rate = {"gemm_flops": 1e11, "exp": 1e9, "elementwise": 1e10}
    q, k, v = (np.random.default_rng(41).standard_normal((4, 1024, 16), dtype=np.float32) for _ in range(3))
    targets._softmax_passes("numpy", q, k, v, 512, 1024, rate)  # the default tiles
    out = capsys.readouterr().out
    assert "1 head(s) at a time" in out and "row sums in P [V | 1]" in out
    targets._softmax_passes("torch", *(torch.from_numpy(x) for x in (q, k, v)), 512, 1024, rate)
    out = capsys.readouterr().out
    assert "2 head(s) at a time" in out and "row sums as a pass" in out
    for phase in ("logits GEMM", "row max", "shift (in place)", "exp", "P V GEMM", "row sums", "rescale acc"):
        assert f"    {phase} " in out, phase
