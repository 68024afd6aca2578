"""What :func:`conformance.vectors.export_vectors` writes, read as a C reader reads it.

A reader in C or C++ (cnpy, a hand-written one) takes each ``.npy`` header's shape and
assumes C order: every stored array must be C-contiguous (``fortran_order`` False), or
it silently reads permuted inputs. And nothing is left out silently: a case the export
does not write is listed in the manifest's ``skipped`` with its reason.
"""

import zipfile

import numpy as np
import pytest
from numpy.lib import format as npy_format

from conformance.catalogue import cases
from conformance.vectors import export_vectors, load_vectors

D1 = "headdim:b1h2-q33k33-d1"
# a head dim of 1 (the case whose bfloat16 q, k, v were stored in Fortran order under
# bnhd), a padding mask, grouped-query heads with a random mask, and one batch entry of
# one head (the only kind layout nd exports)
FEW_IDS = (D1, "mask:b2h2-q12k19-d8-mask-padding", "gqa:b2h6-q63k63-d32-mask-random-kv_heads3",
           "scale:b1h1-q16k16-d8-scale0.3")
FEW = [c for c in cases("softmax", "standard") if c.id in FEW_IDS]


def _headers(npz):
    """``{member: (shape, fortran_order, dtype)}`` of the ``.npy`` files in an ``.npz``."""
    out = {}
    with zipfile.ZipFile(npz) as z:
        for name in z.namelist():
            with z.open(name) as fh:
                version = npy_format.read_magic(fh)
                read = (npy_format.read_array_header_1_0 if version == (1, 0)
                        else npy_format.read_array_header_2_0)
                out[name] = read(fh)
    return out


@pytest.mark.parametrize("layout", ["bhnd", "bnhd", "nd"])
def test_every_exported_array_is_in_c_order(tmp_path, layout):
    assert sorted(c.id for c in FEW) == sorted(FEW_IDS)
    manifest = export_vectors(tmp_path, "softmax", dtypes=("bfloat16", "float16", "float32"),
                              layout=layout, cases=FEW)
    assert manifest["cases"]
    for entry in manifest["cases"]:
        headers = _headers(tmp_path / entry["file"])
        assert sorted(headers) == sorted(n + ".npy" for n in entry["arrays"])
        fortran = [n for n, (_, f, _) in headers.items() if f]
        assert not fortran, (entry["id"], entry["dtype"], layout, fortran)
        for name, (shape, _, _) in headers.items():
            assert list(shape) == entry["shapes"][name[:-4]]


def test_layout_nd_lists_each_case_it_cannot_hold_in_skipped(tmp_path):
    """Layout nd holds one batch entry of one head: every other case is in ``skipped``,
    once per dtype, with the reason, and the written and skipped cases add up."""
    manifest = export_vectors(tmp_path, "softmax", dtypes=("float32", "float16"), layout="nd",
                              cases=FEW)
    written = {(e["id"], e["dtype"]) for e in manifest["cases"]}
    skipped = {(s["id"], s["dtype"]): s["reason"] for s in manifest["skipped"]}
    assert written == {("scale:b1h1-q16k16-d8-scale0.3", dt) for dt in ("float32", "float16")}
    assert sorted(written | set(skipped)) == sorted((c.id, dt) for c in FEW
                                                   for dt in ("float32", "float16"))
    reason = skipped[("mask:b2h2-q12k19-d8-mask-padding", "float32")]
    assert "layout nd" in reason and "B=2, H=2" in reason, reason


def test_the_manifest_scale_is_the_one_the_golden_was_computed_with(tmp_path):
    """Linear attention multiplies phi(q) by its scale, 1 by default (not 1/sqrt(d)):
    unnormalised, the output depends on it, and a kernel called with the manifest's
    ``scale`` reproduces the golden; softmax's default and an explicit scale stay."""
    from attn_ref.registry import get

    ids = ("causal:b1h2-q13k21-d8-causal-br", "scale:b1h1-q16k16-d8-scale0.3")
    manifest = export_vectors(tmp_path, "linear", dtypes=("float64",), options={
        "normalize": False}, cases=[c for c in cases("linear", "standard") if c.id in ids])
    scales = {e["id"]: (e["scale"], e["default_scale"]) for e in manifest["cases"]}
    assert scales == {ids[0]: (1.0, True), ids[1]: (0.3, False)}
    for entry, a in load_vectors(tmp_path):
        out = get("linear").fn(a["q"], a["k"], a["v"], scale=entry["scale"],
                               causal=entry["causal"] or False, **manifest["variant_options"])
        np.testing.assert_allclose(out, a["golden"], rtol=1e-12, atol=1e-12, err_msg=entry["id"])
    soft = export_vectors(tmp_path / "s", "softmax", cases=[c for c in FEW if c.id == FEW_IDS[1]])
    assert [(e["scale"], e["default_scale"]) for e in soft["cases"]] == [(1 / np.sqrt(8), True)]
