"""Decode attention read from the paged KV pool in place (engines/models/paged_attention.py).

The reference is held to the engine's gather + SDPA path; the Triton kernel is held to the
reference, and the talker's decode step reading the pool in place to its gather path, on this CPU
under Triton's interpreter (in a subprocess: ``TRITON_INTERPRET`` must be
set before Triton compiles anything) and on a GPU natively. Tolerances: float32 1e-5 (the same
sums in another order); bfloat16 torch's default for bf16 (rtol 1.6e-2: one or two ulps, both
accumulate in fp32 and round once).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engines.models.layers import attend
from engines.models.paged_attention import paged_decode_attention, reference_decode_attention

ROOT = Path(__file__).resolve().parents[3]


def random_pool(batch=5, heads=4, kv_heads=2, head_dim=16, block=16, blocks=24, lengths=(1, 16, 17, 40, 90),
                dtype=torch.float32, device="cpu", seed=0):
    """A pool with rows whose blocks are scattered through it, and their query vectors."""
    g = torch.Generator().manual_seed(seed)
    pool_k = torch.randn(blocks * block, kv_heads, head_dim, generator=g).to(device, dtype)
    pool_v = torch.randn(blocks * block, kv_heads, head_dim, generator=g).to(device, dtype)
    widest = max(-(-n // block) for n in lengths) + 1
    table = torch.zeros(batch, widest, dtype=torch.int64)
    order = (torch.randperm(blocks - 1, generator=g) + 1).tolist()  # block 0 is the null block
    for r, n in enumerate(lengths):
        need = -(-n // block)
        table[r, :need] = torch.tensor(order[:need])
        order = order[need:]
    q = torch.randn(batch, heads, head_dim, generator=g).to(device, dtype)
    return q, pool_k, pool_v, table.to(device), torch.tensor(lengths, device=device), block


def test_reference_equals_the_gather_and_sdpa_path():
    q, pool_k, pool_v, table, lengths, block = random_pool()
    b, h, hd = q.shape
    slots = (table[:, :, None] * block + torch.arange(block)).reshape(b, -1)
    k, v = pool_k[slots].transpose(1, 2), pool_v[slots].transpose(1, 2)  # [B, KVH, L, hd]
    mask = (torch.arange(slots.shape[1])[None, :] < lengths[:, None])[:, None, None, :]
    expected = attend(q[:, :, None], k, v, mask, hd**-0.5)[:, 0]
    got = reference_decode_attention(q, pool_k, pool_v, table, lengths, hd**-0.5, block)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _paged_forwards(bundle, read_in_place: bool) -> torch.Tensor:
    """A talker decode step of 4 rows (row 3 a padding row that holds no block) over a pool of random
    K/V, reading the pool in place or gathering it (``read_in_place``: RuntimeSwitches.paged_attention)."""
    from engines.models.paged_kv import PagedKVCache

    talker, cfg = bundle.talker, bundle.talker.cfg
    cache = PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 32, 16, 4, 128,
                         torch.device("cpu"), torch.float32, read_in_place=read_in_place)
    assert cache.reads_in_place == read_in_place
    g = torch.Generator().manual_seed(2)
    for layer in range(cfg.num_hidden_layers):
        cache.k[layer].copy_(torch.randn(cache.k[layer].shape, generator=g))
        cache.v[layer].copy_(torch.randn(cache.v[layer].shape, generator=g))
    for row, n in enumerate((5, 33, 70)):
        cache.reserve(row, n + 1)
    cache.flush()
    rope = talker.rope_table(128, torch.float32)
    rows = torch.tensor([0, 1, 2, 3])
    positions = torch.tensor([[5], [33], [70], [0]])
    x = torch.randn(4, 1, cfg.hidden_size, generator=g)
    with torch.no_grad():
        return talker.forward_paged(x, positions, cache, rows, 5, rope)[:3]


def _interpreted_checks() -> dict:
    """Run under TRITON_INTERPRET=1: the kernel vs the reference, and a talker decode step
    reading the pool in place vs the gather path (the cache's switch; the environment variable
    STREAMVOX_PAGED_ATTENTION is the service's settings', which the engine never reads), fp32 and
    on a quantized talker's swapped-in modules (the same layer forward)."""
    from engines.models.paged_attention import kernel_available
    from engines.models.quantize import quantize_talker
    from testsupport.talker import make_bundle

    out = {"kernel_available": kernel_available(torch.device("cpu"))}
    for name, kw in {"fp32": {}, "bf16_gqa8": dict(heads=16, dtype=torch.bfloat16)}.items():
        q, pool_k, pool_v, table, lengths, block = random_pool(**kw)
        got = paged_decode_attention(q, pool_k, pool_v, table, lengths, 0.25, block)
        ref = reference_decode_attention(q, pool_k, pool_v, table, lengths, 0.25, block)
        torch.testing.assert_close(got, ref)  # dtype defaults: fp32 1.3e-6, bf16 1.6e-2
        out[name] = float((got.float() - ref.float()).abs().max())

    os.environ["STREAMVOX_PAGED_ATTENTION"] = "0"  # not the engine's to read: the switch below decides
    bundle = make_bundle(seed=1)
    in_place, gathered = _paged_forwards(bundle, True), _paged_forwards(bundle, False)
    torch.testing.assert_close(in_place, gathered, rtol=1e-5, atol=1e-5)
    out["talker"] = float((in_place - gathered).abs().max())
    quantize_talker(bundle.talker, bundle.predictor, "int8")
    in_place, gathered = _paged_forwards(bundle, True), _paged_forwards(bundle, False)
    out["talker_int8"] = float(((in_place - gathered).norm(dim=-1) / gathered.norm(dim=-1)).max())

    # the switch as the engine's adapter hands it to the talker source (its step graphs then bucket
    # KV blocks, or not)
    from engines.config import EngineConfig, RuntimeSwitches
    from engines.pipelines.profile import PipelineSetup
    from engines.pipelines.talker.adapter import real_source

    for on in (True, False):
        config = EngineConfig.for_tests(switches=RuntimeSwitches(paged_attention=on, static_step_on_cpu=True))
        setup = PipelineSetup(models=None, parts=make_bundle(seed=1), device=torch.device("cpu"), dtype=torch.float32,
                              max_slots=2, vocalizer=None, config=config)
        source, _ = real_source(setup)
        out[f"switch {on}"] = [source.cache.reads_in_place, source.step_runner.spec.bucket_blocks]
    return out


