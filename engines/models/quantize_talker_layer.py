"""A quantized talker decoder layer as TWO ONNX Runtime calls with attention inside (CPU,
``--quantize int8`` / ``int4`` with onnxruntime).

    layer.nbits = NBitsTalkerLayer(layer, bits=8)   # engines/models/quantize.py sets it
    q, k, v = layer.nbits.qkv(x, cos, sin)          # x [B, S, D] -> rotated q, k and v, [B, S, heads * hd]
    x = layer.nbits.attend_mlp(x, q, keys, values, mask)   # keys/values [B, L, KVH * hd]

Between the two calls the talker writes k and v into its (paged) K/V cache and reads the rows'
keys and values back, as the fp32 layer does. Run as quantize_nbits.py's three calls around
torch's RoPE and SDPA, a layer is ~40 small torch ops besides its weights (views, transposes,
RoPE's roll, the mask's conversion, SDPA's flash kernel at one query row); here:
* ``qkv``: input RMSNorm -> one q/k/v ``MatMulNBits`` -> per-head q/k RMSNorm -> RoPE (the
  tables ``prepare_rope`` gives: x * cos + roll(x, hd/2) * sin, as ``apply_rope``);
* ``attend_mlp``: the ONNX ``Attention`` operator (opset 23, grouped-query heads, keys and values
  in the [B, L, KVH * hd] layout the paged gather gives, so no transpose) -> ``o_proj`` -> residual
  -> post-attention RMSNorm -> gate/up -> SiLU * up -> down -> residual.

Numerics: the same packed weights and int8 activations as the three-call layer; RoPE and
attention in ORT's fp32 kernels instead of torch's (rounding-level differences;
tests/engines/models/test_talker_quantize.py compares the two).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from engines.models.quantize_nbits import BLOCK, _Graph

ATTENTION_OPSET = 23  # the ONNX Attention operator with kv_num_heads


def _bind(binding, name: str, t: torch.Tensor, output: bool = False) -> None:
    dtype = np.bool_ if t.dtype == torch.bool else np.float32
    (binding.bind_output if output else binding.bind_input)(name, "cpu", 0, dtype, list(t.shape), t.data_ptr())


class NBitsTalkerLayer(nn.Module):
    """A Qwen3 ``DecoderLayer``'s weights in two ORT sessions (see the module docstring)."""

    def __init__(self, layer: nn.Module, bits: int, block: int = BLOCK):
        super().__init__()
        attn = layer.self_attn
        self.heads, self.n_kv, self.head_dim = attn.n_heads, attn.n_kv, attn.head_dim
        self.hidden = attn.q_proj.in_features
        hd, half = self.head_dim, self.head_dim // 2
        i64 = lambda g, *v: g.const("i", np.array(v, np.int64))  # noqa: E731

        g = _Graph(f"int{bits}_talker_qkv", self.hidden)
        q, k, v = g.norm_qkv("X", layer.input_layernorm, attn, bits, block, lead=2)  # [B, S, heads * hd]
        cos, sin = (g.op("Unsqueeze", [t, i64(g, 2)])[0] for t in ("cos", "sin"))  # [B, S, 1, hd]

        def rope(x: str, heads: int) -> str:
            x = g.op("Reshape", [x, i64(g, 0, 0, heads, hd)])[0]
            lo, hi = g.op("Split", [x, i64(g, half, half)], n_out=2, axis=-1)
            rolled = g.op("Concat", [hi, lo], axis=-1)[0]
            y = g.op("Add", [g.op("Mul", [x, cos])[0], g.op("Mul", [rolled, sin])[0]])[0]
            return g.op("Reshape", [y, i64(g, 0, 0, heads * hd)])[0]

        dims = {"q": ["b", "s", self.heads * hd], "k": ["b", "s", self.n_kv * hd], "v": ["b", "s", self.n_kv * hd]}
        g.build({"X": ["b", "s", self.hidden], "cos": ["b", "s", hd], "sin": ["b", "s", hd]},
                {"q": (rope(q, self.heads), dims["q"]), "k": (rope(k, self.n_kv), dims["k"]), "v": (v, dims["v"])})
        self._qkv, self.weight_bytes, self.weight_elems = g, g.weight_bytes, g.weight_elems
        self.kept_fp32 = list(g.kept_fp32)

        from onnx import TensorProto

        g = _Graph(f"int{bits}_talker_attend_mlp", self.hidden)
        scale = attn.scale if attn.scale is not None else hd ** -0.5
        a = g.op("Attention", ["q", "keys", "values", "mask"], q_num_heads=self.heads, kv_num_heads=self.n_kv,
                 scale=float(scale))[0]
        x = g.op("Add", ["X", g.nbits_matmul(a, attn.o_proj.weight, bits, block)])[0]
        x = g.op("Add", [x, g.norm_mlp(x, layer.post_attention_layernorm, layer.mlp, bits, block)])[0]
        g.build({"X": ["b", "s", self.hidden], "q": dims["q"], "keys": ["b", "l", self.n_kv * hd],
                 "values": ["b", "l", self.n_kv * hd], "mask": (TensorProto.BOOL, ["b", 1, "s", "l"])},
                {"Y": (x, ["b", "s", self.hidden])}, opset=ATTENTION_OPSET)
        self._attend = g
        self.weight_bytes += g.weight_bytes
        self.weight_elems += g.weight_elems
        self.kept_fp32 += g.kept_fp32

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, S, D]; cos/sin prepared (``prepare_rope``: [B, 1, S, hd], sin's first half negated)
        -> rotated q [B, S, H * hd], rotated k and v [B, S, KVH * hd]."""
        b, s, _ = x.shape
        x, cos, sin = (t.contiguous() for t in (x, cos.reshape(b, s, -1), sin.reshape(b, s, -1)))
        q = torch.empty(b, s, self.heads * self.head_dim)
        k, v = (torch.empty(b, s, self.n_kv * self.head_dim) for _ in range(2))
        binding = self._qkv.binding
        for name, t in (("X", x), ("cos", cos), ("sin", sin)):
            _bind(binding, name, t)
        for name, t in (("q", q), ("k", k), ("v", v)):
            _bind(binding, name, t, output=True)
        self._qkv.session.run_with_iobinding(binding)
        return q, k, v

    def attend_mlp(self, x: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
        """x [B, S, D] (the residual), q [B, S, H * hd], keys/values [B, L, KVH * hd], mask [B, 1, S, L]
        bool (True = attend) -> the layer's output [B, S, D]."""
        y = torch.empty(x.shape)
        inputs = {"X": x.contiguous(), "q": q.contiguous(), "keys": keys.contiguous(), "values": values.contiguous(),
                  "mask": mask.contiguous()}  # alive until the run (bound by pointer)
        binding = self._attend.binding
        for name, t in inputs.items():
            _bind(binding, name, t)
        _bind(binding, "Y", y, output=True)
        self._attend.session.run_with_iobinding(binding)
        return y


def strip_layer(layer: nn.Module) -> None:
    """The layer's fp32 norms and projections dropped (inside its ``nbits`` now); what the fusing
    code reads stays, as no weights to fuse."""
    attn = layer.self_attn
    attn.q_proj = attn.k_proj = attn.v_proj = attn.o_proj = attn.q_norm = attn.k_norm = None
    layer.mlp.gate_proj = layer.mlp.up_proj = layer.mlp.down_proj = None
    layer.input_layernorm = layer.post_attention_layernorm = nn.Identity()


__all__ = ["NBitsTalkerLayer", "strip_layer"]
