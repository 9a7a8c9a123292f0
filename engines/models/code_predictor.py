"""Qwen3-TTS code predictor (the "sub-talker"): codebooks 1..G-1 of one frame.

Plain-torch port of ``Qwen3TTSTalkerCodePredictorModelForConditionalGeneration``; the
state-dict keys equal the official ones under ``talker.code_predictor.``:
``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``...q_norm/k_norm.weight``,
``model.layers.{i}.mlp.{gate,up,down}_proj.weight``, ``model.norm.weight``,
``model.codec_embedding.{g}.weight``, ``lm_head.{g}.weight`` and, when the talker is
wider than the predictor, ``small_to_mtp_projection.{weight,bias}``.

Per frame: prefill [h, emb(code0)] (2 positions) -> lm_head[0] -> code 1; then for
i = 1..G-2 one step with query length 1: codec_embedding[i-1](code i) -> lm_head[i]
-> code i+1. Positions restart at 0 every frame. ``predict`` runs this over a
preallocated static KV cache with host-known control flow and on-device sampling;
``naive_predict`` recomputes the whole sequence each step (the reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engines.models.configs import CodePredictorConfig
from engines.models.layers import SwiGLU, compile_block_call
from engines.models.sampling import (
    DOMAIN_CODES,
    keyed_gumbel,
    sample_logits,
    split_seed,
)
from engines.runtime.devices import canonical_device, upload

# --------------------------------------------------------------------------- primitives


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in fp32, cast back, then scale (same order as the official)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """Default (unscaled) RoPE inverse frequencies, computed like transformers does."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """positions [B, S] (int) -> cos, sin [B, S, head_dim] in fp32 math, cast to ``dtype``."""
    freqs = positions.float()[..., None] * inv_freq.float()  # [B, S, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, S, hd]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, S, hd]; cos/sin [B, S, hd]."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin


def expand_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, KVH, S, hd] -> [B, KVH * n_rep, S, hd] (query head h reads kv head h // n_rep)."""
    if n_rep == 1:
        return x
    b, kvh, s, hd = x.shape
    return x[:, :, None].expand(b, kvh, n_rep, s, hd).reshape(b, kvh * n_rep, s, hd)


# --------------------------------------------------------------------------- sampling


@dataclass(frozen=True)
class FrameSampling:
    """Per-row sampling settings for a batch of frames (all tensors [B] on the device).

    ``all_greedy`` is host-known, decided when the batch is built, so greedy batches skip
    the noise entirely without reading anything back from the device.
    """

    seed_lo: torch.Tensor  # int64
    seed_hi: torch.Tensor  # int64
    frame: torch.Tensor  # int64 global frame index (sampling counter)
    greedy: torch.Tensor  # bool
    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int64, <= 0 means off
    top_p: torch.Tensor  # float32
    all_greedy: bool
    any_top_p: bool  # some row has top_p < 1

    @staticmethod
    def for_stream(n_frames: int, seed: int, frame_offset: int, device, greedy: bool = True,
                   temperature: float = 0.9, top_k: int = 50, top_p: float = 1.0) -> "FrameSampling":
        """Rows for frames ``frame_offset .. frame_offset + n_frames - 1`` of one stream."""
        return FrameSampling.for_streams([(n_frames, seed, frame_offset, greedy, temperature, top_k, top_p)], device)

    @staticmethod
    def for_streams(streams: list[tuple[int, int, int, bool, float, int, float]], device) -> "FrameSampling":
        """Rows of several streams at once, each ``(n_frames, seed, frame_offset, greedy,
        temperature, top_k, top_p)``: equal to ``cat`` of their ``for_stream``, but built on the
        host and uploaded once per field (7 copies, not 7 kernels per stream; no stream sync)."""
        cols: dict[str, list] = {k: [] for k in ("seed_lo", "seed_hi", "frame", "greedy", "temperature", "top_k",
                                                 "top_p")}
        for n, seed, offset, greedy, temperature, top_k, top_p in streams:
            lo, hi = split_seed(seed)
            for name, value in (("seed_lo", lo), ("seed_hi", hi), ("greedy", bool(greedy)),
                                ("temperature", float(temperature)), ("top_k", int(top_k)), ("top_p", float(top_p))):
                cols[name].extend([value] * n)
            cols["frame"].extend(range(offset, offset + n))
        dtypes = {"seed_lo": torch.int64, "seed_hi": torch.int64, "frame": torch.int64, "greedy": torch.bool,
                  "temperature": torch.float32, "top_k": torch.int64, "top_p": torch.float32}
        fields = {name: upload(values, dtypes[name], device) for name, values in cols.items()}
        return FrameSampling(**fields, all_greedy=all(s[3] for s in streams),
                             any_top_p=any((not s[3]) and s[6] < 1.0 for s in streams))

    @staticmethod
    def cat(parts: list["FrameSampling"]) -> "FrameSampling":
        def c(name):
            return torch.cat([getattr(p, name) for p in parts])
        return FrameSampling(c("seed_lo"), c("seed_hi"), c("frame"), c("greedy"), c("temperature"), c("top_k"),
                             c("top_p"), all(p.all_greedy for p in parts), any(p.any_top_p for p in parts))

    def rows(self, sl: slice) -> "FrameSampling":
        return FrameSampling(self.seed_lo[sl], self.seed_hi[sl], self.frame[sl], self.greedy[sl],
                             self.temperature[sl], self.top_k[sl], self.top_p[sl], self.all_greedy, self.any_top_p)

    def __len__(self) -> int:
        return self.frame.shape[0]


