"""The native int8 / int4 matrix products (engines/native/talker_frame.c) against a plain read of
their bytes, at the 0.6B talker's shapes, batch 1: how close the kernels come to the memory floor.

    python benchmarks/bench_native_kernels.py [--rounds 5] [--bits 8 4] [--isa avx512vnni]

One "frame" of products: the talker's 28 layers once (q/k/v, o, gate/up, down) and the code
predictor's 5 layers and one head 15 times (its 15 passes; the same weights each pass, as served),
one row. In each round, for each bits, in rotating order: the products (thread CPU and wall time)
and a plain read of the same bytes by this core (the floor: its AVX-512 / AVX2 loads, in the same
round so the same machine load), on the wall clock and in thread CPU time. Ratios are taken
within a round; min, median and max over rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from engines import native  # noqa: E402
from engines.models.quantize_native import NativeLinear  # noqa: E402

HIDDEN, INTER, HEADS, KV, HD, VOCAB = 1024, 3072, 16, 8, 128, 2048
LAYER = [((HEADS + 2 * KV) * HD, HIDDEN), (HIDDEN, HEADS * HD), (2 * INTER, HIDDEN), (HIDDEN, INTER)]


def frame_matrices(bits: int) -> tuple[list[NativeLinear], list[NativeLinear]]:
    """(talker layers' matrices, one predictor pass's: 5 layers and a head), random weights."""
    g = torch.Generator().manual_seed(bits)

    def make(shapes):
        return [NativeLinear(torch.randn(n, k, generator=g) / k ** 0.5, bits) for n, k in shapes]

    return make(LAYER * 28), make(LAYER * 5 + [(VOCAB, HIDDEN)])


def run_products(talker, predictor) -> None:
    x = {k: torch.randn(1, k) for k in (HIDDEN, HEADS * HD, INTER)}
    for m in talker:
        m(x[m.struct.k])
    for _ in range(15):
        for m in predictor:
            m(x[m.struct.k])


def read_all(talker, predictor) -> None:
    for m in talker + predictor * 15:
        for a in m.arrays:
            native.lib.sv_read_bytes(a.ctypes.data, a.nbytes)


def timed(fn, *args) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.thread_time()
    fn(*args)
    return time.perf_counter() - t0, time.thread_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    ap.add_argument("--isa", default=None, choices=native.ISAS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.isa:
        native.set_isa(args.isa)
    sets = {bits: frame_matrices(bits) for bits in args.bits}
    nbytes = {bits: sum(a.nbytes for m in t + p * 15 for a in m.arrays) for bits, (t, p) in sets.items()}
    print(f"native kernels ({native.get_isa()}), 0.6B shapes, batch 1, 1 thread; load average "
          f"{os.getloadavg()[0]:.2f} at start")
    for bits, (t, p) in sets.items():  # warm: first touch of every page
        run_products(t, p)
        read_all(t, p)
    turns = []
    for r in range(args.rounds):
        order = [(bits, what) for bits in args.bits for what in ("products", "read")]
        k = r % len(order)
        row = {}
        for bits, what in order[k:] + order[:k]:
            row[(bits, what)] = timed(run_products if what == "products" else read_all, *sets[bits])
        turns.append(row)
    print("wall: elapsed time; CPU: this thread's time on a core (a loaded machine's waits for a core left out "
          "of both the products and the read)")
    print(f"{'bits':>4} | {'clock':>5} | {'GB a frame':>10} | {'products ms min / med':>21} | {'read ms min / med':>17} | "
          f"{'GB/s read':>9} | {'products / read, in-round min / med / max':>41}")
    for bits in args.bits:
        for clock, i in (("wall", 0), ("CPU", 1)):
            prod = [t[(bits, "products")][i] * 1e3 for t in turns]
            read = [t[(bits, "read")][i] * 1e3 for t in turns]
            ratio = [p / q for p, q in zip(prod, read)]
            print(f"{bits:4d} | {clock:>5} | {nbytes[bits] / 1e9:10.3f} | {min(prod):9.1f} / {statistics.median(prod):9.1f} | "
                  f"{min(read):7.1f} / {statistics.median(read):7.1f} | {nbytes[bits] / min(read) / 1e6:9.1f} | "
                  f"{min(ratio):13.3f} / {statistics.median(ratio):5.3f} / {max(ratio):5.3f}")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
