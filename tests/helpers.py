"""Shared test utilities: seeded inputs on any backend, and a comparison that checks
namespace, dtype, shape and device before values."""

import functools
import math

import array_api_compat
import numpy as np
import pytest
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


#: The functions that cannot run under ``jax.jit``, each with the reason: :func:`call`
#: runs these eagerly on JAX. Every other function a test passes to :func:`call` must
#: trace, and a tracer error fails the test.
NOT_TRACEABLE: dict = {}

#: XLA options of what the tests compile under ``jax.jit`` (:func:`call`, :func:`jit`):
#: XLA's optimisation level 0. The arrays are tiny, so compiling is the cost, not
#: running; level 0 compiles the references about twice as fast (the jitted forms of
#: test_softmax and test_recurrent: 8.4 -> 4.2 s and 11.7 -> 6.3 s of CPU). It is not
#: the suite-wide setting (tests/conftest.py): at level 0 XLA no longer simplifies away
#: a 0 * inf, and ``jax.vjp`` of the sinkhorn forward, a golden of test_grad_sorting,
#: turns NaN. The references under test must not need that simplification. And XLA's
#: legacy fusion emitters (conformance.cli.JAX_RECURRENT_OPTIONS, there for the
#: recurrent family; the same arithmetic, slower code): the jitted JAX cases of
#: test_recurrent's three_forms, final_state, packed_sequences and float16 tests,
#: test_softmax's online_block_sizes and test_variants' output test compile in half
#: the time (one process, load 3-5: 54.7 -> 27.7 s of CPU), and every JAX case that
#: goes through :func:`call` passes with them.
JIT_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}

_JITTED = {}


def jit(fn, **kwargs):
    """``jax.jit(fn, **kwargs)`` compiled with :data:`JIT_COMPILER_OPTIONS`."""
    import jax

    return jax.jit(fn, compiler_options=JIT_COMPILER_OPTIONS, **kwargs)


def _hashable(x):
    try:
        hash(x)
    except TypeError:
        return False
    return True


def call(backend, fn, *args, **kwargs):
    """Call ``fn(*args, **kwargs)``; on JAX, through ``jax.jit``.

    JAX compiles every op of every new shape in eager mode (~50 ms each), which makes
    op-by-op tests slow; one jit per (function, static options) compiles the whole
    function at once, at XLA's optimisation level 0 (:data:`JIT_COMPILER_OPTIONS`). It
    also proves the reference is traceable: no data-dependent Python control flow, no
    host round-trips. Array arguments are traced, everything else (a segment count, a
    block size, a layout) is static. A function that cannot be traced fails the test
    with a message saying so, unless :data:`NOT_TRACEABLE` lists it with the reason.
    """
    if backend.name != "jax" or fn in NOT_TRACEABLE:
        return fn(*args, **kwargs)
    import jax

    def is_array(x):
        return array_api_compat.is_array_api_obj(x) and not isinstance(x, (int, float))

    arrays = {k: v for k, v in kwargs.items() if is_array(v)}
    static = tuple(sorted((k, v) for k, v in kwargs.items() if k not in arrays))
    # Positional non-arrays are static too (a segment count must be a Python int), by
    # position; unhashable ones (a list of arrays) are traced as pytrees.
    fixed = tuple((i, a) for i, a in enumerate(args) if not is_array(a) and _hashable(a))
    traced = tuple(a for i, a in enumerate(args) if i not in dict(fixed))
    key = (fn, static, fixed)
    if key not in _JITTED:

        def run(traced, arrays):
            rest, given = iter(traced), dict(fixed)
            full = [given[i] if i in given else next(rest) for i in range(len(traced) + len(given))]
            return fn(*full, **arrays, **dict(static))

        _JITTED[key] = jit(run)
    try:
        return _JITTED[key](traced, arrays)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError,
            jax.errors.TracerIntegerConversionError) as exc:
        # (TracerBoolConversionError is a ConcretizationTypeError.)
        name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', fn)}"
        raise AssertionError(
            f"{name} cannot be traced under jax.jit ({type(exc).__name__}): it inspects array "
            f"values on the host. Make it traceable; if it must inspect values (to raise an "
            f"error, say), add it to NOT_TRACEABLE in tests/helpers.py with the reason."
        ) from exc


# flash-linear-attention's naive PyTorch references (fla-core 0.6.0, installed with
# --no-deps by .ci/run), the calibration peers of the recurrent family: loaded from their
# files, never through `import fla`, whose __init__ needs triton.
#: variant -> (folder under fla/ops, function, layout of q/k/v: "bhtd" or fla's "bthd")
FLA_NAIVE = {
    "retention": ("retention", "naive_retention", "bhtd"),
    "gla": ("gla", "naive_recurrent_gla", "bthd"),
    "ssd": ("simple_gla", "naive_recurrent_simple_gla", "bthd"),
    "deltanet": ("delta_rule", "delta_rule_recurrence", "bhtd"),
    "gated_deltanet": ("gated_delta_rule", "naive_recurrent_gated_delta_rule", "bthd"),
}


def fla_naive_path(family):
    """The path of ``fla/ops/<family>/naive.py``; ImportError naming the install when
    fla-core (or torch/einops, which the files import) is missing."""
    import importlib.util

    for needed in ("torch", "einops"):
        if importlib.util.find_spec(needed) is None:
            raise ImportError(f"fla's naive references need {needed}")
    spec = importlib.util.find_spec("fla")  # locates the package without running __init__
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("fla-core is not installed (pip install --no-deps fla-core==0.6.0 einops)")
    return f"{spec.submodule_search_locations[0]}/ops/{family}/naive.py"


