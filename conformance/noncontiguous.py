"""Non-contiguous inputs: ``q``, ``k``, ``v`` (and ``do``) as strided views of larger buffers.

Every array the oracle builds otherwise is C-contiguous, so a kernel that reads its
inputs as if they were - the classic CUDA/Triton bug of taking a data pointer and
ignoring the strides - could never fail. The cases of the ``noncontiguous`` feature
(:mod:`conformance.features`) hand the kernel views of the buffers real models produce:

``qkv``
    ``q``, ``k``, ``v`` are ``buf[:, :, i]`` of one packed ``(B, N, 3, H, d)`` buffer, as
    a fused QKV projection and FlashAttention's ``flash_attn_qkvpacked_func`` hold them
    (for a ``bhnd`` kernel also transposed, as HuggingFace models hand them to SDPA).
``kv``
    ``k``, ``v`` are views of one packed ``(B, Nk, 2, H, d)`` buffer (cross attention,
    ``flash_attn_kvpacked_func``); ``q`` is stored in the other of ``bhnd``/``bnhd``.
``layout``
    ``q`` and ``v`` stored in the other of ``bhnd``/``bnhd`` and transposed into the
    kernel's layout; ``k`` stored as ``K^T`` ``(B, H, d, N)``, so its head-dim stride is
    ``N``, not 1.
``headdim``
    ``q``, ``k``, ``v`` are slices ``[..., 0:d]``, ``[..., d:2d]``, ``[..., 2d:2d+dv]`` of
    one ``(..., N, 2d + dv)`` buffer in the kernel's own layout (Megatron's per-head
    ``[q | k | v]`` fused projection): unit head-dim stride, a row stride of
    ``2d + dv``, and a storage offset.

In a gradient run the output's cotangent ``do`` is stored in the other layout too.

A view is a buffer and the basic indexing and axis permutations that take it to the
array the kernel gets (:class:`View`); the oracle converts each buffer once to the
kernel's library and applies the same operations there (:func:`kernel_views`), so the
kernel gets real views sharing one allocation, on every backend with strides (NumPy,
PyTorch, CuPy, array-api-strict, whose arrays wrap NumPy views). JAX arrays have no
strides: there these cases are not applicable, as they are for a kernel that declares
``supports={"noncontiguous": False}`` (it requires contiguous inputs) and for the exported
vectors (files hold contiguous arrays).

:func:`contiguous_reads` gives what a kernel that ignores strides reads instead: the
buffer's elements from the view's storage offset on, in row-major order of the view's
shape. :mod:`conformance.diagnose` runs the reference on those to name the mistake.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .features import NotApplicable

__all__ = ["KINDS", "STRIDED_BACKENDS", "View", "host_views", "cotangent_view", "kernel_views",
           "contiguous_reads", "read_positions", "autograd_of_reads", "view_kind",
           "check_backend", "torch_differentiable_copies"]

#: The kinds of strided case (``Case.param("views_")``), each with what it stands for.
KINDS = {
    "qkv": "q, k, v views of one packed (B, N, 3, H, d) buffer (fused QKV projection)",
    "kv": "k, v views of one packed (B, Nk, 2, H, d) buffer; q stored in the other layout",
    "layout": "q, v stored in the other of bhnd/bnhd; k stored as K^T (head-dim stride N)",
    "headdim": "q, k, v slices of one (..., N, 2d + dv) buffer (row stride 2d + dv, offsets)",
}
#: Backends whose arrays have strides, and so can be handed views.
STRIDED_BACKENDS = ("numpy", "torch", "cupy", "array_api_strict")

# storage orders of the canonical axes; each is its own inverse, so the permutation that
# stores an array is also the one that views the buffer as the canonical array again
_BNHD = (0, 2, 1, 3)  # canonical (B, H, N, d) <-> (B, N, H, d)
_KT = (0, 1, 3, 2)  # (B, H, N, d) <-> (B, H, d, N)


@dataclass(frozen=True)
class View:
    """How one input is taken from a buffer: ``ops`` applied in order to ``buffers[buffer]``.

    Each op is ``("index", key)`` (basic indexing with a full tuple of slices and
    integers) or ``("perm", axes)`` (``permute_dims``): operations every strided
    library does without a copy.
    """

    buffer: str
    ops: tuple


def _apply(view: View, buf, permute):
    x = buf
    for op, arg in view.ops:
        x = x[arg] if op == "index" else permute(x, arg)
    return x


def _storage_order(layout: str, other: bool) -> tuple:
    """Canonical axes in storage order: the kernel's own layout, or the other of bhnd/bnhd."""
    own_bnhd = layout == "bnhd"
    return _BNHD if own_bnhd != other else (0, 1, 2, 3)


