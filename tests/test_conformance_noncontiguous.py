"""conformance.noncontiguous: q, k, v (and do) handed to the kernel as strided views.

Every other case hands C-contiguous arrays, so a kernel that reads its inputs through a
data pointer as if they were contiguous - the classic CUDA/Triton stride bug - passed
them all. Here: the views are real views of one buffer on every backend with strides,
each equal to the case's array; a kernel that ignores strides fails every strided case
(NumPy and PyTorch, forward and a backward that ignores do's strides only, one that
ignores them only for a head-dim stride != 1) and is named so; correct kernels pass;
writes into a view, or through it into another input's part of the buffer, are caught;
JAX, a kernel that declares contiguous inputs and the exported vectors have none.
"""

import numpy as np
import pytest

from conformance import cases, verify
from conformance.calling import parse_supports
from conformance.catalogue import CATALOGUE
from conformance.judging import prepare
from conformance.layouts import to_layout
from conformance.noncontiguous import KINDS, contiguous_reads, cotangent_view, host_views

STRIDED = [c for c in CATALOGUE["standard"] if "noncontiguous" in c.needs]
OTHERS = [c for c in CATALOGUE["quick"]][:4]
FULL = {"causal": "top-left", "progress": False}


def _np_softmax(q, k, v, *, scale=None, causal=False):
    s = q @ np.swapaxes(k, -1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if causal:  # top-left (the strided cases are causal with Nq == Nk only)
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def _np_as_contiguous(x):
    """What a kernel that ignores strides reads: x's buffer from x's first element on."""
    base = x if x.base is None else x.base
    offset = x.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    return np.ndarray(x.shape, x.dtype, buffer=base, offset=offset)


def _np_ignores_strides(q, k, v, *, scale=None, causal=False):
    return _np_softmax(*map(_np_as_contiguous, (q, k, v)), scale=scale, causal=causal)


def _np_ignores_headdim_stride(q, k, v, *, scale=None, causal=False):
    # handles row strides, but assumes the head dim is packed (stride 1 element)
    q, k, v = (_np_as_contiguous(x) if x.strides[-1] != x.itemsize else x for x in (q, k, v))
    return _np_softmax(q, k, v, scale=scale, causal=causal)


def _torch_as_contiguous(x):
    import torch

    strides = [1] * x.dim()
    for i in range(x.dim() - 2, -1, -1):
        strides[i] = strides[i + 1] * x.shape[i + 1]
    return torch.as_strided(x, x.shape, strides, x.storage_offset())


def _sdpa(q, k, v, *, is_causal=False, scale=None):
    import torch

    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal,
                                                            scale=scale)


def _torch_ignores_strides(q, k, v, *, is_causal=False, scale=None):
    return _sdpa(*map(_torch_as_contiguous, (q, k, v)), is_causal=is_causal, scale=scale)


def _torch_eager(q, k, v, *, is_causal=False, scale=None):
    import torch

    s = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if is_causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return s.softmax(-1) @ v


def _torch_backward(q, k, v, do, *, is_causal=False, scale=None):
    import torch

    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    return torch.autograd.grad(_torch_eager(q, k, v, is_causal=is_causal, scale=scale),
                               (q, k, v), do)


def _torch_backward_ignores_do_strides(q, k, v, do, *, is_causal=False, scale=None):
    return _torch_backward(q, k, v, _torch_as_contiguous(do), is_causal=is_causal, scale=scale)


def _bad(rep):
    return [r for r in rep.results if r.verdict != "pass"]


# ------------------------------------------------------------------- the cases


def test_standard_has_one_case_of_each_kind_that_every_variant_meets():
    assert sorted(c.param("views_") for c in STRIDED) == sorted(KINDS)
    assert all(c in CATALOGUE["exhaustive"] for c in STRIDED)
    # self-attention-only and causal-only variants meet some too
    for name in ("softmax", "linformer", "gla", "linear"):
        assert any("noncontiguous" in c.needs for c in cases(name, "standard")), name
    # small: four cases of 2 x 3 heads and <= 41 tokens
    assert len(STRIDED) == 4 and all(c.size <= 2 * 3 * 41 * 41 * 32 for c in STRIDED)


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("case", STRIDED, ids=lambda c: c.param("views_"))
def test_every_view_is_its_array_and_a_contiguous_read_is_not(case, layout):
    prep = prepare(case, "softmax", "float32", 0)
    buffers, views = host_views(case, prep.arrays, layout)
    reads = contiguous_reads(buffers, views)
    for n, view in views.items():
        buf = buffers[view.buffer]
        assert buf.flags["C_CONTIGUOUS"]
        x = buf
        for op, arg in view.ops:
            x = x[arg] if op == "index" else np.transpose(x, arg)
        want = to_layout(prep.arrays[n], layout)
        assert np.array_equal(x, want) and np.shares_memory(x, buf), n
        if not x.flags["C_CONTIGUOUS"]:
            assert not np.array_equal(reads[n], want), n
    # every kind hands at least one input that is not contiguous in either layout
    assert reads
    # do in the other layout: a backward that reads it as contiguous reads other numbers
    do_buf, do_view = cotangent_view(prep.golden, layout)
    assert not np.array_equal(contiguous_reads({"do": do_buf}, {"do": do_view})["do"],
                              to_layout(prep.golden, layout))


