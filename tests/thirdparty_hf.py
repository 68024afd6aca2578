"""HuggingFace transformers' softmax attention, run the way its decoder models run it.

The oracle calls ``kernel(q, k, v, **kw)`` with ``(B, H, N, d)`` tensors; :func:`hf_kernel`
turns a case into what a transformers model hands its attention function and calls the
real function (``eager_attention_forward`` of the model: Mistral's and Qwen 2's are
Llama's; or ``transformers.integrations.sdpa_attention.sdpa_attention_forward``):

* a config of the model (heads, key/value heads, head dim; Mistral's and Gemma's
  ``sliding_window``, Gemma's ``query_pre_attn_scalar`` and ``attn_logit_softcapping``)
  and the model's attention module built from it, whose ``num_key_value_groups`` drives
  ``repeat_kv`` (grouped-query heads, blocked: query head ``h`` reads key/value head
  ``h // (Hq / Hkv)``);
* the mask from ``transformers.masking_utils`` (``create_causal_mask``,
  ``create_sliding_window_causal_mask``; ``create_bidirectional_mask`` off a causal
  case), with a ``DynamicCache`` holding the ``Nk - Nq`` earlier keys when ``Nk > Nq``:
  the queries are the last ``Nq`` positions, i.e. causal is **bottom-right**, and a
  sliding-window layer's cache keeps only the last ``sliding_window - 1`` of them;
* per-sequence key lengths (``seqlens_k``) as HF's generation pads a batch: on the
  **left**, the keys of sequence ``b`` moved to the end and a 2-D ``attention_mask``
  hiding the ``Nk - Lk`` positions before them; a key-padding ``mask`` as a 2-D
  ``attention_mask`` (right padding, as in a training batch); any other boolean mask,
  and a bias, as the custom 4-D mask a caller may pass instead (HF then uses it as is):
  HF's own boolean mask and the case's, and the bias where both allow (the form of
  ``sdpa_attention.create_position_bias_mask``).

HF's conventions and how each maps onto the oracle's (``docs/conformance.md``,
"HuggingFace transformers' decoder attention"):

* ``sliding_window = w`` admits ``w`` keys, the query's own included
  (``kv_idx > q_idx - w``): the oracle's ``window=(w - 1, 0)``; the kernel takes an
  oracle window ``(left, 0)``, or ``(left, -1)`` under a causal mask, as
  ``sliding_window = left + 1`` (:func:`hf_window`);
* a row with no visible key: the eager masks hold ``finfo(dtype).min``, not ``-inf``, so
  such a row is uniform over all keys: ``fully_masked="mean"``;
* the eager functions take the softmax in float32 whatever the input
  (``softmax(..., dtype=torch.float32)``): their float64 rows fail, named.

``PLANTS`` are small bugs put into monkeypatched copies of the HF functions.
"""

import contextlib

import torch
import transformers.masking_utils as masking_utils
from torch import nn
from transformers import (
    DynamicCache,
    Gemma2Config,
    Gemma3TextConfig,
    Llama4TextConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)
from transformers.integrations import sdpa_attention
from transformers.models.gemma2 import modeling_gemma2
from transformers.models.gemma3 import modeling_gemma3
from transformers.models.llama import modeling_llama
from transformers.models.llama4 import modeling_llama4
from transformers.models.mistral import modeling_mistral
from transformers.models.qwen2 import modeling_qwen2

#: model name -> (config class, attention module class, modeling module)
MODELS = {
    "llama": (LlamaConfig, modeling_llama.LlamaAttention, modeling_llama),
    "llama4": (Llama4TextConfig, modeling_llama4.Llama4TextAttention, modeling_llama4),
    "mistral": (MistralConfig, modeling_mistral.MistralAttention, modeling_mistral),
    "qwen2": (Qwen2Config, modeling_qwen2.Qwen2Attention, modeling_qwen2),
    "gemma2": (Gemma2Config, modeling_gemma2.Gemma2Attention, modeling_gemma2),
    "gemma3": (Gemma3TextConfig, modeling_gemma3.Gemma3Attention, modeling_gemma3),
}

