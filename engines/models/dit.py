"""Flow-matching DiT over frame latents.

One row of the batch is ``[clean context frames ; noisy chunk frames ; padding]``.
The model predicts the flow velocity v = noise - x0 for every frame (only the noisy
ones are used), conditioned on

* the timestep t (sinusoidal features in fp32 -> MLP -> adaLN shift/scale/gate),
* the frame kind (clean context vs noisy, a learned embedding added to the input),
* the global frame index (RoPE in self-attention, so chunks line up across time),
* the text (cross-attention to the condition encoder's states).

Masks come from tensor ops only (no Python branches on tensor values), so the forward
has no host reads and traces cleanly. Shapes: B rows, T frames, L text tokens,
D latent width, H hidden width, C encoder width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engines.models.configs import DiTConfig
from engines.models.layers import (
    Attention,
    RMSNorm,
    SwiGLU,
    compile_block_call,
    fp32_rope,
    key_padding_mask,
)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


class TimestepEmbedder(nn.Module):
    """t in [0, 1] [B] -> [B, H]; computed in fp32 whatever the module dtype, because
    neighbouring schedule points differ by less than bf16 resolution near t = 1."""

    def __init__(self, hidden: int, freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.fc1 = nn.Linear(freq_dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)

    def forward(self, t: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(10_000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
        args = t.float()[:, None] * 1000.0 * freqs  # [B, half]
        feats = torch.cat([args.cos(), args.sin()], dim=-1)  # [B, freq_dim]
        h = F.silu(F.linear(feats, self.fc1.weight.float(), self.fc1.bias.float()))
        return F.linear(h, self.fc2.weight.float(), self.fc2.bias.float()).to(out_dtype)  # [B, H]


class DiTBlock(nn.Module):
    """adaLN self-attention, plain pre-norm cross-attention to the text, adaLN SwiGLU."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        H = cfg.hidden_size
        self.self_norm = RMSNorm(H, cfg.rms_norm_eps, affine=False)
        self.self_attn = Attention(H, cfg.num_attention_heads)
        self.cross_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.cross_attn = Attention(H, cfg.num_attention_heads, kv_dim=cfg.cond_dim)
        self.mlp_norm = RMSNorm(H, cfg.rms_norm_eps, affine=False)
        self.mlp = SwiGLU(H, cfg.intermediate_size)
        # adaLN-zero layout (shift, scale, gate x 2), but randomly initialised: a zero
        # init would make an untrained model's output independent of its input.
        self.adaLN_modulation = nn.Linear(H, 6 * H)

    def forward(self, x, c, rope, self_mask, enc, enc_mask):
        # x [B, T, H]; c [B, H]; self_mask [B, 1, 1, T]; enc [B, L, C]; enc_mask [B, 1, 1, L]
        shift1, scale1, gate1, shift2, scale2, gate2 = self.adaLN_modulation(F.silu(c))[:, None, :].chunk(6, dim=-1)
        x = x + gate1 * self.self_attn(modulate(self.self_norm(x), shift1, scale1), self_mask, rope=rope)
        x = x + self.cross_attn(self.cross_norm(x), enc_mask, memory=enc)
        return x + gate2 * self.mlp(modulate(self.mlp_norm(x), shift2, scale2))


def _call_block(block: DiTBlock, h, c, rope, self_mask, enc, cross_mask):
    return block(h, c, rope, self_mask, enc, cross_mask)


class FlowDiT(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        if H % cfg.num_attention_heads:
            raise ValueError(f"DiT hidden size {H} is not divisible by {cfg.num_attention_heads} heads")
        self.head_dim = H // cfg.num_attention_heads
        self.in_proj = nn.Linear(cfg.latent_dim, H)
        self.frame_kind = nn.Embedding(2, H)  # 0 = noisy frame, 1 = clean context frame
        self.t_embedder = TimestepEmbedder(H)
        self.blocks = nn.ModuleList(DiTBlock(cfg) for _ in range(cfg.num_hidden_layers))
        self.final_norm = RMSNorm(H, cfg.rms_norm_eps, affine=False)
        self.final_modulation = nn.Linear(H, 2 * H)
        self.out_proj = nn.Linear(H, cfg.latent_dim)
        self.block_step = None  # compiled replacement for calling a block (compile_blocks)

    def compile_blocks(self, backend: str = "inductor") -> None:
        """Run the blocks through ``torch.compile``: fuses the fp32 norms, RoPE, adaLN
        modulation and gates that dominate a bf16 block once launches are graphed. One
        compiled function serves all blocks (dynamic rows / encoder length)."""
        self.block_step = compile_block_call(_call_block, backend)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, context_mask: torch.Tensor,
                frame_mask: torch.Tensor, t: torch.Tensor, enc: torch.Tensor, enc_mask: torch.Tensor) -> torch.Tensor:
        # x [B, T, D]; positions [B, T] int64 (global frame index); context_mask [B, T]
        # bool (True = clean context frame); frame_mask [B, T] bool (True = real frame,
        # False = padding); t [B] float; enc [B, L, C]; enc_mask [B, L] bool -> v [B, T, D]
        h = self.in_proj(x) + self.frame_kind(context_mask.long())  # [B, T, H]
        c = self.t_embedder(t, h.dtype)  # [B, H]
        rope = fp32_rope(positions, self.head_dim, self.cfg.rope_theta)
        self_mask, cross_mask = key_padding_mask(frame_mask), key_padding_mask(enc_mask)
        step = self.block_step or _call_block
        for block in self.blocks:
            h = step(block, h, c, rope, self_mask, enc, cross_mask)
        shift, scale = self.final_modulation(F.silu(c))[:, None, :].chunk(2, dim=-1)
        return self.out_proj(modulate(self.final_norm(h), shift, scale))  # [B, T, D]
