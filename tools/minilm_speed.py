"""The NumPy forward of all-MiniLM-L6-v2 against sentence-transformers on PyTorch CPU.

    python tools/minilm_speed.py [--reps 7] [--n 512]

One sequence of ``n`` real tokens (the start of CPython's licence file), float32. Both
sides are timed interleaved in one process, median wall-clock seconds of ``reps`` runs
after one warm-up, with the threads each library picks by default (set
``OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1`` for single-thread figures). Measured:
``attn_ref.models.minilm.sentence_embedding`` on NumPy against
``SentenceTransformer.encode`` (tokenised ids given to its module directly, so neither
side pays for tokenising) under ``torch.inference_mode``. The issue's target: NumPy
within 2x of sentence-transformers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--n", type=int, default=512)
    args = ap.parse_args(argv)

    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    from attn_ref.models import minilm, study

    w = minilm.load_weights()
    tok = minilm.load_tokenizer()
    text, source = study.reference_text()
    ids = minilm.tokenize([text], tok, max_length=args.n)[0]
    st = SentenceTransformer(str(minilm.model_dir()), device="cpu")
    st.max_seq_length = args.n
    features = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
                "token_type_ids": torch.zeros(1, len(ids), dtype=torch.long)}
    ids_np = np.asarray(ids)

    def ours():
        return minilm.sentence_embedding(ids_np, w)

    def theirs():
        with torch.inference_mode():
            return st(dict(features))["sentence_embedding"][0].numpy()

    gap = float(np.abs(ours() - theirs()).max())  # warm-up, and the two agree
    t_ours, t_theirs = [], []
    for _ in range(args.reps):
        for f, out in ((ours, t_ours), (theirs, t_theirs)):
            t0 = time.perf_counter()
            f()
            out.append(time.perf_counter() - t0)
    a, b = statistics.median(t_ours), statistics.median(t_theirs)
    print(f"N = {len(ids)} tokens of {source}; max |difference| of the embeddings {gap:.1e}")
    print(f"torch threads {torch.get_num_threads()}, reps {args.reps}")
    print(f"attn_ref NumPy forward:          {a * 1e3:8.1f} ms (median; min {min(t_ours) * 1e3:.1f})")
    print(f"sentence-transformers, torch CPU: {b * 1e3:8.1f} ms (median; min {min(t_theirs) * 1e3:.1f})")
    print(f"ratio NumPy / torch: {a / b:.2f} (target <= 2)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
