"""The device cost table the virtual device replays: what each call the served engine makes costs.

    python3 benchmarks/measure_costs.py --checkpoint /tmp/ckpt-0.6b --device cuda --out benchmarks/costs/h200-0.6b.json
    .venv/bin/python benchmarks/measure_costs.py --checkpoint /tmp/ckpt-tiny --device cpu --out /tmp/costs.json \
        --rows 1 2 --kv-blocks 1 2 --prompts 1 2 --widths 8 16 --decoder-rows 1 2 --frames 1 4 --repeats 2

The engine is built as `streamvox serve` builds it (build_engine: CUDA graphs, compiled layers where
the environment says so) and its graphs are captured as at start (timed: ``start_s`` and the mean
capture of one bucket). Then, each timed as one call with the device synchronised around it
(median of ``--repeats``, after one untimed call), in the shapes the cost table lists
(schema: the module docstring of the virtual device's cost model, and notes/COSTS in the issue):

* ``decode_step``: the talker's whole decode step (the step runner the pipeline uses) over
  ``rows`` rows that each hold ``kv_blocks`` KV blocks of history;
* ``prefill``: one chunked prefill call, ``prompts`` prompts of ``width`` positions in one padded
  talker forward plus their code-0 sampling, as ``Prefill.run`` makes it (through the graphed
  (prompts, width) buckets where the engine has them, eagerly past them);
* ``codec_decode``: one ``Vocalizer.vocalize`` call over ``rows`` streams of ``frames`` frames each;
* ``admit``: starting ``rows`` rows admitted together (``start_admitted``: their prompts' inputs and
  row state, the tick's first device work after a burst of arrivals).

Shapes the KV pool cannot hold are recorded as null. Prints a table and writes the JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engines.build import build_engine  # noqa: E402
from engines.config import EngineConfig, RuntimeSwitches  # noqa: E402
from engines.contract import SynthesisRequest  # noqa: E402
from engines.pipelines.vocoder import VocalizeItem  # noqa: E402
from service.settings import runtime_switches  # noqa: E402  (STREAMVOX_PAGED_ATTENTION=0: gpu-verify's fallback)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median milliseconds of ``fn()`` with the device idle before and synchronised after."""
    fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