def _recorder(seen, base_of):
    def kernel(q, k, v, *, scale=None, causal=False):
        from attn_ref.softmax import softmax_attention

        seen.append({n: base_of(x) for n, x in zip("qkv", (q, k, v))})
        return softmax_attention(q, k, v, scale=scale, causal=causal)
    return kernel


def test_numpy_and_array_api_strict_kernels_get_views_of_one_buffer():
    for backend in ("numpy", "array_api_strict"):
        seen = []

        def info(x):
            h = x if isinstance(x, np.ndarray) else np.from_dlpack(x)
            return h.flags["C_CONTIGUOUS"], h.__array_interface__["data"][0]

        rep = verify(_recorder(seen, info), backend=backend, cases=STRIDED, **FULL)
        assert not _bad(rep), _bad(rep)
        packed = seen[0]  # qkv: one buffer, none contiguous
        assert not any(c for c, _ in packed.values())
        # (B, N, 3, H, d) float32: k's first element is H d elements past q's, v's as far again
        step = STRIDED[0].batch[1] * STRIDED[0].d * 4
        assert packed["k"][1] - packed["q"][1] == packed["v"][1] - packed["k"][1] == step, backend


def test_torch_kernels_get_views_and_torch_sdpa_passes_with_gradients():
    pytest.importorskip("torch")
    seen = []

    def kernel(q, k, v, *, is_causal=False, scale=None):
        seen.append([(x.is_contiguous(), x.untyped_storage().data_ptr(), x.storage_offset())
                     for x in (q, k, v)])
        return _sdpa(q, k, v, is_causal=is_causal, scale=scale)

    for layout in ("bhnd", "bnhd"):
        fn = kernel if layout == "bhnd" else _bnhd(kernel)
        # the gradients (autograd through views of one buffer) in one layout: they cost most
        grads = layout == "bhnd"
        rep = verify(fn, backend="torch", layout=layout, cases=STRIDED, grads=grads, **FULL)
        assert not _bad(rep), [(r.case, r.output, r.diagnosis) for r in _bad(rep)]
        assert len(rep.results) == 4 * (4 if grads else 1)
    (qc, qp, qo), (kc, kp, ko), (vc, vp, vo) = seen[0]
    assert not (qc or kc or vc) and qp == kp == vp and qo < ko < vo


def _bnhd(kernel):
    def fn(q, k, v, *, is_causal=False, scale=None):
        return kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=is_causal,
                      scale=scale).transpose(1, 2)
    return fn


@pytest.mark.parametrize("backend", ["numpy", "array_api_strict", "torch"])
def test_attn_ref_passes_every_strided_case(backend):
    pytest.importorskip(backend)
    from attn_ref.softmax import softmax_attention

    rep = verify(softmax_attention, backend=backend, cases=STRIDED, **FULL)
    assert [r.verdict for r in rep.results] == ["pass"] * 4, _bad(rep)


def test_jax_and_a_kernel_declaring_contiguous_inputs_get_not_applicable():
    pytest.importorskip("jax")
    rep = verify(_np_softmax, backend="jax", cases=STRIDED, **FULL)
    assert all(r.verdict == "n/a" and "JAX arrays have no strides" in r.diagnosis for r in rep.results)
    rep = verify(_np_ignores_strides, backend="numpy", cases=STRIDED + OTHERS,
                 supports={"noncontiguous": False}, **FULL)
    assert [r.verdict for r in rep.results] == ["n/a"] * 4 + ["pass"] * len(OTHERS)
    assert "requires contiguous inputs" in rep.results[0].diagnosis
    assert parse_supports(["noncontiguous=no"]) == {"noncontiguous": False}  # --supports noncontiguous=no
    # a custom (to_kernel, to_host) pair builds arrays from host data: no views to make
    pair = (lambda host, dtype: host.astype(dtype), np.asarray)
    rep = verify(_np_ignores_strides, backend=pair, cases=STRIDED, **FULL)
    assert all(r.verdict == "n/a" and "the custom backend" in r.diagnosis for r in rep.results)


# ------------------------------------------------------------- wrong kernels fail