def keep_top_k(x: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Per-row top-k (sample_logits only takes one k for the whole batch): x [B, V] with values
    below each row's k-th largest set to -inf; top_k [B] int64, <= 0 means off."""
    vocab = x.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(1, vocab)
    kth = torch.sort(x, dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])  # [B, 1]
    return x.masked_fill(x < kth, float("-inf"))


def sample_rows(logits: torch.Tensor, sampling: FrameSampling, domain: int, counters: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> ids [B] (int64) on the device; counters [B] int64 key the Gumbel noise."""
    if sampling.all_greedy:
        return logits.argmax(dim=-1)
    x = keep_top_k(logits.float(), sampling.top_k)
    gumbel = keyed_gumbel(sampling.seed_lo, sampling.seed_hi, domain, counters, x.shape[-1])
    top_p = sampling.top_p if sampling.any_top_p else None
    return sample_logits(x, gumbel, sampling.temperature, None, top_p, sampling.greedy)


# --------------------------------------------------------------------------- model


class Attention(nn.Module):
    def __init__(self, cfg: CodePredictorConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        if self.n_heads % self.n_kv:
            raise ValueError(f"num_attention_heads {self.n_heads} not divisible by num_key_value_heads {self.n_kv}")
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)  # per head
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, S, D] -> q [B, H, S, hd], k/v [B, KVH, S, hd] (q, k rotated)."""
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, s, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [B, H, S, hd], k/v [B, KVH, L, hd], mask bool broadcastable to [B, H, S, L] -> [B, S, D]."""
        rep = self.n_heads // self.n_kv
        out = F.scaled_dot_product_attention(q, expand_kv(k, rep), expand_kv(v, rep), attn_mask=mask,
                                             scale=self.head_dim**-0.5)  # [B, H, S, hd]
        b, _, s, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))


MLP = SwiGLU  # the Qwen3 MLP (gate/up/down projections)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: CodePredictorConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache: tuple[torch.Tensor, torch.Tensor] | None = None,
                positions: torch.Tensor | None = None):
        """x [B, S, D]. With ``cache`` (k, v [B, KVH, G, hd] views of the static cache) the new
        K/V are written at ``positions`` [S] (a device tensor, so the step has no host-side
        position and compiles once for every step) and attention reads the whole (masked) cache."""
        q, k, v = self.self_attn.qkv(self.input_layernorm(x), cos, sin)
        if cache is not None:
            cache_k, cache_v = cache
            cache_k.index_copy_(2, positions, k)
            cache_v.index_copy_(2, positions, v)
            k, v = cache_k, cache_v
        x = x + self.self_attn.attend(q, k, v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def _call_layer(layer: DecoderLayer, x, cos, sin, mask, cache_k, cache_v, positions):
    return layer(x, cos, sin, mask, (cache_k, cache_v), positions)


class CodePredictorModel(nn.Module):
    """Holds the official ``model.*`` parameters (layers, final norm, codec embeddings)."""

    def __init__(self, cfg: CodePredictorConfig):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Table g embeds code g+1, at the talker width (projected afterwards).
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(cfg.vocab_size, cfg.talker_hidden_size) for _ in range(cfg.num_code_groups - 1))


@dataclass
class StaticKVCache:
    """Per-layer K/V storage [rows, KVH, G, hd], allocated once and written in place."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @property
    def rows(self) -> int:
        return self.k[0].shape[0]

    def layer(self, i: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i][:batch], self.v[i][:batch]


class CodePredictor(nn.Module):
    def __init__(self, cfg: CodePredictorConfig):
        super().__init__()
        if cfg.num_code_groups < 2:
            raise ValueError(f"num_code_groups must be >= 2, got {cfg.num_code_groups}")
        self.cfg = cfg
        self.model = CodePredictorModel(cfg)
        self.lm_head = nn.ModuleList(
            nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) for _ in range(cfg.num_code_groups - 1))
        if cfg.hidden_size != cfg.talker_hidden_size:
            self.small_to_mtp_projection: nn.Module = nn.Linear(cfg.talker_hidden_size, cfg.hidden_size, bias=True)
        else:
            self.small_to_mtp_projection = nn.Identity()
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta), persistent=False)
        self.kv_cache: StaticKVCache | None = None
        # Optional replacement for calling a layer in the cached loop, same signature as
        # DecoderLayer.forward plus the layer first: set by compile_layers().
        self.layer_step = None

    def compile_layers(self, backend: str = "inductor") -> None:
        """Run the cached loop's layers through ``torch.compile`` (fused norms, RoPE and
        activations: the eager step is launch bound, ~50 kernels per layer). One compiled
        function serves every layer, step and batch (dynamic shapes; sizes 1 and 2 are
        specialised, so a handful of variants). Capture it in a CUDA graph afterwards."""
        self.layer_step = compile_block_call(_call_layer, backend)

    @property
    def num_code_groups(self) -> int:
        return self.cfg.num_code_groups

    def _rope(self, positions: torch.Tensor, batch: int, dtype: torch.dtype):
        return rope_cos_sin(self.inv_freq, positions[None].expand(batch, -1), dtype)

    def ensure_cache(self, rows: int, device, dtype) -> StaticKVCache:
        """The static cache, (re)allocated only if it is too small or on another device/dtype."""
        c = self.kv_cache
        if c is None or c.rows < rows or c.k[0].device != canonical_device(device) or c.k[0].dtype != dtype:
            shape = (rows, self.cfg.num_key_value_heads, self.cfg.num_code_groups, self.cfg.head_dim)
            n = self.cfg.num_hidden_layers
            c = StaticKVCache([torch.zeros(shape, device=device, dtype=dtype) for _ in range(n)],
                              [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n)])
            self.kv_cache = c
        return c

    def _run(self, x: torch.Tensor, pos: int, cache: StaticKVCache, head: int) -> torch.Tensor:
        """Inputs x [B, S, D] at positions pos.. through the layers (KV written to the cache);
        only the last position goes through the final norm and lm_head[head] -> [B, V]."""
        b, s, _ = x.shape
        g = self.cfg.num_code_groups
        positions = torch.arange(pos, pos + s, device=x.device)
        cos, sin = self._rope(positions, b, x.dtype)
        # Query at position p sees cache slots <= p; slots beyond hold stale rows and are masked.
        mask = torch.arange(g, device=x.device)[None, :] <= positions[:, None]  # [S, G]
        step = self.layer_step or _call_layer
        for i, layer in enumerate(self.model.layers):
            x = step(layer, x, cos, sin, mask, *cache.layer(i, b), positions)
        return self.lm_head[head](self.model.norm(x[:, -1]))

    @torch.no_grad()
    def predict(self, h: torch.Tensor, code0_emb: torch.Tensor, sampling: FrameSampling,
                return_logits: bool = False):
        """h [B, D_talker] (talker hidden after its final norm), code0_emb [B, D_talker]
        -> codes [B, G-1] int64 (codes 1..G-1), and logits [B, G-1, V] if ``return_logits``.

        Static control flow: one prefill + G-2 single-position steps; sampled ids stay on
        the device and feed the next embedding lookup directly.
        """
        if h.shape != code0_emb.shape or h.dim() != 2 or h.shape[1] != self.cfg.talker_hidden_size:
            raise ValueError(f"expected h and code0_emb [B, {self.cfg.talker_hidden_size}], "
                             f"got {tuple(h.shape)} and {tuple(code0_emb.shape)}")
        b, g = h.shape[0], self.cfg.num_code_groups
        cache = self.ensure_cache(b, h.device, h.dtype)
        counters = sampling.frame * g  # + group below: DOMAIN_CODES counter f * G + g
        x = self.small_to_mtp_projection(torch.stack([h, code0_emb], dim=1))  # [B, 2, D]
        logits = self._run(x, 0, cache, head=0)  # [B, V]
        codes, all_logits = [], []
        for i in range(1, g):  # code i from lm_head[i-1]
            if i > 1:
                emb = self.model.codec_embedding[i - 2](codes[-1])  # [B, D_talker]
                logits = self._run(self.small_to_mtp_projection(emb)[:, None], i, cache, head=i - 1)
            codes.append(sample_rows(logits, sampling, DOMAIN_CODES, counters + i))
            if return_logits:
                all_logits.append(logits.float())
        out = torch.stack(codes, dim=1)
        return (out, torch.stack(all_logits, dim=1)) if return_logits else out

    @torch.no_grad()
    def naive_predict(self, h: torch.Tensor, code0_emb: torch.Tensor, sampling: FrameSampling,
                      return_logits: bool = False):
        """Reference: no cache; every step recomputes the full causal sequence from scratch."""
        b, g = h.shape[0], self.cfg.num_code_groups
        seq = [h, code0_emb]  # talker-width inputs
        codes, all_logits = [], []
        for i in range(1, g):
            x = self.small_to_mtp_projection(torch.stack(seq, dim=1))  # [B, S, D]
            s = x.shape[1]
            positions = torch.arange(s, device=x.device)
            cos, sin = self._rope(positions, b, x.dtype)
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            for layer in self.model.layers:
                x = layer(x, cos, sin, mask)
            logits = self.lm_head[i - 1](self.model.norm(x))[:, -1]
            code = sample_rows(logits, sampling, DOMAIN_CODES, sampling.frame * g + i)
            codes.append(code)
            all_logits.append(logits.float())
            if i < g - 1:
                seq.append(self.model.codec_embedding[i - 1](code))
        out = torch.stack(codes, dim=1)
        return (out, torch.stack(all_logits, dim=1)) if return_logits else out
