"""Third-party kernels of the recurrent family as oracle kernels (torch, layout ``bhnd``).

HuggingFace transformers' PyTorch fallbacks, each called as the model calls it, wrapped
only where its conventions differ from :mod:`attn_ref.recurrent` (each difference a
documented step of the wrapper, never a tolerance; docs/conformance.md, "Third-party
kernels: the recurrent family"):

* :func:`hf_gated_delta_rule`: ``torch_chunk_gated_delta_rule`` and
  ``torch_recurrent_gated_delta_rule`` (Qwen3-Next; the same source in qwen3_5,
  qwen3_5_moe, qwen4_exp, olmo_hybrid, lara_mini). Layout ``[B, T, H, d]`` and gates
  ``[B, T, H]`` (transposed in and out); scale fixed at ``d_k^-1/2``; q, k
  l2-normalised in float32 when ``use_qk_l2norm_in_kernel``; every input cast to
  float32, the output cast back, the state float32 (also for float64 inputs); no
  ``cu_seqlens`` (packed sequences: one call per sequence, each with its own initial
  state, as fla's tests check their varlen kernels).
* :func:`hf_mamba2_chunk_scan`: ``mamba2_chunk_scan`` (Mamba-2's SSD in PyTorch, the
  ``mamba_chunk_scan_combined`` signature; the same source in bamba, zamba2, falcon_h1,
  nemotron_h, granitemoehybrid). SSD in Mamba-2's names (docs/recurrent.md):
  ``C = q * scale``, ``B = k``, ``dt = -g`` and ``A = -1`` (so ``dt * A = g``),
  ``x = v / dt`` (so ``x * dt = v``), ``ngroups = H``; its state is ``(b, h, P, N)``,
  ``d_v x d_k``: transposed in and out; it returns a float32 output: cast to the input
  dtype. ``x``, ``dt`` and ``C`` are handed over in float32 (float64 for float64), the
  precision the kernel computes them in: the division and the scale are the wrapper's
  and must not round to a half dtype. ``dt`` is detached where it meets ``x`` (the
  forward unchanged), so that ``dg`` is that of ``dt * A = g`` alone.

* :func:`hf_minimax_lightning`: ``MiniMaxLightningAttention`` (MiniMax-Text-01's lightning
  attention, the model's PyTorch path): retention with ``gamma = exp(-slope)`` per head,
  in blocks of ``block_size`` (the config's, 256) from a zero state, token by token from
  a cached one (the initial state). Its ``forward`` takes hidden states: ``qkv_proj`` is
  the identity, the activation ``"linear"``, and the RMS norm, the output gate and
  ``out_proj`` after the attention are edited out of its source; its buffers of decays
  are rebuilt from the case's ``gamma`` by its own ``decay_factors``; it takes no scale
  (``q`` is scaled before the call) and ``d_v = d_k`` only. The module computes in the
  input's dtype, its state too.

``compute="input"`` runs the same source with its float32 casts replaced by the input's
dtype (the float64 calibration, as for fla's naive files); ``edits`` plant a mistake by
replacing one line of the source (:func:`edited`), each asserted to match exactly once.
"""

import inspect
import textwrap

from tests.helpers import casts_to_input_dtype, per_sequence

#: the transformers modules holding a copy of each function (the audit checks they agree)
GDN_MODULES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen4_exp", "olmo_hybrid", "lara_mini")
SSD_MODULES = ("mamba2", "bamba", "zamba2", "falcon_h1", "nemotron_h", "granitemoehybrid")

# the float32 casts of the HF fallbacks; compute="input" makes each a cast to _DTYPE
_DOWNCASTS = ((r"torch\.float32", "_DTYPE"), (r"\.float\(\)", ".to(_DTYPE)"))


def _module(name):
    import importlib

    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def source_function(module, fn_name):
    """The PyTorch function as written in ``module``'s file, without the hub decorator
    (which would hand the call to fla or mamba_ssm when they import)."""
    fn = inspect.unwrap(getattr(_module(module), fn_name))
    assert fn.__code__.co_filename.endswith(f"modeling_{module}.py"), fn.__code__.co_filename
    return fn


