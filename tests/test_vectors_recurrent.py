"""Exported vectors of the recurrent family: the final state's golden and its bound.

A kernel tested outside Python (C++, CUDA) compares its own ``S_T`` with
``golden_final_state`` under ``tol_final_state``, element by element
(:func:`conformance.vectors.check_final_state`): the reference's own state passes, a
state off by a relative 1e-4 (float32) or 1e-9 (float64), a transposed one and one
computed without the initial state or across the packed sequences fail.
"""

import re

import numpy as np
import pytest

from attn_ref.registry import get
from conformance.catalogue import cases
from conformance.extras import final_state_golden, final_state_tolerance
from conformance.judging import prepare
from conformance.vectors import check_final_state, export_vectors, load_vectors

RECURRENT = [c for c in cases("gla", "standard") if c.family == "recurrent"]
# a chunk boundary, an initial state, packed sequences with their initial states
FEW = [c for c in RECURRENT if c.nq == 33 or (c.tag == "initial-state" and c.nq == 15)
       or c.param("cu_seqlens") == (0, 15, 16, 81, 100)]


def _kernel_state(name, entry, arrays, **change):
    """The reference as a kernel run on the exported inputs (``bhnd``): its final state."""
    a = {**arrays, **change}
    steps = {n: a[n] for n in ("g", "beta", "gamma") if n in a}
    opts = {**entry["params"], **entry["options"]}
    kw = {n: x for n, x in opts.items() if n in ("chunk_size", "qk_l2norm", "gamma")}
    if "cu_seqlens" in opts:
        kw["cu_seqlens"] = tuple(opts["cu_seqlens"])
    return get(name).fn(a["q"], a["k"], a["v"], **steps, **kw, scale=entry["scale"],
                        initial_state=a.get("initial_state"), output_final_state=True)[1]


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
