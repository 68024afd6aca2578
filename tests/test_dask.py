"""attn_ref.dask: long-N goldens on a Dask LocalCluster equal NumPy to rounding.

One LocalCluster of 2 worker processes serves the module (small N, under a few seconds
of work). Checked: exact softmax attention (causal in both alignments, leading axes
chunked too) and linear attention (causal and not) against the NumPy references on
sub-sampled rows; chunking errors named; a worker killed mid-run raises WorkerLost and
returns nothing.
"""

import os
import time

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
pytest.importorskip("distributed")

from attn_ref import linear_attention, softmax_attention  # noqa: E402
from attn_ref.dask import (  # noqa: E402
    WorkerLost,
    compute,
    dask_linear_attention,
    dask_softmax_attention,
    local_cluster,
)

N = 1024
ROWS = np.array([0, 1, 255, 256, 511, 700, 1023])


@pytest.fixture(scope="module")
def client():
    cluster, client = local_cluster(2, memory_limit="1GiB")
    yield client
    client.close()
    cluster.close()


def _qkv(seed=0, n=N, heads=2, d=16):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, heads, n, d)) for _ in range(3)]


@pytest.mark.parametrize("causal", [False, "top-left", "bottom-right"])
def test_softmax_on_the_cluster_equals_numpy_on_sampled_rows(client, causal):
    q, k, v = _qkv()
    q = q[..., : N - 100, :]  # Nq != Nk: the alignments differ
    qd = da.from_array(q, chunks=(1, 1, 200, 16))
    kd, vd = (da.from_array(x, chunks=(1, 1, 256, 16)) for x in (k, v))
    out, lse = compute(*dask_softmax_attention(qd, kd, vd, causal=causal), client=client)
    rows = ROWS[ROWS < q.shape[-2]]
    off = {False: None, "top-left": 0, "bottom-right": k.shape[-2] - q.shape[-2]}[causal]
    mask = None if off is None else np.arange(N)[None, :] <= rows[:, None] + off
    want = softmax_attention(q[..., rows, :], k, v, mask=mask)
    np.testing.assert_allclose(out[..., rows, :], want, rtol=0, atol=1e-14)
    s = (q[..., rows, :] @ np.swapaxes(k, -1, -2)) / 4.0
    s = s if mask is None else np.where(mask, s, -np.inf)
    m = s.max(-1, keepdims=True)
    want_lse = (m + np.log(np.exp(s - m).sum(-1, keepdims=True)))[..., 0]
    np.testing.assert_allclose(lse[..., rows], want_lse, rtol=0, atol=1e-13)


def test_leading_axes_chunked_and_rows_with_no_key(client):
    q, k, v = _qkv(1, n=300, heads=4, d=8)
    kd, vd = (da.from_array(x[..., :30, :], chunks=(1, 2, 10, 8)) for x in (k, v))
    qd = da.from_array(q[..., :40, :], chunks=(1, 2, 16, 8))
    # bottom-right, Nq = 40 > Nk = 30: queries 0..9 see no key (lse -inf, out 0)
    out, lse = compute(*dask_softmax_attention(qd, kd, vd, causal="bottom-right"), client=client)
    assert out.shape == (1, 4, 40, 8) and lse.shape == (1, 4, 40)
    assert np.all(np.isneginf(lse[..., :10])) and np.all(np.isfinite(lse[..., 10:]))
    assert np.all(out[..., :10, :] == 0)
    np.testing.assert_allclose(out, softmax_attention(q[..., :40, :], k[..., :30, :], v[..., :30, :],
                                                      causal="bottom-right"), rtol=0, atol=1e-14)


@pytest.mark.parametrize("causal", [False, True])
def test_linear_on_the_cluster_equals_numpy_on_sampled_rows(client, causal):
    q, k, v = _qkv(2)
    xd = [da.from_array(x, chunks=(1, 2, 128, 16)) for x in (q, k, v)]
    (out,) = compute(dask_linear_attention(*xd, causal=causal), client=client)
    if causal:
        want = linear_attention(q, k, v, causal=True)[..., ROWS, :]
    else:
        want = linear_attention(q[..., ROWS, :], k, v)
    np.testing.assert_allclose(out[..., ROWS, :], want, rtol=1e-13, atol=1e-13)


def test_chunking_errors_are_named():
    q, k, v = (da.from_array(x, chunks=(1, 1, 128, 16)) for x in _qkv(3, n=256))
    with pytest.raises(ValueError, match=r"q is chunked along its last \(head\) dimension"):
        dask_softmax_attention(q.rechunk({3: 8}), k, v)
    with pytest.raises(ValueError, match="mismatched chunks of k and v along the sequence axis"):
        dask_softmax_attention(q, k, v.rechunk({2: 64}))
    with pytest.raises(ValueError, match="mismatched chunks of q and k along the batch/head axes"):
        dask_softmax_attention(q.rechunk({1: 2}), k, v)
    with pytest.raises(ValueError, match="mismatched chunks of q and k along the sequence axis"):
        dask_linear_attention(q.rechunk({2: 64}), k, v, causal=True)
    with pytest.raises(TypeError, match="q must be a dask.array.Array"):
        dask_softmax_attention(np.zeros((4, 2)), k, v)
    with pytest.raises(ValueError, match="split_every must be an integer >= 2"):
        dask_softmax_attention(q, k, v, split_every=1)


def _slow(x):
    time.sleep(3.0)
    return x


def test_a_worker_killed_mid_run_is_an_error_with_no_result(client):
    q, k, v = (da.from_array(x, chunks=(1, 1, 512, 16)) for x in _qkv(4))
    slow_q = q.map_blocks(_slow, dtype=q.dtype)
    out, lse = dask_softmax_attention(slow_q, k, v)
    result = {}
    import threading

    def run():
        try:
            result["value"] = compute(out, lse, client=client)
        except Exception as exc:  # recorded, asserted below
            result["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    deadline = time.time() + 30
    busy = []
    while time.time() < deadline and not busy:
        busy = [w for w, tasks in client.processing().items() if any("_slow" in str(x) for x in tasks)]
        time.sleep(0.05)
    assert busy, "no worker ever ran the slow task"
    try:
        client.run(os._exit, 1, workers=busy[:1])
    except Exception:  # the worker dies under the call: expected
        pass
    t.join(60)
    assert "value" not in result
    assert isinstance(result.get("error"), WorkerLost), result
    assert "no result is returned" in str(result["error"])
