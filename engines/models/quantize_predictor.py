"""The quantized code predictor's decoder layers as ONE ONNX Runtime call per pass (CPU,
``--quantize int8`` / ``int4`` with onnxruntime).

    layers = NBitsPredictorLayers(predictor, bits=8)   # engines/models/quantize.py builds it
    h = layers(x, pos)   # x [B, S, D] at positions pos..pos+S-1 -> final-normed hidden [B, D]

A frame runs the predictor 15 times over 5 layers. Run layer by layer (quantize_nbits.py's three
calls around torch's attention), each pass is 15 ORT calls and ~200 small torch ops (RoPE, K/V
writes, SDPA, views), which at batch 1 cost about as much as the pass's int4 weights. Here a pass
is one graph: every layer's norms, projections (``MatMulNBits``, the same packed weights as the
per-layer calls), RoPE, grouped-query attention over the K/V cache, the MLP, and the final norm.

The K/V cache is this module's own, [G, layers, B, KVH, hd] per batch size (G = code groups:
positions outermost, so the past and the new positions are contiguous slices): the graph reads
``cache[:pos + S]`` (its first ``pos`` positions) and writes the new K/V straight into
``cache[pos:pos + S]`` through output binding, so a pass copies nothing in torch. RoPE tables and
masks per (pos, S) are computed once the way the torch path computes them and bound once per
(B, pos, S) with the cache; a pass binds only its input and output.

Numerics: the same weights and int8 activations as the per-layer calls; attention and RoPE in
ORT's fp32 kernels instead of torch's (rounding-level differences, which can move an activation's
int8 rounding by one level). tests/engines/models/test_talker_quantize.py compares the two paths.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from engines.models.quantize_nbits import BLOCK, _Graph


class NBitsPredictorLayers(nn.Module):
    """All of a ``CodePredictor``'s decoder layers and its final norm in one ORT session."""

    def __init__(self, predictor: nn.Module, bits: int, block: int = BLOCK):
        super().__init__()
        cfg = predictor.cfg
        layers = predictor.model.layers
        self.groups, self.n_layers = cfg.num_code_groups, len(layers)
        self.hidden, self.n_kv, self.head_dim = cfg.hidden_size, cfg.num_key_value_heads, cfg.head_dim
        self.inv_freq = predictor.inv_freq.detach().to("cpu", torch.float32)
        heads, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        rep = heads // kvh
        g = _Graph(f"int{bits}_predictor_layers", self.hidden)
        i64 = lambda *v: g.const("i", np.array(v, np.int64))  # noqa: E731
        # B, S from X [B, S, D]; P (past positions) = T - S from the bound cache [T, L, B, KVH, hd]
        x_shape = g.op("Shape", ["X"])[0]
        bs, s = g.op("Slice", [x_shape, i64(0), i64(2)])[0], g.op("Slice", [x_shape, i64(1), i64(2)])[0]
        t = g.op("Slice", [g.op("Shape", ["cache_k"])[0], i64(0), i64(1)])[0]
        past = g.op("Sub", [t, s])[0]
        q_shape = g.op("Concat", [bs, i64(heads, hd)], axis=0)[0]  # [B, S, H, hd]
        k_shape = g.op("Concat", [bs, i64(kvh, hd)], axis=0)[0]  # [B, S, KVH, hd]
        cos = g.op("Unsqueeze", ["cos", i64(1)])[0]  # [S, 1, hd]: over [B, S, heads, hd]
        sin = g.op("Unsqueeze", ["sin", i64(1)])[0]
        half = hd // 2

        def rope(x: str) -> str:  # x * cos + roll(x, hd/2) * sin (sin's first half negated): apply_rope's
            lo, hi = g.op("Split", [x, i64(half, half)], n_out=2, axis=-1)
            rolled = g.op("Concat", [hi, lo], axis=-1)[0]
            return g.op("Add", [g.op("Mul", [x, cos])[0], g.op("Mul", [rolled, sin])[0]])[0]

        x, new_k, new_v = "X", [], []
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            q, k, v = g.norm_qkv(x, layer.input_layernorm, attn, bits, block)  # [B*S, heads * hd]
            q = rope(g.op("Reshape", [q, q_shape])[0])  # [B, S, H, hd]
            k = rope(g.op("Reshape", [k, k_shape])[0])  # [B, S, KVH, hd]
            v = g.op("Reshape", [v, k_shape])[0]
            kv_all = []
            for new, cache, out in ((k, "cache_k", new_k), (v, "cache_v", new_v)):
                new = g.op("Transpose", [new], perm=[1, 0, 2, 3])[0]  # [S, B, KVH, hd]
                out.append(g.op("Unsqueeze", [new, i64(1)])[0])
                old = g.op("Slice", [cache, i64(0, i), g.op("Concat", [past, i64(i + 1)], axis=0)[0], i64(0, 1)])[0]
                old = g.op("Squeeze", [old, i64(1)])[0]  # [P, B, KVH, hd]
                kv_all.append(g.op("Concat", [old, new], axis=0)[0])  # [T, B, KVH, hd]
            keys = g.op("Transpose", [kv_all[0]], perm=[1, 2, 3, 0])[0]  # [B, KVH, hd, T]
            keys = g.op("Unsqueeze", [keys, i64(2)])[0]  # [B, KVH, 1, hd, T]
            values = g.op("Unsqueeze", [g.op("Transpose", [kv_all[1]], perm=[1, 2, 0, 3])[0], i64(2)])[0]
            q = g.op("Reshape", [q, i64(0, 0, kvh, rep, hd)])[0]  # head = kv head * rep + r
            q = g.op("Transpose", [q], perm=[0, 2, 3, 1, 4])[0]  # [B, KVH, rep, S, hd]
            scale = g.const("scale", np.array(attn.scale if attn.scale is not None else hd ** -0.5, np.float32))
            scores = g.op("Add", [g.op("Mul", [g.op("MatMul", [q, keys])[0], scale])[0], "mask"])[0]
            o = g.op("MatMul", [g.op("Softmax", [scores], axis=-1)[0], values])[0]  # [B, KVH, rep, S, hd]
            o = g.op("Transpose", [o], perm=[0, 3, 1, 2, 4])[0]  # [B, S, KVH, rep, hd]
            o = g.op("Reshape", [o, i64(0, 0, heads * hd)])[0]
            x = g.op("Add", [x, g.nbits_matmul(o, attn.o_proj.weight, bits, block)])[0]
            x = g.op("Add", [x, g.norm_mlp(x, layer.post_attention_layernorm, layer.mlp, bits, block)])[0]
        last = g.op("Squeeze", [g.op("Slice", [x, i64(-1), i64(2**62), i64(1)])[0], i64(1)])[0]  # [B, D]
        out = g.rms_norm(last, predictor.model.norm)
        kv_dims = ["s", self.n_layers, "b", kvh, hd]
        g.build({"X": ["b", "s", self.hidden], "cos": ["s", hd], "sin": ["s", hd], "mask": ["s", "t"],
                 "cache_k": ["t", self.n_layers, "b", kvh, hd], "cache_v": ["t", self.n_layers, "b", kvh, hd]},
                {"H": (out, ["b", self.hidden]), "new_k": (g.op("Concat", new_k, axis=1)[0], kv_dims),
                 "new_v": (g.op("Concat", new_v, axis=1)[0], kv_dims)})
        self._session = g.session
        self.weight_bytes, self.weight_elems = g.weight_bytes, g.weight_elems
        self._caches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._tables: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._bindings: dict[tuple[int, int, int], object] = {}

    def _table(self, pos: int, s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """cos, sin [S, hd] (sin's first half negated, as ``prepare_rope``) and the additive mask
        [S, pos + S] for positions pos..pos+S-1, computed as CodePredictor._tables does."""
        if (pos, s) not in self._tables:
            from engines.models.layers import prepare_rope

            positions = torch.arange(pos, pos + s)
            cos, sin = prepare_rope(*rope_tables(self.inv_freq, positions))
            visible = torch.arange(pos + s)[None, :] <= positions[:, None]
            mask = torch.zeros(s, pos + s).masked_fill(~visible, float("-inf"))
            self._tables[(pos, s)] = (cos[0, 0].contiguous(), sin[0, 0].contiguous(), mask)
        return self._tables[(pos, s)]

    def _binding(self, b: int, pos: int, s: int):
        """An IO binding with the tables and this batch size's cache bound (what stays the same
        for every frame's pass at ``pos``)."""
        key = (b, pos, s)
        if key not in self._bindings:
            if b not in self._caches:
                shape = (self.groups, self.n_layers, b, self.n_kv, self.head_dim)
                self._caches[b] = (torch.zeros(shape), torch.zeros(shape))
            k, v = self._caches[b]
            binding = self._session.io_binding()
            for name, t in zip(("cos", "sin", "mask"), self._table(pos, s)):
                binding.bind_input(name, "cpu", 0, np.float32, list(t.shape), t.data_ptr())
            for name, cache in (("cache_k", k), ("cache_v", v)):
                binding.bind_input(name, "cpu", 0, np.float32, list(cache[:pos + s].shape), cache.data_ptr())
            for name, cache in (("new_k", k), ("new_v", v)):
                binding.bind_output(name, "cpu", 0, np.float32, list(cache[pos:pos + s].shape),
                                    cache[pos:pos + s].data_ptr())
            self._bindings[key] = binding
        return self._bindings[key]

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


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [1, S, hd] in fp32 for positions [S] (``rope_cos_sin`` over one row)."""
    from engines.models.layers import rope_cos_sin

    return rope_cos_sin(inv_freq, positions[None], torch.float32)


__all__ = ["NBitsPredictorLayers"]
