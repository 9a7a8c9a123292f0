"""Qwen3-TTS 12 Hz speech-tokenizer decoder: codes [B, G, T] -> 24 kHz PCM [B, T * 1920].

Plain-torch port of ``Qwen3TTSTokenizerV2Decoder``; state-dict keys equal the official
ones under ``decoder.`` (``quantizer.rvq_first.vq.layers.0._codebook.embedding_sum``,
``pre_conv.conv.weight``, ``pre_transformer.layers.0.self_attn.q_proj.weight``,
``upsample.0.0.conv.weight``, ``decoder.1.block.1.conv.weight``, ...).

Pipeline: RVQ decode (semantic + acoustic codebooks, 1x1 projections) -> causal conv k3
-> sliding-window transformer with LayerScale -> 2 x (transposed conv + ConvNeXt) ->
causal conv k7 -> 4 x (SnakeBeta, transposed conv, 3 residual units) -> SnakeBeta ->
conv k7 -> clamp +-1. Every conv pads on the left only and every transposed conv drops
its kernel-stride overhang on the right, so the network is strictly causal.

Streaming: ``decode_step`` carries, per stream row, the last ``sliding_window`` keys and
values of every attention layer (already rotated at their global positions), the left
context of every conv ((k-1)*dilation input samples) and, for every transposed conv,
the input frames whose outputs overlap the next chunk. Concatenated chunks equal the
full decode up to float rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engines.models.configs import CodecDecoderConfig
from engines.models.layers import DecoderLayer, RMSNorm, rope_cos_sin, rope_inv_freq

# --------------------------------------------------------------------------- streaming state


@dataclass
class DecoderState:
    """Carried state of a batch of streams (every tensor has the stream batch first).

    ``conv[i]`` is the left context of streaming module i (see ``CodecDecoder.streaming``);
    ``keys/values[l]`` [B, KVH, W, hd] the last W rotated keys/values of attention layer l;
    ``position`` [B] int64 the global frame index of the next input frame.
    """

    conv: list[torch.Tensor]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    position: torch.Tensor

    @property
    def batch(self) -> int:
        return self.position.shape[0]

    def select(self, rows: torch.Tensor | list[int]) -> "DecoderState":
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.position.device)
        pick = lambda ts: [t.index_select(0, idx) for t in ts]  # noqa: E731
        return DecoderState(pick(self.conv), pick(self.keys), pick(self.values), self.position.index_select(0, idx))

    @staticmethod
    def cat(states: list["DecoderState"]) -> "DecoderState":
        if len(states) == 1:
            return states[0]
        join = lambda ts: torch.cat(ts, dim=0)  # noqa: E731
        s0 = states[0]
        return DecoderState([join([s.conv[i] for s in states]) for i in range(len(s0.conv))],
                            [join([s.keys[i] for s in states]) for i in range(len(s0.keys))],
                            [join([s.values[i] for s in states]) for i in range(len(s0.values))],
                            join([s.position for s in states]))

    def split(self) -> list["DecoderState"]:
        return [self.select([i]) for i in range(self.batch)]


# --------------------------------------------------------------------------- convolutions


def _few_samples(x: torch.Tensor, samples: int, in_channels: int) -> bool:
    """Whether a conv of a CPU tensor this wide over this few samples runs faster as one GEMM.

    Measured at the released sizes on an AVX-512 EPYC, 1 thread: oneDNN's convolution of many
    channels over few samples (the first layers of a streaming chunk: 768-1536 channels over 2-50
    samples) took 1.2-20x the GEMM's time; at fewer than 16 input channels per sample oneDNN was
    as fast or faster (up to 2x on the 96-384-channel layers over thousands of samples).
    """
    if _exporting():
        return False  # an exported graph keeps torch's conv ops: a traced branch would freeze this choice
    return x.device.type == "cpu" and 16 * samples <= in_channels


def _exporting() -> bool:
    """Inside an ONNX export, a trace or torch.compile: the plain ops, which every exporter knows."""
    return torch.jit.is_tracing() or torch.onnx.is_in_onnx_export() or torch.compiler.is_compiling()


class CausalConv(nn.Module):
    """Conv1d padded (k-1)*dilation on the left (stride 1 in this decoder)."""

    def __init__(self, c_in: int, c_out: int, kernel_size: int, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel_size, dilation=dilation, groups=groups)
        self.context = (kernel_size - 1) * dilation
        self.slot = -1  # index into DecoderState.conv, assigned by CodecDecoder

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, C_in, T] -> [B, C_out, T] (official: pad left k-1, extra right pad is 0 at stride 1)."""
        return self._conv(F.pad(x, (self.context, 0)))

    def init_context(self, batch: int, device, dtype) -> torch.Tensor:
        return torch.zeros(batch, self.conv.in_channels, self.context, device=device, dtype=dtype)

    def step(self, x: torch.Tensor, state: DecoderState) -> torch.Tensor:
        xx = torch.cat([state.conv[self.slot], x], dim=-1)  # [B, C_in, context + t]
        state.conv[self.slot] = xx[..., xx.shape[-1] - self.context:]
        return self._conv(xx)

    def _conv(self, x: torch.Tensor) -> torch.Tensor:
        """The unpadded convolution of x [B, C_in, context + t] -> [B, C_out, t]."""
        c = self.conv
        t = x.shape[-1] - self.context
        if c.groups != 1 or not _few_samples(x, t, c.in_channels):
            return c(x)
        # Gather the k taps of every output sample ([B, t, C_in * k], the weight's own layout)
        # and multiply once: one GEMM instead of oneDNN's path for few samples (see _few_samples).
        k, d = c.kernel_size[0], c.dilation[0]
        taps = x.unfold(2, self.context + 1, 1)[..., ::d] if k > 1 else x[..., None]  # [B, C_in, t, k]
        taps = taps.transpose(1, 2).reshape(x.shape[0], t, c.in_channels * k)
        return F.linear(taps, c.weight.reshape(c.out_channels, -1), c.bias).transpose(1, 2)


