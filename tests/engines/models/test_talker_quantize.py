"""``quantize="int8"`` (engines/models/quantize.py): int8 linear layers against a naive
reference, the served source running on them, and refusals. Fidelity against fp32 on the
oracle checkpoints is measured by benchmarks/quantize_fidelity.py (docs/QUANTIZATION.md),
not asserted: int8 greedy codes are not the official ones."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engines.contract import SynthesisRequest
from engines.models.quantize import REDUCE_RANGE, Int8Linear, quantize_talker
from engines.pipelines.talker.source import TalkerSource
from tests.talker_helpers import make_bundle, step


def naive_int8_linear(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """Per-channel symmetric int8 weights, per-tensor asymmetric uint8 activations (the
    kernel's scheme), in float64."""
    w = linear.weight.double()
    ws = w.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
    wq = torch.round(w / ws).clamp(-128, 127) * ws
    levels = 127 if REDUCE_RANGE else 255
    lo, hi = min(x.min().item(), 0.0), max(x.max().item(), 0.0)
    scale = (hi - lo) / levels
    zero = round(-lo / scale)
    xq = (torch.round(x.double() / scale) + zero).clamp(0, levels)
    y = (xq - zero) * scale @ wq.T
    return y + (linear.bias.double() if linear.bias is not None else 0)


@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_matches_the_naive_scheme(bias):
    g = torch.Generator().manual_seed(0)
    linear = nn.Linear(256, 384, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(384, 256, generator=g) / 16)
        if bias:
            linear.bias.copy_(torch.randn(384, generator=g))
    x = torch.randn(2, 5, 256, generator=g)
    got = Int8Linear(linear)(x)
    want = naive_int8_linear(linear, x.reshape(-1, 256)).reshape(2, 5, 384)
    exact = linear(x).double()
    scale = exact.abs().max()
    # the kernel's rounding may differ from the naive one by one activation level on a few inputs
    assert ((got.double() - want).abs().max() / scale) < 2e-3
    assert 1e-4 < ((got.double() - exact).abs().max() / scale) < 3e-2  # really quantized, not far off


def test_source_runs_int8_and_the_greedy_codes_follow_the_reference_loop():
    bundle = make_bundle(seed=1, max_new_tokens=12)
    converted = quantize_talker(bundle.talker, bundle.predictor, "int8")
    assert converted == 2 * 7 + 2 * 7 + 3  # 7 linears per layer, 2 + 2 layers, G-1 = 3 predictor heads
    want = bundle.generate_codes("Hello world.", "Ryan", greedy=True)
    source = TalkerSource.from_bundle(bundle, max_slots=1, max_seq_len=128)
    source.admit(SynthesisRequest(id="a", text="Hello world.", voice="Ryan", temperature=0))
    frames = []
    while source.active_slots:
        frames += [f.codes for f in step(source)]
    got = torch.cat(frames)
    assert got.shape == want.shape and torch.equal(got, want)


def test_refuses_what_it_cannot_run():
    bundle = make_bundle(seed=1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        quantize_talker(bundle.talker, bundle.predictor, "int8")
    fused = make_bundle(seed=1)
    fused.talker.fuse_projections(measure=False)
    with pytest.raises(ValueError, match="before the projections are fused"):
        quantize_talker(fused.talker, fused.predictor, "int8")
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_talker(fused.talker, fused.predictor, "int4")
