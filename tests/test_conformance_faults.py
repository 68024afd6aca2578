"""conformance: kernel faults, backward= containers, vector loading, report determinism.

Issue 14 items 5-7: whatever a kernel does - raise, ``sys.exit()``, Ctrl-C, hang, return
the wrong thing from its backward, or ship tampered vectors - the oracle reports it and
never exits 0 or passes; and the report JSON of two identical runs is byte-identical
without its timings section.
"""

import json
import signal
import sys
import threading
import time

import numpy as np
import pytest

import attn_ref
from conformance import cases, verify
from conformance.calling import KernelTimeout, Watchdog, call_kernel
from conformance.mutants import MUTANTS, correct_kernel
from conformance.oracle import Interrupted
from conformance.vectors import export_vectors, load_vectors
from tests.helpers import run_plugin

QUICK = cases(None, "quick")
BASIC = [c for c in QUICK if c.id.startswith("basic:")]  # (2, 3) heads, Nq = Nk = 17
BIAS = [c for c in QUICK if c.id.startswith("bias:")]
# The "hung" kernels give up after HANG seconds, so that a broken watchdog makes the
# tests fail on their timing instead of hanging the suite.
HANG = 20.0


def _cli(*args):
    from conformance.cli import main

    return main(list(args))


# ------------------------------------------------------------------ exceptions, sys.exit


@pytest.mark.parametrize("code", [0, 1, "bye"])
def test_sys_exit_in_a_kernel_is_an_error_row_never_a_pass(code):
    def exits(q, k, v):
        sys.exit(code)

    rep = verify(exits, "softmax", backend="numpy", cases=QUICK[:3], progress=False)
    assert not rep.passed and rep.counts["error"] == 3 and rep.counts["pass"] == 0
    assert all(f"SystemExit: {code}" in r.diagnosis for r in rep.failures)


def test_sys_exit_kernel_on_the_command_line_exits_1_with_the_table(tmp_path, capsys):
    mod = tmp_path / "exits.py"
    mod.write_text("import sys\ndef kernel(q, k, v):\n    sys.exit(0)\n")
    assert _cli("verify", f"{mod}:kernel", "--suite", "quick") == 1
    out = capsys.readouterr().out
    assert "SystemExit: 0" in out and "FAIL" in out


def test_any_base_exception_but_keyboard_interrupt_is_caught():
    class Odd(BaseException):
        pass

    for exc in (Odd("odd"), GeneratorExit(), MemoryError("oom"), KernelTimeout()):
        c = call_kernel(lambda e=exc: (_ for _ in ()).throw(e))
        assert not c.ok and type(exc).__name__ in c.fault and not c.timed_out
    with pytest.raises(KeyboardInterrupt):
        call_kernel(lambda: (_ for _ in ()).throw(KeyboardInterrupt()))


# ------------------------------------------------------------------ KeyboardInterrupt


def _interrupting_after(n):
    calls = []

    def kernel(q, k, v, *, mask=None, bias=None, causal=False, scale=None):
        calls.append(1)
        if len(calls) > n:
            raise KeyboardInterrupt
        return correct_kernel(q, k, v, mask=mask, bias=bias, causal=causal, scale=scale)

    return kernel


def test_keyboard_interrupt_stops_verify_with_the_partial_report():
    with pytest.raises(Interrupted) as info:
        verify(_interrupting_after(2), "softmax", backend="numpy", cases=QUICK[:6], progress=False)
    assert isinstance(info.value, KeyboardInterrupt)  # an uncaught one still stops a script
    rep = info.value.report
    assert [r.verdict for r in rep.results] == ["pass", "pass"]
    assert not rep.passed and QUICK[2].id in rep.interrupted
    assert rep.summary().startswith("INTERRUPTED") and "incomplete" in rep.table()
    assert json.loads(rep.to_json())["interrupted"] == rep.interrupted


def test_keyboard_interrupt_on_the_command_line_prints_the_partial_table(tmp_path, capsys):
    mod = tmp_path / "ctrl_c.py"
    mod.write_text("from conformance.mutants import correct_kernel\ncalls = []\n"
                   "def kernel(q, k, v, *, mask=None, bias=None, causal=False, scale=None):\n"
                   "    calls.append(1)\n"
                   "    if len(calls) > 3:\n"
                   "        raise KeyboardInterrupt\n"
                   "    return correct_kernel(q, k, v, mask=mask, bias=bias, causal=causal, "
                   "scale=scale)\n")
    path = tmp_path / "r.json"
    assert _cli("verify", f"{mod}:kernel", "--suite", "quick", "--json", str(path)) == 130
    out = capsys.readouterr().out
    assert "INTERRUPTED: 3 passed" in out and QUICK[0].id in out
    assert json.loads(path.read_text())["passed"] is False


