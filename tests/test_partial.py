"""attn_ref.softmax.partial: split-KV partials and their merge.

The promise: any split of the keys into chunks, merged in any tree and any order,
is softmax attention over all the keys (output and row log-sum-exp) to a few ulps in
float64; rows that see no key have ``lse = -inf`` and a zero output, never NaN.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from attn_ref import merge_attention, partial_attention, softmax_attention
from conformance.backends import from_numpy
from tests.helpers import assert_close, host, property_test, randn


def _host_lse(q, k, *, causal=False, mask=None, query_offset=0, key_offset=0, scale=None):
    """Row log-sum-exp of the masked logits, plainly on the host (``-inf`` for empty rows)."""
    s = (q @ np.swapaxes(k, -1, -2)) * (1 / np.sqrt(q.shape[-1]) if scale is None else scale)
    allowed = np.ones(s.shape[-2:], bool) if mask is None else np.broadcast_to(mask, s.shape)
    if causal:
        i = query_offset + np.arange(q.shape[-2])[:, None]
        j = key_offset + np.arange(k.shape[-2])[None, :]
        allowed = allowed & (j <= i)
    s = np.where(allowed, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return (m + np.log(np.sum(np.exp(s - m), axis=-1, keepdims=True)))[..., 0]


def _merge_tree(xp_parts, order, shape):
    """Merge ``xp_parts`` in the order and tree that ``order``/``shape`` draw."""
    parts = [xp_parts[i] for i in order]
    while len(parts) > 1:
        i = shape.draw(st.integers(0, len(parts) - 2))
        width = shape.draw(st.integers(2, len(parts) - i))
        parts[i:i + width] = [merge_attention(parts[i:i + width])]
    return parts[0]


def test_chunks_merge_to_softmax_attention(backend):
    xp = backend.xp

    # JAX runs this eagerly, compiling every op at each new (nq, nk): 6 examples took
    # two minutes of a loaded run, most of the file. What JAX can get wrong here (a
    # dtype, an immutable array, its -inf handling in the merge) shows on any example;
    # the 25 on the other backends search the shapes, cuts and merge trees.
    @property_test(backend, examples=12 if backend.name == "jax" else 25)
    @given(nq=st.integers(1, 9), nk=st.integers(1, 17), causal=st.booleans(),
           data=st.data())
    def check(nq, nk, causal, data):
        seed = data.draw(st.integers(0, 2**16))
        q, qh = randn(backend, (2, nq, 4), seed=seed)
        k, kh = randn(backend, (2, nk, 4), seed=seed + 1, scale=3.0)
        v, vh = randn(backend, (2, nk, 5), seed=seed + 2)
        cuts = sorted(data.draw(st.sets(st.integers(1, nk - 1), max_size=4)) if nk > 1 else [])
        bounds = list(zip([0] + cuts, cuts + [nk]))
        # Bottom-right alignment of the whole problem: the first query sits at Nk - Nq.
        q_off = nk - nq
        parts = [partial_attention(q, k[..., a:b, :], v[..., a:b, :], causal=causal,
                                   query_offset=q_off, key_offset=a) for a, b in bounds]
        order = data.draw(st.permutations(range(len(parts))))
        out, lse = _merge_tree(parts, order, data)
        want = softmax_attention(q, k, v, causal="bottom-right" if causal else False)
        assert_close(out, host(want), backend, rtol=16 * 2.0**-52, atol=16 * 2.0**-52)
        want_lse = _host_lse(qh, kh, causal=causal, query_offset=q_off)
        got = host(lse)
        assert np.array_equal(np.isneginf(got), np.isneginf(want_lse))
        fin = np.isfinite(want_lse)
        np.testing.assert_allclose(got[fin], want_lse[fin], rtol=0, atol=64 * 2.0**-52)
        # The output of rows that see no key (Nq > Nk, causal) is exactly zero.
        assert np.all(host(out)[np.isneginf(want_lse)] == 0)

    check()
    del xp


def test_merge_is_commutative_and_associative(backend):
    q, _ = randn(backend, (3, 6, 4), seed=3)
    k, _ = randn(backend, (3, 12, 4), seed=4, scale=4.0)
    v, _ = randn(backend, (3, 12, 2), seed=5)
    a, b, c = (partial_attention(q, k[..., i:i + 4, :], v[..., i:i + 4, :]) for i in (0, 4, 8))
    ref_out, ref_lse = merge_attention([a, b, c])
    for tree in ([merge_attention([a, b]), c], [a, merge_attention([c, b])], [c, a, b],
                 [merge_attention([merge_attention([b, c]), a])]):
        out, lse = merge_attention(tree)
        assert_close(out, host(ref_out), backend, rtol=8 * 2.0**-52, atol=8 * 2.0**-52)
        assert_close(lse, host(ref_lse), backend, rtol=8 * 2.0**-52, atol=8 * 2.0**-52)


def test_rows_that_see_no_key(backend):
    xp = backend.xp
    q, _ = randn(backend, (4, 3), seed=7)
    k, _ = randn(backend, (6, 3), seed=8)
    v, _ = randn(backend, (6, 2), seed=9)
    # Row 1 may attend nothing at all; row 0 only keys of the second chunk.
    mask = np.ones((4, 6), bool)
    mask[1] = False
    mask[0, :3] = False
    m = from_numpy(mask, backend)
    first = partial_attention(q, k[:3, :], v[:3, :], mask=m[:, :3])
    second = partial_attention(q, k[3:, :], v[3:, :], mask=m[:, 3:])
    lse0 = host(first[1])
    assert lse0[0] == -np.inf and lse0[1] == -np.inf
    assert np.all(host(first[0])[:2] == 0)
    out, lse = merge_attention([first, second])
    assert host(lse)[1] == -np.inf and np.all(host(out)[1] == 0)
    assert not np.any(np.isnan(host(out))) and not np.any(np.isnan(host(lse)))
    assert_close(out, host(softmax_attention(q, k, v, mask=m)), backend)
    # Every partial empty: still -inf and zeros, no NaN.
    out, lse = merge_attention([partial_attention(q, k[:3, :], v[:3, :], mask=m[:, :3] & False)] * 2)
    assert np.all(host(lse) == -np.inf) and np.all(host(out) == 0)
    del xp


def test_chunk_hidden_by_causal_costs_nothing_and_is_empty(backend):
    q, _ = randn(backend, (2, 4, 3), seed=1)
    k, _ = randn(backend, (2, 4, 3), seed=2)
    out, lse = partial_attention(q, k, k, causal=True, query_offset=0, key_offset=4)
    assert np.all(host(lse) == -np.inf) and np.all(host(out) == 0)
    assert tuple(out.shape) == (2, 4, 3) and tuple(lse.shape) == (2, 4)


@pytest.mark.parametrize("nq", [1, 5, 17])
def test_partials_with_chunks_merge_to_chunked_attention(backend, nq):
    """Llama 4's chunked attention split over the keys: each partial places its rows and
    keys by ``query_offset``/``key_offset`` (absolute positions), the key splits
    (5, 6, 6) straddle the chunks of 4 and 6, and 17 keys are a multiple of neither;
    the merge is ``softmax_attention(chunk=c, causal="bottom-right")``, the log-sum-exp
    that of a plainly built chunked causal mask, and a split no query's chunk reaches
    is empty (``-inf``, zeros)."""
    nk = 17
    q, qh = randn(backend, (2, nq, 4), seed=51)
    k, kh = randn(backend, (2, nk, 4), seed=52, scale=3.0)
    v, _ = randn(backend, (2, nk, 3), seed=53)
    bounds = ((0, 5), (5, 11), (11, 17))
    for chunk in (4, 6):
        parts = [partial_attention(q, k[..., a:b, :], v[..., a:b, :], causal=True, chunk=chunk,
                                   query_offset=nk - nq, key_offset=a) for a, b in bounds]
        out, lse = merge_attention(parts)
        want = softmax_attention(q, k, v, chunk=chunk, causal="bottom-right")
        assert_close(out, host(want), backend, rtol=16 * 2.0**-52, atol=16 * 2.0**-52)
        i, j = np.arange(nk - nq, nk)[:, None], np.arange(nk)[None, :]
        want_lse = _host_lse(qh, kh, mask=(i // chunk == j // chunk) & (j <= i))
        got = host(lse)
        assert np.array_equal(np.isneginf(got), np.isneginf(want_lse))
        fin = np.isfinite(want_lse)
        np.testing.assert_allclose(got[fin], want_lse[fin], rtol=0, atol=64 * 2.0**-52)
    # one query at position 16, chunk 4 = positions 16..19: keys 0..5 are in other chunks
    out, lse = partial_attention(q[..., -1:, :], k[..., :5, :], v[..., :5, :], chunk=4, query_offset=16)
    assert np.all(host(lse) == -np.inf) and np.all(host(out) == 0)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_low_precision_partials_keep_lse_in_float32(backend, dtype):
    xp = backend.xp
    if not hasattr(xp, dtype):
        pytest.skip(f"{backend.name} has no {dtype}")
    q, qh = randn(backend, (5, 8), dtype=dtype, seed=1)
    k, kh = randn(backend, (10, 8), dtype=dtype, seed=2)
    out, lse = merge_attention([partial_attention(q, k[:4, :], k[:4, :]),
                                partial_attention(q, k[4:, :], k[4:, :])])
    assert out.dtype == q.dtype and lse.dtype == xp.float32
    atol = 1e-2 if dtype == "float16" else 1e-5
    np.testing.assert_allclose(host(lse), _host_lse(qh, kh), rtol=0, atol=atol)


def test_bad_partials_are_named(backend):
    xp = backend.xp
    q, _ = randn(backend, (2, 3, 4), seed=1)
    a = partial_attention(q, q, q)
    with pytest.raises(ValueError, match="at least one"):
        merge_attention([])
    with pytest.raises(TypeError, match=r"got one \(out, lse\) pair"):
        merge_attention(a)
    with pytest.raises(TypeError, match=r"partials\[1\] must be an \(out, lse\) pair"):
        merge_attention([a, (a[0],)])
    with pytest.raises(ValueError, match=r"partials\[1\] out has shape \(2, 2, 4\)"):
        merge_attention([a, partial_attention(q[:, :2, :], q, q)])
    with pytest.raises(ValueError, match=r"lse \(2, 2\)"):
        merge_attention([a, (a[0], a[1][:, :2])])
    with pytest.raises(TypeError, match=r"partials\[1\] lse must have a real floating dtype"):
        merge_attention([a, (a[0], xp.astype(a[1], xp.int32))])
    with pytest.raises(TypeError, match=r"partials\[1\] has dtypes out \S*float32"):
        merge_attention([a, (xp.astype(a[0], xp.float32), a[1])])
    with pytest.raises(TypeError, match="different array libraries"):
        merge_attention([a, (np.zeros((2, 3, 4)), np.zeros((2, 3)))] if backend.name != "numpy"
                        else [a, (_foreign(a[0]), _foreign(a[1]))])
    with pytest.raises(TypeError, match="key_offset must be an integer position, got 1.5"):
        partial_attention(q, q, q, causal=True, key_offset=1.5)
    with pytest.raises(TypeError, match="causal must be True or False"):
        partial_attention(q, q, q, causal="bottom-right")


def _foreign(x):
    import array_api_strict

    return array_api_strict.asarray(np.asarray(x))
