"""attn_ref.grad.sparse: gradients of the sparse patterns, on every backend.

Each VJP is checked three ways: against central finite differences of the sparse
forward (float64, host NumPy); against the dense masked softmax VJP
(:func:`attn_ref.grad.softmax_attention` with the pattern's mask), which it must
equal to rounding since the forward equals dense masked softmax; and against
``torch.autograd`` and ``jax.vjp`` applied to the sparse forward code itself.
"""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from attn_ref import grad
from attn_ref import sparse as S
from attn_ref.registry import get
from conformance.backends import from_numpy, load
from tests.helpers import call, host, randn
from tests.test_grad_common import assert_grads_close, jax_vjp, numeric_vjp, run_vjp, torch_vjp

SPARSE = ["block_sparse", "local", "longformer", "bigbird", "strided", "fixed"]
FORWARD = {name: get(name).fn for name in SPARSE}
VJP = {
    "block_sparse": grad.block_sparse_attention,
    "local": grad.local_attention,
    "longformer": grad.longformer_attention,
    "bigbird": grad.bigbird_attention,
    "strided": grad.strided_attention,
    "fixed": grad.fixed_attention,
}


def _layout(nq, nk, b, seed, dead_block=True):
    """A random block layout; with ``dead_block`` the last query block sees nothing."""
    lay = [list(r) for r in S.random_block_layout(-(-nq // b), -(-nk // b), density=0.4, seed=seed)]
    if dead_block:
        lay[-1] = [False] * len(lay[-1])
    return tuple(tuple(r) for r in lay)


# (variant, (Nq, Nk), options): ragged lengths against every block size, dilation,
# every causal alignment, Nq != Nk where the variant allows it.
FD_CASES = {
    "block_sparse-bottom-right": ("block_sparse", (7, 9), {"layout": _layout(7, 9, 3, 1), "block_size": 3,
                                                           "causal": "bottom-right"}),
    "block_sparse-wide": ("block_sparse", (9, 5), {"layout": _layout(9, 5, 2, 2, False), "block_size": 2,
                                                   "causal": "top-left", "scale": 0.8}),
    "local-dilated": ("local", (9, 9), {"window": 2, "dilation": 2, "block_size": 3}),
    "local-causal": ("local", (9, 9), {"window": 3, "causal": True}),
    "longformer-causal": ("longformer", (10, 10), {"window": 1, "global_tokens": (0, 6), "causal": True,
                                                   "block_size": 2}),
    "bigbird": ("bigbird", (10, 10), {"block_size": 3, "window": 0, "global_blocks": 1,
                                      "random_blocks": 1, "seed": 5}),
    "strided-causal": ("strided", (10, 10), {"stride": 3}),
    "strided-both-ways": ("strided", (9, 9), {"stride": 2, "causal": False}),
    "fixed-causal": ("fixed", (10, 10), {"stride": 3, "summary": 1}),
    "fixed-both-ways": ("fixed", (9, 9), {"stride": 4, "summary": 2, "causal": False}),
}


def _case(seed, nq, nk, batch=(2,), d=3, dv=2):
    rng = np.random.default_rng(seed)
    args = {
        "q": rng.standard_normal(batch + (nq, d)),
        "k": rng.standard_normal(batch + (nk, d)),
        "v": rng.standard_normal((1,) * len(batch) + (nk, dv)),  # broadcast over the batch
    }
    return args, rng.standard_normal(batch + (nq, dv))


_FD = {}


@pytest.mark.parametrize("case", FD_CASES)
def test_matches_finite_differences(backend, case):
    name, (nq, nk), options = FD_CASES[case]
    args, do = _case(len(case), nq, nk)
    if case not in _FD:
        _FD[case] = numeric_vjp(FORWARD[name], args, do, options)
    got = run_vjp(backend, VJP[name], args, do, options)
    assert_grads_close(got, _FD[case], backend, rtol=1e-7, atol=1e-8)
    assert {n: tuple(g.shape) for n, g in got.items()} == {n: a.shape for n, a in args.items()}


# ---------------------------------------------------------------- against the dense masked VJP


def _mask(name, n, nk, options, xp, device):
    """The pattern's element mask and the causal argument of the dense equivalent."""
    o = dict(options)
    causal = o.pop("causal", get(name).fn.__kwdefaults__["causal"])
    one_sided = causal is not False
    if name == "block_sparse":
        return S.layout_mask(o["layout"], o["block_size"], nq=n, nk=nk, xp=xp, device=device), causal
    if name == "local":
        return S.local_mask(n, window=o["window"], one_sided=one_sided, dilation=o.get("dilation", 1),
                            xp=xp, device=device), False
    if name == "longformer":
        return S.longformer_mask(n, window=o["window"], global_tokens=o["global_tokens"],
                                 dilation=o.get("dilation", 1), xp=xp, device=device), causal
    if name == "bigbird":
        o.pop("scale", None)
        return S.bigbird_mask(n, **o, xp=xp, device=device), causal
    if name == "strided":
        return S.strided_mask(n, stride=o["stride"], causal=one_sided, xp=xp, device=device), False
    return S.fixed_mask(n, stride=o["stride"], summary=o.get("summary", 1), causal=one_sided, xp=xp,
                        device=device), False


# Cases that the finite-difference cases above do not already cover (one JAX compile each).
DENSE_CASES = [  # variant, (Nq, Nk), options
    ("block_sparse", (7, 13), {"layout": _layout(7, 13, 3, 1), "block_size": 3, "causal": "bottom-right"}),
    ("block_sparse", (13, 6), {"layout": _layout(13, 6, 5, 2, False), "block_size": 5, "causal": True}),
    ("block_sparse", (13, 13), {"layout": ((True,),), "block_size": 13, "scale": 0.3}),
    ("local", (13, 13), {"window": 3, "causal": "bottom-right", "dilation": 2}),
    ("local", (13, 13), {"window": 1, "dilation": 3, "block_size": 5}),
    ("local", (13, 13), {"window": 20, "causal": True, "block_size": 3}),
    ("longformer", (13, 13), {"window": 2, "global_tokens": (3, 11), "causal": True, "block_size": 2}),
    ("longformer", (13, 13), {"window": 1, "global_tokens": (6,), "dilation": 2, "block_size": 3}),
    ("bigbird", (13, 13), {"block_size": 3, "window": 1, "global_blocks": 1, "random_blocks": 2, "seed": 7,
                           "causal": True}),
    ("bigbird", (13, 13), {"block_size": 5, "window": 0, "global_blocks": 0, "random_blocks": 1, "seed": 7}),
    ("bigbird", (13, 13), {"block_size": 2, "window": 1, "global_blocks": 1, "random_blocks": 1, "seed": 3,
                           "last_global_blocks": 1, "causal": "bottom-right"}),
    ("strided", (13, 13), {"stride": 4, "causal": False, "scale": 1.0}),
    ("strided", (13, 13), {"stride": 1, "causal": False}),
    ("fixed", (13, 13), {"stride": 4, "summary": 4, "causal": False}),
    ("fixed", (13, 13), {"stride": 15, "summary": 1, "causal": False}),
]


@pytest.mark.parametrize("name,shape,options", DENSE_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(DENSE_CASES)])
def test_equals_dense_masked_softmax_vjp(backend, name, shape, options):
    nq, nk = shape
    rng = np.random.default_rng(nq * nk + len(options))
    # Broadcast batch dimensions: q over heads, k over batch, v over both.
    args = {"q": rng.standard_normal((2, 1, nq, 4)), "k": rng.standard_normal((1, 3, nk, 4)),
            "v": rng.standard_normal((1, 1, nk, 3))}
    do = rng.standard_normal((2, 3, nq, 3))
    mask, causal = _mask(name, nq, nk, options, backend.xp, backend.device)
    got = run_vjp(backend, VJP[name], args, do, options)
    want = run_vjp(backend, grad.softmax_attention, args, do,
                   {"mask": mask, "causal": causal, "scale": options.get("scale")})
    assert_grads_close(got, {n: host(g) for n, g in want.items()}, backend, rtol=1e-12, atol=1e-12)


def test_registered_options_equal_dense_masked_softmax_vjp():
    # What the oracle calls: VJPS[name] with the registry's options and parameters. The
    # wiring is the same on every backend (the VJPs themselves are checked on each above).
    backend = load("numpy")
    q, k, v, do = (randn(backend, (2, 12, c), seed=i)[0] for i, c in enumerate((4, 4, 3, 3)))
    for name in SPARSE:
        var = get(name)
        assert grad.VJPS[name] is VJP[name]
        extra = var.extra(1, 12, 12, 4, 3, dtype=q.dtype, device=backend.device, xp=backend.xp)
        mask, causal = _mask(name, 12, 12, dict(extra, causal=True), backend.xp, backend.device)
        got = call(backend, grad.VJPS[name], q, k, v, do, causal=True, **extra)
        want = call(backend, grad.softmax_attention, q, k, v, do, mask=mask, causal=causal)
        for n in "qkv":
            np.testing.assert_allclose(host(got[n]), host(want[n]), rtol=1e-12, atol=1e-12, err_msg=name)


# ---------------------------------------------------------------- autodiff of the forward


@pytest.mark.parametrize("library", ["torch", "jax"])
def test_matches_autodiff_of_the_forward(library):
    try:
        backend = load(library)
    except Exception as exc:  # pragma: no cover
        pytest.skip(str(exc))
    autodiff = torch_vjp if library == "torch" else jax_vjp
    cases = ["block_sparse-bottom-right", "local-dilated", "longformer-causal", "bigbird", "strided-causal",
             "fixed-both-ways"]
    if library == "jax":  # compiling jax.vjp of each forward is slow: one case per kind of part
        cases = ["block_sparse-bottom-right", "strided-causal", "fixed-both-ways"]
    for case in cases:
        name, (nq, nk), options = FD_CASES[case]
        args, do = _case(100 + len(case), nq, nk, batch=(2, 2))
        want = autodiff(FORWARD[name], args, do, options)
        assert all(np.all(np.isfinite(g)) for g in want.values()), case
        try:
            assert_grads_close(run_vjp(backend, VJP[name], args, do, options), want, backend,
                               rtol=1e-10, atol=1e-12)
        except AssertionError as exc:
            raise AssertionError(f"{case}: {exc}") from None


def test_global_keys_gradients_under_half_precision_autograd():
    """Longformer's global keys are one column product (attn_ref.sparse.plans.Columns),
    not a block gathered into every query block: the gather's backward sums a global
    key's dV over the N / B blocks in the dtype, and at window 2 (B = 1), N = 1000 in
    bfloat16 torch's autograd erred 3.4-7.6 % on the global keys' dK and dV (relative to
    the key's largest entry). Now 0.3-1.1 %, as an ordinary key's (0.5-0.9 %)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((1, 1, 1000, 64)) for _ in range(4))
    opts = dict(window=2, global_tokens=(0, 500))
    want = grad.longformer_attention(q, k, v, do, **opts)
    t = [torch.tensor(x, dtype=torch.bfloat16, requires_grad=True) for x in (q, k, v)]
    S.longformer_attention(*t, **opts).backward(torch.tensor(do, dtype=torch.bfloat16))
    # not dq: a global query's dq is its own row's, over all 1000 keys
    for name, x in zip("kv", t[1:]):
        got, ref = x.grad.double().numpy(), want[name]
        for j in opts["global_tokens"]:
            err = np.max(np.abs(got[..., j, :] - ref[..., j, :])) / np.max(np.abs(ref[..., j, :]))
            assert err < 0.02, (name, j, err)


# ---------------------------------------------------------------- masked rows, edges, bad input


def test_fully_masked_rows_have_zero_gradients(backend):
    # Query block 2 (rows 6-8) sees no key block; with bottom-right alignment and
    # Nq > Nk the first Nq - Nk = 2 queries see no key at all (query 2 sees key 0 only,
    # a one-hot row whose dS is zero too; queries 3-5 see more).
    lay = ((True, True, False), (True, True, True), (False, False, False))
    options = {"layout": lay, "block_size": 3, "causal": "bottom-right"}
    args, do = _case(7, 9, 7)
    got = {n: host(g) for n, g in run_vjp(backend, grad.block_sparse_attention, args, do, options).items()}
    dead = [0, 1, 6, 7, 8]
    for g in got.values():
        assert np.all(np.isfinite(g))
    assert np.all(got["q"][:, dead] == 0.0)
    assert np.all(got["q"][:, 3:6] != 0.0)
    # Dead rows contribute nothing to dk, dv: the same gradients as with their do = 0.
    do0 = do.copy()
    do0[:, dead] = 0.0
    ref = run_vjp(backend, grad.block_sparse_attention, args, do0, options)
    for n in ("k", "v"):
        np.testing.assert_array_equal(got[n], host(ref[n]))


def test_no_gradient_crosses_the_pattern(backend):
    # Perturbing do of query 0 changes dk, dv only at the keys query 0 attends.
    args, do = _case(8, 12, 12)
    do2 = do.copy()
    do2[:, 0] += 1.0
    for name, options, seen in (("local", {"window": 2}, [0, 1, 2]),
                                ("longformer", {"window": 1, "global_tokens": (7,)}, [0, 1, 7]),
                                ("fixed", {"stride": 4, "summary": 1, "causal": False}, [0, 1, 2, 3, 7, 11])):
        a = run_vjp(backend, VJP[name], args, do, options)
        b = run_vjp(backend, VJP[name], args, do2, options)
        for n in ("k", "v"):
            changed = np.flatnonzero(np.any(host(a[n]) != host(b[n]), axis=(0, 2)))
            assert changed.tolist() == seen, (name, n, changed)


def test_empty_sequences(backend):
    xp = backend.xp
    z = xp.zeros((2, 0, 4), dtype=xp.float64, device=backend.device)
    zv = xp.zeros((2, 0, 3), dtype=xp.float64, device=backend.device)
    for name, kw in (("local", {"window": 2}), ("bigbird", {"block_size": 2}), ("strided", {"stride": 2}),
                     ("fixed", {"stride": 2}), ("longformer", {"window": 1, "global_tokens": ()}),
                     ("block_sparse", {"layout": (), "block_size": 2})):
        g = VJP[name](z, z, zv, zv, **kw)
        assert {n: tuple(a.shape) for n, a in g.items()} == {"q": (2, 0, 4), "k": (2, 0, 4), "v": (2, 0, 3)}
    q, k, v, do = (randn(backend, s, seed=i)[0] for i, s in enumerate([(2, 5, 4), (2, 0, 4), (2, 0, 3),
                                                                        (2, 5, 3)]))
    g = grad.block_sparse_attention(q, k, v, do, layout=((),) * 3, block_size=2)
    assert tuple(g["q"].shape) == (2, 5, 4) and np.all(host(g["q"]) == 0.0)


def test_inputs_not_modified(backend):
    if backend.name == "jax":
        pytest.skip("JAX arrays are immutable")
    args, do = _case(9, 10, 10)
    conv = {n: from_numpy(a, backend) for n, a in args.items()}
    d = from_numpy(do, backend)
    for case in ("strided-causal", "fixed-causal", "longformer-causal"):
        name, _, options = FD_CASES[case]
        call(backend, VJP[name], conv["q"], conv["k"], conv["v"], d, **options)
    for n, a in args.items():
        assert np.array_equal(host(conv[n]), a)
    assert np.array_equal(host(d), do)


def test_bad_input(backend):
    q, _ = randn(backend, (2, 6, 3))
    v, _ = randn(backend, (2, 6, 2))
    k5, _ = randn(backend, (2, 5, 3))
    v5, _ = randn(backend, (2, 5, 2))
    lay = ((True, True), (True, True))
    opts = {"block_sparse": {"layout": lay, "block_size": 3}, "local": {"window": 1},
            "longformer": {"window": 1, "global_tokens": (0,)}, "bigbird": {"block_size": 3},
            "strided": {"stride": 2}, "fixed": {"stride": 2}}
    for name in SPARSE:
        with pytest.raises(ValueError, match=r"do must have the output's shape .*\(2, 6, 2\).*\(2, 6, 3\)"):
            VJP[name](q, q, v, q, **opts[name])
        with pytest.raises(TypeError, match="do must be an array"):
            VJP[name](q, q, v, [[0.0]], **opts[name])
        with pytest.raises(ValueError, match="causal must be"):
            VJP[name](q, q, v, v, **opts[name], causal="diagonal")
        if name != "block_sparse":
            with pytest.raises(ValueError, match="self-attention only"):
                VJP[name](q, k5, v5, v, **opts[name])
    # The forward's own checks, with its messages.
    for name, kw, exc, msg in (
        ("local", {"window": -1}, ValueError, "window must be a non-negative integer"),
        ("local", {"window": 1, "dilation": 0}, ValueError, "dilation must be a positive"),
        ("block_sparse", {"layout": ((True,) * 3,) * 2, "block_size": 3}, ValueError,
         r"\(2, 2\), got row 0 of length 3"),
        ("longformer", {"window": 1, "global_tokens": (6,)}, ValueError,
         r"global_tokens must hold integer positions in \[0, N\) = \[0, 6\), got 6"),
        ("bigbird", {"block_size": 0}, ValueError, "block_size must be a positive"),
        ("strided", {"stride": 0}, ValueError, "stride must be a positive"),
        ("fixed", {"stride": 3, "summary": 4}, ValueError, "summary must be at most"),
    ):
        with pytest.raises(exc, match=msg):
            VJP[name](q, q, v, v, **kw)


# ---------------------------------------------------------------- the oracle


@pytest.mark.parametrize("name", SPARSE)
def test_oracle_checks_sparse_gradients(name):
    # verify(..., grads=True) has a golden gradient for every sparse variant: the
    # reference forward run on torch passes under autograd, and a backward that lets
    # gradients through the pattern (the unmasked softmax VJP) fails on dq, dk, dv.
    pytest.importorskip("torch")
    from conformance import verify
    from conformance.catalogue import cases

    quick = cases(None, "quick")
    rep = verify(FORWARD[name], name, backend="torch", cases=quick, grads=True, causal="both")
    assert rep.passed, rep.table()
    passed = {r.output for r in rep.results if r.verdict == "pass"}
    assert {"out", "dq", "dk", "dv"} <= passed, rep.table()

    def leaky(q, k, v, do, *, causal=False, scale=None, **_):
        g = grad.softmax_attention(q, k, v, do, causal=causal, scale=scale)
        return g["q"], g["k"], g["v"]

    rep = verify(FORWARD[name], name, backend="numpy", cases=quick, backward=leaky, causal="both")
    assert not rep.passed
    assert {"dq", "dk", "dv"} <= {r.output for r in rep.failures}, rep.table()
    assert "out" not in {r.output for r in rep.failures}


# ---------------------------------------------------------------- cost


_LONG = textwrap.dedent("""
    import tracemalloc, numpy as np
    from attn_ref import grad
    n, d, w = 65536, 8, 16
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((n, d)).astype(np.float32) for _ in range(4))
    tracemalloc.start()
    g = grad.local_attention(q, k, v, do, window=w, causal=True)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    # dq of rows at the start, the middle and the end against a windowed NumPy backward.
    q64, k64, v64, do64 = (x.astype(np.float64) for x in (q, k, v, do))
    for i in (0, 1, w, 40000, n - 1):
        j = np.arange(max(0, i - w), i + 1)
        s = (q64[i] @ k64[j].T) / np.sqrt(d)
        p = np.exp(s - s.max()); p /= p.sum()
        dp = do64[i] @ v64[j].T
        ds = p * (dp - p @ dp)
        assert np.abs(g["q"][i] - ds @ k64[j] / np.sqrt(d)).max() < 1e-5, i
    print(peak)
""")


def test_local_vjp_never_builds_an_n_by_n_array():
    # N = 65536 in float32: one (N, N) array is 17 GB. NumPy reports its buffers to
    # tracemalloc, so the traced peak bounds every array the VJP allocated.
    res = subprocess.run([sys.executable, "-c", _LONG], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    peak, n, w, d = int(res.stdout.split()[-1]), 65536, 16, 8
    assert peak < n * n * 4 / 100, peak
    # O(N w d): the forward's gathers and logits, rerun, plus P, dP, dS and the tiles.
    assert peak < 64 * n * (w + d) * 4, peak
