"""The codec decoder beside the talker on a CPU, three ways side by side in one run: after each
tick on the worker thread (the talker's step alone), on a thread of the worker's process (the
GIL shared with the talker), and in a process of its own (the default; engines/pipelines/
vocoder_process.py).

    python benchmarks/bench_codec_process.py --model /tmp/ckpt-0.6b [--rounds 4]
    (checkpoint: .venv-oracle/bin/python benchmarks/make_checkpoint.py --size 0.6b /tmp/ckpt-0.6b)

One engine, built the way `streamvox serve` builds it (the service's defaults: int8 talker, bf16
codec on fixed windows, the threads of the start-up probe), serves one greedy request at a time;
the requests take turns between the three ways, rotated every round, so each way sees the same
machine within seconds of the others (a shared machine's load moves by the minute: ratios are
taken inside a round). The engine switches between them between requests, with no stream open:
"thread" hands the pieces to the same vocoder thread as "process" but decodes them there, with
the in-process vocalizer the process was made from; "alone" decodes them on the worker thread
after each tick. Per request: the talker's step (wall, and where the worker thread spent it, from
the kernel's /proc/thread-self/schedstat: on a core, runnable waiting for a core (the machine's
load), and blocked, which for the talker's step is waiting for the GIL: it does no I/O), the
decoder's wall time per frame as the worker sees it, the real-time factor and first audio; for the process also its own time per
frame (wall and CPU) and the hand-over per piece: the worker's vocoder thread's wall time in the
call less the child's decoding (the pipe both ways, the pickling, the wake-ups).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

MODES = ("alone", "thread", "process")
TEXT = "Hello there. How are you today?"


class Bench:
    def __init__(self, engine):
        self.engine = engine
        self.executor = engine.worker.executor
        self.process, self.local = engine.codec_process, engine.codec_process.vocalizer
        self.threads = self.executor.vocoder_threads
        self.ticks: list[tuple[float, float, float]] = []  # (wall, on a core, waiting for a core) seconds
        tick = engine.pipeline.tick

        def timed_tick(plan):
            t0, (c0, q0) = time.perf_counter(), schedstat()
            try:
                return tick(plan)
            finally:
                c1, q1 = schedstat()
                self.ticks.append((time.perf_counter() - t0, c1 - c0, q1 - q0))

        engine.pipeline.tick = timed_tick

    def use(self, mode: str) -> None:
        """Where the next request's pieces decode (no stream is open between requests)."""
        self.executor.vocoder_threads = 0 if mode == "alone" else self.threads
        self.executor.vocalizer = self.process if mode == "process" else self.local

    def request(self, i: int) -> dict:
        from engines.contract import SAMPLE_RATE, SynthesisRequest

        engine = self.engine
        done, first, samples = threading.Event(), [None], [0]

        def deliver(chunk):
            if chunk.pcm.size and first[0] is None:
                first[0] = time.perf_counter() - t0
            samples[0] += chunk.pcm.size
            if chunk.is_final:
                done.set()

        self.ticks.clear()
        decode0 = engine.stage_seconds()["decode"]
        p = self.process
        before = (p.call_seconds, p.child_seconds, p.child_cpu_seconds, p.calls)
        t0 = time.perf_counter()
        engine.submit(SynthesisRequest(id=f"r{i}", text=TEXT, voice=engine.capabilities.voices[0], seed=1,
                                       temperature=0.0), deliver)
        done.wait(600)
        wall = time.perf_counter() - t0
        ticks = self.ticks[1:]  # the first step prefills
        steps, cpu, queued = ([t[k] for t in ticks] for k in range(3))
        blocked = [w - c - q for w, c, q in ticks]
        call, child, child_cpu, calls = (a - b for a, b in zip((p.call_seconds, p.child_seconds, p.child_cpu_seconds,
                                                                p.calls), before))
        frames = samples[0] / 1920
        extra = dict(child_ms=1e3 * child / frames, child_cpu_ms=1e3 * child_cpu / frames,
                     handover_ms=1e3 * (call - child) / calls) if calls else {}
        return dict(**extra, tick_ms=1e3 * statistics.median(steps), tick_cpu_ms=1e3 * statistics.median(cpu),
                    tick_queued_ms=1e3 * statistics.mean(queued), tick_blocked_ms=1e3 * statistics.mean(blocked),
                    tick_mean_ms=1e3 * statistics.mean(steps),
                    codec_ms=1e3 * (engine.stage_seconds()["decode"] - decode0) / (samples[0] / 1920),
                    rtf=wall / (samples[0] / SAMPLE_RATE), first_ms=1e3 * first[0], load=os.getloadavg()[0])