#: planted bug -> what it changes (each in a monkeypatched copy of HF's code)
PLANTS = {
    "window": "masking_utils.sliding_window_overlay admits kv_idx >= q_idx - w (one key more)",
    "chunk": "masking_utils.chunked_overlay cuts chunks of attention_chunk_size + 1 positions",
    "chunk_left_pad": "masking_utils.chunked_overlay without its left_padding correction (chunks counted "
                      "from the padded start)",
    "gqa": "repeat_kv tiles the key/value heads (x.repeat(1, n_rep, 1, 1)): interleaved groups",
    "softcap": "the soft-cap applied to q.k before the scaling",
    "scale": "the scaling 1 % too large",
    "mask_twice": "the additive attention_mask added twice",
    "bf16_softmax": "the softmax computed in bfloat16",
}


def hf_window(window):
    """HF's ``sliding_window`` for an oracle window ``(left, right)``: ``left + 1`` keys."""
    return None if window is None else window[0] + 1


def gemma_scalar(scale):
    """Gemma's ``query_pre_attn_scalar`` (an int in its config) for a logit scale, or None.

    ``scaling = query_pre_attn_scalar ** -0.5``: a Gemma config expresses only scales
    ``1 / sqrt(n)``, ``n`` a positive integer (0.05 is ``n = 400``; 0.3 is none).
    """
    n = round(scale ** -2)
    return n if n >= 1 and abs(n ** -0.5 - scale) <= 1e-12 * scale else None


def config_for(model, heads, kv_heads, head_dim, *, scale=None, window=None, softcap=None, chunk=None):
    """A one-layer config of ``model`` with these heads, as the model's own config sets them.

    The logit scale goes in where the model takes it from: Gemma's
    ``query_pre_attn_scalar`` (``scaling = query_pre_attn_scalar ** -0.5``), ``None``
    giving ``head_dim`` as in Gemma 2 9B; the other models scale by ``head_dim ** -0.5``
    and take another scale only as the attention function's ``scaling=``.
    """
    cls = MODELS[model][0]
    kw = dict(num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads,
              head_dim=head_dim, hidden_size=heads * head_dim)
    sliding = hf_window(window)
    if model in ("gemma2", "gemma3"):
        kw.update(query_pre_attn_scalar=head_dim if scale is None else gemma_scalar(scale),
                  attn_logit_softcapping=softcap, sliding_window=sliding or 4096,
                  layer_types=["sliding_attention" if sliding else "full_attention"])
    elif model == "qwen2":
        kw.update(use_sliding_window=sliding is not None, sliding_window=sliding,
                  layer_types=["sliding_attention" if sliding else "full_attention"])
    elif model == "mistral":
        kw.update(sliding_window=sliding)
    elif model == "llama4":
        # Llama 4's RoPE layers are its chunked ones (no_rope_layers[i] = 1: RoPE); a
        # layer without a chunk is a full-attention one, as its NoPE layers are
        kw.update(attention_chunk_size=chunk, no_rope_layers=[1],
                  layer_types=["chunked_attention" if chunk else "full_attention"])
    return cls(**kw)


