"""attn_ref._common: the rules every family shares, checked against their definitions.

The online-softmax partials are checked against a plain host softmax: a partial of a
key subset, partials merged over disjoint subsets, and blocks folded one at a time must
all give ``softmax(S) V`` and ``logsumexp(S)``, with rows that see no key giving zeros
and ``lse = +inf``.
"""

import math

import numpy as np
import pytest

from attn_ref._common import (
    BOTTOM_RIGHT,
    TOP_LEFT,
    add_into,
    and_masks,
    causal_alignment,
    causal_offset,
    ceil_div,
    finish_partial,
    finite_max,
    merge_partials,
    mul_into,
    online_step,
    owned_writeable,
    partial_lse,
    records_graph,
    softmax_partial,
)
from conformance.backends import from_numpy
from tests.helpers import assert_close, host


def test_ceil_div_is_exact():
    for n in range(0, 40):
        for b in range(1, 9):
            assert ceil_div(n, b) == math.ceil(n / b)
    # Past 2**53 a float round trip is off by one; the integer rule is not.
    big = 2**60 + 1
    assert ceil_div(big, 2) == 2**59 + 1


def test_causal_offset_and_alignment():
    # Query i sees key j iff j <= i + offset: top-left puts query 0 on key 0,
    # bottom-right puts the last query on the last key.
    assert causal_offset(TOP_LEFT, 3, 7) == 0
    assert causal_offset(BOTTOM_RIGHT, 3, 7) == 4
    assert causal_offset(BOTTOM_RIGHT, 7, 3) == -4
    assert causal_alignment(True) == TOP_LEFT
    assert causal_alignment(False) is None
    assert causal_alignment(np.bool_(True)) == TOP_LEFT
    assert causal_alignment("bottom-right") == BOTTOM_RIGHT
    with pytest.raises(ValueError, match="causal must be"):
        causal_alignment("bottom")
    with pytest.raises(TypeError, match="causal must be True or False"):
        causal_alignment(np.int64(1))


def test_and_masks(backend):
    xp = backend.xp
    a = from_numpy(np.array([True, True, False]), backend)
    b = from_numpy(np.array([True, False, False]), backend)
    assert and_masks(xp, None, None) is None
    assert and_masks(xp, a, None) is a and and_masks(xp, None, b) is b
    assert host(and_masks(xp, a, b)).tolist() == [True, False, False]


def _logits(seed, rows=5, n=9):
    rng = np.random.default_rng(seed)
    s = rng.standard_normal((2, rows, n)) * 3
    s[:, 1, :] = -np.inf  # a row that sees no key
    s[:, 2, :4] = -np.inf  # a row that sees only the last keys
    v = rng.standard_normal((2, n, 3))
    return s, v


def _plain(s, v):
    """softmax(s) v with fully masked rows zero, and logsumexp(s) (+inf on those rows)."""
    m = np.max(s, axis=-1, keepdims=True)
    live = np.isfinite(m)
    e = np.exp(s - np.where(live, m, 0.0))
    z = np.sum(e, axis=-1, keepdims=True)
    out = np.where(live, e @ v / np.where(live, z, 1.0), 0.0)
    lse = np.where(live, np.where(live, m, 0.0) + np.log(np.where(live, z, 1.0)), np.inf)
    return out, lse


def _is_softmax(backend, partial, s, v):
    """The partial ``(m, l, acc)`` finishes to ``softmax(s) v`` and ``logsumexp(s)``."""
    xp = backend.xp
    m, l, acc = partial
    want_out, want_lse = _plain(s, v)
    out = finish_partial(xp, l, acc)
    assert not np.isnan(host(out)).any()  # an empty row's exp(-inf + inf) avoided
    assert_close(out, want_out, backend)
    assert_close(partial_lse(xp, m, l), want_lse, backend)


def test_partial_of_all_keys_is_the_softmax(backend):
    s, v = _logits(0)
    _is_softmax(backend, softmax_partial(backend.xp, from_numpy(s, backend), from_numpy(v, backend)), s, v)


def test_merged_partials_equal_one_partial(backend):
    # Partials over disjoint key sets merge exactly, whichever set holds the row max and
    # when one set has no allowed key for a row.
    xp = backend.xp
    s, v = _logits(1)
    parts = [
        softmax_partial(xp, from_numpy(s[..., lo:hi], backend), from_numpy(v[:, lo:hi], backend))
        for lo, hi in ((0, 2), (2, 6), (6, 9))
    ]
    _is_softmax(backend, merge_partials(xp, merge_partials(xp, parts[0], parts[1]), parts[2]), s, v)