def per_sequence(call, q, k, v, steps, initial_state, cu_seqlens):
    """``(o, S)`` of a torch recurrent kernel run once per packed sequence (``cu_seqlens``,
    or the whole of ``T`` when None), each with its slice of ``q, k, v`` and of the
    per-step inputs ``steps`` (``(B, H, T, ...)``) and its own row of ``initial_state``:
    ``call(q, k, v, steps, s0) -> (o, s)``. ``S`` stacks the final states along the
    packing axis, None when ``call`` returns none."""
    import torch

    bounds = list(cu_seqlens) if cu_seqlens is not None else [0, q.shape[-2]]
    outs, finals = [], []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        s0 = initial_state if cu_seqlens is None or initial_state is None else \
            initial_state[i:i + 1]
        o, s = call(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :],
                    {n: x[:, :, a:b] for n, x in steps.items()}, s0)
        outs.append(o)
        finals.append(s)
    final = None if any(s is None for s in finals) else torch.cat(finals, dim=0)
    return torch.cat(outs, dim=-2), final


def casts_to_input_dtype(source, casts, where):
    """``source`` (a reference's Python text) with each float32 cast replaced as ``casts``
    says (``(regex, replacement)`` pairs, the replacements casting to ``_DTYPE``, which the
    caller defines), so that the reference computes in the input dtype; AssertionError
    naming ``where`` when no cast is found (the third party's source changed)."""
    import re

    found = 0
    for pattern, repl in casts:
        source, n = re.subn(pattern, repl, source)
        found += n
    assert found, f"{where}: no float32 cast found; the source changed"
    return source


def fla_naive_module(family, source=None, name=None):
    """``fla/ops/<family>/naive.py`` as a module, executed from ``source`` when given (the
    file's text, edited) else from the file."""
    import types

    path = fla_naive_path(family)
    if source is None:
        with open(path) as f:
            source = f.read()
    mod = types.ModuleType(name or f"_fla_naive_{family}")
    mod.__file__ = path
    exec(compile(source, path, "exec"), mod.__dict__)
    return mod


class Reports:
    """A pytest plugin that keeps the reports of the tests it sees run: pass it to an
    in-process ``pytest.main(args, plugins=[reports])`` (pytester's in-process runs drop
    the modules the run imports from ``sys.modules`` afterwards; a child process imports
    torch and the oracle again)."""

    def __init__(self):
        self.reports = []
        self.deselected = 0

    def pytest_runtest_logreport(self, report):
        self.reports.append(report)

    def pytest_deselected(self, items):
        self.deselected += len(items)

    def outcomes(self):
        """``(passed, failed, skipped)``: the tests that passed, and the reports that
        failed or skipped (any phase), as pytest's summary line counts them."""
        passed = sum(1 for r in self.reports if r.when == "call" and r.passed)
        return (passed, sum(1 for r in self.reports if r.failed),
                sum(1 for r in self.reports if r.skipped))


def allowed_keys(nq, nk, mask, causal):
    """Host ``(Nq, Nk)`` boolean: the keys each query may see under ``causal`` (False,
    True or "top-left", "bottom-right") and ``mask`` (None or a host boolean array), for
    the hand-written NumPy and torch kernels of the gradient tests."""
    allowed = np.ones((nq, nk), dtype=bool)
    if causal:
        off = 0 if causal in (True, "top-left") else nk - nq
        allowed = np.arange(nk)[None, :] <= np.arange(nq)[:, None] + off
    return allowed if mask is None else allowed & mask


def masked_logits(q, k, mask, bias, causal, scale):
    """Host logits of the hand-written kernels: ``(masked, raw, allowed, scale)``, the
    masked ones ``-inf`` where :func:`allowed_keys` hides a key, ``scale`` defaulting to
    ``1/sqrt(d)``."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ np.swapaxes(k, -1, -2) * scale
    if bias is not None:
        s = s + bias
    allowed = allowed_keys(q.shape[-2], k.shape[-2], mask, causal)
    return np.where(allowed, s, -np.inf), s, allowed, scale


def run_plugin(monkeypatch, where, *args):
    """``pytest --pyargs conformance -q -p no:cacheprovider *args`` (the oracle's plugin)
    in this process, from the folder ``where``: ``(exit code, Reports)``. Not a child
    process, which imports the oracle (and torch) again; the run must stay here, so the
    outer run's ``PYTEST_ADDOPTS`` (``-n``, ``--junitxml``) is dropped."""
    monkeypatch.chdir(where)
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    seen = Reports()
    code = pytest.main(["--pyargs", "conformance", "-q", "-p", "no:cacheprovider", *args],
                       plugins=[seen])
    return code, seen


def autograd_function(forward, backward):
    """A torch function of one tensor computing ``forward(x)`` whose backward is
    ``backward(g)`` (a planted backward mistake)."""
    torch = pytest.importorskip("torch")

    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return forward(x)

        @staticmethod
        def backward(ctx, g):
            return backward(g)

    return Function.apply


def changed_gradient(kernel, name, change):
    """``kernel`` with the gradient ``g`` of its input ``name`` (``q``, ``k``, ``v`` or a
    keyword input such as a parameter) replaced by ``change(g)`` under torch autograd (the
    forward unchanged): a backward wrong in one gradient."""
    through = autograd_function(lambda x: x.view_as(x), change)

    @functools.wraps(kernel)
    def run(q, k, v, **kw):
        x = {"q": q, "k": k, "v": v, **kw}  # name: q, k, v or a keyword input (a parameter)
        x[name] = through(x[name])
        return kernel(x.pop("q"), x.pop("k"), x.pop("v"), **x)
    return run


def scaled_gradient(kernel, name, factor):
    """``kernel`` with the gradient of its input ``name`` scaled by ``factor``
    (:func:`changed_gradient`): a backward slightly wrong in one gradient."""
    return changed_gradient(kernel, name, lambda g: g * factor)
