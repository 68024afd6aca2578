"""Exported vectors of the recurrent family: the final state's golden and its bound.

A kernel tested outside Python (C++, CUDA) compares its own ``S_T`` with
``golden_final_state`` under ``tol_final_state``, element by element
(:func:`conformance.vectors.check_final_state`): the reference's own state passes, a
state off by a relative 1e-4 (float32) or 1e-9 (float64), a transposed one and one
computed without the initial state or across the packed sequences fail.

Written back (:func:`conformance.vectors.check_results`), the state must be there unless
the kernel says it returns none, and a wrong one is diagnosed as verify diagnoses it.
"""

import os
import re

import numpy as np
import pytest

from attn_ref.registry import get
from conformance.catalogue import cases
from conformance.extras import final_state_golden, final_state_tolerance
from conformance.judging import prepare
from conformance.vectors import check_final_state, check_results, export_vectors, load_vectors

RECURRENT = [c for c in cases("gla", "standard") if c.family == "recurrent"]
# a chunk boundary, an initial state, packed sequences with their initial states
FEW = [c for c in RECURRENT if c.nq == 33 or (c.tag == "initial-state" and c.nq == 15)
       or c.param("cu_seqlens") == (0, 15, 16, 81, 100)]


def _kernel_state(name, entry, arrays, **change):
    """The reference as a kernel run on the exported inputs (``bhnd``): its final state."""
    return _kernel(name, entry, arrays, **change)[1]


def _kernel(name, entry, arrays, **change):
    """The reference as a kernel run on the exported inputs (``bhnd``): ``(o, S_T)``."""
    a = {**arrays, **change}
    steps = {n: a[n] for n in ("g", "beta", "gamma") if n in a}
    opts = {**entry["params"], **entry["options"]}
    kw = {n: x for n, x in opts.items() if n in ("chunk_size", "qk_l2norm", "gamma")}
    if "cu_seqlens" in opts:
        kw["cu_seqlens"] = tuple(opts["cu_seqlens"])
    return get(name).fn(a["q"], a["k"], a["v"], **steps, **kw, scale=entry["scale"],
                        initial_state=a.get("initial_state"), output_final_state=True)


