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
