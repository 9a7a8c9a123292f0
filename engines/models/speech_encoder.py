"""The speech tokenizer's encoder (``speech_tokenizer/model.safetensors`` ``encoder.*``):
24 kHz audio -> reference codes [T, G] for in-context voice cloning.

    enc = SpeechEncoder(SpeechEncoderConfig.from_dict(tokenizer_config["encoder_config"]), valid_quantizers=16)
    codes = enc.encode(wav)              # [N] float -> [ceil(N / 1920), G] int64

The released encoder is a transformers ``MimiModel`` without its decoder half (qwen_tts'
``Qwen3TTSTokenizerV2Encoder``): a causal SEANet conv encoder, a causal transformer
(LayerNorm, RoPE, GELU MLP, layer scales), a stride-2 downsampling conv and a split
residual vector quantizer (semantic + acoustic, nearest codeword by Euclidean distance).
Written here in plain torch with the checkpoint's parameter names; it runs once per voice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from engines.models.configs import FromDict
from engines.models.layers import Attention, LayerScale, rope_cos_sin, rope_inv_freq


@dataclass(frozen=True)
class SpeechEncoderConfig(FromDict):
    """``encoder_config`` of speech_tokenizer/config.json (MimiConfig keys)."""

    sampling_rate: int = 24_000
    audio_channels: int = 1
    num_filters: int = 64
    kernel_size: int = 7
    last_kernel_size: int = 3
    residual_kernel_size: int = 3
    dilation_growth_rate: int = 2
    num_residual_layers: int = 1
    compress: int = 2
    upsampling_ratios: tuple[int, ...] = (8, 6, 5, 4)
    use_causal_conv: bool = True
    use_conv_shortcut: bool = False
    pad_mode: str = "constant"
    hidden_size: int = 512
    intermediate_size: int = 2048
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    head_dim: int | None = None
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    layer_scale_initial_scale: float = 0.01
    attention_bias: bool = False
    hidden_act: str = "gelu"
    frame_rate: float = 12.5
    codebook_size: int = 2048
    codebook_dim: int = 256
    vector_quantization_hidden_dimension: int = 256
    num_quantizers: int = 32
    num_semantic_quantizers: int = 1

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SpeechEncoderConfig":
        # MimiConfig saves its frame rate as "_frame_rate" (a plain "frame_rate" wins).
        renamed = {"frame_rate": data["_frame_rate"]} if "_frame_rate" in data else {}
        cfg = super().from_dict({**renamed, **data})
        if not cfg.use_causal_conv:
            raise ValueError("speech encoder: only causal convolutions (use_causal_conv) are supported")
        if cfg.hidden_act != "gelu":
            raise ValueError(f"speech encoder: hidden_act {cfg.hidden_act!r} is not supported (gelu)")
        return cfg

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def conv_frame_rate(self) -> float:
        """Frames per second after the SEANet encoder (before the downsampling conv)."""
        return self.sampling_rate / math.prod(self.upsampling_ratios)


class CausalConv1d(nn.Module):
    """MimiConv1d, causal: left padding kernel - stride, right padding up to a whole last frame."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int = 1, dilation: int = 1, bias: bool = True,
                 pad_mode: str = "constant"):
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel, stride, dilation=dilation, bias=bias)
        self.stride = stride
        self.kernel = (kernel - 1) * dilation + 1
        self.pad_mode = pad_mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[-1]
        padding = self.kernel - self.stride
        frames = -(-(length - self.kernel + padding) // self.stride)  # ceil
        extra = frames * self.stride + self.kernel - padding - length
        return self.conv(F.pad(x, (padding, extra), mode=self.pad_mode))


class ResnetBlock(nn.Module):
    def __init__(self, cfg: SpeechEncoderConfig, dim: int, dilation: int):
        super().__init__()
        hidden = dim // cfg.compress
        # Index layout of the official ModuleList: ELU, conv, ELU, conv.
        self.block = nn.ModuleList([
            nn.ELU(), CausalConv1d(dim, hidden, cfg.residual_kernel_size, dilation=dilation, pad_mode=cfg.pad_mode),
            nn.ELU(), CausalConv1d(hidden, dim, 1, pad_mode=cfg.pad_mode)])
        self.shortcut = CausalConv1d(dim, dim, 1, pad_mode=cfg.pad_mode) if cfg.use_conv_shortcut else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for layer in self.block:
            y = layer(y)
        return (x if self.shortcut is None else self.shortcut(x)) + y


class SEANetEncoder(nn.Module):
    def __init__(self, cfg: SpeechEncoderConfig):
        super().__init__()
        layers: list[nn.Module] = [CausalConv1d(cfg.audio_channels, cfg.num_filters, cfg.kernel_size,
                                                pad_mode=cfg.pad_mode)]
        scale = 1
        for ratio in reversed(cfg.upsampling_ratios):
            dim = scale * cfg.num_filters
            layers += [ResnetBlock(cfg, dim, cfg.dilation_growth_rate ** j) for j in range(cfg.num_residual_layers)]
            layers += [nn.ELU(), CausalConv1d(dim, dim * 2, ratio * 2, stride=ratio, pad_mode=cfg.pad_mode)]
            scale *= 2
        layers += [nn.ELU(), CausalConv1d(scale * cfg.num_filters, cfg.hidden_size, cfg.last_kernel_size,
                                          pad_mode=cfg.pad_mode)]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class GeluMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=False)
        self.fc2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class TransformerLayer(nn.Module):
    def __init__(self, cfg: SpeechEncoderConfig):
        super().__init__()
        d = cfg.hidden_size
        self.self_attn = Attention(d, cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                                   head_dim=cfg.head_size, bias=cfg.attention_bias)
        self.mlp = GeluMLP(d, cfg.intermediate_size)
        self.input_layernorm = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.self_attn_layer_scale = LayerScale(d, cfg.layer_scale_initial_scale)
        self.mlp_layer_scale = LayerScale(d, cfg.layer_scale_initial_scale)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn
        q, k, v = attn.qkv(self.input_layernorm(x), cos, sin)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        # Causal over the whole reference (the official mask has no sliding window here).
        out = F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1)
        out = attn.o_proj(out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))
        x = x + self.self_attn_layer_scale(out)
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class Transformer(nn.Module):
    def __init__(self, cfg: SpeechEncoderConfig):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_size, cfg.rope_theta), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device)[None]
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x


