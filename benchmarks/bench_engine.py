"""The engine in-process (no HTTP): N concurrent requests, per-level time to first audio,
underruns, throughput, and where the worker thread's time goes (plan / admit / tick /
vocalize). Separates engine limits from service limits when bench_e2e.py disappoints.

    python3 benchmarks/bench_engine.py --preset base --device cuda --levels 1,8,64,128 --max-slots 128
    STREAMVOX_STAGE_SYNC=1 ...   # charge asynchronous GPU work to the stage that issued it

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

from engines.contract import SAMPLE_RATE, AudioChunk, SynthesisRequest  # noqa: E402
from engines.engine import DTYPES, build_engine  # noqa: E402


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


def run_level(engine, clients: int, round_id: int) -> dict:
    stages0 = dict(engine.worker.stage_seconds)
    ticks0 = engine.worker.ticks
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
            "stages": stages}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPES))
    ap.add_argument("--levels", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=3, help="runs per level (TTFA percentiles over all of them)")
    ap.add_argument("--max-slots", type=int, default=None)
    args = ap.parse_args()
    engine = build_engine(preset=args.preset, device=args.device, max_queue=4096, max_slots=args.max_slots,
                          dtype=DTYPES.get(args.dtype))
    t0 = time.perf_counter()
    engine.start()
    import torch

    dev = engine.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU x{torch.get_num_threads()} threads"
    print(f"streamvox bench_engine: preset {args.preset}, device {dev} ({name}), dtype {engine.dtype}, "
          f"slots {engine.info.extra.get('max_slots')}, start (capture + warm-up) {time.perf_counter() - t0:.1f}s")
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
    finally:
        engine.stop()
    print("TTFA = submit -> first PCM delivered by the engine (no HTTP); ms/tick = worker stage time / ticks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
