"""The fused kernels beside the graphed step they replace: the talker's whole decode step per rows
bucket, variants taking turns in rotating rounds, next to the memory and compute floor.

    python3 benchmarks/bench_fused.py --size 0.6b --rows 1 8 64 256 --rounds 3            # on a GPU
    TRITON_INTERPRET=1 .venv/bin/python benchmarks/bench_fused.py --size tiny --device cpu \\
        --dtype float32 --rows 1 --kv-blocks 1 --rounds 1 --repeats 1                       # CPU dry run

One TalkerSource (random weights at the released sizes, benchmarks/bench_talker.py's SIZES), one
GraphedTalkerStep per variant (the whole step: code predictor, talker over the paged KV cache,
sampling; one CUDA graph per rows bucket, captured on first use):

  graphed           the default today: the generic code-predictor loop (layers compiled, as the
                    engine runs them), the talker's layers eager, the paged-attention kernel
  fused-persistent  the code predictor's frame as ONE launch (engines/models/fused_predictor.py)
  fused-phased      ... as one launch per dependent step
  fused-all         fused-persistent and the talker's fused decode layers (engines/models/fused_talker.py)

Each call is timed with the device synchronised around it (measure_costs.timed), rows x KV blocks
per variant, the variants' order rotating each round. floor = max(bytes read / copy bandwidth,
2 x rows x weights / GEMM FLOP/s): bytes read = the talker's weights + 15 x the predictor's step
+ the rows' KV history. Correctness is the CUDA tests' (tests/engines/models/test_fused_*.py),
run before this by ``scripts/gpu-verify.sh fused``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from bench_talker import SIZES, compile_backend, frame_weights, gemm_flops, read_bandwidth  # noqa: E402
from measure_costs import TalkerCosts  # noqa: E402

from engines.models.fused_predictor import FusedCodePredictor  # noqa: E402
from engines.models.fused_talker import FusedDecodeLayers  # noqa: E402
from engines.pipelines.talker.source import TalkerSource  # noqa: E402
from engines.runtime.graphed_talker import GraphedTalkerStep  # noqa: E402
from testsupport.talker import make_bundle  # noqa: E402

VARIANTS = ("graphed", "fused-persistent", "fused-phased", "fused-all")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="0.6b", choices=sorted(SIZES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--kv-blocks", type=int, nargs="+", default=[1, 64], help="KV blocks each row holds (16 positions each)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5, help="timed calls per shape per round (median kept)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = p.parse_args()

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    bundle = make_bundle(seed=0, max_new_tokens=100_000, eos_gain=1.0, device=device, dtype=dtype, **SIZES[args.size])
    bundle.generation = dataclasses.replace(bundle.generation, min_new_tokens=10**9)  # EOS never ends a row
    top_rows, top_blocks = max(args.rows), max(args.kv_blocks)
    source = TalkerSource.from_bundle(bundle, max_slots=top_rows, max_seq_len=top_blocks * 16 + 16,
                                      kv_blocks=top_rows * top_blocks + 2, prefix_cache_fraction=0)
    weight_bytes, weight_elems = frame_weights(source.talker, source.predictor)
    cfg = source.talker.cfg
    kv_block_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 16 * dtype.itemsize

    # Every weight view is made before any capture (the fused kernels stack the predictor's weights
    # and fuse the talker's projections; a graph keeps the addresses it captured).
    plain = source.predictor
    fused_predictor = {mode: FusedCodePredictor(plain, mode=mode) for mode in ("persistent", "phased")}
    fused_layers = FusedDecodeLayers(source.talker)
    setups = {"graphed": (plain, None), "fused-persistent": (fused_predictor["persistent"], None),
              "fused-phased": (fused_predictor["phased"], None),
              "fused-all": (fused_predictor["persistent"], fused_layers)}
    backend = compile_backend("predictor") if device.type == "cuda" else None
    runners = {}

    def activate(name: str) -> TalkerCosts:
        """The variant's predictor and talker layers in place (a CPU step runs them at every call)."""
        source.predictor, source.talker.fused_decode_step = setups[name]
        if name not in runners:
            runners[name] = GraphedTalkerStep(source.step_spec(), compile_backend=backend if name == "graphed" else None)
        costs = TalkerCosts(source)
        costs.runner = runners[name]
        return costs

    shapes = [(r, b) for r in args.rows for b in args.kv_blocks if b == min(args.kv_blocks) or r == top_rows]
    with torch.no_grad():
        for name in args.variants:  # captures (and compiles) first, outside the timed rounds
            costs = activate(name)
            for rows, blocks in shapes:
                costs.decode_step(rows, blocks, repeats=1)
        bandwidth = read_bandwidth(device)
        flops = gemm_flops(device, dtype)
        samples: dict[tuple, list[float]] = {}
        for r in range(args.rounds):
            order = args.variants[r % len(args.variants):] + args.variants[:r % len(args.variants)]
            for name in order:
                costs = activate(name)
                for rows, blocks in shapes:
                    samples.setdefault((name, rows, blocks), []).append(costs.decode_step(rows, blocks, args.repeats))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU x{torch.get_num_threads()}"
    print(f"\nbench_fused: {where}, torch {torch.__version__}, size {args.size} {args.dtype}, rounds {args.rounds} x "
          f"{args.repeats} calls; bandwidth {bandwidth / 1e9:.0f} GB/s, GEMM {flops / 1e12:.1f} TFLOP/s; weights "
          f"{weight_bytes / 1e9:.2f} GB per frame (talker + 15 predictor passes); captures "
          + ", ".join(f"{n} {runners[n].captures}" for n in args.variants))
    print("| variant | rows | KV blocks | step ms min | step ms median | ms per frame | floor ms | x floor |")
    print("|---|---|---|---|---|---|---|---|")
    best = {}
    for rows, blocks in shapes:
        floor = max((weight_bytes + rows * blocks * kv_block_bytes) / bandwidth, 2 * rows * weight_elems / flops) * 1e3
        for name in args.variants:
            s = samples[(name, rows, blocks)]
            best[(name, rows, blocks)] = min(s)
            print(f"| {name} | {rows} | {blocks} | {min(s):.3f} | {statistics.median(s):.3f} | {min(s) / rows:.4f} | "
                  f"{floor:.3f} | {min(s) / floor:.1f} |")
    if "graphed" in args.variants:
        for rows, blocks in shapes:
            ratios = ", ".join(f"{n} {best[('graphed', rows, blocks)] / best[(n, rows, blocks)]:.2f}x"
                               for n in args.variants if n != "graphed")
            print(f"graphed / fused at {rows} rows x {blocks} blocks: {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
