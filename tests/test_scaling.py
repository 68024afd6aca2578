"""The scaling report (asv_benches/scaling.py): cost parsing, exponent fits, asv results.

The fits are checked on synthetic asv results files whose exponents are known, written
in the same format (``version 2``, ``result_columns``) that ``asv run`` writes.
"""

import json
import math
import os

import numpy as np
import pytest

from asv_benches import scaling as S

NS = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]
COLUMNS = ["result", "params", "version", "started_at", "duration", "stats_ci_99_a",
           "stats_ci_99_b", "stats_q_25", "stats_q_75", "stats_number", "stats_repeat",
           "samples", "profile"]


@pytest.mark.parametrize("cost, exponent", [
    ("O(N^2 d)", 2.0),
    ("O(N^2)", 2.0),
    ("O(N)", 1.0),
    ("O(N d^2)", 1.0),
    ("O(N d + (N/C) d^2)", 1.0),
    ("O(N m d + m^3)", 1.0),
    ("O(N^2 d / s)", 2.0),
    ("O(N (l + N/l) d)", 2.0),
    ("O(N B (2w + 1 + g + r) d)", 1.0),
    ("O(N log N)", 1.0),
    ("O(N sqrt(N) d)", 1.5),
    ("O(N^1.5)", 1.5),
    ("O(Nq Nk d)", 2.0),
    ("O(N²)", 2.0),
])
def test_cost_exponent(cost, exponent):
    assert S.cost_exponent(cost) == exponent


@pytest.mark.parametrize("cost", ["O(nnz B^2 d)", "O(m d)", "O(N^)", "O((N d)", "fast"])
def test_cost_exponent_none_without_a_parsable_n(cost):
    assert S.cost_exponent(cost) is None


def test_every_registered_cost_parses_or_names_no_n():
    from attn_ref.registry import variants

    for v in variants():
        for cost in (v.time, v.memory):
            e = S.cost_exponent(cost)
            assert e is None or 0 <= e <= 3, (v.name, cost, e)
        assert S.cost_exponent(v.time) is not None or "N" not in v.time.replace("nnz", ""), v.name


@pytest.mark.parametrize("p", [0.5, 1.0, 1.5, 2.0, 3.0])
def test_fit_recovers_exponent_with_noise_and_baseline(p):
    rng = np.random.default_rng(int(p * 10))
    base = 5e7
    values = [base + 3e-2 * n**p * (1 + 0.03 * rng.standard_normal()) for n in NS]
    fitted = S.fit_exponent(NS, values, baseline=base, points=4)
    assert abs(fitted - p) < 0.06
    # Without the baseline the small-N points flatten the slope when the curve is shallow.
    assert S.fit_exponent(NS, [3 * n**p for n in NS]) == pytest.approx(p)


def test_fit_ignores_fixed_costs_at_small_n():
    # A 10 ms overhead dominates small N; the fit over the 4 largest sizes sees N^2.
    values = [1e-2 + 1e-9 * n * n for n in NS]
    assert S.fit_exponent(NS, values, points=4) == pytest.approx(2.0, abs=0.1)
    assert S.fit_exponent(NS, values, points=9) < 1.5


def test_fit_needs_three_points_above_baseline():
    assert S.fit_exponent([256, 512], [1.0, 4.0]) is None
    assert S.fit_exponent(NS[:4], [1.0, 2.0, math.nan, None]) is None
    assert S.fit_exponent(NS[:4], [10.0, 10.0, 11.0, 12.0], baseline=10.0) is None


def _entry(values, params):
    return [values, params] + [None] * (len(COLUMNS) - 2)


