"""The talker's decode layer as fused Triton kernels (engines/models/fused_talker.py), and the whole
decode step with both fused parts (talker layers and the code predictor's frame), against the plain
modules on this CPU under Triton's interpreter.

The kernels run in a subprocess (``TRITON_INTERPRET`` must be set before Triton defines a kernel)
that saves its outputs; this process builds the same bundle from the same seeds and computes the
reference: the layer's decode over the gathered pool (the CPU path), and the plain reference loop
(``TalkerBundle.generate_codes``, itself equal to the official ``generate()``) for the step.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engines.contract import SynthesisRequest
from engines.models.paged_kv import PagedKVCache
from engines.pipelines.talker.source import SourceRunners, TalkerSource
from testsupport.talker import admissible, make_bundle, step

ROOT = Path(__file__).resolve().parents[3]
TOL = 1e-5
RELEASED_0_6B = dict(hidden=1024, intermediate=3072, heads=16, kv_heads=8, head_dim=128, layers=1)  # M-RoPE 24/20/20
STREAMS = [  # (text, voice, language, greedy, seed): one greedy row and one sampled row side by side
    ("Hello world, this is a small test of streaming speech.", "Vivian", "English", True, 0),
    ("the quick brown fox jumps over the lazy dog", "Ryan", "Auto", False, 77),
]
FRAMES = 33  # max_new_tokens 34: the reference loop yields 33 frames unless EOS wins first


def layer_case(sizes: dict, seed: int, device="cpu", dtype=torch.float32):
    """A talker, a pool holding random K/V for rows of 5, 33 and 70 positions (row 3 holds no
    block: a padding row) and one decode position per row."""
    bundle = make_bundle(seed=seed, device=device, dtype=dtype, **sizes)
    talker, cfg = bundle.talker, bundle.talker.cfg
    cache = PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 32, 16, 4, 128,
                         torch.device(device), dtype)
    g = torch.Generator().manual_seed(seed + 1)
    for layer in range(cfg.num_hidden_layers):
        cache.k[layer].copy_(torch.randn(cache.k[layer].shape, generator=g))
        cache.v[layer].copy_(torch.randn(cache.v[layer].shape, generator=g))
    for row, n in enumerate((5, 33, 70)):
        cache.reserve(row, n + 1)
    cache.flush()
    x = torch.randn(4, 1, cfg.hidden_size, generator=g).to(device, dtype)
    return talker, cache, x, torch.tensor([0, 1, 2, 3], device=device), torch.tensor([[5], [33], [70], [0]], device=device)


def decode_step(talker, cache, x, rows, positions):
    with torch.no_grad():
        h = talker.forward_paged(x, positions, cache, rows, 5, talker.rope_table(128, x.dtype))
    return h, torch.stack(cache.k), torch.stack(cache.v)


def stream_bundle():
    return make_bundle(seed=4, eos_gain=0.5, max_new_tokens=FRAMES + 1)


def run_streams(source: TalkerSource) -> dict[str, torch.Tensor]:
    """Both streams admitted together, stepped to their ends; their frames in order."""
    for i, (text, voice, language, greedy, seed) in enumerate(STREAMS):
        source.admit(SynthesisRequest(id=f"s{i}", text=text, voice=voice, language=language, greedy=greedy,
                                      seed=seed), max_new_tokens=FRAMES + 1)
    frames: dict[str, list] = {}
    while source.active_slots:
        for f in step(source):
            frames.setdefault(f.request_id, []).append(f.codes)
    return {rid: torch.cat(parts) for rid, parts in frames.items()}


def _interpreted(out_path: str) -> None:
    """This file's subprocess half: the fused kernels, outputs saved."""
    from engines.models.fused_predictor import FusedCodePredictor
    from engines.models.fused_talker import FusedDecodeLayers

    results = {}
    for name, sizes, seed in (("small", {}, 1), ("released", RELEASED_0_6B, 2)):
        talker, *case = layer_case(sizes, seed)
        talker.fused_decode_step = FusedDecodeLayers(talker)
        results[name] = decode_step(talker, *case)
    kernels = SourceRunners(predictor_kernels=lambda predictor: FusedCodePredictor(predictor, mode="persistent"))
    source = TalkerSource.from_bundle(stream_bundle(), max_slots=2, max_seq_len=128, runners=kernels)
    source.talker.fused_decode_step = FusedDecodeLayers(source.talker)
    assert admissible(source) == 2
    results["streams"] = run_streams(source)
    torch.save(results, out_path)


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    pytest.importorskip("triton")
    out = tmp_path_factory.mktemp("fused_talker") / "out.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    run = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(out)