def test_kernel_equals_the_reference_under_the_triton_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["kernel_available"], "the interpreter should run the kernel on CPU tensors"
    assert result["fp32"] < 1e-5 and result["talker"] < 1e-5
    # the kernel against ORT's attention core, around int8 activations: rounding moves an activation
    # by a level at most now and then (~5e-3 of the hidden state at these widths); a wrong slot,
    # position or head moves it by its own scale
    assert result["talker_int8"] < 3e-2
    assert result["switch True"] == [True, False] and result["switch False"] == [False, True]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernel_equals_the_reference_on_cuda_at_the_released_sizes():
    pytest.importorskip("triton")
    for dtype in (torch.float32, torch.bfloat16):
        q, pool_k, pool_v, table, lengths, block = random_pool(
            batch=9, heads=16, kv_heads=8, head_dim=128, blocks=400, lengths=(1, 2, 15, 16, 17, 100, 513, 1000, 3000),
            dtype=dtype, device="cuda")
        got = paged_decode_attention(q, pool_k, pool_v, table, lengths, 128**-0.5, block)
        ref = reference_decode_attention(q, pool_k, pool_v, table, lengths, 128**-0.5, block)
        torch.testing.assert_close(got, ref, rtol=1e-4 if dtype == torch.float32 else 1.6e-2,
                                   atol=1e-4 if dtype == torch.float32 else 1e-2)


if __name__ == "__main__":  # the interpreted half, in its own process
    print(json.dumps(_interpreted_checks()))
