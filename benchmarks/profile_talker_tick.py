"""PyTorch op calls per talker tick and where a tick's time goes (torch.profiler, CPU).

    python benchmarks/profile_talker_tick.py --size 0.6b --batch 1 --ticks 3 --threads 1

Steady-state ``TalkerSource.tick()`` (no admission, EOS blocked), random weights. Prints:
op calls per tick (top-level ATen ops a tick dispatches: what the Python-side step costs
in dispatch), and the self CPU time of the busiest ops.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

import torch  # noqa: E402
from bench_talker import SIZES, TEXT, machine_line  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from engines.contract import SynthesisRequest  # noqa: E402
from engines.core.scheduler import Scheduler  # noqa: E402
from engines.pipelines.talker.source import TalkerSource  # noqa: E402
from testsupport.talker import make_bundle  # noqa: E402


def steady_source(size: str, batch: int, quantize: str | None = None) -> TalkerSource:
    bundle = make_bundle(seed=0, max_new_tokens=100_000, eos_gain=1.0, **SIZES[size])
    bundle.generation = dataclasses.replace(bundle.generation, min_new_tokens=10**9)
    if quantize:
        from engines.models.quantize import quantize_talker

        quantize_talker(bundle.talker, bundle.predictor, quantize)
    source = TalkerSource.from_bundle(bundle, max_slots=batch, max_seq_len=512, kv_cache_gb=64.0)
    for i in range(batch):
        source.admit(SynthesisRequest(id=f"u{i}", text=TEXT, voice="Ryan", temperature=0), max_new_tokens=400)
    for _ in range(3):
        source.tick(Scheduler(max_slots=batch).step_plan(source.capacity()))
    return source


def top_level_ops(prof) -> Counter:
    """ATen ops called from Python (not nested in another ATen op), by name."""
    return Counter(e.name for e in prof.events() if e.name.startswith("aten::")
                   and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ticks", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quantize", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_line(torch.device("cpu")))
    source = steady_source(args.size, args.batch, args.quantize)
    scheduler = Scheduler(max_slots=args.batch)  # plans each tick's prefill (its default token budget)
    t0 = time.perf_counter()
    for _ in range(args.ticks):
        source.tick(scheduler.step_plan(source.capacity()))
    plain = (time.perf_counter() - t0) / args.ticks
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.ticks):
            source.tick(scheduler.step_plan(source.capacity()))
    ops = top_level_ops(prof)
    total = sum(ops.values()) / args.ticks
    print(f"size {args.size} batch {args.batch}: {total:.0f} top-level op calls per tick "
          f"({len(prof.events()) / args.ticks:.0f} profiler events incl. nested); tick {plain * 1e3:.1f} ms unprofiled")
    print("most called:", ", ".join(f"{n.removeprefix('aten::')} {c / args.ticks:.0f}" for n, c in ops.most_common(12)))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
