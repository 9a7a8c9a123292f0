"""The engine in-process (no HTTP): N concurrent requests, per-level time to first audio,
underruns, throughput, and where the worker thread's time goes (plan / admit / tick /
vocalize). Separates engine limits from service limits when bench_e2e.py disappoints.

    python3 benchmarks/bench_engine.py --preset base --device cuda --levels 1,8,64,128 --max-slots 128
    STREAMVOX_STAGE_SYNC=1 ...   # charge asynchronous GPU work to the stage that issued it
    python3 benchmarks/bench_engine.py --checkpoint DIR ...   # the talker path (random: make_checkpoint.py)
    ... --profile 64 --trace-dir OUT   # torch.profiler over a steady-state second at 64 streams
    python3 benchmarks/bench_engine.py --virtual-device benchmarks/costs/h200-0.6b.json --levels 64 --max-slots 256
        # on this CPU, the talker's and codec decoder's device work as waits of a GPU's measured costs
        # (engines/virtual/; the prompts of benchmarks/costs/prompt-0.6b unless --checkpoint names others)

The profile keeps N requests in flight (a finished one is replaced at once), skips the
first second, records the next one, and prints the GPU's busy share (union of kernel
time / wall), the top 10 kernels and the largest gaps between kernels (host-side stalls:
time in which the GPU had nothing queued).

Underrun model as in loadgen.py: playback starts at the first chunk; a chunk arriving
more than 100 ms after its first sample is due counts as an underrun.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from loadgen import TEXTS, Playback, percentile  # noqa: E402

from engines.build import build_engine  # noqa: E402
from engines.config import EngineConfig, VirtualDeviceConfig  # noqa: E402
from engines.hardware.devices import DTYPES  # noqa: E402
from engines.contract import SAMPLE_RATE, AudioChunk, SynthesisRequest  # noqa: E402
from service.settings import runtime_switches  # noqa: E402


class Track:
    """Delivery times of one request (called on the worker thread)."""

    def __init__(self) -> None:
        self.submitted = time.monotonic()
        self.playback = Playback(SAMPLE_RATE)
        self.error: str | None = None
        self.done = threading.Event()

    def deliver(self, chunk: AudioChunk) -> None:
        if chunk.pcm.size:
            self.playback.arrived(time.monotonic(), chunk.pcm.size)
        if chunk.is_final:
            self.error = chunk.error
            self.done.set()


def virtual_stats(engine) -> dict[str, float]:
    """The virtual device's counters (captures after start, device busy seconds); {} on a real device."""
    return engine.virtual.stats() if engine.virtual is not None else {}


def run_level(engine, clients: int, round_id: int) -> dict:
    stages0 = dict(engine.worker.stage_seconds)
    ticks0 = engine.worker.ticks
    virtual0 = virtual_stats(engine)
    tracks = [Track() for _ in range(clients)]
    t0 = time.monotonic()
    for i, tr in enumerate(tracks):
        tr.submitted = time.monotonic()
        engine.submit(SynthesisRequest(id=f"l{clients}-{round_id}-{i}", text=TEXTS[i % len(TEXTS)], seed=i),
                      tr.deliver)
    for tr in tracks:
        tr.done.wait(600)
    wall = time.monotonic() - t0
    ok = [t for t in tracks if t.error is None and t.playback.first is not None]
    stages = {k: v - stages0.get(k, 0.0) for k, v in engine.worker.stage_seconds.items()}
    return {"clients": clients, "errors": clients - len(ok), "wall": wall,
            "ttfa": [t.playback.first - t.submitted for t in ok],
            "underrun": sum(1 for t in ok if t.playback.underruns),
            "audio_s": sum(t.playback.samples for t in ok) / SAMPLE_RATE, "ticks": engine.worker.ticks - ticks0,
            "stages": stages, "virtual": {k: v - virtual0[k] for k, v in virtual_stats(engine).items()}}