def _results_file(tmp_path, *, online_mem=1.0, name="abc.json"):
    """A results file: softmax ~N^2/N^2, online ~N^2/N^online_mem, linear ~N/N, peers."""
    variants = ["softmax", "online_softmax", "linear"]
    time_p = {"softmax": 2, "online_softmax": 2, "linear": 1}
    mem_p = {"softmax": 2, "online_softmax": online_mem, "linear": 1}
    base = 1e8
    ns = NS[:7]
    times, mems = [], []
    for v in variants:  # itertools.product order: variant, backend, N
        for n in ns:
            times.append(1e-9 * n ** time_p[v] if n <= 8192 or time_p[v] == 1 else None)
            mems.append(base + 50.0 * n ** mem_p[v] if n <= 8192 or mem_p[v] < 2 else math.nan)
    q = [f"'{v}'" for v in variants]
    nstr = [str(n) for n in ns]
    data = {
        "commit_hash": "0123456789abcdef", "env_name": "existing-py", "date": 1,
        "params": {"machine": "synthetic", "cpu": "test", "num_cpu": "2"},
        "result_columns": COLUMNS, "version": 2,
        "results": {
            "variants.Attention.time_forward": _entry(times, [q, ["'numpy'"], nstr]),
            "variants.Attention.peakmem_forward": _entry(mems, [q, ["'numpy'"], nstr]),
            "peers.TorchSDPA.time_forward": _entry([0.5e-9 * n * n for n in ns],
                                                   [["'cpu-float32'"], nstr]),
            "peers.NumpyOneShot.time_forward": _entry([2e-9 * n * n for n in ns], [nstr]),
            "peers.NumpyOneShot.peakmem_forward": _entry([base + 40.0 * n * n for n in ns],
                                                         [nstr]),
            "peers.Matmul.track_gflops": _entry([100.0, 50.0, math.nan],
                                                [["'numpy'", "'torch'", "'jax'"]]),
            "peers.Baseline.peakmem_loaded": _entry([base, 3 * base], [["'numpy'", "'torch'"]]),
        },
    }
    path = tmp_path / "vm" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


COSTS = {"softmax": ("O(N^2 d)", "O(N^2)"), "online_softmax": ("O(N^2 d)", "O(N)"),
         "linear": ("O(N d^2)", "O(N d + (N/C) d^2)")}


def _rows(path, **kw):
    res = S.load_results(str(path))
    return res, {(r.name, r.backend): r for r in S.analyse(res, costs=COSTS, **kw)}


def test_analyse_recovers_exponents_and_agrees(tmp_path):
    res, rows = _rows(_results_file(tmp_path))
    assert res.matmul == {"numpy": 100.0, "torch": 50.0}
    assert res.baseline["numpy"] == 1e8
    for name, t, m in [("softmax", 2, 2), ("online_softmax", 2, 1), ("linear", 1, 1)]:
        r = rows[(name, "numpy")]
        assert r.time_exp == pytest.approx(t, abs=1e-6), name
        assert r.mem_exp == pytest.approx(m, abs=1e-6), name
        assert r.notes == [], (name, r.notes)
    assert rows[("softmax", "numpy")].n_max == 8192
    assert rows[("linear", "numpy")].n_max == 16384
    assert rows[("numpy_oneshot", "numpy")].peer


def test_analyse_ratios_to_peers_and_floor(tmp_path):
    _, rows = _rows(_results_file(tmp_path))
    r = rows[("softmax", "numpy")]
    assert r.vs_sdpa == (pytest.approx(2.0), 8192)   # 1e-9 n^2 against 0.5e-9 n^2
    assert r.vs_numpy == (pytest.approx(0.5), 8192)
    floor = 8 * 4 * 8192**2 * 64 / 100e9
    assert r.vs_floor == (pytest.approx(1e-9 * 8192**2 / floor), 8192)
    # Linear attention is compared with SDPA at the largest N both ran; the NumPy
    # one-shot peer stops where its logits stop fitting, so that ratio is at 8192.
    assert rows[("linear", "numpy")].vs_sdpa[1] == 16384


def test_analyse_states_disagreement(tmp_path):
    _, rows = _rows(_results_file(tmp_path, online_mem=2.0))
    notes = rows[("online_softmax", "numpy")].notes
    assert len(notes) == 1 and notes[0].startswith("memory disagrees: measured N^2.00")
    assert "O(N)" in notes[0]
    text = S.format_table(list(rows.values()))
    assert "disagrees" in text and "online_softmax / numpy" in text


