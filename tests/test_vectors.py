"""Results written back to the oracle (:func:`conformance.vectors.check_results`).

A kernel tested through the exported vectors writes its outputs back, tagged with the
dtype it produced them in (bfloat16 as uint16 bits), and the oracle judges the stored
dtype as it judges a kernel it calls: an output in float32 where float16 was asked is
named, and so is a bfloat16 output stored by truncation (its low bits dropped). Results
files without the tag (outputs widened to float32, as written before the tag) stay
readable.
"""

import os
import re

import array_api_compat.numpy as npx
import numpy as np
import pytest

from attn_ref.softmax import softmax_attention
from conformance import verify
from conformance.catalogue import cases
from conformance.tolerance import bf16_round
from conformance.vectors import check_results, export_vectors, load_vectors, read_result

#: a bfloat16 output truncated fails this case (RMS bound, ratio 1.15): rows of nearly
#: equal outputs, where truncation's bias shows
TRUNCATION_CASE = "constant-keys:b1h2-q65k65-d32-constant_keys"
CASES = [c for c in cases("softmax", "standard")
         if c.id in (TRUNCATION_CASE, "causal:b1h2-q13k21-d8-causal-br",
                     "mask:b2h2-q12k19-d8-mask-padding")]


@pytest.fixture(scope="module")
def vectors(tmp_path_factory):
    d = tmp_path_factory.mktemp("vectors")
    export_vectors(d, "softmax", dtypes=("float16", "bfloat16", "float32"), cases=CASES)
    return d


def _float32_out(entry, a):
    """The case's softmax attention computed in float32 (a correct kernel before its store)."""
    q, k, v = (np.asarray(a[n], dtype=np.float32) for n in "qkv")
    return np.asarray(softmax_attention(q, k, v, mask=a.get("mask"), bias=a.get("bias"),
                                        causal=entry["causal"] or False, scale=entry["scale"],
                                        xp=npx), dtype=np.float32)


def _nearest(out, dtype):
    return bf16_round(out) if dtype == "bfloat16" else out.astype(dtype)


def _write(vectors, results, store):
    """``store(entry, float32 output) -> arrays`` written as each case's results file."""
    os.makedirs(results, exist_ok=True)
    for entry, a in load_vectors(vectors):
        np.savez(os.path.join(results, entry["file"]), **store(entry, _float32_out(entry, a)))
    return results


def _tagged(entry, out):
    dt = entry["dtype"]
    if dt == "bfloat16":
        bits = (bf16_round(out).view(np.uint32) >> 16).astype(np.uint16)
        return {"out": bits, "out_dtype": np.array(dt)}
    return {"out": out.astype(dt), "out_dtype": np.array(dt)}


def test_correct_results_pass_tagged_and_untagged(vectors, tmp_path):
    """Rounded to nearest in the case's dtype: tagged (bfloat16 as bits), and untagged as
    results were written before the tag (the rounded values widened to float32)."""
    rep = check_results(vectors, _write(vectors, tmp_path / "tagged", _tagged))
    assert rep.passed and len(rep.results) == 3 * len(CASES), rep.table()
    old = _write(vectors, tmp_path / "untagged",
                 lambda e, out: {"out": _nearest(out, e["dtype"]).astype(np.float32)})
    rep = check_results(vectors, old)
    assert rep.passed and len(rep.results) == 3 * len(CASES), rep.table()


def test_an_output_in_another_dtype_is_named(vectors, tmp_path):
    """A float32 output for a float16 or bfloat16 case fails every such row, in the words
    the oracle uses for a kernel it calls; untagged, it is told by its values (not all
    numbers of the case's dtype), while float32 cases pass."""
    tagged = _write(vectors, tmp_path / "tagged",
                    lambda e, out: {"out": out, "out_dtype": np.array("float32")})
    untagged = _write(vectors, tmp_path / "untagged", lambda e, out: {"out": out})
    for results, words in ((tagged, "out dtype float32, expected {dt} (the inputs' dtype)"),
                           (untagged, "not {dt} numbers")):
        rep = check_results(vectors, results)
        for r in rep.results:
            if r.dtype == "float32":
                assert r.verdict == "pass", rep.table()
            else:
                assert r.verdict == "fail" and words.format(dt=r.dtype) in r.diagnosis, rep.table()


