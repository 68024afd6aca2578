"""``attn-ref check-results VECTORS RESULTS``: the report of
:func:`conformance.vectors.check_results` as a table, and verify's exit status (0 all
passed, 1 a fail or error or nothing judged, 2 a usage error on one line)."""

import json
import os

import array_api_compat.numpy as npx
import numpy as np
import pytest

from attn_ref.registry import get
from conformance.catalogue import cases
from conformance.cli import main
from conformance.vectors import export_vectors, load_vectors

SOFTMAX = [c for c in cases("softmax", "standard")
           if c.id in ("causal:b1h2-q13k21-d8-causal-br", "mask:b2h2-q12k19-d8-mask-padding")]
GLA = [c for c in cases("gla", "standard") if c.id == "chunks:b2h2-q15k15-d32-causal-tl"]


def _results(vec, results, name, **extra):
    """The reference's float32 outputs written back (the state too unless told not to)."""
    os.makedirs(results, exist_ok=True)
    for entry, a in load_vectors(vec):
        kw = {"causal": entry["causal"] or False, "mask": a.get("mask")} if name == "softmax" \
            else {"g": a["g"], "output_final_state": True}
        ret = get(name).fn(a["q"], a["k"], a["v"], scale=entry["scale"], **kw, xp=npx)
        o, s = ret if isinstance(ret, tuple) else (ret, None)
        arrays = {"out": np.asarray(o, np.float32), "out_dtype": np.array("float32")}
        if s is not None and extra.get("state", True):
            arrays["final_state"] = np.asarray(s, np.float32)
        np.savez(os.path.join(results, entry["file"]), **arrays)
    return str(results)


@pytest.fixture(scope="module")
def softmax_vec(tmp_path_factory):
    d = tmp_path_factory.mktemp("softmax")
    export_vectors(d, "softmax", dtypes=("float32",), cases=SOFTMAX)
    return str(d)


def test_correct_results_exit_0_and_write_the_json(softmax_vec, tmp_path, capsys):
    results = _results(softmax_vec, tmp_path / "r", "softmax")
    assert main(["check-results", softmax_vec, results, "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "PASS: 2 passed, 0 failed, 0 errors" in out and SOFTMAX[0].id in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["passed"] and report["counts"]["pass"] == 2


def test_a_wrong_or_unreadable_result_exits_1_with_its_row(softmax_vec, tmp_path, capsys):
    results = _results(softmax_vec, tmp_path / "r", "softmax")
    first = sorted(os.listdir(results))[0]
    (tmp_path / "r" / first).write_bytes(b"not a zip")
    assert main(["check-results", softmax_vec, results]) == 1
    out = capsys.readouterr().out
    assert "1 passed, 0 failed, 1 errors" in out and "cannot be read as an .npz" in out
    # no results at all: every case an error, nothing judged
    assert main(["check-results", softmax_vec, str(tmp_path / "none")]) == 1


def test_vectors_that_are_not_there_are_a_usage_error(tmp_path, capsys):
    results = str(tmp_path)
    for vectors in (tmp_path / "missing", tmp_path):
        assert main(["check-results", str(vectors), results]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "does not hold attn-ref vectors" in err, err
    (tmp_path / "manifest.json").write_text('{"format": "something else"}')
    assert main(["check-results", str(tmp_path), results]) == 2
    assert "is not an attn-ref vectors manifest" in capsys.readouterr().err


def test_no_final_state_makes_the_state_rows_n_a(tmp_path, capsys):
    vec = tmp_path / "v"
    export_vectors(vec, "gla", dtypes=("float32",), cases=GLA)
    results = _results(vec, tmp_path / "r", "gla", state=False)
    assert main(["check-results", str(vec), results]) == 1
    assert "holds no final_state" in capsys.readouterr().out
    assert main(["check-results", str(vec), results, "--no-final-state"]) == 0
    out = capsys.readouterr().out
    assert "1 passed, 0 failed, 0 errors, 1 not applicable" in out
    assert "the kernel returns no final state" in out
    both = _results(vec, tmp_path / "both", "gla")
    assert main(["check-results", str(vec), both]) == 0