@pytest.mark.parametrize("name, sizes, seed", [("small", {}, 1), ("released", RELEASED_0_6B, 2)])
def test_fused_decode_layer_equals_the_layer_over_the_gathered_pool(fused, name, sizes, seed):
    """Hidden state and every K/V the step wrote, fp32 within 1e-5: the test bundle's sizes, and the
    released 0.6B talker's widths (hidden 1024, 16 / 8 heads of 128, intermediate 3072, M-RoPE
    sections 24 / 20 / 20; one of its 28 layers)."""
    got_h, got_k, got_v = fused[name]
    want_h, want_k, want_v = decode_step(*layer_case(sizes, seed))
    assert (got_h[:3] - want_h[:3]).abs().max() <= TOL * max(1.0, float(want_h.abs().max()))
    assert (got_k - want_k).abs().max() <= TOL * max(1.0, float(want_k.abs().max()))
    assert (got_v - want_v).abs().max() <= TOL * max(1.0, float(want_v.abs().max()))


def test_the_fused_step_gives_the_reference_codes_over_32_frames(fused):
    """Talker layers and code predictor fused, a greedy and a sampled stream in one batch: every
    code of every frame equals the plain reference loop's, each stream alone."""
    bundle = stream_bundle()
    for i, (text, voice, language, greedy, seed) in enumerate(STREAMS):
        want = bundle.generate_codes(text, voice, language, greedy=greedy, max_new_tokens=FRAMES + 1, seed=seed)
        got = fused["streams"][f"s{i}"]
        assert want.shape[0] >= 32, "the stream should run at least 32 frames"
        assert torch.equal(got, want), (i, (got != want).nonzero()[:5].tolist() if got.shape == want.shape else got.shape)


# --------------------------------------------------------------------------- on a GPU (scripts/gpu-verify.sh fused)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_on_cuda_the_fused_layer_equals_the_layer_at_the_released_widths(dtype):
    """fp32 within 1e-4 (IEEE dots: no TF32), bf16 within bf16's rounding (both sides round at the
    same points, sum in another order); the K/V written too."""
    pytest.importorskip("triton")
    from engines.models.fused_talker import FusedDecodeLayers

    want = decode_step(*layer_case(RELEASED_0_6B, 2, "cuda", dtype))
    talker, *case = layer_case(RELEASED_0_6B, 2, "cuda", dtype)
    talker.fused_decode_step = FusedDecodeLayers(talker)
    got = decode_step(talker, *case)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for g, w, what in zip(got, want, ("hidden", "keys", "values")):
        g, w = (g[:3], w[:3]) if what == "hidden" else (g, w)
        err = float((g.float() - w.float()).abs().max()) / max(1.0, float(w.float().abs().max()))
        assert err <= tol, (what, err)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_graphed_fused_step_gives_the_reference_codes():
    """Both fused parts inside the step's CUDA graphs (as the engine switches them on), fp32: every
    code of both streams equals the plain reference loop's."""
    pytest.importorskip("triton")
    from engines.models.fused_predictor import FusedCodePredictor
    from engines.models.fused_talker import FusedDecodeLayers
    from engines.runtime.graphed_talker import GraphedTalkerStep

    bundle = make_bundle(seed=4, eos_gain=0.5, max_new_tokens=FRAMES + 1, device="cuda")
    runners = SourceRunners(predictor_kernels=lambda predictor: FusedCodePredictor(predictor, mode="persistent"),
                            step=GraphedTalkerStep)
    bundle.talker.fused_decode_step = FusedDecodeLayers(bundle.talker)
    source = TalkerSource.from_bundle(bundle, max_slots=2, max_seq_len=128, runners=runners)
    got = run_streams(source)
    assert source.step_runner.captures > 0
    reference = make_bundle(seed=4, eos_gain=0.5, max_new_tokens=FRAMES + 1, device="cuda")
    for i, (text, voice, language, greedy, seed) in enumerate(STREAMS):
        want = reference.generate_codes(text, voice, language, greedy=greedy, max_new_tokens=FRAMES + 1, seed=seed)
        assert torch.equal(got[f"s{i}"].cpu(), want.cpu()), i


if __name__ == "__main__":  # the interpreted half, in its own process
    _interpreted(sys.argv[1])