def edited(module, fn_name, edits=(), compute="float32"):
    """``fn_name`` of ``module`` re-executed from its source with ``edits`` (``(old, new)``
    pairs of text, each found exactly once) and, for ``compute="input"``, its float32
    casts replaced by the input dtype (set as ``_DTYPE`` on the returned function)."""
    fn = source_function(module, fn_name)
    src = textwrap.dedent(inspect.getsource(fn))
    src = src[src.index("def "):]  # drop the decorators
    for old, new in edits:
        assert src.count(old) == 1, f"{fn_name}: {old!r} found {src.count(old)} times"
        src = src.replace(old, new)
    if compute == "input":
        src = casts_to_input_dtype(src, _DOWNCASTS, fn_name)
    if not edits and compute == "float32":
        return fn
    scope = dict(fn.__globals__)
    exec(compile(src, fn.__code__.co_filename, "exec"), scope)
    out = scope[fn_name]
    out._scope, out._source = scope, src
    return out


def _per_sequence(call, q, k, v, steps, initial_state, cu_seqlens, want_state):
    """One call per packed sequence (``cu_seqlens``), each with its own initial state."""
    o, s = per_sequence(call, q, k, v, steps, initial_state, cu_seqlens)
    return (o, s) if want_state else o


def hf_gated_delta_rule(form="chunk", *, module="qwen3_next", chunk_size=64, edits=(),
                        compute="float32", beta_factor=1.0, packed_as_one=False):
    """HF's gated delta rule fallback (``form`` ``"chunk"`` or ``"recurrent"``) as an
    oracle kernel for ``gated_deltanet``. Plants: ``edits`` (source), ``beta_factor``
    (beta scaled before the call), ``packed_as_one`` (packed sequences run as one, the
    state leaking across their boundaries)."""
    fn = edited(module, f"torch_{form}_gated_delta_rule", edits, compute)
    extra = {"chunk_size": chunk_size} if form == "chunk" else {}

    def call(q, k, v, steps, s0, qk_l2norm):
        if compute == "input":
            fn._scope["_DTYPE"] = q.dtype
        t = lambda x: x.transpose(1, 2)  # noqa: E731  (B, H, T, ...) <-> [B, T, H, ...]
        o, s = fn(t(q), t(k), t(v), t(steps["g"]), t(steps["beta"]) * beta_factor,
                  initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=qk_l2norm,
                  **extra)
        return t(o), s

    def kernel(q, k, v, *, g, beta, initial_state=None, output_final_state=False,
               cu_seqlens=None, qk_l2norm=False):
        steps = {"g": g, "beta": beta}
        go = lambda q, k, v, st, s0: call(q, k, v, st, s0, qk_l2norm)  # noqa: E731
        return _per_sequence(go, q, k, v, steps, initial_state,
                             None if packed_as_one else cu_seqlens, output_final_state)

    kernel.__name__ = f"hf_{module}_{form}_gated_delta_rule"
    return kernel


def hf_mamba2_chunk_scan(*, module="mamba2", chunk_size=64, edits=(), compute="float32",
                         packed_as_one=False):
    """HF's ``mamba2_chunk_scan`` (Mamba-2's SSD) as an oracle kernel for ``ssd``, in
    Mamba-2's names (module docstring); plants as :func:`hf_gated_delta_rule`."""
    import torch

    # x = v / dt and x * dt inside: in exact arithmetic the two paths of dt's gradient
    # through x cancel (x * dt = v); in float32 they are terms of size |dx| |v| / dt that
    # cancel to within their rounding (dg off 2 to 4 times its bound at dt ~ 0.01).
    # Both are cut (dt detached in x and in x * dt, the forward unchanged): dt's gradient
    # is then that of dt * A = g alone, as the mapping means it.
    fn = edited(module, "mamba2_chunk_scan", ((
        "hidden_states = hidden_states * dt[..., None].float()",
        "hidden_states = hidden_states * dt[..., None].float().detach()"),) + tuple(edits), compute)

    def call(q, k, v, steps, s0, scale):
        if compute == "input":
            fn._scope["_DTYPE"] = q.dtype
        w = torch.float64 if q.dtype == torch.float64 else torch.float32
        g = steps["g"].to(w)                         # (B, H, T), log decays <= 0
        # Mamba-2's dt is positive (softplus): a log gate of exactly 0 (no decay, the
        # strong-gate cases) is handed as dt = 2^-60, whose decay exp(-2^-60) is 1 in
        # float32 and float64 and whose write (v / 2^-60) 2^-60 is v exactly; added, not
        # clamped, so that g's gradient still flows through -g
        dt = -g + torch.where(g == 0, 2.0 ** -60, 0.0).to(w)
        x = v.to(w) / dt.detach()[..., None]         # x * dt = v
        C = q.to(w) * scale
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        A = -torch.ones(q.shape[1], dtype=w)
        h0 = None if s0 is None else s0.transpose(-1, -2)  # (N, H, dk, dv) -> (b, h, P, N)
        o, s = fn(t(x), t(dt), A, t(k), t(C), chunk_size, initial_states=h0,
                  return_final_states=True)
        return t(o).to(q.dtype), s.transpose(-1, -2)

    def kernel(q, k, v, *, g, scale=None, initial_state=None, output_final_state=False,
               cu_seqlens=None):
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        go = lambda q, k, v, st, s0: call(q, k, v, st, s0, scale)  # noqa: E731
        return _per_sequence(go, q, k, v, {"g": g}, initial_state,
                             None if packed_as_one else cu_seqlens, output_final_state)

    kernel.__name__ = f"hf_{module}_chunk_scan"
    return kernel


