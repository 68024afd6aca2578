"""Shared test utilities: seeded inputs on any backend, and a comparison that checks
namespace, dtype, shape and device before values."""

import array_api_compat
import numpy as np
from hypothesis import HealthCheck, settings

from conformance.backends import from_numpy, to_numpy

EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52}


def randn(backend, shape, dtype="float64", seed=0, scale=1.0):
    """Standard normal host data (float64), moved to ``backend`` in ``dtype``.

    Returns ``(array, host)`` where ``host`` is the float64 NumPy copy of exactly the
    values the backend holds (rounded to ``dtype``).
    """
    a = np.random.default_rng(seed).standard_normal(shape) * scale
    x = from_numpy(a, backend, dtype)
    return x, to_numpy(x).astype(np.float64)


def host(x):
    return to_numpy(x).astype(np.float64)


def assert_close(actual, expected, backend, *, dtype="float64", rtol=None, atol=None):
    """``actual`` (a backend array) against ``expected`` (host float64).

    Checks the array library, dtype, shape and device first, then values with a
    tolerance that defaults to a small multiple of the dtype's epsilon.
    """
    assert array_api_compat.array_namespace(actual) is array_api_compat.array_namespace(
        from_numpy(np.zeros(1), backend)
    ), f"result lives in {type(actual)}, expected {backend.name}"
    assert str(actual.dtype).endswith(dtype), f"dtype {actual.dtype}, expected {dtype}"
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    )
    assert str(array_api_compat.device(actual)) == str(backend.device), (
        f"device {array_api_compat.device(actual)}, expected {backend.device}"
    )
    got = host(actual)
    eps = EPS[dtype]
    rtol = 64 * eps if rtol is None else rtol
    atol = 64 * eps if atol is None else atol
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol)


def naive_attention(q, k, v, *, mask=None, bias=None, causal=None, scale=None):
    """Plain NumPy float64 softmax attention, written independently of attn_ref.

    ``causal`` is None, "top-left" or "bottom-right"; rows with no allowed key are 0.
    """
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    nq, nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1 / np.sqrt(d) if scale is None else scale
    s = np.einsum("...id,...jd->...ij", q, k) * scale
    if bias is not None:
        s = s + bias
    allowed = np.ones(s.shape, dtype=bool)
    if mask is not None:
        allowed = allowed & mask
    if causal is not None:
        off = 0 if causal == "top-left" else nk - nq
        allowed = allowed & (np.arange(nk)[None, :] <= np.arange(nq)[:, None] + off)
    s = np.where(allowed, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True) if nk else np.zeros(s.shape[:-1] + (1,))
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    den = p.sum(-1, keepdims=True)
    p = p / np.where(den > 0, den, 1.0)
    return p @ v, p


def property_test(backend, examples=20):
    """Hypothesis settings for a property test on ``backend``.

    JAX compiles every new shape in eager mode (tens of ms an op), so it gets a
    quarter of the examples; the other backends get ``examples``.
    """
    n = max(3, examples // 4) if backend.name == "jax" else examples
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


_JITTED = {}


def call(backend, fn, *args, **kwargs):
    """Call ``fn(*args, **kwargs)``; on JAX, through ``jax.jit``.

    JAX compiles every op of every new shape in eager mode (~50 ms each), which makes
    op-by-op tests slow; one jit per (function, static options) compiles the whole
    function at once. It also proves the reference is traceable: no data-dependent
    Python control flow, no host round-trips. Array keyword arguments are traced,
    everything else is static. Functions that must inspect values on the host (to
    raise an error, say) fall back to eager mode.
    """
    if backend.name != "jax":
        return fn(*args, **kwargs)
    import jax

    arrays = {
        k: v
        for k, v in kwargs.items()
        if array_api_compat.is_array_api_obj(v) and not isinstance(v, (int, float))
    }
    static = tuple(sorted((k, v) for k, v in kwargs.items() if k not in arrays))
    key = (fn, static)
    if key not in _JITTED:

        def run(args, arrays, _static=None):
            if _static is None:
                _static = dict(static)
            return fn(*args, **arrays, **_static)

        _JITTED[key] = jax.jit(run)
    try:
        return _JITTED[key](args, arrays)
    except (
        jax.errors.ConcretizationTypeError,
        jax.errors.TracerBoolConversionError,
        jax.errors.TracerIntegerConversionError,
    ):
        return fn(*args, **kwargs)
