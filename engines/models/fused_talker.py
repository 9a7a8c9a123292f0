"""The talker's decode layer (one position per row) as fused Triton kernels.

    talker.fused_decode_step = FusedDecodeLayers(talker)     # Talker.forward_paged calls it per layer

Eager, a talker layer's decode step is ~15 kernels (norms, three projections, two q/k norms, two
rotations, two pool writes, attention, o_proj, add, norm, gate/up, SiLU, mul, down, add). Here it
is five launches, each as far as the dependency chain lets one kernel go (every one of them needs
all columns of the one before for every row):

1. input RMSNorm + [q; k; v] + per-head q/k RMSNorm + RoPE (the talker's M-RoPE, from the rotary
   table rows the step gathered) + K and V written into the paged pool at each row's slot;
2. attention read from the pool in place (engines/models/paged_attention.py);
3. o_proj + the residual add;
4. post-attention RMSNorm + gate/up + SiLU(gate) * up;
5. down + the residual add.

The phases are engines/models/triton_blocks.py's, shared with the fused code predictor. The
reference is ``TalkerLayer.forward_paged_decode`` (held to it under Triton's interpreter on the
CPU: tests/engines/models/test_fused_talker.py; on a GPU: ``scripts/gpu-verify.sh fused``). The
engine uses it on CUDA when switched on (``STREAMVOX_FUSED_TALKER=1``, off until measured).
"""

from __future__ import annotations

import torch
from torch import nn