class _LinearCache:
    """The one piece of HF's cache ``MiniMaxLightningAttention.forward`` reads and writes:
    the linear state (the initial state in, the final state out)."""

    def __init__(self, state):
        self.state, self.final = state, None

    def get_linear_cache(self, layer_idx):
        return self.state

    def set_linear_cache(self, layer_idx, state):
        self.final = state


def hf_minimax_lightning(*, block_size=256, edits=()):
    """MiniMax's ``MiniMaxLightningAttention`` (module docstring) as an oracle kernel for
    ``retention``; ``edits`` plant a mistake in its ``forward``'s source."""
    import torch
    from transformers import MiniMaxConfig

    mm = _module("minimax")
    src = textwrap.dedent(inspect.getsource(mm.MiniMaxLightningAttention.forward))
    src = src[src.index("def "):]  # drop the decorators
    for old, new in ((
            "    attn_output = self.norm(attn_output)\n"
            "    attn_output = F.sigmoid(self.output_gate(hidden_states)) * attn_output\n"
            "    attn_output = self.out_proj(attn_output)\n", ""),) + tuple(edits):
        assert src.count(old) == 1, f"forward: {old!r} found {src.count(old)} times"
        src = src.replace(old, new)
    scope = dict(mm.__dict__)
    exec(compile(src, mm.__file__, "exec"), scope)
    forward, layers = scope["forward"], {}

    def call(q, k, v, gamma, s0):
        B, H, T, d = q.shape
        if (H, d, q.dtype) not in layers:
            cfg = MiniMaxConfig(hidden_size=3 * H * d, num_attention_heads=H, head_dim=d,
                                block_size=block_size, hidden_act="linear", num_hidden_layers=2,
                                layer_types=["linear_attention"] * 2)
            layer = mm.MiniMaxLightningAttention(cfg, 0).to(q.dtype).requires_grad_(False)
            with torch.no_grad():
                layer.qkv_proj.weight.copy_(torch.eye(3 * H * d, dtype=q.dtype))
            layers[H, d, q.dtype] = layer
        layer = layers[H, d, q.dtype]
        w = torch.float64 if q.dtype == torch.float64 else torch.float32
        slope = -torch.log(torch.as_tensor(gamma, dtype=w)).reshape(H, 1, 1)
        layer.slope_rate = slope.to(q.dtype)
        layer.query_decay, layer.key_decay, layer.diagonal_decay = (
            x.to(q.dtype) for x in layer.decay_factors(slope))
        # the per-head q, k, v of each token side by side, as qkv_proj's output splits them
        hidden = torch.cat([q, k, v], dim=-1).transpose(1, 2).reshape(B, T, 3 * H * d)
        cache = None if s0 is None else _LinearCache(s0.to(q.dtype))
        out, state = forward(layer, hidden, None, None, cache=cache)
        return out.reshape(B, T, H, d).transpose(1, 2), state if cache is None else cache.final

    def kernel(q, k, v, *, gamma, scale=None, initial_state=None, output_final_state=False,
               cu_seqlens=None):
        q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
        go = lambda q, k, v, st, s0: call(q, k, v, gamma, s0)  # noqa: E731
        return _per_sequence(go, q, k, v, {}, initial_state, cu_seqlens, output_final_state)

    kernel.__name__ = f"hf_minimax_lightning_{block_size}"
    return kernel