def test_a_truncating_bfloat16_store_is_named_as_the_array_path_names_it(vectors, tmp_path):
    """The float32 result stored by dropping its low 16 bits: the results path fails the
    case and names it with the words :func:`conformance.verify` gives a torch kernel that
    does the same."""
    def truncated(entry, out):
        if entry["dtype"] != "bfloat16":
            return _tagged(entry, out)
        return {"out": (out.view(np.uint32) >> 16).astype(np.uint16), "out_dtype": np.array("bfloat16")}

    rep = check_results(vectors, _write(vectors, tmp_path / "r", truncated))
    fails = [r for r in rep.results if r.verdict == "fail"]
    assert [(r.case, r.dtype) for r in fails] == [(TRUNCATION_CASE, "bfloat16")], rep.table()
    words = "the output is rounded toward zero (truncated) to bfloat16, not to nearest"
    assert words in fails[0].diagnosis, rep.table()

    torch = pytest.importorskip("torch")

    def torch_truncating(q, k, v, *, scale=None):
        o = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                             scale=scale)
        return (o.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)

    arr = verify(torch_truncating, "softmax", backend="torch", dtypes=("bfloat16",),
                 cases=[c for c in CASES if c.id == TRUNCATION_CASE], progress=False)
    assert arr.results[0].verdict == "fail" and words in arr.results[0].diagnosis, arr.table()


def test_results_files_that_cannot_be_read_are_refused(vectors, tmp_path):
    entry = next(e for e, _ in load_vectors(vectors))
    bad = tmp_path / "bad.npz"
    np.savez(bad, out=np.zeros(3, np.uint16))
    with pytest.raises(ValueError, match="without an 'out_dtype' tag"):
        read_result(bad)
    np.savez(bad, out=np.zeros(3, np.float32), out_dtype=np.array("float16"))
    with pytest.raises(ValueError, match="stored as float32, which cannot hold out_dtype float16"):
        read_result(bad)
    np.savez(bad, out=np.zeros(3, np.float32), out_dtype=np.array("half"))
    with pytest.raises(ValueError, match="out_dtype 'half'"):
        read_result(bad)
    # float16 as its bits, tagged, reads back as the float16 values
    np.savez(bad, out=np.array([1.5, -2.0], np.float16).view(np.uint16), out_dtype=np.array("float16"))
    assert read_result(bad)[0].tolist() == [1.5, -2.0]
    rep = check_results(vectors, tmp_path / "nothing")
    assert all(r.verdict == "error" and "no results file" in r.diagnosis for r in rep.results)
    assert entry["file"] in rep.results[0].diagnosis


def test_a_recurrent_kernels_final_state_is_its_own_row(tmp_path):
    """GLA's output and final state written back: both rows pass; the state off by 1 %
    fails its row alone."""
    from attn_ref.registry import get

    case = [c for c in cases("gla", "standard") if c.id == "chunks:b2h2-q15k15-d32-causal-tl"]
    vec = tmp_path / "v"
    export_vectors(vec, "gla", dtypes=("float32",), cases=case)

    def write(results, factor):
        for entry, a in load_vectors(vec):
            o, s = get("gla").fn(a["q"], a["k"], a["v"], g=a["g"], scale=entry["scale"],
                                 output_final_state=True, xp=npx)
            np.savez(os.path.join(results, entry["file"]), out=o, out_dtype=np.array("float32"),
                     final_state=s * factor)
        return check_results(vec, results)

    for factor, verdicts in ((1.0, ["pass", "pass"]), (1.01, ["pass", "fail"])):
        (tmp_path / str(factor)).mkdir()
        rep = write(tmp_path / str(factor), factor)
        assert [(r.output, r.verdict) for r in rep.results] == list(
            zip(["out", "final_state"], verdicts)), rep.table()


def test_a_results_file_that_cannot_be_read_is_its_cases_row(vectors, tmp_path):
    """Truncated, a bare .npy under the .npz name, not a zip, no 'out', a tag that is no
    dtype: each is an error row of its own case naming the file and the problem, and
    every other case is judged (one such file used to lose the whole report, and
    BadZipFile or TypeError did not name the file)."""
    results = _write(vectors, tmp_path / "r", _tagged)
    files = sorted(os.listdir(results))
    faults = {
        "truncated": lambda p: p.write_bytes(p.read_bytes()[:100]),
        "a bare .npy": lambda p: np.save(open(p, "wb"), np.zeros(3, np.float32)),
        "not a zip": lambda p: p.write_text("out = 1.0\n"),
        "no 'out'": lambda p: np.savez(p, output=np.zeros(3, np.float32)),
        "tag not a dtype": lambda p: np.savez(p, out=np.zeros(3, np.float32),
                                              out_dtype=np.array("bf16")),
    }
    words = {"truncated": "cannot be read as an .npz archive",
             "a bare .npy": "not an .npz archive but a single .npy array",
             "not a zip": "cannot be read as an .npz archive",
             "no 'out'": "no array 'out'", "tag not a dtype": "out_dtype 'bf16'"}
    broken = dict(zip(files, faults))
    for file, fault in broken.items():
        path = results / file
        faults[fault](path)
        with pytest.raises(ValueError, match=re.escape(str(path))):
            read_result(path)
    rep = check_results(vectors, results)
    assert len(rep.results) == len(files), rep.table()
    by_file = dict(zip((e["file"] for e, _ in load_vectors(vectors)), rep.results))
    for file, r in by_file.items():
        if file in broken:
            assert r.verdict == "error" and str(results / file) in r.diagnosis, rep.table()
            assert words[broken[file]] in r.diagnosis, (broken[file], r.diagnosis)
        else:
            assert r.verdict == "pass", rep.table()
    assert not rep.passed