@contextlib.contextmanager
def planted(model, plant):
    """Monkeypatch ``plant`` (a key of :data:`PLANTS`) into HF's code while inside."""
    mod = MODELS[model][2]
    saved = []

    def patch(owner, name, value):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    if plant == "window":
        def overlay(sliding_window):
            return lambda b, h, q_idx, kv_idx: kv_idx >= q_idx - sliding_window
        patch(masking_utils, "sliding_window_overlay", overlay)
    elif plant in ("chunk", "chunk_left_pad"):
        def chunked(chunk_size, left_padding):
            if plant == "chunk":
                return original(chunk_size + 1, left_padding)
            return original(chunk_size, torch.zeros_like(left_padding))
        original = masking_utils.chunked_overlay
        patch(masking_utils, "chunked_overlay", chunked)
    elif plant == "gqa":
        def tiled(x, n_rep):
            return x.repeat(1, n_rep, 1, 1)
        patch(mod, "repeat_kv", tiled)
        patch(sdpa_attention, "repeat_kv", tiled)
    elif plant in ("softcap", "scale", "mask_twice", "bf16_softmax"):
        patch(mod, "eager_attention_forward", _planted_eager(mod, plant))
    elif plant is not None:
        raise ValueError(f"plant must be one of {sorted(PLANTS)}, got {plant!r}")
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def _planted_eager(mod, plant):
    """Gemma 2's ``eager_attention_forward`` (Llama's when ``softcap`` is None) with one bug."""
    def eager(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
              **kwargs):
        scaling = module.head_dim ** -0.5 if scaling is None else scaling
        key_states = mod.repeat_kv(key, module.num_key_value_groups)
        value_states = mod.repeat_kv(value, module.num_key_value_groups)
        attn_weights = torch.matmul(query, key_states.transpose(2, 3))
        if plant == "scale":
            scaling = scaling * 1.01
        if plant == "softcap" and softcap is not None:
            attn_weights = torch.tanh(attn_weights / softcap) * softcap * scaling
        else:
            attn_weights = attn_weights * scaling
            if softcap is not None:
                attn_weights = torch.tanh(attn_weights / softcap) * softcap
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
            if plant == "mask_twice":
                attn_weights = attn_weights + attention_mask
        if plant == "bf16_softmax":
            attn_weights = nn.functional.softmax(attn_weights.to(torch.bfloat16), dim=-1)
        else:
            attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32)
        attn_weights = attn_weights.to(query.dtype)
        attn_output = torch.matmul(attn_weights, value_states)
        return attn_output.transpose(1, 2).contiguous(), attn_weights
    return eager


def _left_pad(x, lens):
    """Each batch entry's first ``lens[b]`` positions moved to the end (HF's left padding)."""
    n = x.shape[-2]
    return torch.stack([torch.roll(x[b], n - int(lens[b]), dims=-2) for b in range(x.shape[0])])