def _to_layout_ops(layout: str) -> tuple:
    # conformance.layouts.to_layout as view operations
    return {"bhnd": (), "bnhd": (("perm", _BNHD),),
            "nd": (("index", (0, 0, slice(None), slice(None))),)}[layout]


def view_kind(case) -> str | None:
    """The case's kind of strided inputs (:data:`KINDS`), or None."""
    return case.param("views_") if "noncontiguous" in case.needs else None


def host_views(case, arrays: dict, layout: str) -> tuple[dict, dict]:
    """``(buffers, views)`` of a strided case: C-contiguous host buffers (float64) and the
    :class:`View` of each of ``q``, ``k``, ``v`` in the kernel's ``layout``.

    Applied to the buffers, each view equals ``to_layout(arrays[name], layout)`` exactly.
    """
    kind = view_kind(case)
    if kind not in KINDS:
        raise ValueError(f"strided case {case.id}: kind must be one of {sorted(KINDS)}, got {kind!r}")
    full = (slice(None),) * 4
    tail = _to_layout_ops(layout)
    buffers, views = {}, {}

    def stored(name, order):
        buffers[name] = np.ascontiguousarray(np.transpose(arrays[name], order))
        views[name] = View(name, (("perm", order),) + tail)

    def packed(buf, names, order):
        # stacked on a new axis after the storage order's first two: (B, N, n, H, d)
        shapes = {arrays[n].shape for n in names}
        if len(shapes) != 1:
            raise ValueError(f"strided case {case.id}: {', '.join(names)} packed in one buffer "
                             f"must have one shape, got {sorted(shapes)}")
        # (np.stack and np.concatenate keep their inputs' memory order: made C-contiguous,
        # as the kernel's library holds the buffer)
        buffers[buf] = np.ascontiguousarray(
            np.stack([np.transpose(arrays[n], order) for n in names], axis=2))
        for i, n in enumerate(names):
            views[n] = View(buf, (("index", full[:2] + (i,) + full[2:]), ("perm", order)) + tail)

    if kind == "qkv":
        packed("qkv", ("q", "k", "v"), _BNHD)
    elif kind == "kv":
        stored("q", _storage_order(layout, other=True))
        packed("kv", ("k", "v"), _BNHD)
    elif kind == "layout":
        other = _storage_order(layout, other=True)
        stored("q", other)
        stored("v", other)
        buffers["k"] = np.ascontiguousarray(np.swapaxes(arrays["k"], -1, -2))
        views["k"] = View("k", (("perm", _KT),) + tail)
    else:  # headdim
        order = _storage_order(layout, other=False)
        lead = {arrays[n].shape[:-1] for n in ("q", "k", "v")}
        if len(lead) != 1:
            raise ValueError(f"strided case {case.id}: q, k, v sliced from one buffer must "
                             f"share their leading shape, got {sorted(lead)}")
        parts = [np.transpose(arrays[n], order) for n in ("q", "k", "v")]
        buffers["qkv"] = np.ascontiguousarray(np.concatenate(parts, axis=-1))
        start = 0
        for n, p in zip(("q", "k", "v"), parts):
            width = p.shape[-1]
            views[n] = View("qkv", (("index", full[:3] + (slice(start, start + width),)),
                                    ("perm", order)) + tail)
            start += width
    return buffers, views


def cotangent_view(do: np.ndarray, layout: str) -> tuple[np.ndarray, View]:
    """``do`` (canonical) stored in the other of bhnd/bnhd: its buffer and :class:`View`."""
    order = _storage_order(layout, other=True)
    return (np.ascontiguousarray(np.transpose(do, order)),
            View("do", (("perm", order),) + _to_layout_ops(layout)))