def test_numpy_kernel_ignoring_strides_fails_every_strided_case_named():
    rep = verify(_np_ignores_strides, backend="numpy", cases=STRIDED + OTHERS, **FULL)
    got = [(r.verdict, r.diagnosis) for r in rep.results]
    assert [v for v, _ in got] == ["fail"] * 4 + ["pass"] * len(OTHERS), got
    for _, words in got[:4]:
        assert words.startswith("reads q, k, v as if contiguous (ignores the strides"), words
    # bnhd: the packed qkv views are (B, N, H, d) views with a row stride of 3 H d
    rep = verify(_np_bnhd_ignores_strides, backend="numpy", layout="bnhd", cases=STRIDED, **FULL)
    assert all(r.verdict == "fail" and "as if contiguous" in r.diagnosis for r in rep.results), \
        [(r.verdict, r.diagnosis) for r in rep.results]


def _np_bnhd_ignores_strides(q, k, v, *, scale=None, causal=False):
    # a (B, N, H, d) kernel that reads its inputs' memory directly, computes head-major
    q, k, v = (np.swapaxes(_np_as_contiguous(x), 1, 2) for x in (q, k, v))
    return np.swapaxes(_np_softmax(q, k, v, scale=scale, causal=causal), 1, 2)


def test_kernel_ignoring_only_a_head_dim_stride_fails_the_transposed_key_case():
    rep = verify(_np_ignores_headdim_stride, backend="numpy", cases=STRIDED + OTHERS, **FULL)
    bad = _bad(rep)
    assert [r.case for r in bad] == [c.id for c in STRIDED if c.param("views_") == "layout"]
    assert bad[0].diagnosis.startswith("reads k as if contiguous (ignores the strides of its view")


def test_torch_kernel_ignoring_strides_fails_every_strided_case_and_gradient_named():
    pytest.importorskip("torch")
    rep = verify(_torch_ignores_strides, backend="torch", cases=STRIDED + OTHERS, grads=True,
                 **FULL)
    bad = _bad(rep)
    assert {r.case for r in bad} == {c.id for c in STRIDED}, [r.case for r in bad]
    assert {(r.output, r.verdict) for r in bad} == {(o, "fail") for o in ("out", "dq", "dk", "dv")}
    for r in bad:  # the forward named, and the gradients autograd took through the misread
        words = ("reads q, k, v as if contiguous" if r.output == "out" else
                 "the forward reads q, k, v as if contiguous (ignores the strides); autograd's")
        assert words in r.diagnosis, (r.case, r.output, r.diagnosis)


def test_backward_ignoring_the_cotangents_strides_fails_only_strided_gradient_rows():
    pytest.importorskip("torch")
    rep = verify(_torch_eager, backend="torch", cases=STRIDED + OTHERS,
                 backward=_torch_backward, **FULL)
    assert not _bad(rep), _bad(rep)
    rep = verify(_torch_eager, backend="torch", cases=STRIDED + OTHERS,
                 backward=_torch_backward_ignores_do_strides, **FULL)
    bad = _bad(rep)
    assert {(r.case, r.output) for r in bad} == {(c.id, o) for c in STRIDED
                                                 for o in ("dq", "dk", "dv")}
    assert all("the backward reads do as if contiguous" in r.diagnosis for r in bad), bad


# ----------------------------------------------------------- writes through a view


def _np_writes(where):
    def kernel(q, k, v, *, scale=None, causal=False):
        out = _np_softmax(q, k, v, scale=scale, causal=causal)
        flat = _np_as_contiguous(q).reshape(-1)
        if where == "q":
            q[0, 0, 0, 0] += 1.0
        else:  # the element just past q's first row in the packed buffer: k's first
            flat[q.shape[-1] * q.shape[1]] += 1.0
        return out
    return kernel


@pytest.mark.parametrize("where,named", [("q", "q"), ("k", "k")])
def test_a_write_into_a_view_or_through_it_into_another_input_is_caught(where, named):
    # the packed qkv case: in (B, N, 3, H, d), k's first element sits H d past q's
    rep = verify(_np_writes(where), backend="numpy", cases=STRIDED[:1], **FULL)
    r = rep.results[0]
    assert r.verdict == "fail" and r.diagnosis == f"the kernel modified its input {named!r} in place"


def test_a_torch_write_through_a_view_is_caught():
    pytest.importorskip("torch")

    def kernel(q, k, v, *, is_causal=False, scale=None):
        out = _sdpa(q, k, v, is_causal=is_causal, scale=scale)
        _torch_as_contiguous(q).reshape(-1)[q.shape[-1] * q.shape[1]] += 1.0  # k's first
        return out

    r = verify(kernel, backend="torch", cases=STRIDED[:1], **FULL).results[0]
    assert r.verdict == "fail" and r.diagnosis == "the kernel modified its input 'k' in place"


def test_vectors_skip_strided_cases_with_the_reason(tmp_path):
    from conformance.vectors import export_vectors

    man = export_vectors(tmp_path, "softmax", cases=STRIDED[:1] + OTHERS[:1])
    assert [e["id"] for e in man["skipped"]] == [STRIDED[0].id]
    assert "contiguous arrays" in man["skipped"][0]["reason"]
