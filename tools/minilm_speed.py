"""The NumPy forward of all-MiniLM-L6-v2 against sentence-transformers on PyTorch CPU.

    python tools/minilm_speed.py [--reps 11] [--n 512] [--threads 1]

One sequence of ``n`` real tokens (the start of CPython's licence file), float32. Both
sides are timed interleaved in one process, after one warm-up each: the median (and
minimum) of ``reps`` calls, in wall-clock seconds and in CPU seconds of the calling
thread (``time.thread_time``; with one thread, the work of the call, which is what a
machine shared with other processes distorts least). ``--threads`` sets both libraries'
thread count: OpenBLAS's, OpenMP's and MKL's through the environment before NumPy is
imported, ``torch.set_num_threads`` for PyTorch (default 1; CPU times count only the
calling thread, so read the wall times for more). The load average is printed before
and after. Measured: ``attn_ref.models.minilm.sentence_embedding`` on NumPy against
``SentenceTransformer.encode``'s module (tokenised ids given to it directly, so neither
side pays for tokenising) under ``torch.inference_mode``. The issue's target: NumPy
within 2x of sentence-transformers.

Run it from a checkout with ``PYTHONPATH=.`` to time that checkout's ``attn_ref``; the
file it imported is printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    for var in _THREAD_VARIABLES:
        os.environ[var] = str(args.threads)

    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    import attn_ref
    from attn_ref.models import minilm, study

    torch.set_num_threads(args.threads)
    load_before = _loadavg()
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
    times = {"ours": ([], []), "theirs": ([], [])}
    for _ in range(args.reps):
        for name, f in (("ours", ours), ("theirs", theirs)):
            t0, c0 = time.perf_counter(), time.thread_time()
            f()
            times[name][1].append(time.thread_time() - c0)
            times[name][0].append(time.perf_counter() - t0)

    def line(label, name):
        wall, cpu = times[name]
        return (f"{label} wall {statistics.median(wall) * 1e3:7.1f} ms (min {min(wall) * 1e3:7.1f}), "
                f"thread CPU {statistics.median(cpu) * 1e3:7.1f} ms (min {min(cpu) * 1e3:7.1f})")

    def ratio(i):
        return statistics.median(times["ours"][i]) / statistics.median(times["theirs"][i])

    print(f"attn_ref from {os.path.dirname(attn_ref.__file__)}")
    print(f"N = {len(ids)} tokens of {source}; max |difference| of the embeddings {gap:.1e}")
    print(f"threads: torch {torch.get_num_threads()}, "
          + ", ".join(f"{v}={os.environ[v]}" for v in _THREAD_VARIABLES) + f"; reps {args.reps}")
    print(line("attn_ref NumPy forward:          ", "ours"))
    print(line("sentence-transformers, torch CPU:", "theirs"))
    print(f"ratio NumPy / torch of the medians: wall {ratio(0):.2f}, thread CPU {ratio(1):.2f} (target <= 2)")
    print(f"load average before {load_before}, after {_loadavg()} ({os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
