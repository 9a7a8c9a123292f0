"""Code predictor: naive no-cache loop vs static-KV loop, ms per frame; plus codec decoder cost.

    python benchmarks/bench_code_predictor.py [--preset small] [--device auto] [--batches 1 8 64]

Random weights (timing does not depend on their values). Before timing, the two loops
must produce identical codes on the same inputs. On CUDA a third loop, "graphed"
(engines/runtime/graphed_predictor.py: the KV loop as one CUDA graph per batch bucket,
called through its static buffers, copies in and out included), is checked against the
KV loop's codes and timed; then the memory-bandwidth floor per frame (weight bytes per
step / measured device copy bandwidth x steps, / batch) and each variant's ratio to it.
The last table is the streaming codec decoder: ms per 25-frame chunk (2 s of audio) and
its real-time factor.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import time
from pathlib import Path

import torch

from engines.build import resolve_device as pick_device  # auto -> cuda if present
from engines.config import PRESET_NAMES, get_preset
from engines.models.code_predictor import CodePredictor
from engines.models.codec_decoder import CodecDecoder
from engines.models.codec_head import CodecHead
from engines.models.init import init_module_
from engines.models.sampling import FrameSampling
from engines.runtime.graphed_predictor import DEFAULT_BUCKETS, GraphedCodePredictor


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device: torch.device, min_seconds: float, max_reps: int = 200) -> float:
    """Median ms per call after two warm-up calls; repeats until ``min_seconds`` or ``max_reps``."""
    fn(), fn()
    sync(device)
    samples, start = [], time.perf_counter()
    while len(samples) < 3 or (time.perf_counter() - start < min_seconds and len(samples) < max_reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    return samples[len(samples) // 2]


REPO = Path(__file__).resolve().parents[1]


def weight_bytes_per_step(predictor: CodePredictor) -> int:
    """Weight bytes one predictor step must read: every layer, the final norm, the input
    projection and ONE lm_head (each step uses its own head; embedding rows are negligible)."""
    def size(module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    body = size(predictor.model.layers) + size(predictor.model.norm) + size(predictor.small_to_mtp_projection)
    return body + size(predictor.lm_head[0])


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device memory bandwidth in bytes/s from a device-to-device copy of ``nbytes``
    (read + write counted: 2 * nbytes moved), median over ``reps``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        samples.append(time.perf_counter() - t0)
    samples.sort()
    del src, dst
    return 2 * nbytes / samples[len(samples) // 2]


def official_generate_ms(args, cfg, device) -> dict[int, float]:
    """ms/frame of the official generate() per batch, measured in the oracle venv; {} if absent."""
    python = Path(args.oracle_python)
    if not python.exists():
        print(f"(no oracle venv at {python}: official generate() row skipped; bash scripts/oracle-env.sh builds it)")
        return {}
    cmd = [str(python), str(REPO / "tests" / "oracle" / "bench_generate.py"),
           "--config", json.dumps(cfg.code_predictor.to_dict()), "--batches", *map(str, args.batches),
           "--device", str(device), "--dtype", args.dtype, "--min-seconds", str(args.min_seconds)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"(official generate() baseline failed: {done.stderr.strip().splitlines()[-1:]})")
        return {}
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {r["batch"]: r["ms_per_frame"] for r in rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", choices=PRESET_NAMES)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch default)")
    ap.add_argument("--min-seconds", type=float, default=1.0, help="time budget per measurement")
    ap.add_argument("--oracle-python", default=str(REPO / ".venv-oracle" / "bin" / "python"),
                    help="the qwen-tts oracle venv's python, for the official generate() baseline (skipped if absent)")
    args = ap.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = pick_device(args.device), getattr(torch, args.dtype)
    cfg = get_preset(args.preset)
    head = init_module_(CodecHead(cfg.codec_head), 0).to(device, dtype).eval()
    predictor = init_module_(CodePredictor(cfg.code_predictor), 1).to(device, dtype).eval()
    decoder = init_module_(CodecDecoder(cfg.decoder), 2).to(device, dtype).eval()

    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {device} ({dev_name}), dtype {args.dtype}, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, preset {args.preset} "
          f"(G={cfg.num_code_groups}, predictor {cfg.code_predictor.num_hidden_layers}x{cfg.code_predictor.hidden_size}, "
          f"decoder_dim {cfg.decoder.decoder_dim})")

    official = official_generate_ms(args, cfg, device)
    print("\ncode predictor, ms per frame (codes 1..G-1 of one frame; lower is better)")
    if official:
        print("official = qwen-tts generate() in .venv-oracle on the same sizes (random weights; that our loop "
              "computes what it computes is the parity suite's job: tests/engines/models/test_parity_code_predictor.py)")
    graphed = compiled = None
    if device.type == "cuda":
        # Buckets: the engine's, plus any requested batch size that is not one (each timed unpadded).
        graphed = GraphedCodePredictor(predictor, buckets=sorted(set(DEFAULT_BUCKETS) | set(args.batches)))
        print("graphed = the KV loop captured as one CUDA graph per batch bucket (static buffers, copy in/out "
              "included); checked equal to the KV loop's codes before timing")
        # The engine's configuration: the same graphs over torch.compile'd layers (own copy of the weights,
        # so the eager columns stay eager).
        compiled = GraphedCodePredictor(copy.deepcopy(predictor), buckets=graphed.buckets,
                                        compile_backend="inductor")
        print("compiled = graphed, with the layers through torch.compile (inductor) first: the engine's CUDA path")
    print(f"{'batch':>6} {'official ms/frame':>18} {'naive ms/frame':>15} {'kv ms/frame':>12} {'naive/kv':>9} "
          f"{'official/kv':>12} {'graphed ms/frame':>17} {'kv/graphed':>11} {'official/graphed':>17} "
          f"{'compiled ms/frame':>18} {'official/compiled':>18}")
    g = torch.Generator().manual_seed(0)
    per_frame: dict[int, dict[str, float]] = {}
    for b in args.batches:
        u = torch.randn(b, cfg.latent_dim, generator=g).to(device, dtype)
        u = u / u.float().pow(2).mean(-1, keepdim=True).sqrt().to(dtype)
        s = FrameSampling.for_stream(b, seed=1, frame_offset=0, device=device, greedy=True)
        with torch.no_grad():
            h = head.hidden(u)
            emb = head.embed(head.sample_code0(head.logits_from_hidden(h), s))
            kv, naive = predictor.predict(h, emb, s), predictor.naive_predict(h, emb, s)
        agree = (kv == naive).float().mean().item()
        if agree < 1.0 and dtype == torch.float32:
            raise SystemExit(f"batch {b}: KV loop and naive loop disagree on codes; not timing")
        if agree < 1.0:  # low precision: a cached and a recomputed sequence round differently
            print(f"  (batch {b}: {args.dtype} KV and naive loop codes agree on {agree:.1%}; fp32 must agree exactly)")
        t_naive = time_ms(lambda: predictor.naive_predict(h, emb, s), device, args.min_seconds)
        t_kv = time_ms(lambda: predictor.predict(h, emb, s), device, args.min_seconds)
        off = official.get(b)
        off_s = f"{off:>18.3f}" if off else f"{'n/a':>18}"
        ratio = f"{off / (t_kv / b):>12.2f}" if off else f"{'n/a':>12}"
        per_frame[b] = {"naive": t_naive / b, "kv": t_kv / b, **({"official": off} if off else {})}
        if graphed is not None:
            with torch.no_grad():
                graphed_codes = graphed.predict(h, emb, s)
            if not torch.equal(graphed_codes, kv):
                raise SystemExit(f"batch {b}: graphed loop and KV loop disagree on codes; not timing")
            t_graphed = time_ms(lambda: graphed.predict(h, emb, s), device, args.min_seconds)
            per_frame[b]["graphed"] = t_graphed / b
            graphed_s = (f"{t_graphed / b:>17.4f} {t_kv / t_graphed:>11.2f} "
                         + (f"{off / (t_graphed / b):>17.2f}" if off else f"{'n/a':>17}"))
            with torch.no_grad():
                agree = (compiled.predict(h, emb, s) == kv).float().mean().item()
            # fp32: fused kernels reorder sums, which may flip a near-tie now and then. bf16: one flipped
            # code changes every later one in the frame, so agreement is reported, not required.
            if dtype == torch.float32 and agree < 0.99:
                raise SystemExit(f"batch {b}: compiled graphs agree with the KV loop on only {agree:.1%} of codes")
            t_comp = time_ms(lambda: compiled.predict(h, emb, s), device, args.min_seconds)
            per_frame[b]["compiled"] = t_comp / b
            graphed_s += (f" {t_comp / b:>18.4f} " + (f"{off / (t_comp / b):>18.2f}" if off else f"{'n/a':>18}")
                          + (f"  (codes agree {agree:.1%})" if agree < 1 else ""))
        else:
            graphed_s = f"{'n/a (no CUDA)':>17} {'n/a':>11} {'n/a':>17} {'n/a':>18} {'n/a':>18}"
        print(f"{b:>6} {off_s} {t_naive / b:>15.3f} {t_kv / b:>12.3f} {t_naive / t_kv:>9.2f} {ratio} {graphed_s}")

    steps = cfg.num_code_groups - 1  # one prefill + G-2 decode steps, each reading all weights
    if device.type == "cuda":
        step_bytes = weight_bytes_per_step(predictor)
        bandwidth = copy_bandwidth(device)
        floor_ms = steps * step_bytes / bandwidth * 1e3  # per call, any batch that stays weight-bound
        print(f"\nmemory-bandwidth floor: {step_bytes / 1e6:.1f} MB of weights per step x {steps} steps / "
              f"{bandwidth / 1e9:.0f} GB/s measured device copy bandwidth (read + write) = {floor_ms:.4f} ms per call; "
              f"per frame = that / batch; ratio = variant ms/frame / floor ms/frame (1.0 = at the floor)")
        names = ("official", "naive", "kv", "graphed", "compiled")
        print(f"{'batch':>6} {'floor ms/frame':>15} " + " ".join(f"{n + '/floor':>14}" for n in names))
        for b, row in per_frame.items():
            floor = floor_ms / b
            cells = " ".join(f"{row[n] / floor:>14.2f}" if n in row else f"{'n/a':>14}" for n in names)
            print(f"{b:>6} {floor:>15.5f} {cells}")
    else:
        print("\nmemory-bandwidth floor: n/a (no CUDA)")

    chunk = 25
    print(f"\ncodec decoder, streaming {chunk}-frame chunks ({chunk * 0.08:.1f} s of audio), ms per chunk per stream")
    print(f"{'streams':>7} {'ms/chunk':>9} {'RTF':>7}")
    for b in (1, 8):
        codes = torch.randint(0, cfg.decoder.codebook_size, (b, cfg.decoder.num_quantizers, 4 * chunk), generator=g)
        codes = codes.to(device)

        def run_stream():
            state = decoder.init_state(b, device, dtype)
            for start in range(0, codes.shape[-1], chunk):
                _, state = decoder.decode_step(codes[..., start:start + chunk], state)

        t = time_ms(run_stream, device, args.min_seconds, max_reps=20) / 4 / b
        print(f"{b:>7} {t:>9.2f} {t / (chunk * 80.0):>7.3f}")


if __name__ == "__main__":
    main()