class TalkerCosts:
    """Calls into a built talker engine's source and vocalizer, in the shapes the table lists."""

    def __init__(self, source, vocalizer=None):
        self.source = source  # a TalkerSource (an engine's: engine.pipeline.source)
        self.vocalizer = vocalizer
        self.device = self.source.device
        self.cache = self.source.cache
        self.runner = self.source.step_runner or self.source.runner.eager_step
        self.hidden = self.source.talker.cfg.hidden_size

    def _hold_blocks(self, rows: int, blocks: int) -> bool:
        """Rows 0..rows-1 each own ``blocks`` blocks (position = the last of them); False when the pool is short."""
        cache = self.cache
        for row in range(rows):
            cache.release(row)
        if rows * blocks > cache.free_blocks or blocks > cache.max_blocks_per_row:
            return False
        for row in range(rows):
            cache.reserve(row, blocks * cache.block_size)
        cache.flush()
        return True

    def decode_step(self, rows: int, blocks: int, repeats: int) -> float | None:
        if not self._hold_blocks(rows, blocks):
            return None
        state = self.source.state
        idx = torch.arange(rows, device=self.device)
        last = blocks * self.cache.block_size - 1

        def step():
            state.pos.index_fill_(0, idx, last)  # every call reads the same history
            state.ntok.index_fill_(0, idx, 4)
            self.runner(list(range(rows)), blocks, False, False)

        with torch.no_grad():
            return timed(step, self.device, repeats)

    def prefill(self, prompts: int, width: int, repeats: int) -> float | None:
        blocks = math.ceil(width / self.cache.block_size)
        if not self._hold_blocks(prompts, blocks):
            return None
        talker, dev = self.source.talker, self.device
        x = torch.randn(prompts, width, self.hidden, device=dev, dtype=self.source.dtype)
        positions = torch.arange(width, device=dev).expand(prompts, width).contiguous()
        rows = torch.arange(prompts, device=dev)

        runner = self.source.prefill.runner  # the graphed buckets, as served (every prompt starts at 0)

        def call():
            slots = self.cache.slots(rows, positions)
            last = torch.full((prompts,), width - 1, device=dev)
            h = runner(x, positions, rows, last, slots) if runner is not None else None
            if h is None:  # no bucket holds this call: it runs eagerly when served too
                h = talker.forward_paged(x, positions, self.cache, rows, blocks, self.source.rope, last=last,
                                         write_slots=slots)
            self.source.decoder.sample(h, rows, all_greedy=False, any_top_p=False)

        with torch.no_grad():
            return timed(call, dev, repeats)

    def admit(self, rows: int, repeats: int) -> float | None:
        """Median ms of starting ``rows`` rows admitted together (each repeat admits fresh ones)."""
        source = self.source
        if rows > source.free_rows():
            return None
        voice = (source.voices() or [None])[0]
        samples = []
        for k in range(repeats + 1):  # the first round is untimed, like timed()'s
            ids = [f"cost-admit-{k}-{i}" for i in range(rows)]
            for rid in ids:
                source.admit(SynthesisRequest(id=rid, text="Hello there, this is a sentence of an ordinary request.",
                                              voice=voice), max_new_tokens=8)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            source.start_admitted()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            if k:
                samples.append((time.perf_counter() - t0) * 1e3)
            for rid in ids:
                source.cancel(rid)
        return statistics.median(samples)

    def codec_decode(self, rows: int, frames: int, repeats: int) -> float:
        groups = self.source.num_code_groups
        codes = torch.randint(0, 2048 if groups == 16 else 32, (frames, groups), device=self.device)
        offset = [0]

        def call():
            items = [VocalizeItem(f"cost-{r}", codes, offset[0]) for r in range(rows)]
            self.vocalizer.vocalize(items)
            offset[0] += frames

        with torch.no_grad():
            ms = timed(call, self.device, repeats)
        for r in range(rows):
            self.vocalizer.close(f"cost-{r}")
        return ms


def captured_keys(wrapper) -> int:
    return len(wrapper.captured) if wrapper is not None else 0


