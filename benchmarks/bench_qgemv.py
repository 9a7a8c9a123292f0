"""The native int8 / int4 products (engines/native/talker_frame.c) per matrix shape of the 0.6B
frame against a plain read of the same bytes, one thread, in the same process, alternating: the
micro-benchmark that judges a kernel change in seconds.

    python benchmarks/bench_qgemv.py [--bits 8 4] [--rows 1] [--rounds 5] [--isa avx512vnni]

Each shape: enough distinct matrices of it (random codes, scales, zero points) that they do not fit
in the last-level cache (--mb, default 192 MB), all run in turn in one native call (the input
quantized for each matrix, as the frame does); the "frame" row: the talker's 28 layers once, then
the code predictor's 5 layers and a head 15 times (the same weights each pass, as served). Each
round times the products and the read (sv_bench_read: this core's AVX-512 / AVX2 loads of the codes,
scales and zero points) in rotating order; "x read" = products / read within a round (min / median).
Times are thread CPU time and wall time (the CPU column leaves out a loaded machine's waits).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from engines import native  # noqa: E402

HIDDEN, INTER, HEADS, KV, HD, VOCAB = 1024, 3072, 16, 8, 128, 2048
SHAPES = {"l2": (256, HIDDEN), "qkv": ((HEADS + 2 * KV) * HD, HIDDEN), "o": (HIDDEN, HEADS * HD), "gate_up": (2 * INTER, HIDDEN),
          "down": (HIDDEN, INTER), "head": (VOCAB, HIDDEN)}


class Matrix:
    """Random packed weights [n, k] in MatMulNBits' layout (the values do not matter for the time)."""

    def __init__(self, n: int, k: int, bits: int, rng: np.random.Generator):
        nb = k // native.QBLOCK
        self.w = rng.integers(0, 256, n * k * bits // 8, dtype=np.uint8)
        self.scale = (rng.random(n * nb, dtype=np.float32) + 0.5) / 256
        self.zero = rng.integers(0, 256, n * nb if bits == 8 else n * ((nb + 1) // 2), dtype=np.uint8)
        if bits == 4:
            self.zero &= 0x77  # nibbles near the middle, as a 4-bit zero point
        self.struct = native.QLinear(ctypes.cast(self.w.ctypes.data, ctypes.POINTER(ctypes.c_uint8)),
                                     ctypes.cast(self.scale.ctypes.data, ctypes.POINTER(ctypes.c_float)),
                                     ctypes.cast(self.zero.ctypes.data, ctypes.POINTER(ctypes.c_uint8)),
                                     None, n, k, bits, 0)
        self.nbytes = self.w.nbytes + self.scale.nbytes + self.zero.nbytes


class Run:
    """A list of matrices run in one native call (their structs in one array)."""

    def __init__(self, mats: list[Matrix], rows: int, quantize: bool):
        self.mats, self.rows, self.quantize = mats, rows, quantize
        self.array = (native.QLinear * len(mats))(*[m.struct for m in mats])
        self.kmax = max(m.struct.k for m in mats)
        self.nmax = max(m.struct.n for m in mats)
        self.x = np.random.default_rng(1).standard_normal((rows, self.kmax)).astype(np.float32)
        self.y = np.empty((rows, self.nmax), np.float32)
        self.nbytes = sum(m.nbytes for m in mats)

    def products(self, lib=None) -> None:
        if (lib or native.lib).sv_bench_products(self.array, len(self.mats), self.rows, self.x.ctypes.data, self.kmax,
                                        self.y.ctypes.data, self.nmax, int(self.quantize)):
            raise MemoryError

    def read(self) -> None:
        native.lib.sv_bench_read(self.array, len(self.mats))


def declare(lib) -> None:
    lib.sv_bench_products.argtypes = [ctypes.POINTER(native.QLinear), ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                      ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.sv_bench_products.restype = ctypes.c_int
    lib.sv_bench_read.argtypes = [ctypes.POINTER(native.QLinear), ctypes.c_int]
    lib.sv_bench_read.restype = ctypes.c_uint64


def timed(fn) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - t0, time.thread_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mb", type=float, default=192, help="bytes of distinct matrices per shape (MB)")
    ap.add_argument("--shapes", nargs="+", default=[*list(SHAPES)[1:], "frame"], choices=[*SHAPES, "frame"])
    ap.add_argument("--isa", default=None, choices=native.ISAS)
    ap.add_argument("--hot", action="store_true",
                    help="one matrix per shape run over and over (its bytes in the caches): the kernel's compute rate")
    ap.add_argument("--no-quantize", action="store_true", help="quantize the input once per width (the products alone)")
    ap.add_argument("--libs", nargs="+", default=[], metavar="SO",
                    help="also time the products of these builds of the extension (copies of _talker_frame*.so), "
                         "taking turns with this one in every round")
    args = ap.parse_args()
    libs = {"this": native.lib} | {Path(p).stem: ctypes.CDLL(str(Path(p).resolve())) for p in args.libs}
    for lib in libs.values():
        declare(lib)
    if args.isa:
        native.set_isa(args.isa)
        for lib in libs.values():
            lib.sv_set_isa(native.ISAS.index(args.isa))
    rng = np.random.default_rng(0)
    runs = {}
    for bits in args.bits:
        for name in args.shapes:
            if name == "frame":
                layer = [Matrix(*SHAPES[s], bits, rng) for _ in range(28) for s in ("qkv", "o", "gate_up", "down")]
                pred = [Matrix(*SHAPES[s], bits, rng) for _ in range(5) for s in ("qkv", "o", "gate_up", "down")]
                mats = layer + (pred + [Matrix(*SHAPES["head"], bits, rng)]) * 15
            else:
                n, k = SHAPES[name]
                one = n * k * bits // 8
                count = max(2, int(args.mb * 1e6 / one))
                mats = [Matrix(n, k, bits, rng)] * count if args.hot else [Matrix(n, k, bits, rng) for _ in range(count)]
            runs[(bits, name)] = Run(mats, args.rows, not args.no_quantize)
    for run in runs.values():  # warm: every page touched
        for lib in libs.values():
            run.products(lib)
        run.read()
    turns = []
    keys = [(key, what) for key in runs for what in [*libs, "read"]]
    for r in range(args.rounds):
        k = (r * 3) % len(keys)
        turns.append({kw: timed(runs[kw[0]].read if kw[1] == "read" else
                                (lambda kw=kw: runs[kw[0]].products(libs[kw[1]])))
                      for kw in keys[k:] + keys[:k]})
    print(f"native products ({native.get_isa()}), {platform.processor() or platform.machine()} "
          f"{os.cpu_count()} cores, rows {args.rows}, 1 thread, rounds {args.rounds}, "
          f"{'input quantized once per width' if args.no_quantize else 'input quantized per matrix'}; "
          f"load {os.getloadavg()[0]:.2f} at the end")
    print(f"{'bits':>4} | {'shape':>8} | {'build':>10} | {'n x k':>11} | {'MB':>7} | {'products ms':>11} | {'read ms':>7} | "
          f"{'GB/s read':>9} | {'GB/s prod':>9} | {'x read wall min / med':>21} | {'x read CPU min / med':>20}")
    for (bits, name), run in runs.items():
        read = [t[((bits, name), "read")] for t in turns]
        for build in libs:
            prod = [t[((bits, name), build)] for t in turns]
            wall = [p[0] / q[0] for p, q in zip(prod, read)]
            cpu = [p[1] / q[1] for p, q in zip(prod, read)]
            shape = "mixed" if name == "frame" else "%d x %d" % SHAPES[name]
            print(f"{bits:4d} | {name:>8} | {build[:10]:>10} | {shape:>11} | {run.nbytes / 1e6:7.1f} | "
                  f"{min(p[0] for p in prod) * 1e3:11.2f} | {min(q[0] for q in read) * 1e3:7.2f} | "
                  f"{run.nbytes / min(q[0] for q in read) / 1e9:9.1f} | {run.nbytes / min(p[0] for p in prod) / 1e9:9.1f} | "
                  f"{min(wall):9.3f} / {statistics.median(wall):9.3f} | {min(cpu):8.3f} / {statistics.median(cpu):9.3f}")


if __name__ == "__main__":
    main()