class CausalTransConv(nn.Module):
    """ConvTranspose1d(k, stride s) with the last k - s output samples dropped."""

    def __init__(self, c_in: int, c_out: int, kernel_size: int, stride: int):
        super().__init__()
        if kernel_size < stride:
            raise ValueError(f"kernel_size {kernel_size} < stride {stride}")
        self.conv = nn.ConvTranspose1d(c_in, c_out, kernel_size, stride=stride)
        self.stride, self.trim = stride, kernel_size - stride
        # Input frames whose outputs still overlap the next chunk's first samples.
        self.context = math.ceil(self.trim / stride)
        self.slot = -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, C_in, T] -> [B, C_out, T * s]."""
        y = self._conv(x)
        return y[..., : y.shape[-1] - self.trim] if self.trim else y

    def _conv(self, x: torch.Tensor) -> torch.Tensor:
        """The full transposed convolution: x [B, C_in, T] -> [B, C_out, (T - 1) * s + k]."""
        c = self.conv
        if not _few_samples(x, x.shape[-1], c.in_channels):
            return c(x)
        # Every input sample times the weight [C_in, C_out * k] (a view: no copy), then the
        # k-sample pieces overlap-added s apart (F.fold).
        c_in, c_out, k = c.weight.shape
        pieces = torch.matmul(x.transpose(1, 2), c.weight.reshape(c_in, c_out * k))  # [B, T, C_out * k]
        y = F.fold(pieces.transpose(1, 2), (1, (x.shape[-1] - 1) * self.stride + k), (1, k), stride=(1, self.stride))
        y = y[:, :, 0]
        return y + c.bias[:, None] if c.bias is not None else y

    def init_context(self, batch: int, device, dtype) -> torch.Tensor:
        # Zero frames contribute nothing but the bias, which is dropped with them.
        return torch.zeros(batch, self.conv.in_channels, self.context, device=device, dtype=dtype)

    def step(self, x: torch.Tensor, state: DecoderState) -> torch.Tensor:
        t = x.shape[-1]
        xx = torch.cat([state.conv[self.slot], x], dim=-1)  # [B, C_in, context + t]
        state.conv[self.slot] = xx[..., xx.shape[-1] - self.context:]
        y = self._conv(xx)  # [B, C_out, (context + t - 1) * s + k]
        start = self.context * self.stride
        return y[..., start:start + t * self.stride]


class SnakeBeta(nn.Module):
    """x + 1/exp(beta) * sin^2(exp(alpha) * x), per channel (log-scale parameters)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))
        self._coefficients: tuple[tuple, torch.Tensor, torch.Tensor] | None = None

    def coefficients(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(exp(alpha), sqrt(1 / (exp(beta) + eps))) as [C, 1], computed once per parameter version
        (a load or an in-place update bumps it) instead of on every call."""
        key = (self.alpha._version, self.beta._version, self.alpha.data_ptr(), self.beta.data_ptr(), dtype)
        if self._coefficients is None or self._coefficients[0] != key:
            work = torch.promote_types(torch.promote_types(dtype, self.alpha.dtype), torch.float32)
            with torch.no_grad():
                scale = self.alpha.to(work).exp()[:, None]
                root_gain = (1.0 / (self.beta.to(work).exp() + 1e-9)).sqrt()[:, None]
            self._coefficients = (key, scale.to(dtype), root_gain.to(dtype))
        return self._coefficients[1], self._coefficients[2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, C, T]
        if _exporting() or (torch.is_grad_enabled() and (x.requires_grad or self.alpha.requires_grad)):
            # The official expression: differentiable, and what an exported graph holds.
            return x + (1.0 / (self.beta.exp()[:, None] + 1e-9)) * torch.sin(x * self.alpha.exp()[:, None]).pow(2)
        # Inference: one temporary, four passes over it, x read twice.
        scale, root_gain = self.coefficients(x.dtype)
        y = torch.mul(x, scale)
        y.sin_().mul_(root_gain)
        return torch.addcmul(x, y, y, out=y)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(1e-6 * torch.ones(dim))

    def _pointwise(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h.transpose(1, 2)))))  # [B, T, C]
        return x + (self.gamma * h).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T]
        return self._pointwise(x, self.dwconv(x))

    def step(self, x: torch.Tensor, state: DecoderState) -> torch.Tensor:
        return self._pointwise(x, self.dwconv.step(x, state))


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv(dim, dim, 1)
        self.conv2.conv.init_gain = 0.3  # random init only: 12 stacked residual units must not blow up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))

    def step(self, x: torch.Tensor, state: DecoderState) -> torch.Tensor:
        return x + self.conv2.step(self.act2(self.conv1.step(self.act1(x), state)), state)


class DecoderBlock(nn.Module):
    """SnakeBeta -> transposed conv (k = 2 * rate, stride rate) -> residual units (dilation 1, 3, 9)."""

    def __init__(self, c_in: int, c_out: int, rate: int):
        super().__init__()
        self.block = nn.ModuleList([SnakeBeta(c_in), CausalTransConv(c_in, c_out, 2 * rate, rate),
                                    *(ResidualUnit(c_out, d) for d in (1, 3, 9))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.block:
            x = m(x)
        return x

    def step(self, x: torch.Tensor, state: DecoderState) -> torch.Tensor:
        x = self.block[0](x)
        for m in self.block[1:]:
            x = m.step(x, state)
        return x


# --------------------------------------------------------------------------- quantizer


class EuclideanCodebook(nn.Module):
    def __init__(self, dim: int, codebook_size: int, epsilon: float = 1e-5):
        super().__init__()
        self.epsilon = epsilon
        self.cluster_usage = nn.Parameter(torch.ones(codebook_size))
        self.embedding_sum = nn.Parameter(torch.zeros(codebook_size, dim))
        self._table: tuple[tuple, torch.Tensor] | None = None

    def table(self) -> torch.Tensor:
        """The codebook [codebook_size, dim], divided once per parameter version (not per chunk)."""
        s, u = self.embedding_sum, self.cluster_usage
        key = (s._version, u._version, s.data_ptr(), u.data_ptr())
        if self._table is None or self._table[0] != key:
            with torch.no_grad():
                self._table = (key, s / u.clamp(min=self.epsilon)[:, None])
        return self._table[1]

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, T] -> [B, T, dim]."""
        if _exporting() or torch.is_grad_enabled():  # differentiable, and the division stays in an exported graph
            return F.embedding(codes, self.embedding_sum / self.cluster_usage.clamp(min=self.epsilon)[:, None])
        return F.embedding(codes, self.table())


class VectorQuantization(nn.Module):
    def __init__(self, dim: int, codebook_size: int):
        super().__init__()
        self._codebook = EuclideanCodebook(dim, codebook_size)


class ResidualVQ(nn.Module):
    def __init__(self, dim: int, codebook_size: int, n_q: int):
        super().__init__()
        self.layers = nn.ModuleList(VectorQuantization(dim, codebook_size) for _ in range(n_q))


class ResidualVectorQuantizer(nn.Module):
    """``input_proj`` only encodes (kept so the official keys load); ``output_proj`` decodes."""

    def __init__(self, codebook_dim: int, codebook_size: int, n_q: int):
        super().__init__()
        dim = codebook_dim // 2
        self.input_proj = nn.Conv1d(codebook_dim, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, codebook_dim, 1, bias=False)
        self.vq = ResidualVQ(dim, codebook_size, n_q)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, K, T] -> [B, codebook_dim, T]: sum of codebook vectors, then 1x1 projection."""
        q = sum(layer._codebook.decode(codes[:, i]) for i, layer in enumerate(self.vq.layers))  # [B, T, dim]
        return self.output_proj(q.transpose(1, 2))


class SplitResidualVectorQuantizer(nn.Module):
    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        n_sem = cfg.num_semantic_quantizers
        if not 0 < n_sem < cfg.num_quantizers:
            raise ValueError(f"need 0 < num_semantic_quantizers ({n_sem}) < num_quantizers ({cfg.num_quantizers})")
        self.n_q_semantic = n_sem
        self.rvq_first = ResidualVectorQuantizer(cfg.codebook_dim, cfg.codebook_size, n_sem)
        self.rvq_rest = ResidualVectorQuantizer(cfg.codebook_dim, cfg.codebook_size, cfg.num_quantizers - n_sem)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, K, T] -> [B, codebook_dim, T] (frame-local: no streaming state)."""
        return self.rvq_first.decode(codes[:, : self.n_q_semantic]) + self.rvq_rest.decode(codes[:, self.n_q_semantic:])


