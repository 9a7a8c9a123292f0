"""The quantized talker's 28 layers before and after the one-layer-forward refactor, in one process.

    .venv/bin/python benchmarks/bench_talker_layers.py --baseline-commit dfc7768 [--bits 8] [--reps 15]

Before (``--baseline-commit``, whose engines/models/quantize_talker_layer.py is read with ``git show``):
each layer two ONNX Runtime calls with attention inside (``NBitsTalkerLayer``), called as that tree's
``TalkerLayer.forward_paged`` branch did (K/V written and gathered by torch between them). After (this
tree): the layer's one forward on the modules ``convert_layer`` swapped in, attention over a
``GatheredKV`` by ``OrtAttention``. The same random layers at the released 0.6B sizes, the same packed
weights, torch and ONNX Runtime on one thread; the two layouts take turns (order flipped every
repetition) over a decode position (1 query, 100 cached) and a 65-position prompt. Prints thread CPU
time per 28-layer forward (min / median), the ratio of medians, whether the outputs are the same bits,
the machine and its load.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engines.models.kv_access import GatheredKV  # noqa: E402
from engines.models.layers import mrope_cos_sin, prepare_rope, rope_inv_freq  # noqa: E402
from engines.models.quantize_nbits import OrtAttention, convert_layer, ensure_pool  # noqa: E402
from engines.models.talker import TalkerConfig, TalkerLayer  # noqa: E402

CFG = TalkerConfig(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                   num_key_value_heads=8, head_dim=128, mrope_section=(24, 20, 20))


def old_layer_class(rev: str):
    source = subprocess.run(["git", "show", f"{rev}:engines/models/quantize_talker_layer.py"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "old_talker_layer.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("old_talker_layer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.NBitsTalkerLayer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-commit", required=True, help="a commit with engines/models/quantize_talker_layer.py")
    ap.add_argument("--bits", type=int, default=8, choices=[4, 8])
    ap.add_argument("--reps", type=int, default=15, help="turns of each layout at a decode position")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ensure_pool(1)
    NBitsTalkerLayer = old_layer_class(args.baseline_commit)
    g = torch.Generator().manual_seed(0)
    old, new = [], []
    for _ in range(CFG.num_hidden_layers):
        layer = TalkerLayer(CFG)
        with torch.no_grad():
            for p in layer.parameters():  # matrices ~ N(0, 0.03), norms ~ 1
                p.copy_(torch.randn(p.shape, generator=g) * (0.03 if p.dim() == 2 else 1) + (p.dim() == 1))
        old.append(NBitsTalkerLayer(layer, args.bits))
        new.append(copy.deepcopy(layer))
        convert_layer(new[-1], args.bits)
    core = OrtAttention(CFG.num_attention_heads, CFG.num_key_value_heads, CFG.head_dim, CFG.head_dim ** -0.5)
    pools = [(torch.zeros(64 * 16, CFG.num_key_value_heads, CFG.head_dim),
              torch.zeros(64 * 16, CFG.num_key_value_heads, CFG.head_dim)) for _ in range(CFG.num_hidden_layers)]

    def before(x, cos, sin, write, read, mask):  # the previous TalkerLayer.forward_paged's quantized branch
        for layer, (pool_k, pool_v) in zip(old, pools):
            q, k, v = layer.qkv(x, cos, sin)
            flat = write.reshape(-1)
            pool_k.index_put_((flat,), k.view(flat.shape[0], *pool_k.shape[1:]))
            pool_v.index_put_((flat,), v.view(flat.shape[0], *pool_v.shape[1:]))
            b, n = read.shape
            keys, values = (pool.index_select(0, read.reshape(-1)).view(b, n, -1) for pool in (pool_k, pool_v))
            x = layer.attend_mlp(x, q, keys, values, mask)
        return x

    def after(x, cos, sin, write, read, mask):
        kvs = [GatheredKV(pool_k, pool_v, write, read, mask, core) for pool_k, pool_v in pools]
        for layer, kv in zip(new, kvs):
            x = layer(x, cos, sin, kv)
        return x

    inv_freq = rope_inv_freq(CFG.head_dim, CFG.rope_theta)
    print(f"int{args.bits} talker layers at the 0.6B sizes, {CFG.num_hidden_layers} per forward, 1 thread; before = "
          f"{args.baseline_commit}; load average {os.getloadavg()[0]:.2f}")
    print(f"{'shape':>22} | {'before ms min / med':>20} | {'after ms min / med':>20} | after / before | same bits")
    for s, length, reps in ((1, 100, args.reps), (65, 65, max(3, args.reps // 3))):
        positions = torch.arange(length - s, length)[None]
        cos, sin = prepare_rope(*mrope_cos_sin(inv_freq, positions[None].expand(3, 1, s), CFG.mrope_section,
                                               CFG.mrope_interleaved, torch.float32))
        read = torch.arange(-(-length // 16) * 16)[None]
        mask = (read[:, None, :] <= positions[:, :, None])[:, None]
        inputs = (torch.randn(1, s, CFG.hidden_size, generator=g) * 0.1, cos, sin, positions, read, mask)
        times = {"before": [], "after": []}
        with torch.no_grad():
            same = torch.equal(before(*inputs), after(*inputs))
            for r in range(reps):
                for name in ("before", "after") if r % 2 == 0 else ("after", "before"):
                    t0 = time.thread_time()
                    (before if name == "before" else after)(*inputs)
                    times[name].append((time.thread_time() - t0) * 1e3)
        mins = {k: min(v) for k, v in times.items()}
        meds = {k: statistics.median(v) for k, v in times.items()}
        label = "decode position" if s == 1 else f"{s}-position prompt"
        print(f"{label:>22} | {mins['before']:8.1f} / {meds['before']:8.1f} | {mins['after']:8.1f} / "
              f"{meds['after']:8.1f} | {meds['after'] / meds['before']:14.3f} | {same}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