# ------------------------------------------------------------------ deterministic=True


@pytest.mark.parametrize("fault, verdict, words", [
    (lambda: 1 / 0, "error", "ZeroDivisionError"),
    (lambda: sys.exit(0), "error", "SystemExit"),
    (lambda: time.sleep(HANG), "fail", "timed out"),
], ids=["raises", "exits", "hangs"])
def test_a_fault_on_the_second_call_is_a_row_not_an_escape(fault, verdict, words):
    calls = []

    def second_call_faults(q, k, v):
        calls.append(1)
        if len(calls) % 2 == 0:
            fault()
        return correct_kernel(q, k, v)

    t0 = time.perf_counter()
    rep = verify(second_call_faults, "softmax", backend="numpy", cases=BASIC, deterministic=True,
                 time_limit=1.0, progress=False)
    assert time.perf_counter() - t0 < 10
    (row,) = rep.results
    assert row.verdict == verdict and "second call" in row.diagnosis and words in row.diagnosis


# ------------------------------------------------------------------ the time limit


def _sleeps(q, k, v):
    time.sleep(HANG)
    return correct_kernel(q, k, v)


def _spins(q, k, v):
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < HANG:
        pass
    return correct_kernel(q, k, v)


def _swallows(q, k, v):
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < HANG:  # retries on any Exception: must still be stopped
        try:
            time.sleep(0.01)
        except Exception:
            pass
    return correct_kernel(q, k, v)


@pytest.mark.parametrize("kernel", [_sleeps, _spins, _swallows], ids=lambda f: f.__name__)
def test_a_hung_kernel_is_stopped_at_the_time_limit(kernel):
    verify(correct_kernel, "softmax", backend="numpy", cases=BASIC, progress=False)  # warm caches
    t0 = time.perf_counter()
    rep = verify(kernel, "softmax", backend="numpy", cases=BASIC, time_limit=1.0, progress=False)
    wall = time.perf_counter() - t0
    (row,) = rep.results
    assert row.verdict == "fail" and "timed out" in row.diagnosis and "time limit of 1 s" in row.diagnosis
    assert 1.0 <= row.time_s < 2.0 and wall < 3.0, (row.time_s, wall)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # nothing left armed


def test_a_call_the_watchdog_cannot_interrupt_is_reported_as_such():
    """C code that never lets a signal handler run (simulated by blocking SIGALRM) is
    stopped only when it returns; the row says so instead of claiming the limit held."""

    def in_c(q, k, v):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        try:
            time.sleep(1.6)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})
        return correct_kernel(q, k, v)

    (row,) = verify(in_c, "softmax", backend="numpy", cases=BASIC, time_limit=0.3,
                    progress=False).results
    assert row.verdict == "fail" and row.time_s >= 1.6
    assert "timed out" in row.diagnosis and "only when it returned" in row.diagnosis


def test_the_time_limit_holds_off_the_main_thread_too():
    out = {}

    def run():
        out["rep"] = verify(_spins, "softmax", backend="numpy", cases=BASIC, time_limit=0.5,
                            progress=False)

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    assert not t.is_alive()
    (row,) = out["rep"].results
    assert row.verdict == "fail" and "timed out" in row.diagnosis and row.time_s < 1.5


def test_a_fast_kernel_is_untouched_by_the_time_limit():
    rep = verify(correct_kernel, "softmax", backend="numpy", cases=QUICK, time_limit=5.0,
                 causal="both", progress=False)
    assert rep.passed, rep.table()
    with pytest.raises(ValueError, match="time_limit must be positive"):
        verify(correct_kernel, "softmax", backend="numpy", cases=BASIC, time_limit=0)
    with pytest.raises(TypeError, match="time_limit must be a number"):
        verify(correct_kernel, "softmax", backend="numpy", cases=BASIC, time_limit="60")