# ------------------------------------------------------------------ gradients written back

GRAD_CASES = [c for c in cases("softmax", "standard", grads=True)
              if c.id in ("causal:b1h2-q13k21-d8-causal-br", "mask:b2h2-q12k19-d8-mask-padding",
                          "bias:b1h2-q16k16-d8-bias")]


@pytest.fixture(scope="module")
def grad_vectors(tmp_path_factory):
    d = tmp_path_factory.mktemp("grad_vectors")
    export_vectors(d, "softmax", dtypes=("float32", "bfloat16"), cases=GRAD_CASES, grads=True)
    return d


def _softmax_backward(entry, a, mistake=None):
    """dq, dk, dv (dbias) of the case in float32 from the file's inputs and ``do``: a
    correct kernel's backward, or with ``mistake`` "rowsum" its dS = P * dP (the rowsum(dO
    * O) term dropped)."""
    f32 = {n: np.asarray(a[n], dtype=np.float32) for n in ("q", "k", "v", "do")}
    q, k, v, do = f32["q"], f32["k"], f32["v"], f32["do"]
    s = np.float32(entry["scale"]) * (q @ np.swapaxes(k, -1, -2))
    if "bias" in a:
        s = s + np.asarray(a["bias"], dtype=np.float32)
    allowed = np.ones(s.shape, bool) if a.get("mask") is None else np.broadcast_to(a["mask"], s.shape)
    if entry["causal"]:
        nq, nk = s.shape[-2:]
        shift = 0 if entry["causal"] == "top-left" else nk - nq
        allowed = allowed & (np.arange(nk)[None, :] <= np.arange(nq)[:, None] + shift)
    s = np.where(allowed, s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p = p / p.sum(axis=-1, keepdims=True)
    o = p @ v
    dp = do @ np.swapaxes(v, -1, -2)
    ds = p * dp if mistake == "rowsum" else p * (dp - np.sum(do * o, axis=-1, keepdims=True))
    out = {"dq": np.float32(entry["scale"]) * ds @ k,
           "dk": np.float32(entry["scale"]) * np.swapaxes(ds, -1, -2) @ q,
           "dv": np.swapaxes(p, -1, -2) @ do}
    if "bias" in a:
        out["dbias"] = ds.sum(axis=tuple(i for i, n in enumerate(a["bias"].shape) if n == 1),
                              keepdims=True)
    return out


def _write_grads(vectors, results, mistake=None, drop=(), scale=None):
    """Each case's results file: the output and its gradients, stored in the case's dtype."""
    os.makedirs(results, exist_ok=True)
    for entry, a in load_vectors(vectors):
        arrays = _tagged(entry, _float32_out(entry, a))
        for n, x in _softmax_backward(entry, a, mistake).items():
            if n in drop:
                continue
            x = x * np.float32(scale.get(n, 1.0)) if scale else x
            t = _tagged(entry, x.astype(np.float32))
            arrays[n], arrays[n + "_dtype"] = t["out"], t["out_dtype"]
        np.savez(os.path.join(results, entry["file"]), **arrays)
    return results


def test_gradients_written_back_are_judged(grad_vectors, tmp_path):
    # Vectors exported with --grads hold golden_dq...: check_results judged only `out`
    # before, so a results file with wrong gradients, or none, passed (an audit's C
    # kernel: every planted backward bug passed, exit 0)
    good = check_results(grad_vectors, _write_grads(grad_vectors, tmp_path / "good"))
    names = {r.output for r in good.results}
    assert {"out", "dq", "dk", "dv", "dbias"} <= names, good.table()
    assert good.passed, good.table()
    judged = [r for r in good.results if r.output.startswith("d") and r.verdict == "pass"]
    assert len(judged) >= 12, good.table()

    bad = check_results(grad_vectors, _write_grads(grad_vectors, tmp_path / "bad", mistake="rowsum"))
    rows = [r for r in bad.results if r.output in ("dq", "dk") and r.verdict == "fail"]
    assert rows and all("rowsum(dO * O) term is missing" in r.diagnosis for r in rows
                        if r.dtype == "float32"), bad.table()

    off = check_results(grad_vectors, _write_grads(grad_vectors, tmp_path / "off", scale={"dv": 1.03}))
    failed = {(r.case, r.dtype) for r in off.results if r.output == "dv" and r.verdict == "fail"}
    assert len(failed) == 2 * len(GRAD_CASES), off.table()
    assert all(r.verdict == "pass" for r in off.results if r.output != "dv"), off.table()


def test_a_missing_gradient_fails_and_no_grads_makes_the_rows_n_a(grad_vectors, tmp_path):
    results = _write_grads(grad_vectors, tmp_path / "r", drop=("dk",))
    rep = check_results(grad_vectors, results)
    dk = [r for r in rep.results if r.output == "dk"]
    assert dk and all(r.verdict == "fail" and "holds no dk" in r.diagnosis
                      and "--no-grads" in r.diagnosis for r in dk), rep.table()
    none = check_results(grad_vectors, results, grads=False)
    grads = [r for r in none.results if r.output != "out"]
    assert grads and all(r.verdict == "n/a" for r in grads), none.table()
    assert none.passed


def test_a_gradient_in_another_dtype_is_named(grad_vectors, tmp_path):
    results = _write_grads(grad_vectors, tmp_path / "r")
    for entry, _ in load_vectors(grad_vectors):
        if entry["dtype"] == "bfloat16":
            path = os.path.join(results, entry["file"])
            with np.load(path) as z:
                arrays = dict(z)
            arrays["dq"] = (arrays["dq"].astype(np.uint32) << 16).view(np.float32)
            arrays["dq_dtype"] = np.array("float32")
            np.savez(path, **arrays)
    rep = check_results(grad_vectors, results)
    bad = [r for r in rep.results if r.output == "dq" and r.dtype == "bfloat16"]
    assert bad and all(r.verdict == "fail" and "dq dtype float32, expected bfloat16" in r.diagnosis
                       for r in bad), rep.table()


def test_gradients_the_oracle_does_not_judge_are_listed_and_n_a(tmp_path):
    # A gradient whose bound no plain implementation supports (ill-conditioned) is not
    # exported; the manifest says why, and check_results gives it the n/a row verify does
    case = [c for c in cases("softmax", "standard", grads=True)
            if c.id == "large-logits:b1h2-q16k16-d8-large_logits"]
    manifest = export_vectors(tmp_path / "v", "softmax", dtypes=("float16",), cases=case, grads=True)
    (entry,) = manifest["cases"]
    skipped = entry["grads_not_judged"]
    assert skipped and all(f"golden_{n}" not in entry["outputs"] for n in skipped), entry
    results = _write_grads(tmp_path / "v", tmp_path / "r")
    rep = check_results(tmp_path / "v", results)
    na = {r.output: r for r in rep.results if r.verdict == "n/a"}
    assert set(na) == set(skipped) and all(na[n].diagnosis == skipped[n] for n in na), rep.table()
    assert rep.passed, rep.table()


def test_untagged_uint16_gradients_are_read_as_their_inputs_bits(grad_vectors, tmp_path):
    # as the file stores a bfloat16 case's inputs: an audit's C kernel wrote its bfloat16
    # gradients so, and every such row was refused as "float16 or bfloat16 bits?"
    results = _write_grads(grad_vectors, tmp_path / "r")
    for entry, _ in load_vectors(grad_vectors):
        path = os.path.join(results, entry["file"])
        with np.load(path) as z:
            arrays = {n: a for n, a in z.items() if not (n.endswith("_dtype") and n != "out_dtype")}
        np.savez(path, **arrays)
    rep = check_results(grad_vectors, results)
    assert rep.passed and {r.output for r in rep.results} >= {"dq", "dk", "dv"}, rep.table()


def test_a_gradient_within_its_bounds_of_zero_reads_n_a_when_written_back(tmp_path):
    # on rows one-hot in float32 softmax's dq (1.3e-5) is below its bound (1.3e-3): a zero
    # dq passed there; the manifest says so (conformance.grads._unresolved) and the row
    # reads n/a, while a dq off by more than the bound fails
    case = [c for c in cases("softmax", "standard", grads=True)
            if c.id == "large-logits:b1h2-q65k63-d64-large_logits-causal-tl"]
    vectors = tmp_path / "v"
    man = export_vectors(vectors, "softmax", dtypes=("float32",), cases=case, grads=True)
    tols = man["cases"][0]["output_tolerances"]
    assert "not resolved in float32" in tols["golden_dq"]["unresolved"], tols
    assert "unresolved" not in tols["golden_dv"], tols

    def written(name, dq):
        os.makedirs(tmp_path / name)
        for entry, a in load_vectors(vectors):
            arrays = _tagged(entry, _float32_out(entry, a))
            for n, x in _softmax_backward(entry, a).items():
                arrays[n] = dq(x) if n == "dq" else x
            np.savez(tmp_path / name / entry["file"], **arrays)
        return check_results(vectors, tmp_path / name)

    for name, dq in (("right", lambda x: x), ("zero", np.zeros_like)):
        rep = written(name, dq)
        assert [(r.verdict, "not resolved" in r.diagnosis) for r in rep.results
                if r.output == "dq"] == [("n/a", True)], rep.table(show_na=True)
        assert rep.passed and [r.verdict for r in rep.results if r.output == "dv"] == ["pass"]
    rep = written("off", lambda x: x + np.float32(0.01))
    assert [r.verdict for r in rep.results if r.output == "dq"] == ["fail"], rep.table(show_na=True)


@pytest.mark.parametrize("from_file", [False, True])
def test_an_error_on_one_small_row_fails_when_written_back(tmp_path, monkeypatch, from_file):
    # the row bounds travel in the file (tol_rows): judged by the file alone (from_file:
    # the case not prepared again) as by the oracle
    import conformance.vectors as vec

    case = [c for c in cases("softmax", "standard") if c.id == "long:b1h1-q1000k1000-d64-causal-tl"]
    vectors = tmp_path / "v"
    export_vectors(vectors, "softmax", dtypes=("bfloat16",), cases=case)
    ((entry, a),) = load_vectors(vectors)
    if from_file:
        monkeypatch.setattr(vec, "_prepared", lambda *args: None)

    def written(name, factor):
        out = _float32_out(entry, a)
        out[..., -1, :] *= np.float32(factor)
        os.makedirs(tmp_path / name)
        np.savez(tmp_path / name / entry["file"], **_tagged(entry, out))
        return check_results(vectors, tmp_path / name)

    assert written("right", 1.0).passed
    (r,) = written("off", 1.1).results
    assert r.verdict == "fail" and r.max_err <= r.tol_max and r.rms_err <= r.tol_rms, r
    assert "row (batch 0, head 0, row 999)" in r.diagnosis, r.diagnosis
    assert a["tol_rows"].shape == a["golden"].shape[:-1] + (1,)


@pytest.mark.parametrize("dtype, factor", [("bfloat16", 1.1), ("float16", 1.02)])
def test_a_gradient_off_on_one_small_row_fails_when_written_back(tmp_path, dtype, factor):
    # each gradient's row bounds travel in the file (tol_rows_dq...), judged by it alone
    case = [c for c in cases("softmax", "standard", grads=True)
            if c.id == "long:b1h1-q1000k1000-d64-causal-tl"]
    vectors = tmp_path / "v"
    export_vectors(vectors, "softmax", dtypes=(dtype,), cases=case, grads=True)

    def written(name, factor):
        os.makedirs(tmp_path / name)
        for entry, a in load_vectors(vectors):
            arrays = _tagged(entry, _float32_out(entry, a))
            for n, x in _softmax_backward(entry, a).items():
                if n == "dq":
                    x = x.copy()
                    x[..., -1, :] *= np.float32(factor)
                t = _tagged(entry, x.astype(np.float32))
                arrays[n], arrays[n + "_dtype"] = t["out"], t["out_dtype"]
            np.savez(tmp_path / name / entry["file"], **arrays)
        return check_results(vectors, tmp_path / name)

    assert written("right", 1.0).passed
    (r,) = [r for r in written("off", factor).results if r.output == "dq"]
    assert r.verdict == "fail" and r.max_err <= r.tol_max and r.rms_err <= r.tol_rms, r
    assert "dq row (batch 0, head 0, row 999)" in r.diagnosis, r.diagnosis
    ((entry, a),) = load_vectors(vectors)
    assert a["tol_rows_dq"].shape == a["golden_dq"].shape[:-1] + (1,)