from engines.models.kv_access import InPlaceKV
from engines.models.paged_attention import paged_decode_attention
from engines.models.triton_blocks import (
    TileConfig,
    gate_up_phase,
    kernels_run_on,
    pow2,
    qkv_rope_phase,
    residual_linear_phase,
    stack_as_views,
    tiles_for,
    triton,
)

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _qkv_kernel(n_tok, x_ptr, D, ln_ptr, eps, w_ptr, qk_norm_ptr, cos_ptr, sin_ptr, rope_idx_ptr, slot_ptr,
                    q_ptr, k_ptr, v_ptr, H: tl.constexpr, KVH: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr,
                    IEEE: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
        qkv_rope_phase(tl.program_id(0), tl.num_programs(0), n_tok, x_ptr, D, D, ln_ptr, eps, w_ptr, qk_norm_ptr,
                       cos_ptr, sin_ptr, rope_idx_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, H=H, KVH=KVH, HD=HD,
                       HALF=HALF, IEEE=IEEE, BM=BM, BK=BK, CACHE="")

    @triton.jit
    def _residual_kernel(n_tok, a_ptr, K, w_ptr, x_ptr, out_ptr, N, IEEE: tl.constexpr, BM: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr):
        residual_linear_phase(tl.program_id(0), tl.num_programs(0), n_tok, a_ptr, K, w_ptr, x_ptr, out_ptr, N,
                              IEEE=IEEE, BM=BM, BN=BN, BK=BK, CACHE="")

    @triton.jit
    def _gate_up_kernel(n_tok, x_ptr, D, ln_ptr, eps, wg_ptr, wu_ptr, act_ptr, N, IEEE: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        gate_up_phase(tl.program_id(0), tl.num_programs(0), n_tok, x_ptr, D, ln_ptr, eps, wg_ptr, wu_ptr, act_ptr, N,
                      IEEE=IEEE, BM=BM, BN=BN, BK=BK, CACHE="")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class FusedDecodeLayers:
    """A talker's ``fused_decode_step`` (the call ``Talker.forward_paged`` makes per layer when the
    step reads the pool in place: engines/models/kv_access.py ``InPlaceKV``) as five fused launches. Each layer's q/k/v and gate/up weights
    are fused into one matrix each and its q/k norm weights stacked, all as views of the modules'
    parameters (no memory added; the modules compute what they did)."""

    def __init__(self, talker, tiles: TileConfig | None = None):
        param = talker.codec_head.weight
        if not kernels_run_on(param.device):
            raise RuntimeError("the fused talker layers run on CUDA with Triton (or under TRITON_INTERPRET=1)")
        layers = list(talker.model.layers)
        for layer in layers:
            if not isinstance(layer.mlp.down_proj, nn.Linear):
                raise ValueError("the fused talker layers need the plain (not quantized) layers")
            layer.self_attn.fuse_qkv()
            layer.mlp.fuse()
            if layer.self_attn.qkv_weight is None or layer.mlp.gate_up is None:
                raise ValueError("the fused talker layers need bias-free q/k/v and gate/up projections")
        qk_norm = stack_as_views([[l.self_attn.q_norm.weight, l.self_attn.k_norm.weight] for l in layers])
        self._qk_norm = {id(layer): qk_norm[i] for i, layer in enumerate(layers)}
        cfg = talker.cfg
        self.tiles = tiles or tiles_for(param.device)
        self.block_n = min(self.tiles.block_n, pow2(min(cfg.hidden_size, cfg.intermediate_size)))
        self.block_k = min(self.tiles.block_k, pow2(cfg.hidden_size))
        self.ieee = param.dtype == torch.float32

    def __call__(self, layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: InPlaceKV) -> torch.Tensor:
        """``TalkerLayer.forward`` over ``kv``: x [B, 1, D]; cos/sin the prepared rotary rows
        [B, 1, 1, hd]; K/V written at ``kv.write_slots`` [B, 1]; attention over each row's block
        table up to its length -> [B, 1, D]."""
        pool_k, pool_v, write_slots = kv.pool_k, kv.pool_v, kv.write_slots
        table, lengths, block_size = kv.table, kv.lengths, kv.block_size
        attn, mlp = layer.self_attn, layer.mlp
        b, _, d = x.shape
        heads, kv_heads, hd = attn.n_heads, attn.n_kv, attn.head_dim
        inter = mlp.gate_up.shape[0] // 2
        t = self.tiles
        x = x.reshape(b, d).contiguous()
        q = torch.empty(b, heads, hd, dtype=x.dtype, device=x.device)
        eps = layer.input_layernorm.eps
        _qkv_kernel[(_cdiv(b, t.block_m) * (heads + 2 * kv_heads),)](
            b, x, d, layer.input_layernorm.weight, eps, attn.qkv_weight, self._qk_norm[id(layer)],
            cos.reshape(b, hd).contiguous(), sin.reshape(b, hd).contiguous(), torch.arange(b, device=x.device),
            write_slots.reshape(b).contiguous(), q, pool_k, pool_v, H=heads, KVH=kv_heads, HD=hd,
            HALF=pow2(hd // 2), IEEE=self.ieee, BM=t.block_m, BK=self.block_k, num_warps=t.num_warps)
        a = paged_decode_attention(q, pool_k, pool_v, table, lengths, attn.scale, block_size)
        h = torch.empty_like(x)
        grid_d = (_cdiv(b, t.block_m) * _cdiv(d, self.block_n),)
        _residual_kernel[grid_d](b, a, heads * hd, attn.o_proj.weight, x, h, d, IEEE=self.ieee, BM=t.block_m,
                                 BN=self.block_n, BK=self.block_k, num_warps=t.num_warps)
        act = torch.empty(b, inter, dtype=x.dtype, device=x.device)
        _gate_up_kernel[(_cdiv(b, t.block_m) * _cdiv(inter, self.block_n),)](
            b, h, d, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps,
            mlp.gate_proj.weight, mlp.up_proj.weight, act, inter, IEEE=self.ieee, BM=t.block_m, BN=self.block_n,
            BK=self.block_k, num_warps=t.num_warps)
        _residual_kernel[grid_d](b, act, inter, mlp.down_proj.weight, h, h, d, IEEE=self.ieee, BM=t.block_m,
                                 BN=self.block_n, BK=self.block_k, num_warps=t.num_warps)
        return h.view(b, 1, d)


__all__ = ["FusedDecodeLayers"]
