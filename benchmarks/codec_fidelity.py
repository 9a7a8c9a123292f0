"""How far our codec decoder in bfloat16 is from float32, beside how far the official decoder in
bfloat16 (the precision the release is evaluated and served in) is from its own float32.

    .venv-oracle/bin/python benchmarks/official_codec.py CKPT CODES.json /tmp/official-codec.npz
    python benchmarks/codec_fidelity.py CKPT /tmp/official-codec.npz [--chunk 4] [--threads 1]

Our decoder decodes every case streaming, in chunks of ``--chunk`` frames as the server does,
once per precision; the official waveforms are whole-utterance decodes. Per pair of waveforms:
SNR = 10 log10(|ref|^2 / |other - ref|^2), and the mean absolute log-mel difference in dB
(128 mel bands, 1024-point frames): what a listener's spectrum sees, where a waveform SNR also
counts phase. Also the decoder's thread CPU time per frame in each precision (same run,
alternating). The rule docs/QUANTIZATION.md applies to the codec: bf16 where our bf16 is about as
close to fp32 as the official bf16 is (SNR at most 3 dB lower, mel difference at most 2x).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_talker import machine_line  # noqa: E402
from quantize_fidelity import snr_db  # noqa: E402

from engines.checkpoints.qwen3_tts import Qwen3TTSParts, load_checkpoint  # noqa: E402
from engines.models.mel import LogMel  # noqa: E402

MEL = LogMel()


def mel_db(ref: torch.Tensor, other: torch.Tensor) -> float:
    """Mean |difference| of the log-mel magnitudes, in dB."""
    return (MEL(ref[None]) - MEL(other[None])).abs().mean().item() * 20 / math.log(10)


def streamed(parts: Qwen3TTSParts, codes: torch.Tensor, chunk: int) -> tuple[torch.Tensor, float]:
    """codes [T, G] decoded in chunks -> (waveform fp32 [T * 1920], thread CPU seconds)."""
    t0 = time.thread_time()
    with torch.no_grad():
        wav = torch.cat(list(parts.decode_stream(codes.T[None], chunk)), dim=-1)[0]
    return wav, time.thread_time() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("official", type=Path, help="official_codec.py's .npz for this checkpoint")
    ap.add_argument("--chunk", type=int, default=4, help="frames per streamed chunk (default 4)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_line(torch.device("cpu")))
    official = np.load(args.official)
    cases = sorted(int(k.split("_")[1]) for k in official.files if k.startswith("codes_"))
    decoders = {"fp32": load_checkpoint(args.checkpoint), "bf16": load_checkpoint(args.checkpoint, dtype=torch.bfloat16)}
    pairs: dict[str, list[tuple[float, float]]] = {}
    cpu = {p: 0.0 for p in decoders}
    frames = 0
    for k in cases:
        codes = torch.from_numpy(official[f"codes_{k}"])
        ref = {f"official {p}": torch.from_numpy(official[f"{p}_{k}"]) for p in ("fp32", "bf16")}
        ours = {}
        for p, parts in decoders.items():
            ours[f"ours {p}"], seconds = streamed(parts, codes, args.chunk)
            cpu[p] += seconds
        frames += codes.shape[0]
        wavs = {**ref, **ours}
        for a, b in (("official fp32", "official bf16"), ("ours fp32", "ours bf16"),
                     ("official fp32", "ours fp32"), ("official fp32", "ours bf16"),
                     ("official bf16", "ours bf16")):
            n = min(wavs[a].numel(), wavs[b].numel())
            pairs.setdefault(f"{b} vs {a}", []).append((snr_db(wavs[a][:n], wavs[b][:n]),
                                                        mel_db(wavs[a][:n], wavs[b][:n])))
    rms = statistics.mean(torch.from_numpy(official[f"fp32_{k}"]).pow(2).mean().sqrt().item() for k in cases)
    print(f"{args.checkpoint}: {len(cases)} utterances, {frames} frames, official fp32 RMS {rms:.3f}; "
          f"ours streamed in chunks of {args.chunk}")
    print("| pair | SNR dB, median (min) | log-mel difference dB, mean (max) |")
    print("|---|---|---|")
    for name, values in pairs.items():
        snrs, mels = [v[0] for v in values], [v[1] for v in values]
        print(f"| {name} | {statistics.median(snrs):.1f} ({min(snrs):.1f}) | "
              f"{statistics.mean(mels):.3f} ({max(mels):.3f}) |")
    print("decoder thread CPU per frame: " + ", ".join(f"{p} {1000 * s / frames:.1f} ms" for p, s in cpu.items())
          + f" (bf16 / fp32 {cpu['bf16'] / cpu['fp32']:.2f})")
    yard, ours = pairs["official bf16 vs official fp32"], pairs["ours bf16 vs ours fp32"]
    snr_ok = statistics.median(v[0] for v in ours) >= statistics.median(v[0] for v in yard) - 3
    mel_ok = statistics.mean(v[1] for v in ours) <= 2 * statistics.mean(v[1] for v in yard)
    print(f"rule (bf16 within 3 dB SNR and 2x the mel difference of the official bf16): "
          f"{'passes' if snr_ok and mel_ok else 'fails'} (SNR {'ok' if snr_ok else 'no'}, mel {'ok' if mel_ok else 'no'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