def check_backend(ctx):
    """Raise :class:`NotApplicable` unless ``ctx``'s backend can hold strided views."""
    name = ctx.backend_name if isinstance(ctx.backend_name, str) and ctx.backend_name else "custom"
    if name == "jax":
        raise NotApplicable("strided inputs: JAX arrays have no strides (every JAX array is "
                            "handed over contiguous)")
    if name not in STRIDED_BACKENDS:
        raise NotApplicable(f"strided inputs: the {name} backend builds its arrays from host "
                            f"data; the oracle makes views on {', '.join(STRIDED_BACKENDS)}")


def kernel_views(ctx, buffers: dict, views: dict, dtype: str) -> tuple[dict, dict]:
    """Each buffer converted once to the kernel's library (``ctx.to_kernel``) and each input
    as its view of it: ``(inputs, buffers)`` in the kernel's library.

    Raises :class:`NotApplicable` on a backend without strides (JAX, a custom pair).
    """
    check_backend(ctx)
    xp = ctx.backend.xp
    bufs = {n: ctx.to_kernel(b, dtype) for n, b in buffers.items()}
    return {n: _apply(v, bufs[v.buffer], xp.permute_dims) for n, v in views.items()}, bufs


def _element_offset(view_host: np.ndarray, buf: np.ndarray) -> int:
    start = view_host.__array_interface__["data"][0] - buf.__array_interface__["data"][0]
    return start // buf.itemsize


def read_positions(buffers: dict, views: dict) -> dict:
    """``{name: (at, read)}``: flat indices into the view's buffer, each shaped as the view
    (the kernel's layout): ``at`` where the view's elements are, ``read`` what a kernel that
    ignores strides reads instead - the buffer from the view's storage offset on, in
    row-major order of the view's shape (``np.ndarray(shape, buffer=..., offset=...)``,
    ``torch.as_strided`` with contiguous strides). Only views that are not C-contiguous
    (for the others the two agree) and whose read stays inside the buffer.
    """
    out = {}
    for n, v in views.items():
        buf = np.ascontiguousarray(buffers[v.buffer])
        x = _apply(v, buf, np.transpose)
        if x.flags["C_CONTIGUOUS"]:
            continue
        off, size = _element_offset(x, buf), int(np.prod(x.shape))
        if off + size <= buf.size:
            at = _apply(v, np.arange(buf.size).reshape(buf.shape), np.transpose)
            out[n] = (at, off + np.arange(size).reshape(x.shape))
    return out


def contiguous_reads(buffers: dict, views: dict) -> dict:
    """What a kernel that ignores strides reads for each view (:func:`read_positions`):
    ``{name: array}`` in the kernel's layout."""
    return {n: np.ascontiguousarray(buffers[views[n].buffer]).reshape(-1)[read]
            for n, (_, read) in read_positions(buffers, views).items()}


def autograd_of_reads(buffers: dict, views: dict, grads: dict) -> dict:
    """The gradients autograd gives a view when the kernel read it as if contiguous.

    ``grads[name]``: the gradient with respect to what was read (kernel layout). A
    ``torch.as_strided(x, shape, contiguous strides, offset)`` of a view ``x`` scatters
    that into ``x``'s storage and hands ``x`` the elements at its own positions; the rest
    (another input's part of a packed buffer) reaches no input.
    """
    out = {}
    for n, (at, read) in read_positions(buffers, views).items():
        if n in grads:
            g = np.zeros(np.asarray(buffers[views[n].buffer]).size)
            np.add.at(g, read.reshape(-1), np.asarray(grads[n], dtype=np.float64).reshape(-1))
            out[n] = g[at]
    return out


def torch_differentiable_copies(xs: dict) -> dict:
    """Copies of torch tensors with their memory layout kept, each differentiable.

    ``tensor.clone()`` makes a view with gaps (``qkv[:, :, 0]``) contiguous, so a kernel
    differentiated by autograd would never see the strides of its case. Here each
    storage the tensors share is copied once, as a flat buffer that requires grad, and
    each tensor is that buffer's ``as_strided`` view with its own sizes, strides and
    storage offset; ``torch.autograd.grad`` takes those views as inputs.
    """
    import torch

    roots, out = {}, {}
    for n, x in xs.items():
        storage = x.untyped_storage()
        if storage.data_ptr() not in roots:
            flat = torch.as_strided(x.detach(), (storage.nbytes() // x.element_size(),), (1,), 0)
            roots[storage.data_ptr()] = flat.clone().requires_grad_(True)
        out[n] = roots[storage.data_ptr()].as_strided(x.size(), x.stride(), x.storage_offset())
    return out
