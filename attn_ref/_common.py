"""Rules every family follows, written once: causal alignment, block counts and the
online softmax's running state.

Nothing here checks its arguments; the public functions that call it have.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import array_api_compat

from ._checks import check_flag

__all__ = [
    "TOP_LEFT",
    "BOTTOM_RIGHT",
    "causal_alignment",
    "causal_offset",
    "ceil_div",
    "and_masks",
    "scaled_logits",
    "finite_max",
    "softmax_partial",
    "merge_partials",
    "online_step",
    "finish_partial",
    "partial_lse",
    "cpu_count",
    "parallel_map",
    "blas_one_thread",
    "blas_controllable",
    "batch_rows",
    "numpy_backed",
    "torch_cpu",
    "row_groups",
    "is_lazy",
    "pool_helps",
    "owned_writeable",
    "records_graph",
    "keep_freed_memory",
    "add_into",
    "mul_into",
]

TOP_LEFT = "top-left"
BOTTOM_RIGHT = "bottom-right"
_CAUSAL = (TOP_LEFT, BOTTOM_RIGHT)


def causal_alignment(causal):
    """Normalise ``causal`` to ``None``, ``"top-left"`` or ``"bottom-right"``."""
    if causal is None:
        return None
    if isinstance(causal, str):
        if causal in _CAUSAL:
            return causal
    elif isinstance(causal, bool) or type(causal).__module__ == "numpy":
        # A flag (a NumPy bool included); check_flag refuses other NumPy scalars.
        return TOP_LEFT if check_flag("causal", causal) else None
    raise ValueError(
        f"causal must be False, True (= {TOP_LEFT!r}), {TOP_LEFT!r} or {BOTTOM_RIGHT!r}, "
        f"got {causal!r}"
    )


def causal_offset(alignment, nq, nk):
    """The causal diagonal: query ``i`` may see key ``j`` iff ``j <= i + offset``.

    ``0`` for ``"top-left"`` (query 0 sees key 0), ``nk - nq`` for ``"bottom-right"``
    (the last query sees the last key: the KV-cache convention).
    """
    return 0 if alignment == TOP_LEFT else nk - nq


def and_masks(xp, a, b):
    """``a & b`` for optional bool masks, ``None`` meaning "everything allowed"."""
    if a is None:
        return b
    if b is None:
        return a
    return xp.logical_and(a, b)


def ceil_div(n, b):
    """``ceil(n / b)`` for integers, exactly (no float round trip): blocks of ``b`` that cover ``n``."""
    return -(-n // b)


def scaled_logits(xp, s, scale):
    """``scale * s`` for products ``s = q k^T``, clamped to the dtype's finite range.

    The scale multiplies the product, not ``q``: ``scale * q`` may overflow where
    ``scale * (q . k)`` does not, and an infinite ``q`` gives ``inf - inf = NaN`` inside the
    product. A logit past the range (a huge scale) becomes ``+-finfo.max``, never ``+-inf``,
    so ``s - rowmax`` is never ``inf - inf``: the softmax tends to the row's hardmax, as
    the mathematics does. ``finfo.max`` stays the library's scalar (``float()`` of
    ``np.longdouble``'s is inf). Apply it before masking: it clamps ``-inf`` too.
    """
    if scale == 1.0:
        return s
    big = xp.finfo(s.dtype).max
    return xp.clip(s * scale, min=-big, max=big)


# ---------------------------------------------------------------- online softmax
# A "partial" is (m, l, acc): running row maximum (..., N, 1), normaliser (..., N, 1)
# and unnormalised output (..., N, dv) of a softmax over a subset of the keys. Two
# partials over disjoint key sets merge exactly (Milakov & Gimelshein 2018, "Online
# normalizer calculation for softmax"; FlashAttention's running state).


def finite_max(xp, m):
    """Row maxima with ``-inf`` (a row with no allowed logit yet) replaced by 0.

    Shifting by it keeps ``exp(s - m)`` at ``exp(-inf - 0) = 0`` on such a row instead
    of ``exp(-inf + inf) = NaN``.
    """
    return xp.where(m == -xp.inf, xp.zeros_like(m), m)


def softmax_partial(xp, s, v):
    """The partial ``(m, l, acc)`` of logits ``s (..., N, n)`` (``-inf`` where not allowed)
    against values ``v (..., n, dv)``: ``O(N n dv)`` time."""
    m = xp.max(s, axis=-1, keepdims=True)
    p = xp.exp(s - finite_max(xp, m))
    return m, xp.sum(p, axis=-1, keepdims=True), p @ v


def merge_partials(xp, a, b):
    """The partial over the union of the disjoint key sets of partials ``a`` and ``b``."""
    (ma, la, acca), (mb, lb, accb) = a, b
    m = xp.maximum(ma, mb)
    ms = finite_max(xp, m)
    ea, eb = xp.exp(ma - ms), xp.exp(mb - ms)
    return m, la * ea + lb * eb, acca * ea + accb * eb


def online_step(xp, m, l, s, *, with_sum=True, overwrite=False):
    """Fold one block of logits ``s (..., N, n)`` into the running ``(m, l)``.

    Returns ``(m_new, l_new, p, alpha)``: ``p = exp(s - m_new)``, the block's
    unnormalised weights, and ``alpha = exp(m - m_new)``, the factor that rescales the
    running accumulator before ``p @ v`` is added to it. Start from ``m = -inf``,
    ``l = 0``; ``m = None`` (and ``l = None``) marks the first block, which needs no
    ``alpha`` (returned as None) and gives the same bits as starting from ``-inf``
    and 0 (``0 * 0 + x`` is ``x``).

    ``with_sum=False`` leaves the row sums to the caller (``l_new`` is None): the online
    softmax gets them from ``P [V | 1]``, saving a pass over the block. ``overwrite=True``
    shifts ``s`` in place (``s`` must be the caller's own fresh array, and on a torch
    tensor one that records no autograd graph: ``max``'s backward reads it), one pass
    and one block-sized allocation fewer; on JAX it rebinds the local name only.
    """
    block_max = xp.max(s, axis=-1, keepdims=True)
    m_new = block_max if m is None else xp.maximum(m, block_max)
    m_safe = finite_max(xp, m_new)
    if overwrite:
        s -= m_safe
        p = xp.exp(s)
    else:
        p = xp.exp(s - m_safe)
    alpha = None if m is None else xp.exp(m - m_safe)
    if not with_sum:
        return m_new, None, p, alpha
    rowsum = xp.sum(p, axis=-1, keepdims=True)
    return m_new, (rowsum if alpha is None else l * alpha + rowsum), p, alpha


def finish_partial(xp, l, acc):
    """The softmax output ``acc / l``; rows with no allowed key (``l = 0``) are zero."""
    return acc / xp.where(l == 0, xp.ones_like(l), l)


def partial_lse(xp, m, l, empty=float("inf")):
    """Row log-sum-exp ``m + log l`` of a partial, ``empty`` on a row with no allowed key
    (``l = 0``): ``+inf`` by default, so that a backward's ``exp(S - lse)`` is 0 there;
    ``-inf`` (``log 0``) for a partial that is merged later
    (:mod:`attn_ref.softmax.partial`), where it weighs nothing."""
    value = empty
    empty = l == 0
    one = xp.ones_like(l)
    return xp.where(empty, xp.full_like(l, value),
                    xp.where(empty, xp.zeros_like(m), m) + xp.log(xp.where(empty, one, l)))


# ---------------------------------------------------------------- thread pool


def cpu_count():
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def parallel_map(fn, items, *, pooled, one_blas_thread=True):
    """``[fn(item) for item in items]``, on a pool of one thread per CPU when ``pooled``,
    with the BLAS held to one thread while the pool runs (:func:`blas_one_thread`;
    ``one_blas_thread=False`` leaves BLAS as it is, for work whose GEMMs are all small
    enough for OpenBLAS's one-thread kernel, where the limit measured slower: linear
    attention's block loop, ``attn_ref.linear.engine.POOL_MIN_ROWS``).

    NumPy's ufuncs and BLAS release the GIL, so independent pieces of one call (heads)
    run on all cores in plain Python. Each worker's GEMMs run on one BLAS thread: the
    pool's threads are the parallelism, and BLAS threads of their own would compete with
    them for the cores (NumPy, N = 4096, 8 heads: the online softmax's heads on two
    workers took 377 ms with BLAS on one thread, against 617 ms for the unpooled call on
    BLAS's two threads; ``docs/comparison.md``). The results come back in the order of
    ``items``, each computed by the same operations whichever thread ran it: nothing
    depends on the scheduling. The caller decides ``pooled`` (:func:`pool_helps`: large
    eager NumPy arrays); an exception in a worker propagates after the limit is restored.
    """
    items = list(items)
    workers = min(cpu_count(), len(items))
    if not pooled or workers < 2:
        return [fn(item) for item in items]
    with (blas_one_thread() if one_blas_thread else contextlib.nullcontext()), \
            ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, items))


class _BlasLimit:
    """The process's BLAS held to one thread while anyone holds it (a count under a
    lock): two calls pooling at once from two user threads must not restore the
    limit under each other, and the last to leave restores what was there before."""

    def __init__(self):
        self._lock = threading.Lock()
        self._holders = 0
        self._limiter = None
        self._blas = None  # threadpoolctl's controller of the loaded BLAS, made once

    def controller(self):
        """threadpoolctl's controller of the BLAS libraries loaded now, made at the first
        call (listing the loaded libraries takes about 8 ms; a limit then about 10 us)."""
        with self._lock:
            if self._blas is None:
                from threadpoolctl import ThreadpoolController

                self._blas = ThreadpoolController().select(user_api="blas")
            return self._blas

    def __enter__(self):
        blas = self.controller()
        with self._lock:
            if self._holders == 0:
                self._limiter = blas.limit(limits=1)
            self._holders += 1
        return self

    def __exit__(self, *exc):
        with self._lock:
            self._holders -= 1
            if self._holders == 0:
                self._limiter.restore_original_limits()
                self._limiter = None
        return False


_BLAS_LIMIT = _BlasLimit()


def blas_one_thread():
    """A context that holds the BLAS libraries loaded in this process (NumPy's OpenBLAS,
    found by threadpoolctl) to one thread, and restores their thread counts on leaving,
    also when the body raises.

    The limit is process-wide while it is held: every thread's GEMMs, not only the
    pool's, run on one BLAS thread until the last holder leaves (nested and concurrent
    holders are counted, so one leaving early does not lift another's limit).
    """
    return _BLAS_LIMIT


def blas_controllable():
    """Whether threadpoolctl finds a BLAS library in this process whose threads it can
    limit (without one, a pool's workers would compete with BLAS's own threads)."""
    return bool(_BLAS_LIMIT.controller().lib_controllers)


def row_groups(rows, most=None):
    """``[(a, b)]``: ``range(rows)`` cut into contiguous, near-equal ranges, the pieces
    :func:`parallel_map` runs a batch in: one per CPU (fewer when there are fewer rows),
    or more, so that none holds more than ``most`` rows (the pool's workers then take
    the pieces in turn)."""
    groups = min(cpu_count(), rows)
    if most is not None:
        groups = max(groups, -(-rows // most))
    cuts = [rows * i // groups for i in range(groups + 1)]
    return list(zip(cuts, cuts[1:]))


def batch_rows(arrays):
    """The number of leading batch rows the ``arrays`` can be cut along together: the
    product of their batch shape (all but the last two axes) when they share it, else 1
    (a broadcast batch is not cut)."""
    shapes = {tuple(x.shape[:-2]) for x in arrays}
    if len(shapes) != 1:
        return 1
    rows = 1
    for n in shapes.pop():
        rows *= n
    return rows


def pool_helps(*arrays):
    """Whether :func:`parallel_map`'s threads can speed up a call on ``arrays``: eager
    NumPy arrays (or array-api-strict's, which wrap NumPy's) in a process whose BLAS
    threadpoolctl can hold to one thread. Not PyTorch's tensors, whose operators already
    run on every core (the online softmax at N = 4096, 8 heads, on torch tensors: 656 ms
    with a pool against 555 ms without, on a quiet 2-core machine); not lazy arrays
    (:func:`is_lazy`: ``jax.jit`` tracers, Dask), whose values are computed later; not
    JAX's eager arrays (XLA's own threads) nor CuPy's (the GPU, not the CPU's cores)."""
    if not arrays or is_lazy(*arrays):
        return False
    if not all(numpy_backed(x) for x in arrays):
        return False
    return blas_controllable()


def numpy_backed(x):
    """Whether NumPy computes on ``x``: a NumPy array, or array-api-strict's (NumPy's
    underneath, whatever its simulated device)."""
    return array_api_compat.is_numpy_array(x) or type(x).__module__.split(".")[0] == "array_api_strict"


def torch_cpu(x):
    """Whether ``x`` is an eager PyTorch tensor on the CPU."""
    return array_api_compat.is_torch_array(x) and x.device.type == "cpu"


def is_lazy(*arrays):
    """Whether any of ``arrays`` is lazy (a ``jax.jit`` tracer, a Dask array): its values
    cannot be read, and threads gain nothing on it."""
    return any(array_api_compat.is_lazy_array(x) for x in arrays)


def records_graph(x):
    """Whether ``x`` is a torch tensor that records an autograd graph (reading its values
    back to the host makes torch warn, and the backward may read what it was made from)."""
    return array_api_compat.is_torch_array(x) and x.requires_grad


def owned_writeable(x):
    """Whether ``x``, an array the caller made itself, may be updated in place
    (``x += y``, ``x[..., i] = y``): a writeable array (NumPy, PyTorch, CuPy,
    array-api-strict; not JAX), not lazy, and not a torch tensor that records an
    autograd graph (the backward of the operation that made it may read it).

    Updating in place saves a fresh array per operation; on NumPy a fresh block-sized
    array often costs page faults (the allocator returns freed memory to the system and
    takes it back), more than the arithmetic itself.
    """
    if not array_api_compat.is_writeable_array(x) or is_lazy(x):
        return False
    return not records_graph(x)


#: Bytes of the block :func:`keep_freed_memory` makes and drops: glibc's ``free`` raises
#: its mmap threshold to the size of a freed mapped block below its
#: ``DEFAULT_MMAP_THRESHOLD_MAX`` (32 MiB on 64-bit systems), and its trim threshold to
#: twice that.
KEEP_FREED_BYTES = 16 << 20
_freed_memory_kept = False


def keep_freed_memory(x):
    """Once per process, on the CPU: make and drop one untouched array of
    :data:`KEEP_FREED_BYTES`, so that glibc's allocator keeps the memory of the block
    loops' freed temporaries for the next block instead of returning it to the system.

    glibc serves requests from its mmap threshold up (128 KiB at start) with fresh
    mappings and gives the heap's free top back once it exceeds its trim threshold
    (128 KiB at start); both rise only when a mapped block is freed, to its size and
    twice that. A loop whose block makes several arrays of about 1 MiB frees them
    together, at the top of the heap, more than twice the largest: they are trimmed,
    and the next block's arrays fault their pages in again, a page at a time (causal
    linear attention at N = 65536, 8 heads, d = 64: 48-69K page faults a call, a
    quarter of its time; see :doc:`/comparison`). After one freed 16 MiB block, blocks
    up to 16 MiB come from the heap, and the heap keeps up to 32 MiB of free memory:
    the same state that any NumPy program reaches once it frees an array of that size.
    The array is never written, so no page of it is touched. Nothing happens for other
    devices or lazy arrays, nor with an allocator that is not glibc's (the array is
    then simply made and dropped).
    """
    global _freed_memory_kept
    if _freed_memory_kept or is_lazy(x) or not (numpy_backed(x) or torch_cpu(x)):
        return
    xp = array_api_compat.array_namespace(x)
    xp.empty((KEEP_FREED_BYTES,), dtype=xp.uint8, device=array_api_compat.device(x))
    _freed_memory_kept = True


def _keeps_shape(x, y):
    """Whether ``y`` broadcasts to ``x``'s shape (so ``x op y`` has ``x``'s shape)."""
    xs, ys = tuple(x.shape), tuple(getattr(y, "shape", ()))
    return len(ys) <= len(xs) and all(b in (1, a) for a, b in zip(xs[::-1], ys[::-1]))


def add_into(x, y):
    """``x + y``, written into ``x`` where :func:`owned_writeable` allows it and ``y``
    broadcasts to ``x``'s shape (``x`` must be the caller's own array): the same sums,
    without a fresh array."""
    if owned_writeable(x) and _keeps_shape(x, y):
        x += y
        return x
    return x + y


def mul_into(x, y):
    """``x * y``, written into ``x`` as :func:`add_into` does."""
    if owned_writeable(x) and _keeps_shape(x, y):
        x *= y
        return x
    return x * y