def profile_level(engine, clients: int, trace_dir: str | None, warm_s: float = 1.0, window_s: float = 1.0) -> None:
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    finished = threading.Semaphore(0)
    serial = 0

    def submit() -> None:
        nonlocal serial
        serial += 1

        def deliver(chunk: AudioChunk) -> None:
            if chunk.is_final:
                finished.release()
        engine.submit(SynthesisRequest(id=f"p{serial}", text=TEXTS[serial % len(TEXTS)], seed=serial), deliver)

    def keep_full(until: float) -> None:
        while time.monotonic() < until:
            if finished.acquire(timeout=0.01):
                submit()

    for _ in range(clients):
        submit()
    keep_full(time.monotonic() + warm_s)
    cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.monotonic()
        keep_full(t0 + window_s)
        if cuda:
            torch.cuda.synchronize(engine.device)
        wall_us = (time.monotonic() - t0) * 1e6
    for _ in range(clients):  # the requests still in flight finish before anything else runs
        finished.acquire(timeout=120)
    print(f"\nprofile: {clients} requests kept in flight, {window_s:.1f} s window after {warm_s:.1f} s")
    if trace_dir:
        path = Path(trace_dir) / f"trace_{clients}.json"
        prof.export_chrome_trace(str(path))
        print(f"chrome trace: {path}")
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    rows = [a for a in prof.key_averages() if getattr(a, key, 0) > 0
            and (not cuda or a.device_type == DeviceType.CUDA)]
    rows.sort(key=lambda a: getattr(a, key), reverse=True)
    total = sum(getattr(a, key) for a in rows) or 1.0
    print(f"top kernels by {'GPU' if cuda else 'CPU'} time ({total / 1e3:.1f} ms in all):")
    for a in rows[:10]:
        print(f"  {getattr(a, key) / 1e3:8.2f} ms {100 * getattr(a, key) / total:5.1f}% x{a.count:<6} {a.key[:90]}")
    if not cuda:
        return
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not spans:
        print("no kernels recorded")
        return
    busy, gaps, (start, end) = 0.0, [], spans[0]
    for s, e in spans[1:]:
        if s > end:
            busy += end - start
            gaps.append((s - end, end))
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    first = spans[0][0]
    gaps.sort(reverse=True)
    print(f"GPU busy {busy / 1e3:.1f} ms of {wall_us / 1e3:.1f} ms wall ({100 * busy / wall_us:.0f}%); "
          f"{len(gaps)} idle gaps, {sum(g for g, _ in gaps) / 1e3:.1f} ms in all; gaps > 50 us: "
          f"{sum(1 for g, _ in gaps if g > 50)} ({sum(g for g, _ in gaps if g > 50) / 1e3:.1f} ms)")
    print("largest idle gaps (ms at ms into the window): " + ", ".join(
        f"{g / 1e3:.2f}@{(at - first) / 1e3:.0f}" for g, at in gaps[:10]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPES))
    ap.add_argument("--levels", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=3, help="runs per level (TTFA percentiles over all of them)")
    ap.add_argument("--max-slots", type=int, default=None)
    ap.add_argument("--checkpoint", help="Qwen3-TTS directory: its talker is the source (see make_checkpoint.py)")
    ap.add_argument("--profile", type=int, default=0, metavar="CLIENTS",
                    help="after the levels, profile a steady-state second at this many concurrent requests")
    ap.add_argument("--trace-dir", help="write the profile's chrome trace here")
    ap.add_argument("--virtual-device", metavar="COSTS_JSON",
                    help="a GPU cost table (benchmarks/costs/*.json): the talker on a virtual device on this CPU")
    ap.add_argument("--virtual-eos-frames", type=int, help="with --virtual-device: utterances end after this many frames")
    args = ap.parse_args()
    if args.virtual_device and not args.checkpoint:
        args.checkpoint = str(Path(__file__).resolve().parent / "costs" / "prompt-0.6b")
    virtual = VirtualDeviceConfig(args.virtual_device, args.virtual_eos_frames) if args.virtual_device else None
    engine = build_engine(EngineConfig().updated(
        preset=args.preset, device=args.device, max_queue=4096, max_slots=args.max_slots, dtype=args.dtype or "auto",
        checkpoint=args.checkpoint, switches=runtime_switches(),  # STREAMVOX_STAGE_SYNC=1 ... (service/settings.py)
        virtual=virtual))
    t0 = time.perf_counter()
    engine.start()
    import torch

    dev = engine.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU x{torch.get_num_threads()} threads"
    if engine.virtual is not None:
        name = f"{engine.info.device}, on CPU x{torch.get_num_threads()} threads"
    print(f"streamvox bench_engine: source {engine.pipeline.name}, preset {args.preset}, device {dev} ({name}), dtype {engine.dtype}, "
          f"slots {engine.info.max_slots}, start (capture + warm-up) {time.perf_counter() - t0:.1f}s")
    print(f"{'clients':>7} {'errors':>6} {'TTFA p50':>9} {'TTFA p95':>9} {'underrun':>8} {'audio s/s':>9} "
          f"{'ms/tick':>8} | stage share of worker wall time: plan admit tick vocalize deliver")
    try:
        for clients in [int(x) for x in args.levels.split(",")]:
            results = [run_level(engine, clients, r) for r in range(args.rounds)]
            ttfa = [x for r in results for x in r["ttfa"]]
            wall = sum(r["wall"] for r in results)
            ticks = sum(r["ticks"] for r in results)
            stages = {k: sum(r["stages"].get(k, 0.0) for r in results) for k in ("plan", "admit", "tick", "vocalize", "deliver")}
            total = sum(stages.values()) or 1.0
            share = " ".join(f"{k} {100 * v / total:4.1f}%" for k, v in stages.items())
            print(f"{clients:>7} {sum(r['errors'] for r in results):>6} {1000 * percentile(ttfa, 0.5):>9.1f} "
                  f"{1000 * percentile(ttfa, 0.95):>9.1f} {sum(r['underrun'] for r in results):>8} "
                  f"{sum(r['audio_s'] for r in results) / wall:>9.1f} {1000 * total / max(ticks, 1):>8.2f} | {share}")
            if engine.virtual is not None:
                v = {k: sum(r["virtual"].get(k, 0.0) for r in results) for k in results[0]["virtual"]}
                print(f"{'':>7} virtual device: busy {100 * v['busy_s'] / wall:.0f}% of the wall, the host waited on it "
                      f"{100 * v['host_waited_s'] / wall:.0f}%; captures after start: talker step "
                      f"{v.get('talker_step_captures_after_start', 0):.0f}, codec decoder "
                      f"{v.get('codec_decoder_captures_after_start', 0):.0f}")
        if args.profile:
            profile_level(engine, args.profile, args.trace_dir)
    finally:
        engine.stop()
    print("TTFA = submit -> first PCM delivered by the engine (no HTTP); ms/tick = worker stage time / ticks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