class Codebook(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self.register_buffer("initialized", torch.ones(1))
        self.register_buffer("cluster_usage", torch.ones(size))
        self.register_buffer("embed_sum", torch.zeros(size, dim))

    def embed(self) -> torch.Tensor:
        return self.embed_sum / self.cluster_usage.clamp(min=1e-5)[:, None]


class VectorQuantization(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self.codebook = Codebook(size, dim)


class ResidualVectorQuantizer(nn.Module):
    def __init__(self, cfg: SpeechEncoderConfig, num_quantizers: int):
        super().__init__()
        self.layers = nn.ModuleList(VectorQuantization(cfg.codebook_size, cfg.codebook_dim)
                                    for _ in range(num_quantizers))
        self.input_proj = self.output_proj = None
        if cfg.vector_quantization_hidden_dimension != cfg.hidden_size:
            vq = cfg.vector_quantization_hidden_dimension
            self.input_proj = nn.Conv1d(cfg.hidden_size, vq, 1, bias=False)
            self.output_proj = nn.Conv1d(vq, cfg.hidden_size, 1, bias=False)  # decoder side; loaded, unused

    def encode(self, x: torch.Tensor, count: int) -> torch.Tensor:
        """x [B, hidden, T] -> codes [count, B, T]: nearest codeword, subtract, repeat."""
        if self.input_proj is not None:
            x = self.input_proj(x)
        residual = x.permute(0, 2, 1)  # [B, T, dim]
        out = []
        for layer in self.layers[:count]:
            embed = layer.codebook.embed()
            flat = residual.reshape(-1, residual.shape[-1])
            ids = torch.cdist(flat[None].float(), embed[None].float(), p=2)[0].argmin(dim=-1)
            ids = ids.view(residual.shape[:-1])
            residual = residual - F.embedding(ids, embed)
            out.append(ids)
        return torch.stack(out)


class SplitResidualVectorQuantizer(nn.Module):
    def __init__(self, cfg: SpeechEncoderConfig):
        super().__init__()
        self.num_semantic = cfg.num_semantic_quantizers
        self.semantic_residual_vector_quantizer = ResidualVectorQuantizer(cfg, cfg.num_semantic_quantizers)
        self.acoustic_residual_vector_quantizer = ResidualVectorQuantizer(
            cfg, cfg.num_quantizers - cfg.num_semantic_quantizers)

    def encode(self, x: torch.Tensor, count: int) -> torch.Tensor:
        codes = self.semantic_residual_vector_quantizer.encode(x, self.num_semantic)
        if count > self.num_semantic:
            acoustic = self.acoustic_residual_vector_quantizer.encode(x, count - self.num_semantic)
            codes = torch.cat([codes, acoustic], dim=0)
        return codes


class SpeechEncoder(nn.Module):
    """Parameter names as under ``encoder.`` of the speech tokenizer's safetensors."""

    def __init__(self, cfg: SpeechEncoderConfig, valid_quantizers: int, samples_per_frame: int = 1920):
        super().__init__()
        if not cfg.num_semantic_quantizers <= valid_quantizers <= cfg.num_quantizers:
            raise ValueError(f"speech encoder: {valid_quantizers} valid quantizers outside "
                             f"[{cfg.num_semantic_quantizers}, {cfg.num_quantizers}]")
        self.cfg = cfg
        self.valid_quantizers = valid_quantizers
        self.samples_per_frame = samples_per_frame
        self.encoder = SEANetEncoder(cfg)
        self.encoder_transformer = Transformer(cfg)
        ratio = cfg.conv_frame_rate / cfg.frame_rate
        self.downsample = CausalConv1d(cfg.hidden_size, cfg.hidden_size, 2 * int(ratio), stride=2, bias=False,
                                       pad_mode="replicate")
        self.quantizer = SplitResidualVectorQuantizer(cfg)

    @torch.no_grad()
    def encode(self, wav: torch.Tensor) -> torch.Tensor:
        """wav [N] at ``cfg.sampling_rate`` -> codes [ceil(N / samples_per_frame), valid_quantizers] int64."""
        p = next(self.parameters())
        x = wav.to(device=p.device, dtype=p.dtype).reshape(1, 1, -1)
        x = self.encoder(x)
        x = self.encoder_transformer(x.transpose(1, 2)).transpose(1, 2)
        x = self.downsample(x)
        codes = self.quantizer.encode(x, self.valid_quantizers)[:, 0]  # [G, T]
        frames = -(-wav.shape[-1] // self.samples_per_frame)
        return codes[:, :frames].transpose(0, 1).contiguous()


__all__ = ["SpeechEncoder", "SpeechEncoderConfig"]