def test_tolerance_decides_agreement(tmp_path):
    _, rows = _rows(_results_file(tmp_path, online_mem=1.25))
    assert rows[("online_softmax", "numpy")].notes == []
    _, rows = _rows(_results_file(tmp_path, online_mem=1.25), tolerance=0.1)
    assert rows[("online_softmax", "numpy")].notes


def test_format_table_text_and_markdown(tmp_path):
    res, rows = _rows(_results_file(tmp_path))
    text = S.format_table(list(rows.values()), res)
    assert "commit 01234567" in text and "numpy 100" in text
    assert "softmax" in text and "2.00 (2)" in text
    assert "Every fitted exponent agrees" in text
    md = S.format_table(list(rows.values()), res, markdown=True)
    header = next(line for line in md.splitlines() if line.startswith("| variant"))
    assert header.count("|") == len(S.HEADER) + 1


def test_find_results_picks_newest(tmp_path):
    old = _results_file(tmp_path, name="old.json")
    new = _results_file(tmp_path, name="new.json")
    data = json.loads(new.read_text())
    data["date"] = 2
    new.write_text(json.dumps(data))
    (tmp_path / "vm" / "machine.json").write_text("{}")
    assert S.find_results(str(tmp_path)) == str(new)
    assert S.find_results(str(old)) == str(old)
    with pytest.raises(FileNotFoundError, match="for machine 'other'"):
        S.find_results(str(tmp_path), machine="other")
    with pytest.raises(FileNotFoundError, match="no asv results"):
        S.find_results(str(tmp_path / "missing"))


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    res, _ = _rows(_results_file(tmp_path))
    out = S.plot(res, str(tmp_path / "sub" / "scaling.png"), title="t")
    with open(out, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(out) > 10_000


def test_command_line(tmp_path, capsys):
    path = _results_file(tmp_path)
    md = tmp_path / "table.md"
    assert S.main(["--results", str(path), "--plot", "", "--markdown", str(md)]) == 0
    out = capsys.readouterr().out
    assert "online_softmax" in out and "time exp" in out
    assert md.read_text().startswith("asv results: commit 01234567")
    assert S.main(["--results", str(tmp_path / "nothing"), "--plot", ""]) == 2
    assert "no asv results" in capsys.readouterr().out


def test_committed_results_are_complete():
    """The measured results behind docs/_static/scaling.png parse and cover the core rows.

    Their values are a noisy machine's and are not asserted; that the fits exist is.
    """
    root = os.path.join(os.path.dirname(__file__), "..")
    path = os.path.join(root, S.COMMITTED_RESULTS)
    if not os.path.exists(path):
        pytest.skip("no committed results yet")
    res = S.load_results(path)
    rows = {(r.name, r.backend): r for r in S.analyse(res)}
    for key in [("softmax", "numpy"), ("online_softmax", "numpy"), ("linear", "numpy"),
                ("numpy_oneshot", "numpy"), ("torch_sdpa", "torch")]:
        assert key in rows, key
        assert rows[key].time_exp is not None and rows[key].mem_exp is not None, key
    assert res.matmul.get("numpy", 0) > 0 and res.baseline.get("numpy", 0) > 0
    assert os.path.exists(os.path.join(root, "docs", "_static", "scaling.png"))


def test_attn_ref_scaling_subcommand(tmp_path, capsys):
    from conformance.cli import main

    path = _results_file(tmp_path)
    assert main(["scaling", "--results", str(path), "--plot", ""]) == 0
    assert "linear" in capsys.readouterr().out


def test_benchmark_costs_are_the_suites_and_the_default(tmp_path):
    # The suite runs pooling with a stride (N / s segments: quadratic) and the strided
    # pattern with l ~ sqrt(N) (N^1.5); the report must judge them by those costs.
    from attn_ref.registry import variants

    costs = S.benchmark_costs()
    assert costs is not None and set(costs) == {v.name for v in variants()}
    assert S.cost_exponent(costs["pooled"][0]) == 2.0
    assert S.cost_exponent(costs["strided"][0]) == 1.5
    assert costs["softmax"] == S.registry_costs()["softmax"]
    # analyse() without costs uses them: a pooled series growing as N^2 agrees.
    ns = NS[:6]
    data = {
        "commit_hash": "0123456789abcdef", "env_name": "existing-py", "date": 1,
        "params": {"machine": "synthetic", "cpu": "test", "num_cpu": "2"},
        "result_columns": COLUMNS, "version": 2,
        "results": {"variants.Attention.time_forward": _entry(
            [1e-9 * n * n for n in ns], [["'pooled'"], ["'numpy'"], [str(n) for n in ns]])},
    }
    path = tmp_path / "vm" / "r.json"
    path.parent.mkdir()
    path.write_text(json.dumps(data))
    res = S.load_results(str(path))
    (row,) = S.analyse(res)
    assert row.name == "pooled" and not any("time disagrees" in n for n in row.notes), row.notes
    (row,) = S.analyse(res, costs=S.registry_costs())
    assert any("time disagrees" in n for n in row.notes), row.notes


# ------------------------------------------------------------------ peers and roofline


def test_sdpa_rows_keep_their_kernel(tmp_path):
    # The default (fused) and the forced rows are separate series; the math path
    # must not overwrite the row that /SDPA compares with.
    path = _results_file(tmp_path)
    data = json.loads(path.read_text())
    ns = [str(n) for n in NS[:7]]
    cfgs = ["'cpu-float32'", "'cpu-flash-float32'", "'cpu-math-float32'"]
    data["results"]["peers.TorchSDPA.time_forward"] = _entry(
        [c * 1e-9 * int(n) ** 2 for c in (0.5, 0.6, 3.0) for n in ns], [cfgs, ns])
    data["results"]["peers.JaxDotProductAttention.time_forward"] = _entry(
        [1e-9 * int(n) ** 2 for n in ns], [["'cpu-float32'"], ns])
    path.write_text(json.dumps(data))
    res, rows = _rows(path)
    backends = {s.backend for s in res.series if s.name == "torch_sdpa"}
    assert backends == {"torch", "torch-flash", "torch-math"}
    assert rows[("softmax", "numpy")].vs_sdpa == (pytest.approx(2.0), 8192)
    assert rows[("jax_dpa", "jax")].peer


RATES = {"gemm_flops": 100e9, "exp": 2e9, "elementwise": 4e9, "bandwidth": 10e9}


def test_analyse_ratio_to_the_roofline(tmp_path):
    _, rows = _rows(_results_file(tmp_path), rates={"numpy": RATES})
    n, h, d = 8192, 8, 64
    pairs = h * n * n
    roof = 4 * pairs * d / 100e9 + pairs / 2e9 + 3 * pairs / 4e9  # compute-bound here
    assert rows[("softmax", "numpy")].vs_roofline == (pytest.approx(1e-9 * n * n / roof), n)
    assert rows[("numpy_oneshot", "numpy")].vs_roofline is None  # a peer has no count
    _, rows = _rows(_results_file(tmp_path), rates={})
    assert rows[("softmax", "numpy")].vs_roofline is None
    table = S.format_table(list(rows.values()))
    assert "/roofline" in table.splitlines()[0]


def test_committed_roofline_rates_say_where_they_were_measured():
    rates, meta = S.load_rates()
    assert {"numpy", "torch"} <= set(rates)
    for backend, r in rates.items():
        assert all(r[k] > 0 for k in ("gemm_flops", "exp", "elementwise", "bandwidth")), backend
    assert {"machine", "date", "loadavg_1min", "quiet", "note", "command"} <= set(meta)
    assert ("loaded" in meta["note"]) != meta["quiet"]
