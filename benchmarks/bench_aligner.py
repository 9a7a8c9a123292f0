"""Forced-aligner cost per audio second on this machine (CPU unless --device).

    python benchmarks/bench_aligner.py --model tests/fixtures/aligner/tiny --batch 1 8 --seconds 3
    python benchmarks/bench_aligner.py --model Qwen/Qwen3-ForcedAligner-0.6B --batch 1 8

Prints, per batch size, wall time per call and milliseconds of compute per second of audio
(lower is better; < 1000 means faster than real time on one stream).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from engines.pipelines.aligner import Aligner, AlignItem

TEXT = "The quick brown fox jumps over the lazy dog while the streaming voice keeps talking about time."


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tests/fixtures/aligner/tiny")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    aligner = Aligner.load(args.model, device=args.device)
    rng = np.random.default_rng(0)
    wav = (0.1 * rng.standard_normal(int(args.seconds * 24_000))).astype(np.float32)
    print(f"model {args.model}  device {args.device}  threads {torch.get_num_threads()}  "
          f"piece {args.seconds:g} s, {len(TEXT.split())} words")
    for batch in args.batch:
        items = [AlignItem(wav, TEXT, "English") for _ in range(batch)]
        aligner.align_batch(items)  # warm-up
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            aligner.align_batch(items)
            times.append(time.perf_counter() - start)
        best = min(times)
        print(f"batch {batch:2d}: {best * 1000:8.1f} ms per call, "
              f"{best * 1000 / (batch * args.seconds):7.1f} ms per audio second")


if __name__ == "__main__":
    main()
