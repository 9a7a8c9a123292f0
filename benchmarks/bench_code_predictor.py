"""Code predictor: naive no-cache loop vs static-KV loop, ms per frame; plus codec decoder cost.

    python benchmarks/bench_code_predictor.py [--preset small] [--device auto] [--batches 1 8 64]

Random weights (timing does not depend on their values). Before timing, the two loops
must produce identical codes on the same inputs. The second table is the streaming
codec decoder: ms per 25-frame chunk (2 s of audio) and its real-time factor.
"""

from __future__ import annotations

import argparse
import time

import torch

from engines.models.code_predictor import CodePredictor, FrameSampling
from engines.models.codec_decoder import CodecDecoder
from engines.models.codec_head import CodecHead
from engines.models.init import init_module_
from engines.presets import PRESET_NAMES, get_preset


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", choices=PRESET_NAMES)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch default)")
    ap.add_argument("--min-seconds", type=float, default=1.0, help="time budget per measurement")
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

    print("\ncode predictor, ms per frame (codes 1..G-1 of one frame; lower is better)")
    print(f"{'batch':>6} {'naive ms/frame':>15} {'kv ms/frame':>12} {'naive/kv':>9}")
    g = torch.Generator().manual_seed(0)
    for b in args.batches:
        u = torch.randn(b, cfg.latent_dim, generator=g).to(device, dtype)
        u = u / u.float().pow(2).mean(-1, keepdim=True).sqrt().to(dtype)
        s = FrameSampling.for_stream(b, seed=1, frame_offset=0, device=device, greedy=True)
        with torch.no_grad():
            h = head.hidden(u)
            emb = head.embed(head.sample_code0(head.logits_from_hidden(h), s))
            kv, naive = predictor.predict(h, emb, s), predictor.naive_predict(h, emb, s)
        if not torch.equal(kv, naive):
            raise SystemExit(f"batch {b}: KV loop and naive loop disagree on codes; not timing")
        t_naive = time_ms(lambda: predictor.naive_predict(h, emb, s), device, args.min_seconds)
        t_kv = time_ms(lambda: predictor.predict(h, emb, s), device, args.min_seconds)
        print(f"{b:>6} {t_naive / b:>15.3f} {t_kv / b:>12.3f} {t_naive / t_kv:>9.2f}")

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