# --------------------------------------------------------------------------- transformer


class TransformerLayer(DecoderLayer):
    """The Qwen3 layer without q/k norm, LayerScaled; attends to a carried window of
    rotated keys/values (``past``) before this chunk's."""

    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__(cfg, qk_norm=False, bias=cfg.attention_bias, layer_scale=cfg.layer_scale_initial_scale)

    def forward(self, x, cos, sin, mask, past: tuple[torch.Tensor, torch.Tensor] | None = None):
        """x [B, t, D]; past (k, v) [B, KVH, W, hd]; mask bool [B, t, W + t]. Returns
        [B, t, D] and the full (k, v) [B, KVH, W + t, hd]."""
        q, k, v = self.qkv(x, cos, sin)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        return self.finish(x, q, k, v, mask[:, None]), (k, v)


class PreTransformer(nn.Module):
    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_proj = nn.Linear(cfg.latent_dim, cfg.hidden_size)
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.latent_dim)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta), persistent=False)

    def _mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """q_pos [B, t], k_pos [B, L] -> bool [B, t, L]: causal, inside the window, key exists (pos >= 0)."""
        q, k = q_pos[:, :, None], k_pos[:, None, :]
        return (k >= 0) & (k <= q) & (k > q - self.cfg.sliding_window)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, latent] -> [B, T, latent], positions 0..T-1."""
        b, t, _ = x.shape
        h = self.input_proj(x)
        pos = torch.arange(t, device=x.device)[None].expand(b, t)
        cos, sin = rope_cos_sin(self.inv_freq, pos, h.dtype)
        mask = self._mask(pos, pos)
        for layer in self.layers:
            h, _ = layer(h, cos, sin, mask)
        return self.output_proj(self.norm(h))

    def step(self, x: torch.Tensor, state: DecoderState) -> torch.Tensor:
        """x [B, t, latent] at positions state.position.. ; updates the carried K/V windows."""
        b, t, _ = x.shape
        w = state.keys[0].shape[2]
        h = self.input_proj(x)
        q_pos = state.position[:, None] + torch.arange(t, device=x.device)[None]  # [B, t]
        past_pos = state.position[:, None] - w + torch.arange(w, device=x.device)[None]  # [B, W]; < 0: empty
        cos, sin = rope_cos_sin(self.inv_freq, q_pos, h.dtype)
        mask = self._mask(q_pos, torch.cat([past_pos, q_pos], dim=1))
        for i, layer in enumerate(self.layers):
            h, (k, v) = layer(h, cos, sin, mask, (state.keys[i], state.values[i]))
            state.keys[i], state.values[i] = k[:, :, k.shape[2] - w:], v[:, :, v.shape[2] - w:]
        return self.output_proj(self.norm(h))


# --------------------------------------------------------------------------- decoder


class CodecDecoder(nn.Module):
    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        if cfg.decoder_dim % 2 ** len(cfg.upsample_rates):
            raise ValueError(f"decoder_dim {cfg.decoder_dim} must be divisible by 2**{len(cfg.upsample_rates)}")
        self.cfg = cfg
        self.samples_per_frame = math.prod(cfg.upsample_rates) * math.prod(cfg.upsampling_ratios)
        self.quantizer = SplitResidualVectorQuantizer(cfg)
        self.pre_conv = CausalConv(cfg.codebook_dim, cfg.latent_dim, 3)
        self.pre_transformer = PreTransformer(cfg)
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalTransConv(cfg.latent_dim, cfg.latent_dim, f, f), ConvNeXtBlock(cfg.latent_dim)])
            for f in cfg.upsampling_ratios)
        blocks: list[nn.Module] = [CausalConv(cfg.latent_dim, cfg.decoder_dim, 7)]
        for i, rate in enumerate(cfg.upsample_rates):
            blocks.append(DecoderBlock(cfg.decoder_dim // 2**i, cfg.decoder_dim // 2 ** (i + 1), rate))
        out_dim = cfg.decoder_dim // 2 ** len(cfg.upsample_rates)
        blocks += [SnakeBeta(out_dim), CausalConv(out_dim, 1, 7)]
        blocks[-1].conv.init_gain = 0.05  # random init only: keep the waveform (and its DC) inside +-1
        self.decoder = nn.ModuleList(blocks)
        # Every module with a left context gets a slot in DecoderState.conv (module order).
        self.streaming = [m for m in self.modules() if isinstance(m, (CausalConv, CausalTransConv))]
        for i, m in enumerate(self.streaming):
            m.slot = i

    def _check(self, codes: torch.Tensor) -> None:
        if codes.dim() != 3 or codes.shape[1] != self.cfg.num_quantizers:
            raise ValueError(f"expected codes [B, {self.cfg.num_quantizers}, T], got {tuple(codes.shape)}")
        if codes.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"codes must be integer, got {codes.dtype}")

    @torch.no_grad()
    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """Full decode: codes [B, G, T] -> wav [B, T * samples_per_frame] in [-1, 1]."""
        self._check(codes)
        h = self.pre_conv(self.quantizer.decode(codes))  # [B, latent, T]
        h = self.pre_transformer(h.transpose(1, 2)).transpose(1, 2)
        for up in self.upsample:
            for m in up:
                h = m(h)
        for m in self.decoder:
            h = m(h)
        return h.clamp(-1, 1)[:, 0]

    def init_state(self, batch: int, device=None, dtype=None) -> DecoderState:
        p = next(self.parameters())
        device, dtype = device or p.device, dtype or p.dtype
        c = self.cfg
        kv_shape = (batch, c.num_key_value_heads, c.sliding_window, c.head_dim)
        return DecoderState(
            conv=[m.init_context(batch, device, dtype) for m in self.streaming],
            keys=[torch.zeros(kv_shape, device=device, dtype=dtype) for _ in range(c.num_hidden_layers)],
            values=[torch.zeros(kv_shape, device=device, dtype=dtype) for _ in range(c.num_hidden_layers)],
            position=torch.zeros(batch, dtype=torch.int64, device=device))

    @torch.no_grad()
    def decode_step(self, codes: torch.Tensor, state: DecoderState) -> tuple[torch.Tensor, DecoderState]:
        """Streaming decode of the next ``t`` frames: codes [B, G, t] -> (wav [B, t * 1920], new state).

        The input state is left untouched (a new one is returned), so a failed step can be retried.
        """
        self._check(codes)
        if codes.shape[0] != state.batch:
            raise ValueError(f"codes batch {codes.shape[0]} != state batch {state.batch}")
        t = codes.shape[-1]
        st = DecoderState(list(state.conv), list(state.keys), list(state.values), state.position)
        h = self.pre_conv.step(self.quantizer.decode(codes), st)
        h = self.pre_transformer.step(h.transpose(1, 2), st).transpose(1, 2)
        for up in self.upsample:
            for m in up:
                h = m.step(h, st)
        h = self.decoder[0].step(h, st)
        for m in self.decoder[1:-2]:
            h = m.step(h, st)
        h = self.decoder[-1].step(self.decoder[-2](h), st)
        st.position = state.position + t
        return h.clamp(-1, 1)[:, 0], st