def test_online_steps_equal_one_partial(backend):
    xp = backend.xp
    s, v = _logits(2)
    shape = s.shape[:-1] + (1,)
    m = from_numpy(np.full(shape, -np.inf), backend)
    l = from_numpy(np.zeros(shape), backend)
    acc = from_numpy(np.zeros(s.shape[:-1] + (v.shape[-1],)), backend)
    for lo, hi in ((0, 3), (3, 4), (4, 9)):
        m, l, p, alpha = online_step(xp, m, l, from_numpy(s[..., lo:hi], backend))
        acc = acc * alpha + p @ from_numpy(v[:, lo:hi], backend)
    _is_softmax(backend, (m, l, acc), s, v)


def test_finite_max_shifts_only_minus_inf(backend):
    xp = backend.xp
    m = from_numpy(np.array([[-np.inf], [2.5], [-1e300], [np.inf]]), backend)
    assert host(finite_max(xp, m))[:, 0].tolist() == [0.0, 2.5, -1e300, np.inf]


def test_add_into_and_mul_into_write_only_where_they_may(backend):
    """The in-place sums and products of the block loops (linear attention, the online
    softmax, the recurrent chunk forms): the values of ``x + y`` and ``x * y`` always;
    written into ``x`` only where it is writeable and keeps its shape (a ``y`` that
    broadcasts ``x`` to a larger shape gets a new array, and ``x`` is left as it was)."""
    x0 = np.arange(6.0).reshape(2, 3)
    for op, fn in ((np.add, add_into), (np.multiply, mul_into)):
        x = from_numpy(x0.copy(), backend)
        out = fn(x, from_numpy(np.full((3,), 2.0), backend))
        assert_close(out, op(x0, 2.0), backend, rtol=0, atol=0)
        if owned_writeable(x):  # written into x: x holds the result
            assert_close(x, op(x0, 2.0), backend, rtol=0, atol=0)
        x = from_numpy(x0.copy(), backend)
        out = fn(x, from_numpy(np.ones((4, 2, 3)), backend))  # would grow x
        assert tuple(out.shape) == (4, 2, 3)
        assert_close(out, op(x0, np.ones((4, 2, 3))), backend, rtol=0, atol=0)
        assert_close(x, x0, backend, rtol=0, atol=0)


def test_records_graph_only_for_torch_tensors_under_autograd(backend):
    x = from_numpy(np.ones(3), backend)
    assert not records_graph(x)
    if backend.name == "torch":
        assert records_graph(x.clone().requires_grad_(True))
        assert records_graph(x.clone().requires_grad_(True) * 2)


@pytest.mark.filterwarnings("error::UserWarning")
def test_online_forward_reads_nothing_back_under_autograd():
    # the scale folding reads max|q|, max|k| on the host: under a graph torch warned
    # 'Converting a tensor with requires_grad=True to a scalar'; now the clamped path
    torch = pytest.importorskip("torch")
    from attn_ref.grad import online_softmax_forward

    q = torch.randn(2, 1, 5, 4, dtype=torch.float64, requires_grad=True)
    out, lse = online_softmax_forward(q, q, q, seqlens_k=torch.tensor([5, 3]), block_q=2, block_k=2)
    g = torch.autograd.grad((out.sum() + lse[0].sum()), q)[0]
    assert torch.isfinite(g).all()


def test_add_into_leaves_autograd_tensors_alone():
    torch = pytest.importorskip("torch")
    x = torch.ones(3, requires_grad=True) * 2  # records a graph: not to be overwritten
    out = add_into(x, torch.ones(3))
    assert out is not x and float(x.detach()[0]) == 2.0


# ---------------------------------------------------------------- the heads pool


def _blas_threads():
    """The thread counts of the BLAS libraries threadpoolctl finds in this process."""
    from attn_ref._common import blas_one_thread

    return [lib["num_threads"] for lib in blas_one_thread().controller().info()]


@pytest.fixture
def two_blas_threads(monkeypatch):
    """BLAS on two threads and two CPUs for the pool, whatever this machine has: a pool
    that did not hold BLAS to one thread shows 2 inside its workers."""
    from threadpoolctl import threadpool_limits

    import attn_ref._common as common

    if not common.blas_controllable():
        pytest.fail("threadpoolctl finds no BLAS in this process: NumPy's BLAS should be found")
    monkeypatch.setattr(common, "cpu_count", lambda: 2)
    with threadpool_limits(2, "blas"):
        yield


def test_parallel_map_holds_blas_to_one_thread_and_restores_it(two_blas_threads):
    import threading

    from attn_ref._common import parallel_map

    seen = []

    def work(i):
        seen.append((threading.get_ident(), _blas_threads()))
        return i * i

    assert parallel_map(work, range(4), pooled=True) == [0, 1, 4, 9]  # in order
    assert seen and all(set(t) == {1} for _, t in seen)
    assert set(_blas_threads()) == {2}  # restored after the call
    seen.clear()
    assert parallel_map(work, range(3), pooled=False) == [0, 1, 4]
    assert {i for i, _ in seen} == {threading.get_ident()}  # unpooled: this thread
    assert all(set(t) == {2} for _, t in seen)  # and no limit


