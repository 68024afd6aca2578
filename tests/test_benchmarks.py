"""The asv suite (asv_benches/): it imports, its grid is well formed, every case runs.

Speed is not measured here; each benchmark body runs once at the smallest N so that a
variant that breaks under the benchmark's shapes fails in CI, not in the next asv run.
"""

import importlib
import inspect
import json
import math
import os
import pkgutil
import re

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
            "peers.Matmul", "peers.Baseline"} <= set(CLASSES)
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


def test_gpu_probe_without_a_gpu():
    probe = C.gpu_probe()
    assert set(probe) == {"cupy", "torch-cuda"} and all(isinstance(v, bool) for v in probe.values())
    if not os.path.exists("/dev/nvidiactl"):
        assert not any(probe.values())


def test_benchmarks_use_the_functions_default_tiles():
    from attn_ref.registry import Variant, get

    b = C.load_backend("numpy")
    online = get("online_softmax")
    assert online.options.get("block_q", 512) < 512  # test-sized in the registry
    assert C.benchmark_kwargs(online, b, 256) == {}

    def fn(q, k, v, *, window, block=64):
        return q

    v = Variant(name="fake", fn=fn, family="x", exact=False, causal=False, time="O(N w d)",
                memory="O(N w)", options={"window": 3, "block": 4})
    assert C.benchmark_kwargs(v, b, 256) == {"window": 3}


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
    bench = variants.Attention()
    bench.setup(name, backend, 256)
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
    bench = peers.TorchSDPA()
    bench.setup("cpu-float32", 256)
    got = bench.run().numpy()
    np.testing.assert_allclose(got, peers.numpy_oneshot(*C.inputs(256)), rtol=1e-4, atol=1e-5)
    with pytest.raises(NotImplementedError, match="exceeds the cap"):
        bench.setup("cpu-float32", 65536)


def test_baseline_loads_each_backend():
    for backend in peers.Baseline.params[0]:
        if backend == "cupy":
            continue
        bench = peers.Baseline()
        bench.setup(backend)
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