def grid(fn, outer: list[int], inner: list[int], label: str) -> list[list[float | None]]:
    out = []
    for a in outer:
        row = [fn(a, b) for b in inner]
        out.append(row)
        print(f"  {label} {a:>4}: " + " ".join("   -  " if v is None else f"{v:6.2f}" for v in row), flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="a Qwen3-TTS directory in the official layout")
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", default="0.6b", help="the checkpoint's size, recorded in the table")
    p.add_argument("--slots", type=int, default=256, help="talker slots (the largest rows bucket)")
    p.add_argument("--kv-cache-gb", type=float, default=None)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    p.add_argument("--kv-blocks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--prompts", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--widths", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512])
    p.add_argument("--decoder-rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--frames", type=int, nargs="+", default=[1, 2, 4, 8, 12, 15, 25])
    p.add_argument("--admit-rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--fused-predictor", default="off", choices=("off", "phased", "persistent"),
                   help="the code predictor's frame as fused Triton kernels (CUDA; RuntimeSwitches.fused_predictor)")
    p.add_argument("--fused-talker", action="store_true", help="the talker's decode layers fused (CUDA)")
    p.add_argument("--out", required=True, help="the JSON cost table to write")
    args = p.parse_args()

    device = torch.device(args.device)
    t0 = time.perf_counter()
    engine = build_engine(EngineConfig().updated(
        device=args.device, checkpoint=args.checkpoint, max_slots=args.slots, kv_cache_gb=args.kv_cache_gb,
        warmup=False,
        switches=RuntimeSwitches(static_step_on_cpu=device.type == "cpu",
                                                   fused_predictor=args.fused_predictor, fused_talker=args.fused_talker,
                                                   paged_attention=runtime_switches().paged_attention)))
    built = time.perf_counter() - t0
    costs = TalkerCosts(engine.pipeline.source, engine.vocalizer)
    step_runner = costs.source.step_runner
    decoder = costs.vocalizer.graphed_decoder
    with torch.no_grad():
        t = time.perf_counter()
        engine.pipeline.capture_graphs()
        talker_capture = time.perf_counter() - t
        t = time.perf_counter()
        engine.vocalizer.capture_graphs()
        decoder_capture = time.perf_counter() - t
    start_s = talker_capture + decoder_capture
    n_talker, n_decoder = captured_keys(step_runner), captured_keys(decoder)
    n_prefill = captured_keys(costs.source.prefill.runner)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU x{torch.get_num_threads()} threads"
    print(f"measure_costs: {name}, torch {torch.__version__}, checkpoint {args.checkpoint} ({args.size}), "
          f"built in {built:.1f} s, graphs captured in {start_s:.1f} s ({n_talker} talker step, {n_prefill} prefill, {n_decoder} decoder); "
          f"talker step reads the KV pool in place: {not getattr(getattr(step_runner, 'spec', None), 'bucket_blocks', True)}")
    slots = args.slots
    rows = [r for r in args.rows if r <= slots]
    print(f"decode_step ms (rows x kv_blocks {args.kv_blocks}):")
    decode = grid(lambda r, b: costs.decode_step(r, b, args.repeats), rows, args.kv_blocks, "rows")
    prompts = [n for n in args.prompts if n <= slots]
    print(f"prefill ms (prompts x width {args.widths}):")
    prefill = grid(lambda n, w: costs.prefill(n, w, args.repeats), prompts, args.widths, "prompts")
    for row in range(slots):
        costs.cache.release(row)
    admit_rows = [n for n in args.admit_rows if n <= slots]
    with torch.no_grad():
        admit = [costs.admit(n, args.repeats) for n in admit_rows]
    print("admit ms (rows started together): " + " ".join(f"{n}: {ms:.2f}" for n, ms in zip(admit_rows, admit)))
    print(f"codec_decode ms (rows x frames {args.frames}):")
    codec = grid(lambda r, f: costs.codec_decode(r, f, args.repeats), args.decoder_rows, args.frames, "rows")
    prefill_runner = costs.source.prefill.runner
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    table = {
        "schema": 1, "device": name, "torch": torch.__version__,
        "date": datetime.date.today().isoformat(), "commit": commit, "size": args.size,
        "dtype": str(engine.info.dtype), "command": "python3 benchmarks/measure_costs.py " + " ".join(sys.argv[1:]),
        "decode_step": {"rows": rows, "kv_blocks": args.kv_blocks, "ms": decode},
        "prefill": {"prompts": prompts, "width": args.widths, "ms": prefill},
        "codec_decode": {"rows": args.decoder_rows, "frames": args.frames, "ms": codec},
        "capture_ms": {"decode_step": 1e3 * talker_capture / max(1, n_talker),
                       "codec_decode": 1e3 * decoder_capture / max(1, n_decoder)},
        "admit": {"rows": admit_rows, "ms": admit},
        "start_s": start_s,
        "kv_in_place": not getattr(getattr(step_runner, "spec", None), "bucket_blocks", True),
        # the prefill calls that replayed a graph (the rest ran eagerly, launch bound)
        "prefill_graph_positions": prefill_runner.spec.max_positions if prefill_runner is not None else 0,
        "notes": ("measured: each call timed with the device synchronised around it, median of "
                  f"{args.repeats}; capture_ms = the start's capture time / graphs captured "
                  f"({n_talker} talker-step keys, {n_decoder} decoder keys); fused kernels (CUDA only): "
                  f"predictor {args.fused_predictor if device.type == 'cuda' else 'off'}, "
                  f"talker {'on' if args.fused_talker and device.type == 'cuda' else 'off'}"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
