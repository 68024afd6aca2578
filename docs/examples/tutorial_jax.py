"""The JAX tutorial of docs/conformance.md, as run by the test suite."""

import functools

import jax

from conformance import verify


@functools.cache
def _jit(is_causal, scale):
    return jax.jit(lambda q, k, v, bias, mask: jax.nn.dot_product_attention(
        q, k, v, bias=bias, mask=mask, scale=scale, is_causal=is_causal))


def dpa(q, k, v, *, mask=None, bias=None, is_causal=False, scale=None):
    return _jit(is_causal, scale)(q, k, v, bias, mask)


report = verify(dpa, "softmax", backend="jax", dtypes=("float32", "bfloat16"),
                layout="bnhd",                 # (batch, seq, heads, dim)
                fully_masked="mean",           # JAX's empty rows: the mean of V
                causal="top-left",             # is_causal with Nq != Nk
                supports={"value_dim": False}) # JAX needs dv == d
print(report.table())

# On XLA's CPU backend a bfloat16 product of 1 x 1 operands is not implemented
# ("ALG_DOT_BF16_BF16_F32" is refused by its elemental emitter): the kernel raises on
# that case, and the oracle reports an error - never a pass. Every other case passes.
cpu_bug = "ALG_DOT_BF16_BF16_F32"
problems = [r for r in report.results if r.verdict in ("fail", "error")]
assert all(cpu_bug in r.diagnosis for r in problems), [r.diagnosis for r in problems]
assert report.counts["pass"] > 0
