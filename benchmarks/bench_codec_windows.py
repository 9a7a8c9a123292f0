"""The codec decoder in bf16, the same codes cut into different chunks: how far apart the PCM comes
out, and what each chunking costs, decoding on fixed windows (engines/pipelines/vocoder.py, the
default in bf16) against decoding each chunk as it comes (the chunk's own shapes, as before).

    python benchmarks/bench_codec_windows.py [--size 0.6b] [--frames 48] [--rounds 3]

The decoder at the released codec sizes (random weights, benchmarks/bench_talker.py
``codec_decoder``), one stream, one torch thread (what the decoder has served on a 2-core machine;
the windows are the same to the bit at any thread count: tests/engines/pipelines/
test_vocalizer_windows.py). Each chunking's PCM is compared with the same decoder's one-call
decode of all the frames, in LSB of 16-bit PCM (max, and the samples more than 1 LSB off); the
cost is the process's CPU time per frame, the median of ``--rounds`` (the two ways alternate), so
a busy machine changes it little.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]


def chunkings(frames: int) -> dict[str, list[int]]:
    def equal(n: int) -> list[int]:
        return [n] * (frames // n) + ([frames % n] if frames % n else [])

    rng, cuts = random.Random(0), []
    while sum(cuts) < frames:
        cuts.append(min(rng.randint(1, 9), frames - sum(cuts)))
    doubling, n = [], 1
    for size in (1, 1, 2, 4, 8) + (12,) * frames:
        if n > frames:
            break
        doubling.append(min(size, frames - sum(doubling)))
        n = sum(doubling) + 1
    return {"1 x 8, then 4 (served on this CPU)": [1] * 8 + equal(4)[2:],
            "1, 1, 2, 4, 8, 12 (served with room to grow)": doubling, "4-frame chunks": equal(4),
            "1-frame chunks": equal(1), "3-frame chunks": equal(3), "random 1-9": cuts, "one call": [frames]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="0.6b", choices=["tiny", "0.6b"])
    ap.add_argument("--frames", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import torch
    from bench_talker import codec_decoder, machine_line

    from engines.pipelines.vocoder import VocalizeItem, Vocalizer

    torch.set_num_threads(1)  # both ways on one thread: the decoder's share on a 2-core machine
    print(machine_line(torch.device("cpu")))
    decoder = codec_decoder(args.size, "cpu", torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, decoder.cfg.codebook_size, (args.frames, decoder.cfg.num_quantizers), generator=g)

    def decode(sizes: list[int], windowed: bool) -> tuple[torch.Tensor, float]:
        vocalizer, offset, out = Vocalizer(decoder, "cpu", torch.bfloat16, windowed=windowed), 0, []
        t0 = time.process_time()
        for n in sizes:
            out.append(vocalizer.vocalize([VocalizeItem("s", codes[offset:offset + n], offset,
                                                        is_last=offset + n == args.frames)])[0].pcm)
            offset += n
        return torch.cat(out), (time.process_time() - t0) * 1e3 / args.frames

    ways = {"fixed windows": True, "chunk shapes": False}
    whole = {way: decode([args.frames], windowed)[0] for way, windowed in ways.items()}
    rows: dict[tuple[str, str], dict] = {}
    for r in range(args.rounds):
        for name, sizes in chunkings(args.frames).items():
            for way, windowed in (ways.items() if r % 2 == 0 else reversed(ways.items())):
                pcm, ms = decode(sizes, windowed)
                lsb = (pcm - whole[way]).abs() * 32768
                row = rows.setdefault((name, way), {"ms": [], "max": 0.0, "off": 0})
                row["ms"].append(ms)
                row["max"], row["off"] = max(row["max"], lsb.max().item()), max(row["off"], int((lsb > 1).sum()))
    print(f"{args.frames} frames ({args.frames * 1920} samples), bf16, released codec sizes ({args.size}); "
          f"load {os.getloadavg()[0]:.2f} at the end")
    print("| chunks | fixed windows: max LSB off the one-call decode (samples > 1 LSB) | CPU ms/frame "
          "| chunk shapes: max LSB (samples > 1 LSB) | CPU ms/frame | windows / shapes |")
    print("|---|---|---|---|---|---|")
    for name in chunkings(args.frames):
        w, c = rows[(name, "fixed windows")], rows[(name, "chunk shapes")]
        wm, cm = statistics.median(w["ms"]), statistics.median(c["ms"])
        print(f"| {name} | {w['max']:.0f} ({w['off']}) | {wm:.1f} | {c['max']:.0f} ({c['off']}) | {cm:.1f} | {wm / cm:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