def test_the_watchdog_keeps_an_outer_alarm_working():
    """pytest-timeout's signal method arms ITIMER_REAL too: it must still fire, on time."""
    fired = []
    old = signal.signal(signal.SIGALRM, lambda s, f: fired.append(time.monotonic()))
    try:
        t0 = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, 0.3)  # outer deadline first
        assert call_kernel(time.sleep, 0.6, time_limit=5.0).ok
        assert len(fired) == 1 and 0.25 < fired[0] - t0 < 0.5
        fired.clear()
        t0 = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, 0.8)  # ours first: theirs is re-armed after
        c = call_kernel(time.sleep, 30, time_limit=0.3)
        assert c.timed_out and not fired and 0.3 <= c.elapsed < 0.6
        assert 0.3 < signal.getitimer(signal.ITIMER_REAL)[0] <= 0.55
        time.sleep(0.7)
        assert len(fired) == 1 and 0.7 < fired[0] - t0 < 1.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    with Watchdog(None):  # no limit arms nothing
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_plugin_takes_the_time_limit(tmp_path, monkeypatch):
    (tmp_path / "hangs.py").write_text("import time\ndef kernel(q, k, v):\n    time.sleep(30)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    t0 = time.perf_counter()
    code, seen = run_plugin(monkeypatch, tmp_path, "--attn-kernel", "hangs:kernel", "--attn-suite",
                            "quick", "--attn-time-limit", "0.5", "-k", "basic or length1")
    failed = [r.longreprtext for r in seen.reports if r.failed]
    assert code == 1 and len(failed) == 3, failed
    assert all("timed out" in text for text in failed), failed
    assert time.perf_counter() - t0 < 60  # not 3 x 30 s


# ------------------------------------------------------------------ backward= containers


def _backward(q, k, v, do, *, mask=None, bias=None, causal=False, scale=None):
    g = attn_ref.grad.softmax_attention(q, k, v, do, mask=mask, bias=bias, causal=causal,
                                        scale=scale)
    return {"d" + n: x.astype(q.dtype) for n, x in g.items() if x is not None}


def _wrong(**change):
    """A correct backward with one gradient replaced by ``change[name](grads, inputs)``."""

    def backward(q, k, v, do, **kw):
        g = _backward(q, k, v, do, **kw)
        for n, f in change.items():
            g[n] = f(g, {"q": q, "k": k, "v": v, "do": do, **kw})
        return g

    return backward


def _grad_rows(backward, cases=BASIC, **kw):
    rep = verify(correct_kernel, "softmax", backend="numpy", cases=cases, backward=backward,
                 progress=False, **kw)
    return rep, [r for r in rep.results if r.output != "out"]


def test_a_correct_backward_passes_the_container_checks():
    rep, rows = _grad_rows(_backward, cases=BASIC + BIAS, dtypes=("float32", "float16"))
    assert rep.passed, rep.table()
    assert {r.output for r in rows} == {"dq", "dk", "dv", "dbias"}


def _write(name):
    def f(g, a):
        a[name][...] = 0  # in place, as a careless fused kernel might
        return g["d" + name] if name in "qkv" else g["dq"]

    return f


@pytest.mark.parametrize("backward, words", [
    (_wrong(dq=lambda g, a: g["dq"].astype(np.float64)), "dq dtype float64, expected float32"),
    (_wrong(dk=lambda g, a: g["dk"].tolist()), "dk is a list, expected a numpy array"),
    (_wrong(dv=lambda g, a: g["dv"][..., :-1]), "dv shape (2, 3, 17, 15), expected (2, 3, 17, 16)"),
    (_wrong(dq=lambda g, a: np.full(g["dq"].shape, "x")), "dq dtype <U1, expected float32"),
    (_wrong(dq=lambda g, a: np.array(None)), "dq dtype object"),
    (_wrong(dq=lambda g, a: "not an array"), "dq is a str"),
    (_wrong(dk=_write("q")), "backward modified its input 'q' in place"),
    (_wrong(dq=_write("do")), "backward modified its input 'do' in place"),
    (_wrong(dv=lambda g, a: np.where(g["dv"] > 1, np.nan, g["dv"]).astype(np.float32)),
     "NaN/Inf values where the golden is finite"),
], ids=["float64", "list", "shape", "strings", "object", "str", "writes-q", "writes-do", "nan"])
def test_a_wrong_backward_container_fails_never_crashes(backward, words):
    rep, rows = _grad_rows(backward)
    assert not rep.passed
    assert any(words in r.diagnosis and r.verdict == "fail" for r in rows), rep.table()


def test_a_wrong_dbias_fails():
    rep, rows = _grad_rows(_wrong(dbias=lambda g, a: g["dbias"].astype(np.float64)), cases=BIAS)
    assert [r.output for r in rep.failures] == ["dbias"], rep.table()
    assert "dbias dtype float64" in rep.failures[0].diagnosis


def test_a_backward_that_exits_or_hangs_is_a_row():
    def exits(q, k, v, do, **kw):
        sys.exit(0)

    _, rows = _grad_rows(exits)
    assert [(r.verdict, r.output) for r in rows] == [("error", "grads")]
    assert "kernel backward raised SystemExit: 0" in rows[0].diagnosis

    def hangs(q, k, v, do, **kw):
        _spins(q, k, v)
        return _backward(q, k, v, do, **kw)

    _, rows = _grad_rows(hangs, time_limit=0.5)
    assert [(r.verdict, r.output) for r in rows] == [("fail", "grads")]
    assert "timed out" in rows[0].diagnosis and rows[0].time_s < 1.5


def test_a_non_numeric_gradient_through_a_custom_backend_fails():
    be = (lambda host, dtype: np.asarray(host, dtype=dtype), lambda x: np.asarray(x))
    bad = _wrong(dq=lambda g, a: [["a", "b"]])
    rep = verify(correct_kernel, "softmax", backend=be, cases=BASIC, backward=bad, progress=False)
    (row,) = [r for r in rep.results if r.output == "dq"]
    assert row.verdict == "fail" and "dq shape (1, 2), expected (2, 3, 17, 16)" in row.diagnosis
    bad = _wrong(dq=lambda g, a: np.full(g["dq"].shape, "x"))
    rep = verify(correct_kernel, "softmax", backend=be, cases=BASIC, backward=bad, progress=False)
    (row,) = [r for r in rep.results if r.output == "dq"]
    assert row.verdict == "fail" and "dq is not numeric" in row.diagnosis


def test_torch_gradients_from_another_library_or_device_fail():
    torch = pytest.importorskip("torch")

    def on_torch(g, a):
        return torch.from_numpy(g["dq"])

    rep, _ = _grad_rows(_wrong(dq=on_torch))
    assert "dq is a torch array, expected numpy like the inputs" in rep.failures[0].diagnosis

    def kernel(q, k, v):
        s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        return torch.softmax(s, -1) @ v

    def backward(q, k, v, do):
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
        grads = torch.autograd.grad(kernel(*leaves), leaves, grad_outputs=do)
        return grads[0].to("meta"), grads[1], grads[2]

    rep = verify(kernel, "softmax", backend="torch", cases=BASIC, backward=backward, progress=False)
    assert [r.output for r in rep.failures] == ["dq"], rep.table()
    assert "dq on device meta, expected cpu" in rep.failures[0].diagnosis


# ------------------------------------------------------------------ vectors


@pytest.fixture
def vectors(tmp_path):
    d = tmp_path / "vec"
    export_vectors(d, "softmax", dtypes=("float32", "bfloat16"), cases=BASIC + BIAS)
    return d


def _manifest(d, edit):
    path = d / "manifest.json"
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m))