def hf_kernel(model, implementation="eager", plant=None):
    """A kernel for :func:`conformance.verify` that runs ``model``'s attention as the model does.

    ``implementation`` is ``"eager"`` (the model's ``eager_attention_forward``) or
    ``"sdpa"`` (``transformers.integrations.sdpa_attention.sdpa_attention_forward``);
    ``plant`` one of :data:`PLANTS`. The kernel takes the oracle's ``mask``, ``bias``,
    ``causal`` (bottom-right), ``scale``, ``enable_gqa``, ``window`` (``(left, 0)``, or
    ``(left, -1)`` with ``causal``), ``softcap`` (Gemma), ``attention_chunk_size`` (Llama
    4, with ``causal``) and ``seqlens_k``, and returns ``(B, H, Nq, dv)``.
    """
    def kernel(q, k, v, *, mask=None, bias=None, causal=False, scale=None, enable_gqa=False,
               window=None, softcap=None, attention_chunk_size=None, seqlens_k=None):
        b, h, nq, d = q.shape
        hkv, nk = k.shape[1], k.shape[-2]
        config = config_for(model, h, hkv, d, scale=scale, window=window, softcap=softcap,
                            chunk=attention_chunk_size)
        config._attn_implementation = implementation
        module = MODELS[model][1](config, layer_idx=0).eval()
        pad = None  # HF's 2-D attention_mask (B, Nk), True = a real token
        if seqlens_k is not None:
            k, v = _left_pad(k, seqlens_k), _left_pad(v, seqlens_k)
            pad = torch.arange(nk)[None, :] >= nk - torch.tensor(seqlens_k)[:, None]
        custom = mask is not None and (mask.shape[1] != 1 or mask.shape[2] != 1)
        if seqlens_k is not None and (custom or bias is not None):
            # the keys move to the end of the row (left padding); so would these
            raise NotImplementedError("seqlens_k with a 4-D mask or a bias")
        if mask is not None and not custom:
            pad = mask[:, 0, 0, :] if pad is None else pad & mask[:, 0, 0, :]
        if custom or bias is not None:
            # the 4-D mask a caller passes: HF's own pattern, as booleans, and the case's
            config._attn_implementation = "sdpa"
        with planted(model, plant):
            cache = None
            if nk > nq:
                cache = DynamicCache(config=config)
                cache.update(k[:, :, :nk - nq], v[:, :, :nk - nq], 0)
            embeds = torch.empty((b, nq, config.hidden_size), dtype=q.dtype)
            make = (masking_utils.create_sliding_window_causal_mask if window is not None
                    else masking_utils.create_chunked_causal_mask if attention_chunk_size is not None
                    else masking_utils.create_causal_mask if causal
                    else masking_utils.create_bidirectional_mask)
            skip = not (custom or bias is not None)
            kw = ({"allow_is_bidirectional_skip": skip} if make is masking_utils.create_bidirectional_mask
                  else {"allow_is_causal_skip": skip})
            attn_mask = make(config, embeds, pad, cache=cache, **kw)
            if cache is not None:
                k, v = cache.update(k[:, :, nk - nq:], v[:, :, nk - nq:], 0)
            if custom or bias is not None:
                allowed = attn_mask
                if allowed is None:
                    allowed = torch.ones((b, 1, nq, k.shape[-2]), dtype=torch.bool)
                if custom:
                    allowed = allowed & mask[..., -k.shape[-2]:]
                config._attn_implementation = implementation
                if implementation == "eager" or bias is not None:
                    add = torch.zeros((), dtype=q.dtype) if bias is None else bias[..., -k.shape[-2]:]
                    attn_mask = torch.where(allowed, add, torch.finfo(q.dtype).min)
                else:
                    attn_mask = allowed
            # what the model's forward passes its attention function: Gemma its scaling and
            # soft-cap from the config (sdpa refuses the soft-cap), the others the scaling
            gemma = model in ("gemma2", "gemma3")
            extra = {"softcap": config.attn_logit_softcapping} if gemma else {}
            scaling = module.scaling if scale is None or gemma else scale
            # is_causal: what transformers' attention wrapper passes from config.is_causal
            if implementation == "sdpa":
                out, _ = sdpa_attention.sdpa_attention_forward(
                    module, q, k, v, attn_mask, scaling=scaling,
                    is_causal=bool(causal or window or attention_chunk_size),
                    **extra)
            else:
                fn = MODELS[model][2].eager_attention_forward
                out, _ = fn(module, q, k, v, attn_mask, scaling=scaling, **extra)
        return out.transpose(1, 2)
    kernel.__name__ = f"hf_{model}_{implementation}" + (f"_{plant}" if plant else "")
    return kernel


def declared(model, implementation="eager"):
    """The ``supports=`` of :func:`hf_kernel`: what the model's attention takes.

    Grouped-query heads and left-padded key lengths always; Gemma's soft-cap with the
    eager function only (``sdpa_attention_forward`` raises on a soft-cap, and Gemma 2
    sets ``_supports_sdpa = False``); sliding windows where the model has them (Mistral,
    Qwen 2, Gemma), and of them only ``(left, 0)``, or ``(left, -1)`` under a causal
    mask: HF's window is causal; Llama 4's chunks (``attention_chunk_size``) only under a
    causal mask, for the same reason. Causal only bottom-right or with ``Nq == Nk`` (a
    decoder's queries are the last positions of its cache), never ``Nq > Nk``; Gemma's
    scales only ``1 / sqrt(n)`` (:func:`gemma_scalar`). No ALiBi, dropout keep-mask,
    padded queries (``seqlens_q``) or broadcast batches: none of these functions takes
    them.
    """
    gemma = model in ("gemma2", "gemma3")
    sliding = model not in ("llama", "llama4")

    def takes(case):
        if case.param("chunk") is not None and not case.causal:
            return False
        w = case.param("window")
        if w is not None and not (w[0] >= 0 and (w[1] == 0 or (w[1] == -1 and case.causal))):
            return False
        if case.causal and case.nq > case.nk:
            return False
        if case.causal == "top-left" and case.nq != case.nk:
            return False
        return not (gemma and case.scale is not None and gemma_scalar(case.scale) is None)

    return {"gqa": True, "seqlens_k": True, "window": sliding, "chunk": model == "llama4",
            "softcap": gemma and implementation == "eager", "cases": takes}