def schedstat() -> tuple[float, float]:
    """The calling thread's seconds on a core and runnable waiting for one, since it started."""
    on_cpu, queued, _ = open("/proc/thread-self/schedstat").read().split()
    return int(on_cpu) / 1e9, int(queued) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a Qwen3-TTS directory (make_checkpoint.py --size 0.6b)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--quantize", default="auto")
    ap.add_argument("--codec-precision", default="auto")
    args = ap.parse_args()
    import torch
    from bench_talker import machine_line

    from service.server import build_engine_for
    from service.settings import Settings

    print(machine_line(torch.device("cpu")))
    engine = build_engine_for(Settings(checkpoint=args.model, device="cpu", quantize=args.quantize,
                                       codec_precision=args.codec_precision))
    engine._warmup = False  # warmed below, in every way
    engine.start()
    if engine.codec_process is None:
        print(f"no codec process here (threads: {engine.info.threads}): nothing to compare")
        return 1
    print(f"`{TEXT}` greedy, one request at a time; --quantize {engine.info.quantize}, codec {engine.info.codec_dtype}, "
          f"threads: {engine.info.threads}")
    bench, results = Bench(engine), {m: [] for m in MODES}
    try:
        for mode in MODES:  # warm: each way's first request pays its first-use costs
            bench.use(mode)
            bench.request(-1)
        for r in range(args.rounds):
            order = MODES[r % 3:] + MODES[:r % 3]
            for mode in order:
                bench.use(mode)
                row = bench.request(r)
                results[mode].append(row)
                print(f"round {r + 1} {mode:8s} load {row['load']:.2f}: talker step {row['tick_ms']:.1f} ms "
                      f"(CPU {row['tick_cpu_ms']:.1f}; mean {row['tick_mean_ms']:.1f} = waiting for a core "
                      f"{row['tick_queued_ms']:.1f} + blocked {row['tick_blocked_ms']:.1f} + on a core), codec {row['codec_ms']:.1f} ms/frame, RTF {row['rtf']:.2f}, "
                      f"first audio {row['first_ms']:.0f} ms" + (f"; in the process {row['child_ms']:.1f} ms/frame "
                      f"(CPU {row['child_cpu_ms']:.1f}), hand-over {row['handover_ms']:.2f} ms/piece"
                      if "child_ms" in row else ""), flush=True)
    finally:
        engine.stop()
    print("\n| codec decoder | talker step ms (min / median) | on a core | waiting for a core | blocked (GIL) "
          "| codec ms per frame | RTF | first audio ms |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, rows in results.items():
        med = lambda k: statistics.median(x[k] for x in rows)  # noqa: E731
        print(f"| {mode} | {min(x['tick_ms'] for x in rows):.1f} / {med('tick_ms'):.1f} | {med('tick_cpu_ms'):.1f} | "
              f"{med('tick_queued_ms'):.1f} | {med('tick_blocked_ms'):.1f} | {med('codec_ms'):.1f} | {med('rtf'):.2f} | "
              f"{med('first_ms'):.0f} |")
    print("(per step, medians over rounds of each request's median step (wall, on a core) and mean wait)")
    for mode in ("thread", "process"):
        ratios = sorted(b["tick_ms"] / a["tick_ms"] for a, b in zip(results["alone"], results[mode]))
        print(f"talker step beside the decoder's {mode} / alone, per round (min .. median .. max): "
              f"{ratios[0]:.2f} .. {statistics.median(ratios):.2f} .. {ratios[-1]:.2f}")
    proc = results["process"]
    print(f"the process's own time per frame: wall {statistics.median(x['child_ms'] for x in proc):.1f} ms, "
          f"CPU {statistics.median(x['child_cpu_ms'] for x in proc):.1f} ms; hand-over per piece (the vocoder "
          f"thread's wall less the child's): {statistics.median(x['handover_ms'] for x in proc):.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
