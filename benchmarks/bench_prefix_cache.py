"""Time to first audio with the talker's prompt-prefix cache cold vs warm, side by side.

    python benchmarks/bench_prefix_cache.py --size 0.6b --rounds 3 --threads 1
    python benchmarks/bench_prefix_cache.py --size 0.6b --device cuda --dtype bfloat16 --rounds 3

In-process talker source (engines/pipelines/talker/source.py) at the chosen sizes, random
weights (testsupport/talker.py), fp32 by default (``--dtype``), one request at a time, greedy. For each scenario a
request's time to its first frame and to its first 4-frame chunk (what the served pipeline
vocodes first; the vocoder itself is not included, it costs the same cold or warm):
* cold: the cache off (``prefix_cache_fraction=0``): the whole prompt is prefilled;
* warm: the cache on, after a "primer" request that left what the scenario shares indexed
  (the primer is not timed). Cold and warm take turns, the order alternating per round;
  min and median over rounds, and warm / cold per round.

Scenarios (what a warm request can reuse follows from the official prompt layout,
engines/pipelines/talker/prompt.py):
* built-in speaker, new text: role + think/language tags + speaker (about 9 positions);
* built-in speaker, same text again: every prompt position but the last;
* saved voice (in-context cloning: x-vector + 5 s of reference codes + transcript), new
  text: tags + x-vector + the reference transcript's positions. The reference frames sit
  beside the NEW text's ids in the streaming-text layout (and after them in the
  non-streaming one), so they are prefilled again for every new text;
* saved voice, same text again: everything but the last position;
* saved voice, x-vector only, new text: tags + x-vector;
* VoiceDesign instructions (about 40 tokens), new text: the instruction block.

On CUDA (``--device cuda``, or ``auto`` where a GPU is present) the weights move there in
``--dtype`` and the decode step runs as the served engine runs it (engines/core/engine.py):
the whole step as CUDA graphs (engines/runtime/graphed_talker.GraphedTalkerStep), except that
the code predictor's layers inside the graphs stay uncompiled (the engine compiles them with
inductor; that changes the decode step alike cold or warm, never the prefill the cache saves).
``--eager-step`` leaves the step eager instead. Before the rounds every source serves one
untimed request longer than any timed one (CUDA/cuBLAS start-up, the trailing-text buffer at
its size) and captures its graphs, so no timed turn captures (the table says if one did). The
clock is read after ``torch.cuda.synchronize``; the CPU-time columns are then the host thread's
time (launches and the wait in synchronize), not the GPU's work.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_talker import SIZES, machine_line  # noqa: E402

from engines.contract import SynthesisRequest, VoiceClone  # noqa: E402
from engines.core.scheduler import Scheduler  # noqa: E402
from engines.pipelines.talker.prompt import PromptBuilder  # noqa: E402
from engines.pipelines.talker.reference import frame_embedder  # noqa: E402
from engines.pipelines.talker.source import TalkerSource  # noqa: E402
from testsupport.talker import make_bundle  # noqa: E402

TEXTS = ["Hello world, this is a small test of streaming speech.", "the quick brown fox jumps over the lazy dog"]
INSTRUCT = ("Speak slowly and warmly, like a calm narrator reading the quick brown fox story to the world, "
            "with a small smile.")
CHUNK = 4
WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]


def bundle_for(base, task: str):
    """The same weights with a Base / VoiceDesign / CustomVoice prompt."""
    cfg = dataclasses.replace(base.prompt.config, tts_model_type=task)
    return dataclasses.replace(base, prompt=PromptBuilder(cfg, base.prompt.tokenizer,
                                                          frame_embedder(base.talker, base.predictor)))


def clock(device: torch.device) -> tuple[float, float]:
    """(wall, this thread's CPU) seconds once the device's queued work has finished."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter(), time.thread_time()


def first_audio(source: TalkerSource, request: SynthesisRequest) -> tuple[float, float, int, float, float]:
    """-> wall seconds to the first frame, to the first CHUNK frames; prompt positions; the
    same two in this thread's CPU seconds (torch runs on it with --threads 1: the work done,
    whatever else the shared machine runs; on CUDA the host's share only)."""
    positions = source.prompt_positions(request)
    scheduler = Scheduler(max_slots=source.max_slots)  # plans each tick's prefill (its default token budget)
    t0, c0 = clock(source.device)
    source.admit(request, max_new_tokens=CHUNK + 2)
    frames, first = 0, None
    while frames < CHUNK:
        frames += sum(f.codes.shape[0] for f in source.tick(scheduler.step_plan(source.capacity())) if f.request_id == request.id)
        if frames and first is None:
            t, c = clock(source.device)
            first = (t - t0, c - c0)
    t, c = clock(source.device)
    chunk = (t - t0, c - c0)
    source.cancel(request.id)
    return first[0], chunk[0], positions, first[1], chunk[1]


def warm_up(source: TalkerSource, request: SynthesisRequest, graphs: bool) -> None:
    """CUDA: one untimed request longer than any timed one (start-up costs, the trailing-text
    buffer grown), then, with ``graphs``, the step as CUDA graphs (the served engine's
    GraphedTalkerStep) captured at every KV-block bucket a timed request can reach."""
    first_audio(source, request)
    if graphs:
        from engines.runtime.graphed_talker import GraphedTalkerStep

        source.step_runner = GraphedTalkerStep(source.step_spec())
        blocks = source.cache.blocks_for(source.prompt_positions(request) + CHUNK + 2)
        source.step_runner.capture_all(max_blocks=1 << max(0, (blocks - 1).bit_length()))
        first_audio(source, dataclasses.replace(request, id=request.id + "-graphed"))


def graph_captures(sources: dict[str, TalkerSource]) -> int:
    return sum(source.step_runner.captures for source in sources.values() if source.step_runner is not None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ref-seconds", type=float, default=5.0, help="saved voice's reference length (12.5 frames/s)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--eager-step", action="store_true", help="CUDA: the decode step eager, not CUDA graphs")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    graphs = device.type == "cuda" and not args.eager_step
    dtype_name = "fp32" if args.dtype == "float32" else args.dtype
    step_note = "" if device.type != "cuda" else (
        " step CUDA graphs (predictor layers uncompiled)" if graphs else " step eager")
    print(f"prefix cache TTFA: size={args.size} {dtype_name} rounds={args.rounds}{step_note}")
    print(machine_line(device), flush=True)
    base = make_bundle(seed=0, max_new_tokens=10_000, eos_gain=1.0, device=device, dtype=getattr(torch, args.dtype),
                       **SIZES[args.size])
    base.generation = dataclasses.replace(base.generation, min_new_tokens=10**9)  # no early EOS
    cfg = base.talker.cfg
    rng = np.random.default_rng(0)
    frames = int(args.ref_seconds * 12.5)
    xvector = rng.standard_normal(cfg.hidden_size).astype(np.float32)
    icl = VoiceClone(xvector, rng.integers(0, SIZES[args.size]["codebook"], (frames, cfg.num_code_groups)),
                     "Hello world, this is a small test.", key="saved-a")
    xvec = VoiceClone(xvector, key="saved-x")
    cv, clone, design = base, bundle_for(base, "base"), bundle_for(base, "voice_design")

    def req(i, text, **kw):
        return SynthesisRequest(id=f"q{i}", text=text, greedy=True, prefix_owner="key-a", **kw)

    # name, bundle, primer request fields, timed request fields
    scenarios = [
        ("built-in speaker, new text", cv, dict(text=TEXTS[0], voice="Ryan"), dict(text=TEXTS[1], voice="Ryan")),
        ("built-in speaker, same text", cv, dict(text=TEXTS[0], voice="Ryan"), dict(text=TEXTS[0], voice="Ryan")),
        ("saved voice (in-context), new text", clone, dict(text=TEXTS[0], clone=icl), dict(text=TEXTS[1], clone=icl)),
        ("saved voice (in-context), same text", clone, dict(text=TEXTS[0], clone=icl), dict(text=TEXTS[0], clone=icl)),
        ("saved voice (x-vector), new text", clone, dict(text=TEXTS[0], clone=xvec), dict(text=TEXTS[1], clone=xvec)),
        ("VoiceDesign instructions, new text", design, dict(text=TEXTS[0], instructions=INSTRUCT),
         dict(text=TEXTS[1], instructions=INSTRUCT)),
    ]
    serial = 0
    rows = []
    for name, bundle, primer, timed in scenarios:
        sources = {"cold": TalkerSource.from_bundle(bundle, max_slots=1, max_seq_len=512, prefix_cache_fraction=0.0),
                   "warm": TalkerSource.from_bundle(bundle, max_slots=1, max_seq_len=512)}
        captures = 0
        if device.type == "cuda":
            for source in sources.values():
                warm_up(source, req(serial, **dict(primer, text=f"{TEXTS[1]} {TEXTS[0]}")), graphs)
                serial += 1
            captures = graph_captures(sources)
        got = {"cold": [], "warm": []}
        reused = 0
        for r in range(args.rounds):
            for kind in (("cold", "warm") if r % 2 == 0 else ("warm", "cold")):
                source = sources[kind]
                if kind == "warm":
                    first_audio(source, req(serial, **primer))  # leaves the shared prefix indexed
                    serial += 1
                    before = source.kv_cache_stats()["prefix_hit_positions"]
                fields = dict(timed)
                if timed["text"] != primer["text"]:  # a text neither source has seen: new in every turn
                    fields["text"] = f"{WORDS[serial % len(WORDS)]} {WORDS[serial // len(WORDS) % len(WORDS)]}, {timed['text']}"
                got[kind].append(first_audio(source, req(serial, **fields)))
                serial += 1
                if kind == "warm":
                    reused = source.kv_cache_stats()["prefix_hit_positions"] - before
        if device.type == "cuda":
            timed_captures = graph_captures(sources) - captures
            if timed_captures:
                name += f" ({timed_captures} graph captures while timed)"
        rows.append((name, got, reused))
        cold, warm = got["cold"], got["warm"]
        print(f"  {name}: prompt {cold[0][2]} positions, {reused} from the cache; first chunk cold "
              f"{statistics.median(c[1] for c in cold) * 1e3:.0f} ms, warm {statistics.median(w[1] for w in warm) * 1e3:.0f} ms",
              flush=True)
    print(f"\nload average now {os.getloadavg()[0]:.2f}; ms, min / median over {args.rounds} rounds; "
          f"ratio = warm / cold per round, median")
    if device.type == "cuda":
        print("CPU ms on CUDA: the host thread's time (launches, the wait in synchronize), not the GPU's work")
    print(f"| scenario | prompt positions | from cache | first frame cold | first frame warm | ratio | "
          f"first {CHUNK} frames cold | first {CHUNK} frames warm | ratio | CPU ms first frame cold / warm | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, got, reused in rows:
        cold, warm = got["cold"], got["warm"]

        def cell(xs, i):
            vals = [x[i] * 1e3 for x in xs]
            return f"{min(vals):.0f} / {statistics.median(vals):.0f}"

        ratio = [statistics.median(w[i] / c[i] for c, w in zip(cold, warm)) for i in (0, 1, 3)]
        cpu = [statistics.median(x[3] for x in xs) * 1e3 for xs in (cold, warm)]
        print(f"| {name} | {cold[0][2]} | {reused} | {cell(cold, 0)} | {cell(warm, 0)} | {ratio[0]:.2f} | "
              f"{cell(cold, 1)} | {cell(warm, 1)} | {ratio[1]:.2f} | {cpu[0]:.0f} / {cpu[1]:.0f} | {ratio[2]:.2f} |")


if __name__ == "__main__":
    main()
