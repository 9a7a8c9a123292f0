"""``quantize="int8"`` / ``"int4"`` (engines/models/quantize*.py): quantized layers against
naive references, the served source running on them, the CPU default, and refusals. Fidelity
against fp32 is measured by benchmarks/quantize_fidelity.py (docs/QUANTIZATION.md), not
asserted: quantized greedy codes are not the official ones."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from engines.contract import SynthesisRequest
from engines.models.quantize import CPU_DEFAULT, REDUCE_RANGE, Int8Linear, quantize_talker, resolve_quantize
from engines.models.quantize_nbits import block_for, convert_layer, pack_nbits
from engines.models.sampling import FrameSampling
from engines.pipelines.talker.source import TalkerSource
from testsupport.talker import make_bundle, step


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


def test_int4_packing_round_trips_and_keeps_zero_exact():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 256, generator=g)
    w[0, :128] = 0.0  # a block of zeros
    packed, scales, zeros, dequant = pack_nbits(w, 4, 128)
    assert packed.shape == (8, 2, 64) and scales.shape == (16,) and zeros.shape == (8,)
    assert torch.all(dequant[0, :128] == 0)
    codes = torch.stack([torch.from_numpy(packed) & 15, torch.from_numpy(packed) >> 4], -1).reshape(8, 2, 128)
    zp = torch.from_numpy(zeros)
    z = torch.stack([zp & 15, zp >> 4], -1).reshape(8, 2).float()
    again = (codes.float() - z[..., None]) * torch.from_numpy(scales).reshape(8, 2, 1)
    assert torch.equal(again.reshape(8, 256), dequant)
    step = torch.from_numpy(scales).reshape(8, 2).repeat_interleave(128, 1)
    assert torch.all((dequant - w).abs() <= step / 2 + 1e-6)  # rounding to the nearest of 16 levels
    assert block_for(1024) == 128 and block_for(96) == 32 and block_for(32) == 32 and block_for(40) is None


@pytest.mark.parametrize("bits", [4, 8])
def test_nbits_layer_matches_the_dequantized_fp32_layer(bits):
    """A converted decoder layer (three ORT calls, norms inside) computes what the fp32 layer with
    the dequantized weights computes, up to its int8 activations, and is really quantized."""
    bundle = make_bundle(seed=3, hidden=64, head_dim=16, heads=4, kv_heads=2)
    layer = bundle.talker.model.layers[0]
    reference = copy.deepcopy(layer)
    with torch.no_grad():
        for m in reference.modules():
            if isinstance(m, nn.Linear):
                m.weight.copy_(pack_nbits(m.weight, bits, block_for(m.in_features))[3])
    converted = copy.deepcopy(layer)
    assert convert_layer(converted, bits) == 7
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(1))
    cos, sin = (t[None] for t in bundle.talker.rope_table(3, torch.float32))  # [1, S, hd]
    with torch.no_grad():
        for got, want, exact in zip(converted.qkv(x, cos, sin), reference.qkv(x, cos, sin), layer.qkv(x, cos, sin)):
            assert ((got - want).norm() / want.norm()) < 2e-2
            assert ((got - exact).norm() / exact.norm()) > 1e-4
        a = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(2))
        got, want = converted.after_attention(x, a), reference.after_attention(x, a)
        # the MLP branch: its int8 activations cost 1.4-2.1 % (200 random inputs); a wrong weight, O(1)
        assert ((got - want).norm() / (want - x - a).norm()) < 3e-2


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("predictor_head_dim", [8, 16])  # 16: the predictor's layers as one call per pass
def test_source_runs_quantized_and_the_greedy_codes_follow_the_reference_loop(mode, predictor_head_dim):
    bundle = make_bundle(seed=1, max_new_tokens=12, predictor_head_dim=predictor_head_dim)
    converted = quantize_talker(bundle.talker, bundle.predictor, mode)
    assert converted == 2 * 7 + 2 * 7 + 3  # 7 linears per layer, 2 + 2 layers, G-1 = 3 predictor heads
    assert (bundle.predictor.fused_layers is not None) == (predictor_head_dim == 16)
    want = bundle.generate_codes("Hello world.", "Ryan", greedy=True)
    source = TalkerSource.from_bundle(bundle, max_slots=1, max_seq_len=128)
    source.admit(SynthesisRequest(id="a", text="Hello world.", voice="Ryan", temperature=0))
    frames = []
    while source.active_slots:
        frames += [f.codes for f in step(source)]
    got = torch.cat(frames)
    assert got.shape == want.shape and torch.equal(got, want)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_fused_predictor_computes_what_the_per_layer_calls_compute(mode):
    """The predictor's layers as one ORT call per pass (GroupQueryAttention over its own K/V cache)
    against the per-layer calls (three per layer around torch's attention and cache): the same packed
    weights and int8 activations, so the only difference is attention and RoPE in ORT's fp32 kernels
    instead of torch's, a rounding-level one: most logits equal to ~1e-7 of their scale; where that
    moves one activation to the next int8 level, the frame's logits move by up to ~2e-3 of their scale
    (int4, measured). The bound, 1e-2 of the scale (RMS), is far below what a wrong position, mask or
    cache slot does (the logits' own scale). Several frames reuse the cache; rows of a batch stay apart."""
    per_layer = make_bundle(seed=2, groups=16, hidden=64, predictor_hidden=64, predictor_head_dim=16)
    fused = copy.deepcopy(per_layer)
    quantize_talker(per_layer.talker, per_layer.predictor, mode, fused=False)
    quantize_talker(fused.talker, fused.predictor, mode)
    assert per_layer.predictor.fused_layers is None and fused.predictor.fused_layers is not None
    g = torch.Generator().manual_seed(0)
    for frame, rows in enumerate([1, 3, 1, 2]):
        h, emb = torch.randn(rows, 64, generator=g), torch.randn(rows, 64, generator=g)
        sampling = FrameSampling.for_stream(rows, 0, frame, "cpu", greedy=True, temperature=1.0, top_k=50, top_p=1.0)
        want_codes, want = per_layer.predictor.predict(h, emb, sampling, return_logits=True)
        got_codes, got = fused.predictor.predict(h, emb, sampling, return_logits=True)
        assert ((got - want).norm() / want.norm()) < 1e-2
        assert torch.equal(got_codes, want_codes)
        alone = fused.predictor.predict(h[-1:], emb[-1:], sampling, return_logits=True)[1]  # a row without the others
        assert ((alone[0] - want[-1]).norm() / want[-1].norm()) < 1e-2


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_ort_attention_computes_what_torch_attention_computes(mode):
    """The talker's attention on ORT's kernel (OrtAttention, swapped in for torch's SDPA) against torch's:
    the same swapped-in layer modules and packed weights, rounding-level differences, over a prompt and
    then steps on the paged cache of the served source, and on the dense cache of the reference loop. At
    this tiny width (blocks of 32 inputs) one activation moved to the next int8 level moves the
    hidden state by up to ~5e-3 of its norm (measured); a RoPE sign error moves it by 0.1-1.4, so
    the bound is 3e-2."""
    from engines.models.layers import ScaledDotProduct
    from engines.models.quantize_nbits import OrtAttention

    per_layer = make_bundle(seed=4, max_new_tokens=6)
    fused = copy.deepcopy(per_layer)
    quantize_talker(per_layer.talker, per_layer.predictor, mode, fused=False)
    quantize_talker(fused.talker, fused.predictor, mode)
    assert isinstance(fused.talker.attention_core, OrtAttention)
    assert isinstance(per_layer.talker.attention_core, ScaledDotProduct)
    hidden = {}
    for name, bundle in (("per_layer", per_layer), ("fused", fused)):
        source = TalkerSource.from_bundle(bundle, max_slots=1, max_seq_len=64)
        source.admit(SynthesisRequest(id="a", text="Hello world.", voice="Ryan", temperature=0))
        states = []
        for _ in range(4):
            step(source)
            states.append(source.state.h[:1].clone())  # the talker's last hidden state of the row
        hidden[name] = torch.cat(states)
        x = torch.randn(1, 5, bundle.talker.cfg.hidden_size, generator=torch.Generator().manual_seed(5))
        cache = bundle.talker.new_cache(1, 8, "cpu", torch.float32)
        with torch.no_grad():
            hidden[name + " dense"] = bundle.talker(x, torch.arange(5)[None], cache)
    for key in ("", " dense"):
        want, got = hidden["per_layer" + key], hidden["fused" + key]
        assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max() < 3e-2


@pytest.mark.parametrize("predictor_head_dim", [8, 16])  # 16: the predictor's layers as one call per pass
def test_mixed_mode_is_the_int8_talker_with_the_int4_predictor(predictor_head_dim):
    """``int8-int4p`` builds the int8 mode's talker layers and the int4 mode's predictor (layers,
    heads, input projection) from the same blocks: the same outputs, bit for bit, on the same inputs."""
    built = {}
    for mode in ("int8", "int4", "int8-int4p"):
        bundle = built[mode] = make_bundle(seed=3, predictor_head_dim=predictor_head_dim)
        assert quantize_talker(bundle.talker, bundle.predictor, mode) == 2 * 7 + 2 * 7 + 3
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, built["int8"].talker.cfg.hidden_size, generator=g)
    h, emb = (torch.randn(2, built["int8"].predictor.cfg.talker_hidden_size, generator=g) for _ in range(2))
    sampling = FrameSampling.for_stream(2, 0, 0, "cpu", greedy=True, temperature=1.0, top_k=50, top_p=1.0)
    out = {}
    with torch.no_grad():
        for mode, bundle in built.items():
            cache = bundle.talker.new_cache(2, 8, "cpu", torch.float32)
            out[mode] = (bundle.talker(x, torch.arange(5)[None].expand(2, -1), cache),
                         bundle.predictor.predict(h, emb, sampling, return_logits=True)[1])
    assert torch.equal(out["int8-int4p"][0], out["int8"][0])
    assert torch.equal(out["int8-int4p"][1], out["int4"][1])
    assert not torch.equal(out["int8-int4p"][0], out["int4"][0])  # the two modes differ where they should
    assert not torch.equal(out["int8-int4p"][1], out["int8"][1])


def test_refuses_what_it_cannot_run():
    bundle = make_bundle(seed=1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        quantize_talker(bundle.talker, bundle.predictor, "int8")
    fused = make_bundle(seed=1)
    fused.talker.fuse_projections(measure=False)
    with pytest.raises(ValueError, match="before the projections are fused"):
        quantize_talker(fused.talker, fused.predictor, "int8")
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_talker(fused.talker, fused.predictor, "int3")


def test_the_cpu_default_is_for_a_float32_talker_on_a_cpu():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_quantize("auto", cpu, torch.float32, talker=True) == CPU_DEFAULT
    assert resolve_quantize("auto", cpu, torch.bfloat16, talker=True) is None
    assert resolve_quantize("auto", cuda, torch.bfloat16, talker=True) is None
    assert resolve_quantize("auto", cpu, torch.float32, talker=False) is None  # the DiT pipeline
    assert resolve_quantize("none", cpu, torch.float32, talker=True) is None
    assert resolve_quantize(None, cpu, torch.float32, talker=True) is None
    assert resolve_quantize("int4", cpu, torch.float32, talker=True) == "int4"
    assert resolve_quantize("int8-int4p", cpu, torch.float32, talker=True) == "int8-int4p"


@pytest.mark.parametrize("asked, runs", [("auto", CPU_DEFAULT), ("none", "none"), (None, "none"),
                                        ("int8-int4p", "int8-int4p")])
def test_built_engine_runs_and_names_the_mode(asked, runs):
    """``--quantize auto`` (the service's default) quantizes a talker on CPU; ``none`` and the
    library default keep fp32 (the parity tests' engines); a named mode runs as named (what
    /v1/models reports: ``engine.info.quantize``)."""
    from engines.build import build_engine
    from engines.config import EngineConfig
    from tests.oracle import talker_fixtures as fx

    engine = build_engine(EngineConfig.for_tests(checkpoint=str(fx.checkpoint_dir("cv_proj")), warmup=False,
                                                 quantize=asked))
    assert engine.info.quantize == runs


def test_without_onnxruntime_int8_runs_torch_kernels_and_int4_is_refused(monkeypatch):
    from engines.models import quantize_nbits

    monkeypatch.setattr(quantize_nbits, "available", lambda: False)
    bundle = make_bundle(seed=1)
    assert quantize_talker(bundle.talker, bundle.predictor, "int8") == 2 * 7 + 2 * 7 + 3
    assert isinstance(bundle.talker.model.layers[0].mlp.down_proj, Int8Linear)
    for mode in ("int4", "int8-int4p"):
        with pytest.raises(ValueError, match="needs onnxruntime"):
            quantize_talker(*(lambda b: (b.talker, b.predictor))(make_bundle(seed=1)), mode)
    assert resolve_quantize("auto", torch.device("cpu"), torch.float32, talker=True) in ("int8", CPU_DEFAULT)


def odd_width_checkpoint(directory, intermediate: int = 40):
    """The cv_ident fixture with both MLPs ``intermediate`` wide (fresh fan-in scaled weights): the
    down projections then take 40 input channels, which no MatMulNBits block (16 or more) divides."""
    import json
    import math
    import shutil

    from safetensors.torch import load_file, save_file

    from tests.oracle import talker_fixtures as fx

    shutil.copytree(fx.checkpoint_dir("cv_ident"), directory)
    config = json.loads((directory / "config.json").read_text())
    for part in (config["talker_config"], config["talker_config"]["code_predictor_config"]):
        part["intermediate_size"] = intermediate
    (directory / "config.json").write_text(json.dumps(config))
    weights = load_file(str(directory / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    for key, value in list(weights.items()):
        if ".mlp." in key and key.startswith("talker."):
            rows, cols = value.shape
            shape = (rows, intermediate) if key.endswith("down_proj.weight") else (intermediate, cols)
            weights[key] = (torch.randn(shape, generator=g) / math.sqrt(shape[1])).to(value.dtype)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


@pytest.mark.parametrize("asked", ["auto", "int8", "int4"])
def test_odd_widths_stay_fp32_per_matrix_and_say_so_once(asked, tmp_path, caplog):
    """A checkpoint whose MLP width (40) no MatMulNBits block divides starts: its down projections
    stay fp32, every other matrix is quantized, and one warning says how many and why (it used to
    refuse to load: "40 input channels are not a multiple of 16")."""
    from engines.build import build_engine
    from engines.config import EngineConfig

    directory = odd_width_checkpoint(tmp_path / "odd")
    with caplog.at_level("WARNING", logger="streamvox.quantize"):
        engine = build_engine(EngineConfig.for_tests(checkpoint=str(directory), warmup=False, quantize=asked))
    assert engine.info.quantize == (CPU_DEFAULT if asked == "auto" else asked)
    lines = [r.getMessage() for r in caplog.records if r.name == "streamvox.quantize"]
    layers = 2 + 2  # the fixture's talker and predictor layers: one down projection each
    assert len(lines) == 1 and f"{layers} of the talker's and code predictor's weight matrices stay fp32" in lines[0]
    assert "input widths (40) are not a multiple of 16" in lines[0]


@pytest.mark.parametrize("fused", [True, False])
def test_odd_width_layers_compute_in_fp32_and_the_source_runs(fused):
    """The matrices left in fp32 are exactly the odd-width ones, and a quantized source over them
    generates the reference loop's greedy codes."""
    from engines.models.quantize import kept_fp32

    bundle = make_bundle(seed=1, max_new_tokens=8, hidden=64, intermediate=40, predictor_hidden=64,
                         predictor_intermediate=40, predictor_head_dim=16)
    quantize_talker(bundle.talker, bundle.predictor, "int8", fused=fused)
    assert kept_fp32(bundle.talker, bundle.predictor) == [(64, 40)] * 4
    want = bundle.generate_codes("Hello world.", "Ryan", greedy=True)
    source = TalkerSource.from_bundle(bundle, max_slots=1, max_seq_len=128)
    source.admit(SynthesisRequest(id="a", text="Hello world.", voice="Ryan", temperature=0))
    frames = []
    while source.active_slots:
        frames += [f.codes for f in step(source)]
    assert torch.equal(torch.cat(frames), want)
