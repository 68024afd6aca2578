"""conformance.ties: a discrete choice within the dtype's rounding is judged against every
admissible choice, and a kernel that computes another function still fails."""

import inspect

import numpy as np
import pytest

from attn_ref.registry import get
from conformance import verify
from conformance.catalogue import cases
from conformance.judging import prepare
from conformance.ties import alternatives, moved, nearest, settled
from tests.helpers import scaled_gradient

# attn_ref's reference under torch in float16 selected another key at a near tie of this
# case's head 10 and failed its output at 77x and its gradients at 40-90x (seed 4)
TIED = ("range:b3h5-q37k37-d16v24", "float16", 4)


def _case(case_id):
    return next(c for c in cases("clustered_topk", "standard") if c.id == case_id)


def test_nearest_adds_each_ties_nearest_choice():
    golden = np.zeros((2, 3))
    a, b = np.zeros((2, 3)), np.zeros((2, 3))
    a[0] = 1.0
    b[1] = -2.0
    ties = [[a], [b, 2 * b]]
    assert np.array_equal(nearest(golden + a + 2 * b, golden, ties), a + 2 * b)
    assert np.array_equal(nearest(golden + 0.1, golden, ties), golden)  # nearer the golden
    assert np.array_equal(nearest(golden + a, golden, []), golden)
    # a value left out of the comparison does not choose
    keep = np.array([[False] * 3, [True] * 3])
    assert np.array_equal(nearest(golden + a, golden, ties, keep), golden)
    assert np.array_equal(settled((2, 3), ties), np.zeros((2, 3), bool))
    assert settled((2, 3), [[a]])[1].all() and not settled((2, 3), [[a]])[0].any()


def test_alternatives_find_the_near_tie_and_only_there():
    case_id, dtype, seed = TIED
    prep = prepare(_case(case_id), "clustered_topk", dtype, seed)
    ties = alternatives(prep)
    assert ties is not None and any(pos[:2] == (2, 0) for pos, _ in ties.ties)  # head 10 = (2, 0)
    for pos, rows in ties.ties:
        for row in rows:  # one key swapped for another, the rest kept
            assert len(set(row.tolist())) == len(row)
            assert len(set(row.tolist()) - set(ties.chosen[pos].tolist())) == 1
    # float32's rounding resolves every choice of this case
    assert alternatives(prepare(_case(case_id), "clustered_topk", "float32", seed)) is None


def test_a_kernel_that_chose_otherwise_at_a_near_tie_passes_and_a_wrong_one_fails():
    torch = pytest.importorskip("torch")
    from conformance import backends as B
    from conformance.cli import reference_kernel

    case_id, dtype, seed = TIED
    prep = prepare(_case(case_id), "clustered_topk", dtype, seed)
    ref = reference_kernel(get("clustered_topk"), B.load("torch"))
    a = {n: torch.from_numpy(np.asarray(prep.arrays[n], np.float32)).to(torch.float16) for n in "qkv"}
    out = np.asarray(ref(a["q"], a["k"], a["v"], **prep.kwargs, **prep.params, **prep.options)
                     .double().numpy())
    # it computed the function of the other selection: the golden's bound does not hold
    assert np.max(np.abs(out - prep.golden)) > 10 * prep.tol_max
    assert prep.check(out).verdict == "pass"

    def run(factor, grad_factor=1.0, name="k"):
        def kernel(q, k, v, **kw):
            return ref(q, k, v, **kw) * factor

        kernel.__signature__ = inspect.signature(get("clustered_topk").fn)
        rep = verify(scaled_gradient(kernel, name, grad_factor), "clustered_topk", backend="torch",
                     dtypes=(dtype,), seed=seed, cases=[_case(case_id)], grads=True,
                     diagnose=False, progress=False, time_limit=None)
        return {r.output: r.verdict for r in rep.results}

    assert run(1.0) == {"out": "pass", "dq": "pass", "dk": "pass", "dv": "pass"}
    assert run(1.01)["out"] == "fail"
    assert run(1.0, 1.03, "k")["dk"] == "fail"
    assert run(1.0, 1.03, "v")["dv"] == "fail"