def test_untouched_vectors_load(vectors):
    got = list(load_vectors(vectors))
    assert len(got) == 4 and got[1][1]["q"].dtype == np.float32  # bfloat16 widened


@pytest.mark.parametrize("edit, words", [
    (lambda m: m.update(version=2), "manifest version 2; this attn-ref reads version 1"),
    (lambda m: m.pop("version"), "manifest version None"),
    (lambda m: m.update(version="1"), "manifest version '1'"),
    (lambda m: m.update(format="other"), "not an attn-ref vectors manifest"),
    (lambda m: m["cases"][0].pop("shapes"), "cases[0] lacks ['shapes']"),
    (lambda m: m["cases"][1].update(dtype="float8"), "cases[1]: dtype 'float8'"),
    (lambda m: m["cases"][0].update(file="../outside.npz"), "outside the vectors directory"),
    (lambda m: m["cases"][0].update(file="/etc/passwd"), "is an absolute path"),
    (lambda m: m["cases"][0].update(file="missing.npz"), "no such file"),
    (lambda m: m["cases"][0]["storage"].update(q="float64"),
     "q of a float32 case must be stored as float32"),
    (lambda m: m["cases"][0]["storage"].pop("golden"), "\"storage\" must name exactly the arrays"),
], ids=["version2", "no-version", "version-str", "format", "field", "dtype", "dotdot", "absolute",
        "missing", "storage", "storage-names"])
def test_a_bad_manifest_is_refused_when_loading_starts(vectors, edit, words):
    (vectors.parent / "outside.npz").write_bytes((vectors / "000_float32.npz").read_bytes())
    _manifest(vectors, edit)
    with pytest.raises(ValueError, match="manifest.json") as info:
        load_vectors(vectors)  # before any case is handed out
    assert words in str(info.value)