@pytest.fixture(scope="module", params=["gla", "gated_deltanet"])
def exported(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    export_vectors(d, request.param, dtypes=("float32", "float64"), cases=FEW)
    return request.param, list(load_vectors(d))


def test_recurrent_vectors_carry_the_final_state_and_its_bound(exported):
    name, loaded = exported
    assert len(loaded) == 2 * len(FEW)
    for entry, arrays in loaded:
        assert "golden_final_state" in entry["outputs"]
        g, tol = arrays["golden_final_state"], arrays["tol_final_state"]
        assert g.dtype == tol.dtype == np.float64 and g.shape == tol.shape
        b, h, _, dk = arrays["q"].shape
        cu = entry["options"].get("cu_seqlens")
        assert g.shape == (b if cu is None else len(cu) - 1, h, dk, arrays["v"].shape[-1])
        assert np.all(tol > 0)
        # the oracle's own golden and bound, as the final_state row judges
        prep = prepare([c for c in FEW if c.id == entry["id"]][0], name, entry["dtype"])
        golden = final_state_golden(prep)
        np.testing.assert_array_equal(g, golden)
        np.testing.assert_array_equal(tol, final_state_tolerance(prep, golden))


def test_the_reference_state_passes_and_a_wrong_one_fails(exported):
    name, loaded = exported
    for entry, arrays in loaded:
        ok, err, ratio = check_final_state(entry, arrays, _kernel_state(name, entry, arrays))
        assert ok and ratio <= 1, (entry["id"], entry["dtype"], err, ratio)
        state = _kernel_state(name, entry, arrays)
        off = 1e-4 if entry["dtype"] == "float32" else 1e-9
        assert not check_final_state(entry, arrays, state * (1 + off))[0], entry["id"]
        if "initial_state" in arrays and arrays["q"].shape[-2] <= 16:
            # (over 33 steps GLA's gates decay S_0 below the bound: ignoring it is invisible)
            ignored = _kernel_state(name, entry, arrays, initial_state=None)
            assert not check_final_state(entry, arrays, ignored)[0], entry["id"]
        nan = state.copy()
        nan[0, 0, 0, 0] = np.nan
        assert not check_final_state(entry, arrays, nan)[0]


def test_a_state_of_the_wrong_shape_is_named(exported):
    name, loaded = exported
    entry, arrays = loaded[0]
    state = _kernel_state(name, entry, arrays)
    want = tuple(arrays["golden_final_state"].shape)
    with pytest.raises(ValueError, match=rf"expected shape {re.escape(str(want))}.*got "
                                         rf"{re.escape(str(want[1:]))}"):
        check_final_state(entry, arrays, state[0])
    assert not check_final_state(entry, arrays, np.swapaxes(state, -1, -2))[0]


def test_softmax_vectors_have_no_final_state(tmp_path):
    export_vectors(tmp_path, "softmax", cases=cases("softmax", "quick")[:1])
    ((entry, arrays),) = list(load_vectors(tmp_path))
    assert "golden_final_state" not in arrays and entry["outputs"] == ["golden"]
    with pytest.raises(ValueError, match="no final-state golden"):
        check_final_state(entry, arrays, np.zeros((1, 1, 2, 2)))


# ------------------------------------------------------- final states written back


@pytest.fixture(scope="module")
def gla32(tmp_path_factory):
    d = tmp_path_factory.mktemp("gla32")
    export_vectors(d, "gla", dtypes=("float32",), cases=FEW)
    return d


def _write_results(vec, results, state=lambda entry, arrays, s: s):
    """Each case's output and ``state(entry, arrays, S_T)`` (None: not written) as results."""
    os.makedirs(results, exist_ok=True)
    for entry, arrays in load_vectors(vec):
        o, s = _kernel("gla", entry, arrays)
        kept = state(entry, arrays, s)
        np.savez(os.path.join(results, entry["file"]), out=o, out_dtype=np.array("float32"),
                 **({} if kept is None else {"final_state": kept}))
    return results


def test_written_back_a_missing_final_state_fails_unless_the_kernel_opts_out(gla32, tmp_path):
    """A kernel with a wrong state used to pass by not writing it: each case now has a
    failing final_state row naming the file and the opt-out; opted out, n/a rows."""
    assert check_results(gla32, _write_results(gla32, tmp_path / "all")).passed
    results = _write_results(gla32, tmp_path / "none", lambda e, a, s: None)
    rep = check_results(gla32, results)
    rows = {(r.case, r.output): r for r in rep.results}
    assert not rep.passed and len(rows) == 2 * len(FEW), rep.table()
    for c in FEW:
        assert rows[(c.id, "out")].verdict == "pass", rep.table()
        row = rows[(c.id, "final_state")]
        assert row.verdict == "fail", rep.table()
        assert str(results) in row.diagnosis and "holds no final_state" in row.diagnosis
        assert "final_state=False" in row.diagnosis
    rep = check_results(gla32, results, final_state=False)
    assert rep.passed, rep.table()
    assert [r.verdict for r in rep.results if r.output == "final_state"] == ["n/a"] * len(FEW)
    assert rep.na_reasons() == [("the kernel returns no final state (final_state=False, "
                                 "--no-final-state)", len(FEW))]


def test_written_back_a_wrong_final_state_is_diagnosed(gla32, tmp_path):
    """One step early, transposed (d_k = d_v) and kept in float16 for a float32 case: each
    named in verify's words, where check_results gave the final_state rows no words."""
    chunks = "chunks:b2h2-q33k33-d32-causal-tl"

    def early(entry, arrays, s):
        short = {n: arrays[n][:, :, :-1] for n in ("q", "k", "v", "g")}
        return _kernel("gla", entry, arrays, **short)[1]

    for kept, words in (
            (early, "the state before the last token's update"),
            (lambda e, a, s: np.swapaxes(s, -1, -2), "the state transposed"),
            (lambda e, a, s: s.astype(np.float16),
             "final_state stored as float16, below the float32")):
        results = _write_results(gla32, tmp_path / words[:12].replace(" ", "_"),
                                 lambda e, a, s, kept=kept: kept(e, a, s) if e["id"] == chunks else s)
        rep = check_results(gla32, results)
        bad = [r for r in rep.results if r.verdict != "pass"]
        assert [(r.case, r.output, r.verdict) for r in bad] == [
            (chunks, "final_state", "fail")], rep.table()
        assert words in bad[0].diagnosis, rep.table()


def test_written_back_a_final_state_of_the_wrong_shape_is_a_row(gla32, tmp_path):
    """A state of another shape fails its own row, naming both shapes (and, known, why):
    the other cases are still judged, where the whole report was lost to a ValueError."""
    packed = "varlen-packed:b1h2-q100k100-d32-causal-tl-cu_seqlens0x15x16x81x100"
    results = _write_results(gla32, tmp_path / "r",
                             lambda e, a, s: s[:1] if e["id"] == packed else s)
    rep = check_results(gla32, results)
    bad = [r for r in rep.results if r.verdict != "pass"]
    assert [(r.case, r.output, r.verdict) for r in bad] == [(packed, "final_state", "fail")]
    assert "shape (1, 2, 32, 32), expected (4, 2, 32, 32)" in bad[0].diagnosis
    assert "one state per batch entry, not one per packed sequence" in bad[0].diagnosis
    assert len(rep.results) == 2 * len(FEW), rep.table()
