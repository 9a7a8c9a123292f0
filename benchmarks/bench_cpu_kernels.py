"""One-row matrix products at the 0.6B talker's shapes, per CPU kernel: what the int4 / int8
modes were chosen by (docs/QUANTIZATION.md, "Choosing the int4 kernel").

    python benchmarks/bench_cpu_kernels.py [--threads 1] [--copies 8] [--rounds 3]

Each kernel multiplies one row by ``--copies`` different weights of each shape in turn (so the
weights stream from memory as in a decode step, not from cache), in rounds whose kernel order
rotates; per call: the thread CPU time (with 1 thread the work runs on the calling thread,
robust to a shared machine) and the wall time, min over rounds. Kernels: torch fp32
``F.linear`` (MKL), torch's int8 ``quantized::linear_dynamic`` (FBGEMM), ONNX Runtime's fp32
``MatMul`` and ``MatMulNBits`` (4 bits in blocks of 32 and 128, 8 bits in blocks of 128; int8
activations), and torch's int4 ops ``_weight_int4pack_mm_for_cpu`` (bf16 activations) and
``_dyn_quant_matmul_4bit``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `streamvox` runs (clients/cli.py)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

SHAPES = ((1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024))  # q/k/v, o_proj, gate/up, down


def torch_int4(w: torch.Tensor, block: int = 128):
    """torch's weight-only int4 CPU kernel (bf16 activations: fp32 ones measured 20-50x slower)."""
    n, k = w.shape
    blocks = w.reshape(n, k // block, block)
    lo, hi = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    q = torch.clamp(torch.round((blocks - lo) / scale), 0, 15).to(torch.int32).reshape(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = torch.stack([scale.reshape(n, -1), (lo + 8 * scale).reshape(n, -1)], -1).transpose(0, 1).contiguous()
    sz = sz.to(torch.bfloat16)
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, block, sz)


def torch_dyn4(w: torch.Tensor, block: int = 128):
    n, k = w.shape
    blocks = w.reshape(n, k // block, block)
    scale = (blocks.abs().amax(-1) / 7).clamp_min(1e-8)
    q = (torch.round(blocks / scale[..., None]).clamp(-8, 7) + 8).to(torch.uint8).reshape(n, k)
    packed = torch.ops.aten._dyn_quant_pack_4bit_weight((q[:, 1::2] << 4 | q[:, ::2]).contiguous(), scale.float(),
                                                        None, block, k, n)
    return lambda x: torch.ops.aten._dyn_quant_matmul_4bit(x, packed, block, k, n)


def kernels():
    from engines.models.quantize import Int8Linear
    from engines.models.quantize_nbits import NBitsLinear, _Graph

    def ort_fp32(w):
        g = _Graph("fp32", w.shape[1])
        return g.finish(g.op("MatMul", ["X", g.const("w", w.T.contiguous().numpy())])[0], w.shape[0])

    def linear(w):
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
        lin.weight.data = w
        return lin

    return {
        "fp32 torch (MKL)": lambda w: (lambda x: F.linear(x, w)),
        "fp32 ORT MatMul": ort_fp32,
        "int8 torch linear_dynamic": lambda w: Int8Linear(linear(w)),
        "int8 ORT MatMulNBits b128": lambda w: NBitsLinear(linear(w), 8, 128),
        "int4 ORT MatMulNBits b32": lambda w: NBitsLinear(linear(w), 4, 32),
        "int4 ORT MatMulNBits b128": lambda w: NBitsLinear(linear(w), 4, 128),
        "int4 torch int4pack_mm (bf16 x)": torch_int4,
        "int4 torch dyn_quant_matmul_4bit": torch_dyn4,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--copies", type=int, default=8, help="weights of each shape cycled (they must not fit in cache)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3, help="passes over the copies per turn")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    makers = kernels()
    print(f"bench_cpu_kernels: {args.threads} thread(s), {args.copies} weights per shape, load average "
          f"{os.getloadavg()[0]:.2f}; per call, min over {args.rounds} rounds: thread CPU us / wall us")
    totals = {name: [0.0, 0.0] for name in makers}
    header = f"{'kernel':>34} | " + " | ".join(f"{k}->{n:<5}" for k, n in SHAPES) + " | one layer (CPU us)"
    rows = {name: [] for name in makers}
    for k, n in SHAPES:
        weights = [torch.randn(n, k, generator=g) / k**0.5 for _ in range(args.copies)]
        x = torch.randn(1, k, generator=g)
        fns = {}
        for name, make in makers.items():
            try:
                fns[name] = [make(w) for w in weights]
            except Exception as exc:  # a kernel this build or CPU lacks
                print(f"  {name}: not available ({type(exc).__name__}: {exc})"[:160])
        best = {name: [float("inf"), float("inf")] for name in fns}
        names = list(fns)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                for f in fns[name]:
                    f(x)  # warm
                c0, w0 = time.thread_time(), time.perf_counter()
                for _ in range(args.reps):
                    for f in fns[name]:
                        f(x)
                calls = args.reps * len(fns[name])
                cpu, wall = (time.thread_time() - c0) / calls * 1e6, (time.perf_counter() - w0) / calls * 1e6
                best[name] = [min(best[name][0], cpu), min(best[name][1], wall)]
        for name in makers:
            if name in best:
                rows[name].append(f"{best[name][0]:6.0f} / {best[name][1]:6.0f}")
                # one decoder layer: q/k/v + o + gate/up + down, each once
                totals[name][0] += best[name][0]
            else:
                rows[name].append(f"{'-':>15}")
    print(header)
    print("-" * len(header))
    for name in makers:
        print(f"{name:>34} | " + " | ".join(rows[name]) + f" | {totals[name][0]:8.0f}")


if __name__ == "__main__":
    main()