def test_vectors_leave_out_the_values_a_near_tie_changes(tmp_path):
    from conformance.vectors import export_vectors

    case_id, dtype, seed = TIED
    prep = prepare(_case(case_id), "clustered_topk", dtype, seed)
    changed = ~settled(prep.golden.shape, prep.ties)
    assert changed[2, 0].any() and not changed[0, 1].any()
    export_vectors(tmp_path, "clustered_topk", dtypes=(dtype,), seed=seed, cases=[_case(case_id)],
                   grads=True)
    (f,) = tmp_path.glob("*.npz")
    with np.load(f) as z:
        assert np.array_equal(np.isnan(z["golden"]), changed)
        assert np.isnan(z["golden_dk"][2, 0]).all() and not np.isnan(z["golden_dk"][0, 1]).any()


def test_moved_marks_changed_query_rows_and_whole_heads_of_keys():
    golden = np.ones((1, 2, 3, 2))
    alt = golden.copy()
    alt[0, 1, 2, 0] += 1e-3
    alt[0, 0, 1, 1] += 1e-15  # rounding of the same function: not moved
    rows = moved(alt, golden)
    assert rows[0, 1, 2].all() and rows.sum() == 2
    heads = moved(alt, golden, queries=False)
    assert heads[0, 1].all() and not heads[0, 0].any()


def test_an_exact_tie_of_many_keys_leaves_out_what_the_selection_moves():
    # constant-keys: every key ties with every other, so any topk of them is admissible,
    # more selections than are enumerated. The output does not depend on the selection
    # (identical keys: uniform weights whatever is selected) and stays judged; dk does, and
    # its rows are left out. A kernel selecting the last keys instead of the first (as
    # torch.topk may) failed dk at 42-276x before (a plain torch kernel, seeds 0-7).
    torch = pytest.importorskip("torch")
    from conformance import backends as B
    from conformance.cli import reference_kernel

    case = _case("constant-keys:b1h2-q65k65-d32-constant_keys")
    prep = prepare(case, "clustered_topk", "float32", 0)
    ties = alternatives(prep)
    assert ties is not None and ties.far
    ref = reference_kernel(get("clustered_topk"), B.load("torch"))

    def last_keys(q, k, v, **kw):
        nk, c, t = k.shape[-2], kw["num_clusters"], kw["topk"]
        order = torch.arange(nk - 1, nk - 1 - t, -1).expand(c, t)
        return ref(q, k, v, **kw, topk_keys=order)

    last_keys.__signature__ = inspect.signature(get("clustered_topk").fn)
    rep = verify(last_keys, "clustered_topk", backend="torch", dtypes=("float32",), cases=[case],
                 grads=True, diagnose=False, progress=False, time_limit=None)
    got = {r.output: r for r in rep.results}
    assert got["out"].verdict == "pass" and got["dq"].verdict == "pass"
    assert got["dk"].verdict == "n/a" and "every row is left out" in got["dk"].diagnosis + str(
        getattr(got["dk"], "reason", ""))
    # the same kernel with the golden's selection passes dk; the other selection's dk is
    # another gradient, far outside the bound
    from conformance.grads import prepare_grads

    g = prepare_grads(prep)
    a = {n: torch.tensor(np.asarray(prep.arrays[n], np.float32), requires_grad=True) for n in "qkv"}
    kw = {**prep.kwargs, **prep.params, **prep.options}
    out = last_keys(a["q"], a["k"], a["v"], **kw)
    torch.autograd.backward(out, torch.tensor(g["do"], dtype=torch.float32))
    gold, _, tmax, _, _ = g["k"]
    assert np.max(np.abs(a["k"].grad.double().numpy() - gold)) > 10 * tmax
