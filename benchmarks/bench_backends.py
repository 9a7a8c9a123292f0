"""ONNX Runtime vs torch eager on CPU: DiT tick-forward, decoder chunk, end-to-end RTF.

    python benchmarks/bench_backends.py [--preset small] [--threads 1] [--slots 1 4 8 16]

Random weights (timing does not depend on their values). The graphs are exported into
a temporary directory first (``export_models``, the same code as ``streamvox export``)
and checked against torch (max |diff| printed) before anything is timed.

* DiT: one tick's forward with ``n`` slots in flight under fused CFG (2n rows), each
  row context + one full chunk of frames, padded encoder states of ``--enc-len``.
* Decoder: one streaming ``decode_step`` of a full chunk (25 frames = 2 s) for 1 stream.
* End to end: the whole engine (planner, tick loop, code predictor, vocalizer) with the
  models from ``apply_backend``, one request, real-time factor = compute / audio time.
Both sides use the same thread count (torch.set_num_threads / ORT intra-op threads).
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import threading
import time

import torch

from engines.build import resolve_config
from engines.config import PRESET_NAMES, EngineConfig, RuntimeConfig, get_preset
from engines.contract import SAMPLE_RATE, SynthesisRequest
from engines.core.engine import Engine
from engines.export import apply_backend
from engines.export.onnx_export import export_models
from engines.export.parity import example_dit_batch, parity_report
from engines.pipelines.dit.weights import build_models
from engines.pipelines.profile import Loaded

TEXT = ("The quick brown fox jumps over the lazy dog, and then it runs back home "
        "across the field before the evening rain begins.")


def time_ms(fn, min_seconds: float, max_reps: int = 200) -> float:
    """Median ms per call after two warm-up calls."""
    fn(), fn()
    samples, start = [], time.perf_counter()
    while len(samples) < 5 or (time.perf_counter() - start < min_seconds and len(samples) < max_reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    return samples[len(samples) // 2]


def end_to_end(models, steps: int) -> tuple[float, float]:
    """(compute seconds, audio seconds) for one request through the whole engine."""
    engine = Engine(Loaded(models), resolve_config(EngineConfig(runtime=RuntimeConfig(device="cpu"), warmup=False)))
    engine.start()
    samples, done = [0], threading.Event()

    def deliver(chunk):
        samples[0] += len(chunk.pcm)
        if chunk.is_final:
            done.set()

    try:
        t0 = time.perf_counter()
        engine.submit(SynthesisRequest(id="bench", text=TEXT, steps=steps, seed=0), deliver)
        done.wait(600)
        return time.perf_counter() - t0, samples[0] / SAMPLE_RATE
    finally:
        engine.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", choices=PRESET_NAMES)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads for both torch and ORT")
    ap.add_argument("--slots", type=int, nargs="+", default=[1, 4, 8, 16], help="slots in flight (2n rows)")
    ap.add_argument("--enc-len", type=int, default=48)
    ap.add_argument("--steps", type=int, default=8, help="denoising steps (end-to-end run)")
    ap.add_argument("--min-seconds", type=float, default=1.0)
    ap.add_argument("--no-e2e", action="store_true", help="skip the end-to-end engine run")
    args = ap.parse_args()

    import onnxruntime

    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    config = get_preset(args.preset)
    models = build_models(config, seed=0)
    s, d = config.stream, config.dit
    print(f"device: cpu ({platform.processor() or platform.machine()}), threads={args.threads}, "
          f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, preset {args.preset}")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        export_models(models, tmp)
        print(f"export: {time.perf_counter() - t0:.1f} s")
        for name, err in parity_report(models, tmp).items():
            print(f"  parity onnxruntime vs torch, {name}: max |diff| {err:.1e}")
        ort = apply_backend(models, "onnxruntime", tmp, "cpu", threads=args.threads)

        frames = d.context_frames + s.chunk_frames
        print(f"\nDiT tick forward (fused CFG: 2n rows x {frames} frames, enc_len {args.enc_len})")
        print(f"{'slots':>5} {'rows':>5} {'torch ms':>10} {'ort ms':>10} {'torch/ort':>10}")
        for n in args.slots:
            if 2 * n > s.batch_ceiling:
                continue
            batch = example_dit_batch(d, positive_rows=n, frames=frames, enc_len=args.enc_len,
                                      context=d.context_frames)
            t_ms = time_ms(lambda: models.dit(*batch), args.min_seconds)
            o_ms = time_ms(lambda: ort.dit(*batch), args.min_seconds)
            print(f"{n:>5} {2 * n:>5} {t_ms:>10.2f} {o_ms:>10.2f} {t_ms / o_ms:>10.2f}")

        dc = config.decoder
        codes = torch.randint(0, dc.codebook_size, (1, dc.num_quantizers, s.chunk_frames))
        st_t, st_o = models.decoder.init_state(1), ort.decoder.init_state(1)
        t_ms = time_ms(lambda: models.decoder.decode_step(codes, st_t), args.min_seconds)
        o_ms = time_ms(lambda: ort.decoder.decode_step(codes, st_o), args.min_seconds)
        audio_ms = s.chunk_frames * 1920 / SAMPLE_RATE * 1e3
        print(f"\nCodec decoder decode_step, 1 stream x {s.chunk_frames} frames ({audio_ms:.0f} ms audio)")
        print(f"{'':>5} {'torch ms':>10} {'ort ms':>10} {'torch/ort':>10}")
        print(f"{'':>5} {t_ms:>10.2f} {o_ms:>10.2f} {t_ms / o_ms:>10.2f}")

        if not args.no_e2e:
            print(f"\nEnd to end, one request ({args.steps} steps, CFG), whole engine")
            print(f"{'backend':>12} {'compute s':>10} {'audio s':>8} {'RTF':>7}")
            rtf = {}
            for name, m in (("torch", models), ("onnxruntime", ort)):
                end_to_end(m, 2)  # warm-up
                sec, audio = end_to_end(m, args.steps)
                rtf[name] = sec / audio
                print(f"{name:>12} {sec:>10.2f} {audio:>8.2f} {rtf[name]:>7.3f}")
            print(f"{'torch/ort':>12} {'':>10} {'':>8} {rtf['torch'] / rtf['onnxruntime']:>7.2f}")


if __name__ == "__main__":
    main()
