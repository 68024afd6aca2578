"""attn_ref.grad._common: the small VJPs, and the gradient checks every test_grad_* file uses.

The helpers at the top compute reference gradients of an ``attn_ref`` forward three
independent ways: central finite differences in float64 (host NumPy),
``torch.autograd`` and ``jax.vjp`` applied to the forward code itself run on those
libraries. The VJPs of :mod:`attn_ref.grad` are checked against all three.
"""

import numpy as np
import pytest

from attn_ref.grad._common import check_cotangent, matmul_vjp, softmax_vjp, unbroadcast
from conformance.backends import from_numpy, load
from tests.helpers import assert_close, call, host, randn

POSITIONAL = ("q", "k", "v")


def _split(args):
    pos = [args[n] for n in POSITIONAL if n in args]
    kw = {n: a for n, a in args.items() if n not in POSITIONAL}
    return pos, kw


def numeric_vjp(forward, args, do, options=None, h=1e-6):
    """Central differences of ``<do, forward(**args, **options)>`` for each array in ``args``.

    Runs on host NumPy float64; ``args`` maps input names to arrays (``q``, ``k``, ``v``
    positional, the rest keywords).
    """
    options = options or {}
    args = {n: np.asarray(a, dtype=np.float64) for n, a in args.items()}

    def f(a):
        pos, kw = _split(a)
        return float(np.sum(np.asarray(forward(*pos, **kw, **options)) * do))

    out = {}
    for name, x in args.items():
        g = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            e = np.zeros_like(x)
            e[idx] = h
            plus = dict(args, **{name: x + e})
            minus = dict(args, **{name: x - e})
            g[idx] = (f(plus) - f(minus)) / (2 * h)
        out[name] = g
    return out


def _to(backend, options):
    return {n: (from_numpy(a, backend) if isinstance(a, np.ndarray) else a) for n, a in options.items()}


def torch_vjp(forward, args, do, options=None):
    """``torch.autograd`` through ``forward`` (an attn_ref function) run on torch, float64."""
    import torch

    b = load("torch")
    ts = {n: torch.tensor(a, dtype=torch.float64, requires_grad=True) for n, a in args.items()}
    pos, kw = _split(ts)
    out = forward(*pos, **kw, **_to(b, options or {}))
    grads = torch.autograd.grad(out, list(ts.values()), grad_outputs=torch.tensor(do), allow_unused=True)
    return {n: (np.zeros(args[n].shape) if g is None else g.detach().numpy()) for n, g in zip(ts, grads)}


def jax_vjp(forward, args, do, options=None):
    """``jax.vjp`` through ``forward`` (an attn_ref function) run on JAX, float64, under jit."""
    import jax
    import jax.numpy as jnp

    b = load("jax")
    names = list(args)
    opts = _to(b, options or {})
    arr_opts = {n: a for n, a in opts.items() if hasattr(a, "shape")}
    static = {n: a for n, a in opts.items() if n not in arr_opts}

    @jax.jit
    def run(xs, arr_opts, do):
        def f(*xs):
            pos, kw = _split(dict(zip(names, xs)))
            return forward(*pos, **kw, **arr_opts, **static)

        return jax.vjp(f, *xs)[1](do)

    grads = run([jnp.asarray(args[n]) for n in names], arr_opts, jnp.asarray(do))
    return {n: np.asarray(g) for n, g in zip(names, grads)}


def run_vjp(backend, vjp, args, do, options=None, dtype="float64"):
    """Call ``vjp`` on ``backend`` (jit on JAX) with host ``args``/``do``; returns the dict."""
    converted = {n: from_numpy(a, backend, dtype) for n, a in args.items()}
    pos, kw = _split(converted)
    return call(backend, vjp, *pos, from_numpy(do, backend, dtype), **kw, **_to(backend, options or {}))


def assert_grads_close(got, want, backend, *, dtype="float64", rtol=None, atol=None):
    """Every gradient in ``want`` (host) is in ``got`` (backend arrays), and no others."""
    assert set(got) == set(want), f"gradients for {sorted(got)}, expected {sorted(want)}"
    for n in want:
        try:
            assert_close(got[n], want[n], backend, dtype=dtype, rtol=rtol, atol=atol)
        except AssertionError as exc:
            raise AssertionError(f"gradient of {n}: {exc}") from None


# ---------------------------------------------------------------- the small VJPs


def test_unbroadcast_sums_added_and_unit_dimensions(backend):
    g, gh = randn(backend, (2, 3, 4, 5))
    for shape in [(2, 3, 4, 5), (3, 4, 5), (1, 4, 5), (4, 1), (1, 1, 5), (2, 1, 4, 1)]:
        want = gh.sum(axis=tuple(range(4 - len(shape))))
        want = want.sum(axis=tuple(i for i, s in enumerate(shape) if s == 1), keepdims=True)
        assert_close(unbroadcast(backend.xp, g, shape), want.reshape(shape), backend)


def test_matmul_vjp_matches_finite_differences(backend):
    ah = np.random.default_rng(1).standard_normal((1, 3, 4))
    bh = np.random.default_rng(2).standard_normal((2, 4, 5))
    gh = np.random.default_rng(3).standard_normal((2, 3, 5))
    want = numeric_vjp(lambda q, k: q @ k, {"q": ah, "k": bh}, gh)
    da, db = matmul_vjp(backend.xp, from_numpy(ah, backend), from_numpy(bh, backend), from_numpy(gh, backend))
    assert_close(da, want["q"], backend, rtol=1e-8, atol=1e-8)
    assert_close(db, want["k"], backend, rtol=1e-8, atol=1e-8)


def test_softmax_vjp_matches_finite_differences_and_is_zero_where_p_is(backend):
    rng = np.random.default_rng(4)
    sh, gh = rng.standard_normal((3, 6)), rng.standard_normal((3, 6))

    def softmax(q):
        e = np.exp(q - q.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    want = numeric_vjp(softmax, {"q": sh}, gh)["q"]
    p = from_numpy(softmax(sh), backend)
    assert_close(softmax_vjp(backend.xp, p, from_numpy(gh, backend)), want, backend, rtol=1e-8, atol=1e-8)
    ph = softmax(sh)
    ph[1] = 0.0  # a row with nothing to attend to
    ph[2, :3] = 0.0
    ds = host(softmax_vjp(backend.xp, from_numpy(ph, backend), from_numpy(gh, backend)))
    assert np.all(ds[1] == 0.0) and np.all(ds[2, :3] == 0.0)
    assert np.all(np.isfinite(ds))


def test_check_cotangent_names_the_argument(backend):
    xp = backend.xp
    do, _ = randn(backend, (2, 3))
    with pytest.raises(ValueError, match=r"do must have the output's shape .*\(2, 4\).*\(2, 3\)"):
        check_cotangent(xp, do, (2, 4), do)
    with pytest.raises(TypeError, match="do must be an array of "):
        check_cotangent(xp, [[1.0]], (1, 1), do)
    ints = xp.ones((2, 3), dtype=xp.int32, device=backend.device)
    with pytest.raises(TypeError, match=r"do must have the dtype of q \(.*float64\), got .*int32"):
        check_cotangent(xp, ints, (2, 3), do)