def test_a_symlink_out_of_the_directory_is_refused(vectors):
    outside = vectors.parent / "elsewhere.npz"
    outside.write_bytes((vectors / "000_float32.npz").read_bytes())
    (vectors / "link.npz").symlink_to(outside)
    _manifest(vectors, lambda m: m["cases"][0].update(file="link.npz"))
    with pytest.raises(ValueError, match="link.npz.*outside the vectors directory"):
        load_vectors(vectors)


def _rewrite(path, **arrays):
    with np.load(path, allow_pickle=False) as z:
        keep = {n: z[n] for n in z.files}
    for n, a in arrays.items():
        if a is None:
            del keep[n]
        else:
            keep[n] = a
    np.savez(path, **keep)


@pytest.mark.parametrize("change, words", [
    (lambda q: {"q": q[..., :-1]}, "array 'q' has shape (2, 3, 17, 15), the manifest says (2, 3, 17, 16)"),
    (lambda q: {"q": q.astype(np.float64)}, "array 'q' is stored as float64, the manifest says float32"),
    (lambda q: {"golden": None}, "missing ['golden']"),
    (lambda q: {"extra": q}, "unexpected ['extra']"),
], ids=["shape", "dtype", "missing", "extra"])
def test_an_array_that_disagrees_with_the_manifest_is_refused(vectors, change, words):
    path = vectors / "000_float32.npz"
    with np.load(path) as z:
        q = z["q"]
    _rewrite(path, **change(q))
    with pytest.raises(ValueError, match="000_float32.npz") as info:
        list(load_vectors(vectors))
    assert words in str(info.value)


def test_bfloat16_vectors_must_hold_bit_patterns(vectors):
    path = vectors / "001_bfloat16.npz"
    with np.load(path) as z:
        q = z["q"]
    _rewrite(path, q=(q.astype(np.uint32) << 16).view(np.float32))  # widened by hand
    with pytest.raises(ValueError, match="'q' is stored as float32, the manifest says uint16"):
        list(load_vectors(vectors))


# ------------------------------------------------------------------ report JSON


@pytest.mark.parametrize("kernel", [correct_kernel, MUTANTS[0].kernel], ids=["correct", "mutant"])
def test_report_json_is_byte_identical_between_identical_runs(kernel):
    def run():
        return verify(kernel, "softmax", backend="numpy", suite="quick", dtypes=("float32", "float16"),
                      causal="both", progress=False)

    a, b = run(), run()
    assert a.to_json(timings=False) == b.to_json(timings=False)
    assert "time_s" not in a.to_json(timings=False) and "timings" not in a.to_dict(timings=False)
    # the seconds are all in their own section, one entry per row, in the same order
    da, db = json.loads(a.to_json()), json.loads(b.to_json())
    ta = da.pop("timings")
    assert [(t["case"], t["dtype"], t["output"]) for t in ta["results"]] == \
        [(r["case"], r["dtype"], r["output"]) for r in da["results"]]
    assert any(t["time_s"] > 0 for t in ta["results"])
    db.pop("timings")
    assert da == db


def test_a_jax_kernels_default_float64_array_is_explained():
    # the oracle turns x64 on; a kernel making jnp.zeros(shape) gets float64 and failed
    # "output dtype float64, expected float32" without a word of why (an audit)
    jax = pytest.importorskip("jax")

    def kernel(q, k, v, *, scale=None):
        acc = jax.numpy.zeros(q.shape[:-1] + (v.shape[-1],))
        p = jax.nn.softmax(q @ k.swapaxes(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale))
        return acc + p @ v

    rep = verify(kernel, "softmax", backend="jax", dtypes=("float32",),
                 cases=cases("softmax", "quick")[:1], progress=False)
    (row,) = rep.results
    assert row.verdict == "fail" and "jax_enable_x64" in row.diagnosis, rep.table()


def test_a_jax_kernel_that_donates_its_inputs_is_told_so():
    # "Array has been deleted" named nothing; on other shapes XLA did not reuse the
    # buffer and the same kernel passed (an audit)
    jax = pytest.importorskip("jax")
    from conformance.calling import call_kernel

    x = jax.numpy.ones(4)

    def donated():
        x.delete()
        return x + 1

    call = call_kernel(donated, time_limit=30)
    assert not call.ok and "donate_argnums" in call.fault, call.fault
