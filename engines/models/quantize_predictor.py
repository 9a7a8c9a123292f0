"""The quantized code predictor's decoder layers as ONE ONNX Runtime call per pass (CPU,
``--quantize int8`` / ``int4`` with onnxruntime).

    layers = NBitsPredictorLayers(predictor, bits=8)   # engines/models/quantize.py builds it
    h = layers(x, pos)   # x [B, S, D] at positions pos..pos+S-1 -> final-normed hidden [B, D]

A frame runs the predictor 15 times over 5 layers. Run layer by layer (quantize_nbits.py's three
calls around torch's attention), each pass is 15 ORT calls and ~200 small torch ops (RoPE, K/V
writes, SDPA, views), which at batch 1 cost about as much as the pass's int4 weights. Here a pass
is one graph: every layer's norms and projections (``MatMulNBits``, the same packed weights as the
per-layer calls), attention as ORT's ``GroupQueryAttention`` (RoPE inside, from tables computed
as the torch path computes them), the MLP, and the final norm. Measured at the released sizes, 1
thread: the predictor's share of a frame int8 92 -> 59 ms, int4 70 -> 39 ms (benchmarks/RESULTS.md).

The K/V cache is this module's own: per layer [B, KVH, G, hd] (G = code groups, every position a
frame's passes reach), kept per batch size. Each layer's past and present K/V are bound to the same
buffer, so the operator writes the new positions in place (no copy in torch or ORT); the lengths of
a pass (``seqlens_k``, ``total_len``) and the cache are bound once per (B, pos, S), and a pass binds
only its input and output. ORT's CPU ``GroupQueryAttention`` takes a head size that is a multiple
of 16 (``supports``); quantize_talker keeps the per-layer calls for other (test-sized) predictors.

Numerics: the same weights and int8 activations as the per-layer calls; attention and RoPE in
ORT's fp32 kernels instead of torch's: rounding-level differences, which now and then move an
activation to the next int8 level (tests/engines/models/test_talker_quantize.py compares the two
paths; docs/QUANTIZATION.md's fidelity figures are measured on this path).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from engines.models.quantize_nbits import BLOCK, _Graph


class NBitsPredictorLayers(nn.Module):
    """All of a ``CodePredictor``'s decoder layers and its final norm in one ORT session."""

    @staticmethod
    def supports(cfg) -> bool:
        """ORT's CPU ``GroupQueryAttention`` takes heads of a multiple of 16 (the release's: 128)."""
        return cfg.head_dim % 16 == 0

    def __init__(self, predictor: nn.Module, bits: int, block: int = BLOCK):
        super().__init__()
        cfg = predictor.cfg
        layers = predictor.model.layers
        self.groups, self.n_layers = cfg.num_code_groups, len(layers)
        self.hidden, self.n_kv, self.head_dim = cfg.hidden_size, cfg.num_key_value_heads, cfg.head_dim
        self.inv_freq = predictor.inv_freq.detach().to("cpu", torch.float32)
        heads, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        g = _Graph(f"int{bits}_predictor_layers", self.hidden)
        from onnx import TensorProto

        # RoPE's tables [G, hd / 2] for positions 0..G-1, computed as the torch path does
        cos, sin = (t[0, :, : hd // 2].contiguous().numpy() for t in rope_tables(self.inv_freq, torch.arange(self.groups)))
        cos, sin = g.const("cos", cos), g.const("sin", sin)
        x, inputs, outputs = "X", {"X": ["b", "s", self.hidden]}, {}
        inputs["seqlens_k"] = (TensorProto.INT32, ["b"])  # per row: positions after this pass - 1
        inputs["total_len"] = (TensorProto.INT32, [])  # positions after this pass
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            q, k, v = g.norm_qkv(x, layer.input_layernorm, attn, bits, block, lead=2)  # [B, S, heads * hd]
            # the layer's K/V cache [B, KVH, G, hd]: past and present bound to the same buffer
            past, present = [f"past_{kv}_{i}" for kv in "kv"], [f"present_{kv}_{i}" for kv in "kv"]
            for a, b in zip(past, present):
                inputs[a] = ["b", kvh, self.groups, hd]
                outputs[b] = (b, ["b", kvh, self.groups, hd])
            scale = attn.scale if attn.scale is not None else hd ** -0.5
            o = g.op("GroupQueryAttention", [q, k, v, *past, "seqlens_k", "total_len", cos, sin], n_out=3,
                     domain="com.microsoft", num_heads=heads, kv_num_heads=kvh, do_rotary=1, rotary_interleaved=0,
                     scale=float(scale))
            g.nodes[-1].output[1:] = present  # graph outputs themselves (no copy)
            x = g.op("Add", [x, g.nbits_matmul(o[0], attn.o_proj.weight, bits, block)])[0]
            x = g.op("Add", [x, g.norm_mlp(x, layer.post_attention_layernorm, layer.mlp, bits, block)])[0]
        last = g.op("Squeeze", [g.op("Slice", [x, i64c(g, -1), i64c(g, 2**62), i64c(g, 1)])[0], i64c(g, 1)])[0]
        outputs["H"] = (g.rms_norm(last, predictor.model.norm), ["b", self.hidden])  # [B, D]
        g.build(inputs, outputs)
        self._session = g.session
        self.weight_bytes, self.weight_elems, self.kept_fp32 = g.weight_bytes, g.weight_elems, g.kept_fp32
        self._caches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._bindings: dict[tuple[int, int, int], object] = {}

    def _binding(self, b: int, pos: int, s: int):
        """An IO binding with this batch size's cache and the pass's lengths bound (what stays the
        same for every frame's pass at ``pos``)."""
        key = (b, pos, s)
        if key not in self._bindings:
            if b not in self._caches:
                shape = (self.n_layers, b, self.n_kv, self.groups, self.head_dim)
                self._caches[b] = (torch.zeros(shape), torch.zeros(shape))
            binding = self._session.io_binding()
            lengths = (torch.full((b,), pos + s - 1, dtype=torch.int32), torch.tensor(pos + s, dtype=torch.int32))
            for name, t in zip(("seqlens_k", "total_len"), lengths):
                binding.bind_input(name, "cpu", 0, np.int32, list(t.shape), t.data_ptr())
            for i in range(self.n_layers):
                for kv, cache in zip("kv", self._caches[b]):
                    layer = cache[i]
                    binding.bind_input(f"past_{kv}_{i}", "cpu", 0, np.float32, list(layer.shape), layer.data_ptr())
                    binding.bind_output(f"present_{kv}_{i}", "cpu", 0, np.float32, list(layer.shape), layer.data_ptr())
            self._bindings[key] = (binding, lengths)  # the tensors bound by pointer stay alive
        return self._bindings[key][0]

    def forward(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """x [B, S, D] fp32 at positions pos..pos+S-1 (every row; a frame's pass 0 has pos 0, S 2)
        -> the last position's hidden state after the final norm [B, D]; K/V kept for later passes."""
        b, s, _ = x.shape
        if pos + s > self.groups:
            raise ValueError(f"positions up to {pos + s} exceed the predictor's {self.groups} code groups")
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        binding = self._binding(b, pos, s)
        out = torch.empty(b, self.hidden)
        binding.bind_input("X", "cpu", 0, np.float32, [b, s, self.hidden], x.data_ptr())
        binding.bind_output("H", "cpu", 0, np.float32, [b, self.hidden], out.data_ptr())
        self._session.run_with_iobinding(binding)
        return out


def i64c(g: _Graph, *values: int) -> str:
    return g.const("i", np.array(values, np.int64))


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [1, S, hd] in fp32 for positions [S] (``rope_cos_sin`` over one row)."""
    from engines.models.layers import rope_cos_sin

    return rope_cos_sin(inv_freq, positions[None], torch.float32)


__all__ = ["NBitsPredictorLayers"]
