"""Stream tick loop throughput: ms/tick, finished chunks/s and audio x realtime at
several depths (active slots), fused CFG (one forward of 2n rows) vs two passes.

    .venv/bin/python benchmarks/bench_tick.py --preset small --device auto

Slots run in steady state like the worker drives them: staggered steps, and a
finished chunk is replaced at once by the next chunk of the same clause (same
encoder-state objects, the previous tail as context). Random weights; before
timing, fused and two-pass outputs are checked to agree. On CUDA a last column times the
fused variant with the DiT forward CUDA-graphed (engines/runtime/graphed_dit.py), after
checking that graphed and eager fused outputs agree; elsewhere it reads "n/a (no CUDA)".
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time

import torch

from engines.build import resolve_device as pick_device  # auto -> cuda if present
from engines.config import get_preset
from engines.contract import SAMPLE_RATE, SAMPLES_PER_FRAME
from engines.models.dit import FlowDiT
from engines.models.init import init_module_
from engines.models.sampling import keyed_normal
from engines.pipelines.dit.denoiser import ChunkJob, Denoiser
from engines.runtime.graphed_dit import GraphedDiT, default_enc_buckets

FRAMES_PER_SECOND = SAMPLE_RATE / SAMPLES_PER_FRAME  # 12.5


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Feeder:
    """Keeps ``depth`` slots busy: admits staggered jobs, replaces finished ones."""

    def __init__(self, sched: Denoiser, depth: int, frames: int, context: int, steps: int,
                 scale: float, text_len: int, device: torch.device, dtype: torch.dtype):
        cfg = sched.dit.cfg
        self.sched, self.frames, self.context, self.steps, self.scale = sched, frames, context, steps, scale
        null = keyed_normal(0, 900, torch.arange(1, device=device), cfg.cond_dim).to(dtype)[0]
        self.clauses = []
        for i in range(depth):
            length = text_len + 5 * (i % 4)  # ragged text lengths: padding is exercised
            enc = keyed_normal(i, 901, torch.arange(length, device=device), cfg.cond_dim).to(dtype)
            self.clauses.append((enc, null.expand(length, -1)))
        self.next_chunk = [0] * depth
        self.tails = [torch.zeros(0, cfg.latent_dim, device=device)] * depth
        self.pending = list(range(depth))  # clause indices waiting for a slot

    def admit_one(self) -> None:
        i = self.pending.pop(0)
        enc, null = self.clauses[i]
        n = self.next_chunk[i]
        self.sched.admit(ChunkJob(key=(f"c{i}", n), enc=enc, enc_null=null, context=self.tails[i],
                                  frame_start=n * self.frames, num_frames=self.frames, seed=i,
                                  steps=self.steps, guidance_scale=self.scale))
        self.next_chunk[i] += 1

    def tick(self) -> list:
        finished = self.sched.tick()
        for f in finished:
            i = int(f.key[0][1:])
            self.tails[i] = f.latents[-self.context:] if self.context else f.latents[:0]
            self.pending.append(i)
        return finished

    def warm_up(self) -> None:
        # One admission per tick until all slots are busy (staggered steps), then a
        # full schedule of steady state.
        for _ in range(len(self.clauses)):
            self.admit_one()
            self.tick()
        for _ in range(self.steps):
            while self.pending:
                self.admit_one()
            self.tick()
        while self.pending:
            self.admit_one()


FUSION_PAYS = 1.1  # two-pass / fused below this: within noise of no gain


def make_scheduler(dit, base_cfg, depth: int, fused: bool, device, dtype) -> Denoiser:
    ceiling = 2 * depth if fused else depth
    cfg = dataclasses.replace(base_cfg, max_slots=depth, batch_ceiling=ceiling, guidance="cfg",
                              guidance_timing="full", memo_size=max(8, base_cfg.memo_size))
    return Denoiser(dit, cfg, device, dtype)


def check_fused_equals_two_pass(dit, stream_cfg, args, device, dtype, other=None) -> float:
    """Max abs diff of fused vs two-pass outputs; with ``other`` (a wrapped DiT), fused
    ``dit`` vs fused ``other`` instead."""
    outs = []
    for fused, model in ((True, dit), (True, other)) if other is not None else ((True, dit), (False, dit)):
        feeder = Feeder(make_scheduler(model, stream_cfg, 4, fused, device, dtype), 4, args.frames, args.context,
                        args.steps, args.guidance_scale, args.text_len, device, dtype)
        while feeder.pending:
            feeder.admit_one()
        got = {}
        while feeder.sched.active_slots:
            got.update({f.key: f.latents for f in feeder.sched.tick()})
        outs.append(got)
    err = max((outs[0][k] - outs[1][k]).abs().max().item() for k in outs[0])
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    if err > tol:
        what = "graphed and eager fused CFG" if other is not None else "fused and two-pass CFG"
        raise SystemExit(f"{what} disagree: max abs diff {err:.2e} > {tol:.0e}")
    return err


def make_graphed(dit, args, max_depth: int, device) -> GraphedDiT | None:
    """The DiT behind CUDA graphs sized for this benchmark (rows up to 2 x the deepest depth,
    frames = context + chunk, encoder buckets up to the longest clause); None off CUDA."""
    if device.type != "cuda":
        return None
    # The engine's CUDA configuration: compiled blocks (own copy of the weights, so the eager
    # columns stay eager) replayed from CUDA graphs.
    graphed = GraphedDiT(copy.deepcopy(dit), max_rows=2 * max(max_depth, 4), frames=args.context + args.frames,
                         enc_buckets=default_enc_buckets(args.text_len + 15),  # Feeder: text_len + 5 (i % 4)
                         compile_backend=None if args.no_compile else "inductor")
    graphed.capture_all()
    return graphed


def measure(dit, stream_cfg, args, depth: int, fused: bool, device, dtype, cfg_off: bool = False) -> dict:
    """``cfg_off``: guidance scale 1 (no negative rows): what guidance costs at all."""
    sched = make_scheduler(dit, stream_cfg, depth, fused, device, dtype)
    feeder = Feeder(sched, depth, args.frames, args.context, args.steps, 1.0 if cfg_off else args.guidance_scale,
                    args.text_len, device, dtype)
    feeder.warm_up()
    sync(device)
    forwards0 = sched.forward_count
    chunks = frames = 0
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(args.ticks):
        finished = feeder.tick()
        chunks += len(finished)
        frames += sum(f.latents.shape[0] for f in finished)
        while feeder.pending:  # admission is part of the steady state
            feeder.admit_one()
    sync(device)
    seconds = time.perf_counter() - t0
    cpu_seconds = time.process_time() - c0
    return dict(ms_tick=1000 * seconds / args.ticks, cpu_ms_tick=1000 * cpu_seconds / args.ticks, chunks_s=chunks / seconds, frames_s=frames / seconds,
                rows=sched.last_batch_rows, forwards=(sched.forward_count - forwards0) / args.ticks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--depths", default="1,4,8,16")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--ticks", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3, help="runs per variant (median reported)")
    ap.add_argument("--frames", type=int, default=None, help="frames per chunk (default: preset chunk_frames)")
    ap.add_argument("--guidance-scale", type=float, default=2.0)
    ap.add_argument("--text-len", type=int, default=60, help="tokens per clause")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0 = torch default)")
    ap.add_argument("--no-compile", action="store_true", help="graphed column without torch.compile'd blocks")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    cfg = get_preset(args.preset)
    device = pick_device(args.device)
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
             "float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    args.frames = args.frames or cfg.stream.chunk_frames
    args.context = cfg.dit.context_frames
    dit = init_module_(FlowDiT(cfg.dit), 0).to(device=device, dtype=dtype).eval()

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"device: {name} | torch {torch.__version__} | dtype {str(dtype).replace('torch.', '')}")
    print(f"preset {args.preset}: DiT {cfg.dit.num_hidden_layers}x{cfg.dit.hidden_size}, latent {cfg.dit.latent_dim}; "
          f"chunk {args.frames} frames + {args.context} context, {args.steps} steps, CFG scale {args.guidance_scale}")
    err = check_fused_equals_two_pass(dit, cfg.stream, args, device, dtype)
    print(f"check: fused == two-pass (max abs diff {err:.1e})")
    depths = [int(d) for d in args.depths.split(",")]
    graphed = make_graphed(dit, args, max(depths), device)
    if graphed is not None:
        gerr = check_fused_equals_two_pass(dit, cfg.stream, args, device, dtype, other=graphed)
        print(f"check: graphed fused == eager fused (max abs diff {gerr:.1e}); "
              f"{len(graphed.captured)} graphs, rows {graphed.row_buckets}, enc {graphed.enc_buckets}")

    header = (f"{'depth':>5} | {'rows':>4} | {'CFG off ms/tick':>15} | {'fused ms/tick':>13} | {'2-pass ms/tick':>14} | {'2-pass/fused':>12} | "
              f"{'CPU-time ratio':>14} | {'chunks/s':>8} | {'frames/s':>8} | {'x realtime':>10} | "
              f"{'graphed ms/tick':>15} | {'fused/graphed':>13}")
    print(header)
    print("-" * len(header))
    fusion_gain: dict[int, float] = {}
    for depth in depths:
        # Alternate the variants and keep each one's median run: a shared machine is noisy.
        runs = {True: [], False: [], "graphed": [], "off": []}
        for _ in range(args.repeats):
            for variant in (True, False):
                runs[variant].append(measure(dit, cfg.stream, args, depth, variant, device, dtype))
            runs["off"].append(measure(dit, cfg.stream, args, depth, True, device, dtype, cfg_off=True))
            if graphed is not None:
                runs["graphed"].append(measure(graphed, cfg.stream, args, depth, True, device, dtype))
        fused, split, off = (sorted(runs[v], key=lambda r: r["ms_tick"])[len(runs[v]) // 2] for v in (True, False, "off"))
        assert fused["forwards"] == 1.0 and split["forwards"] == 2.0, (fused, split)
        if graphed is not None:
            g = sorted(runs["graphed"], key=lambda r: r["ms_tick"])[len(runs["graphed"]) // 2]
            assert g["forwards"] == 1.0 and graphed.fallback_calls == 0, (g, graphed.fallback_calls)
            graphed_cols = f"{g['ms_tick']:>15.2f} | {fused['ms_tick'] / g['ms_tick']:>13.2f}"
        else:
            graphed_cols = f"{'n/a (no CUDA)':>15} | {'n/a':>13}"
        fusion_gain[depth] = split["ms_tick"] / fused["ms_tick"]
        print(f"{depth:>5} | {fused['rows']:>4} | {off['ms_tick']:>15.2f} | {fused['ms_tick']:>13.2f} | {split['ms_tick']:>14.2f} | "
              f"{split['ms_tick'] / fused['ms_tick']:>12.2f} | {split['cpu_ms_tick'] / fused['cpu_ms_tick']:>14.2f} | "
              f"{fused['chunks_s']:>8.2f} | "
              f"{fused['frames_s']:>8.1f} | {fused['frames_s'] / FRAMES_PER_SECOND:>10.2f} | {graphed_cols}")
    unpaid = [d for d, gain in fusion_gain.items() if gain < FUSION_PAYS]
    print(f"fused CFG stops paying (two-pass/fused < {FUSION_PAYS}) at depth {unpaid[0]}" if unpaid else
          f"fused CFG pays at every measured depth (two-pass/fused >= {FUSION_PAYS} up to depth {max(fusion_gain)})")
    print("x realtime = finished frames/s / 12.5 (fused); depth = active slots, rows = DiT batch rows (2n under CFG);")
    print("CPU-time ratio = 2-pass / fused process CPU time per tick (robust to other load on a shared CPU)")
    print("graphed = fused CFG with the DiT forward replayed from CUDA graphs (CUDA only), blocks through "
          "torch.compile first unless --no-compile: the engine's CUDA path")


if __name__ == "__main__":
    main()