def test_parallel_map_restores_blas_after_a_worker_raises(two_blas_threads):
    from attn_ref._common import parallel_map

    def work(i):
        if i == 1:
            raise ZeroDivisionError("worker 1 failed")
        return i

    with pytest.raises(ZeroDivisionError, match="worker 1 failed"):
        parallel_map(work, range(4), pooled=True)
    assert set(_blas_threads()) == {2}


def test_blas_limit_is_lifted_only_by_the_last_holder(two_blas_threads):
    # Two pooled calls at once (two user threads): the first to finish must not give
    # BLAS its threads back while the other's workers still run on one.
    from attn_ref._common import blas_one_thread

    first, second = blas_one_thread(), blas_one_thread()
    first.__enter__()
    second.__enter__()
    assert set(_blas_threads()) == {1}
    first.__exit__(None, None, None)
    assert set(_blas_threads()) == {1}
    second.__exit__(None, None, None)
    assert set(_blas_threads()) == {2}


def test_pool_helps_only_eager_numpy_arrays(backend):
    # NumPy's (and array-api-strict's, NumPy underneath) ufuncs run on one thread: the
    # pool helps. PyTorch threads its own operators, JAX's XLA too, and a traced array
    # has no values yet: never pooled.
    from attn_ref._common import pool_helps

    x = from_numpy(np.ones((2, 3, 4)), backend)
    assert pool_helps(x, x) == (backend.name in ("numpy", "array_api_strict"))
    assert not pool_helps()
    if backend.name == "jax":
        import jax

        seen = []

        def traced(x):
            seen.append(pool_helps(x))
            return x

        jax.jit(traced)(x)
        assert seen == [False]
    if backend.name == "numpy":
        torch = pytest.importorskip("torch")
        assert not pool_helps(x, torch.ones(2))  # one torch array among them is enough


@pytest.mark.parametrize("rows, cpus, most, want", [
    (8, 2, None, [(0, 4), (4, 8)]),  # one contiguous range per CPU
    (3, 4, None, [(0, 1), (1, 2), (2, 3)]),  # never an empty range
    (8, 2, 1, [(i, i + 1) for i in range(8)]),  # one row each: tiles of one head
    (8, 2, 3, [(0, 2), (2, 5), (5, 8)]),  # near-equal, none above three rows
    (8, 2, 100, [(0, 4), (4, 8)]),  # a loose limit keeps one range per CPU
])
def test_row_groups_cover_the_rows_in_order(monkeypatch, rows, cpus, most, want):
    import attn_ref._common as common

    monkeypatch.setattr(common, "cpu_count", lambda: cpus)
    assert common.row_groups(rows, most=most) == want


_FAULTS = """
import resource, sys
import numpy as np
import attn_ref._common as common
from attn_ref import linear_attention
from attn_ref.recurrent import gated_linear_attention
if sys.argv[1] == "off":
    common._freed_memory_kept = True  # as if done already: nothing is made and dropped
rng = np.random.default_rng(0)
T = int(sys.argv[3])
q, k, v = (rng.standard_normal((8, T, 64), dtype=np.float32) for _ in range(3))
if sys.argv[2] == "linear":
    def call():
        linear_attention(q, k, v, causal=True)
else:
    g = np.log(1 / (1 + np.exp(-rng.standard_normal((8, T, 64))))).astype(np.float32)
    def call():
        gated_linear_attention(q, k, v, g=g)
call()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
call()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="glibc's allocator")
@pytest.mark.parametrize("caller, T, least", [("linear", 16384, 8000), ("gla", 8192, 1500)])
def test_keep_freed_memory_spares_the_block_loops_their_page_faults(caller, T, least):
    # A fresh process each (the allocator's thresholds only rise), 8 heads, the second
    # call: causal linear attention's block loop (N = 16384) and GLA's groups of chunks (T
    # = 8192). Without the dropped block their temporaries of about 1 MiB were trimmed
    # from the heap's top and faulted in again (15K and 2.2K faults of 4 KiB, measured);
    # with it, their memory is reused (about 540 and under 10).
    import subprocess
    import sys

    def faults(mode):
        res = subprocess.run([sys.executable, "-c", _FAULTS, mode, caller, str(T)], capture_output=True,
                             text=True, timeout=120)
        assert res.returncode == 0, res.stderr[-2000:]
        return int(res.stdout.split()[-1])

    off = faults("off")
    if off < least:
        pytest.skip(f"this allocator gives nothing back here ({off} page faults without the block)")
    on = faults("on")
    assert on < off / 4, (on, off)
