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
from torch import nn

from engines.hardware.devices import canonical_device
from engines.models.configs import CodePredictorConfig
from engines.models.layers import (
    DecoderLayer,
    RMSNorm,
    compile_block_call,
    prepare_rope,
    rope_cos_sin,
    rope_inv_freq,
)
from engines.models.sampling import DOMAIN_CODES, FrameSampling, sample_rows


class PredictorLayer(DecoderLayer):
    """The Qwen3 layer; with a cache, K/V are written into static slots first."""

    def forward(self, x, cos, sin, mask, cache: tuple[torch.Tensor, torch.Tensor] | None = None,
                positions: torch.Tensor | None = None):
        """x [B, S, D]. With ``cache`` (k, v [B, KVH, G, hd] views of the static cache) the new
        K/V are written at ``positions`` [S] (a device tensor, so the step has no host-side
        position and compiles once for every step) and attention reads the whole (masked) cache."""
        q, k, v = self.qkv(x, cos, sin)
        if cache is not None:
            cache_k, cache_v = cache
            cache_k.index_copy_(2, positions, k)
            cache_v.index_copy_(2, positions, v)
            k, v = cache_k, cache_v
        return self.finish(x, q, k, v, mask)


def _call_layer(layer: PredictorLayer, x, cos, sin, mask, cache_k, cache_v, positions):
    return layer(x, cos, sin, mask, (cache_k, cache_v), positions)


class CodePredictorModel(nn.Module):
    """Holds the official ``model.*`` parameters (layers, final norm, codec embeddings)."""

    def __init__(self, cfg: CodePredictorConfig):
        super().__init__()
        self.layers = nn.ModuleList(PredictorLayer(cfg) for _ in range(cfg.num_hidden_layers))
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
        # PredictorLayer.forward plus the layer first: set by compile_layers().
        self.layer_step = None
        # Every layer and the final norm as one call per pass, with its own K/V cache: set by
        # quantize_talker on CPU (engines/models/quantize_predictor.py); model.layers is then empty.
        self.fused_layers: nn.Module | None = None

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

    def _tables(self, pos: int, s: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Positions pos..pos+s-1, their cos/sin [1, 1, s, hd] (``prepare_rope``) and the causal
        mask rows [s, G], computed once per device and dtype (a frame's 15 passes only look
        them up: fewer ops per step). Separate tensors per (pos, s), not views of one table, so
        a compiled layer sees the same strides and offsets at every step."""
        key = (canonical_device(device), dtype)
        if self._table_key != key:
            self._table = {}
            self._table_key = key
        if (pos, s) not in self._table:
            g = self.cfg.num_code_groups
            positions = torch.arange(pos, pos + s, device=device)
            cos, sin = prepare_rope(*self._rope(positions, 1, dtype))
            # Query at position p sees cache slots <= p; slots beyond hold stale rows and are masked.
            mask = torch.arange(g, device=device)[None, :] <= positions[:, None]
            self._table[(pos, s)] = (positions, cos, sin, mask)
        return self._table[(pos, s)]

    _table_key = None
    _table: dict | None = None

    def _run(self, x: torch.Tensor, pos: int, cache: StaticKVCache, head: int) -> torch.Tensor:
        """Inputs x [B, S, D] at positions pos.. through the layers (KV written to the cache);
        only the last position goes through the final norm and lm_head[head] -> [B, V]."""
        if self.fused_layers is not None:
            return self.lm_head[head](self.fused_layers(x, pos))
        b, s, _ = x.shape
        positions, cos, sin, mask = self._tables(pos, s, x.device, x.dtype)  # cos/sin broadcast over rows
        step = self.layer_step or _call_layer
        for i, layer in enumerate(self.model.layers):
            x = step(layer, x, cos, sin, mask, *cache.layer(i, b), positions)
        return self.lm_head[head](self.model.norm(x[:, -1]))

    @torch.no_grad()
    def predict(self, h: torch.Tensor, code0_emb: torch.Tensor, sampling: FrameSampling,
                return_logits: bool = False, forced: torch.Tensor | None = None):
        """h [B, D_talker] (talker hidden after its final norm), code0_emb [B, D_talker]
        -> codes [B, G-1] int64 (codes 1..G-1), and logits [B, G-1, V] if ``return_logits``.
        ``forced`` [B, G-1]: teacher forcing (benchmarks/quantize_fidelity.py): each pass is fed
        these codes 1..i-1 instead of the sampled ones (the logits are then code i's given them).

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
                emb = self.model.codec_embedding[i - 2](codes[-1] if forced is None else forced[:, i - 2])  # [B, D_talker]
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
        if self.fused_layers is not None:
            raise ValueError("the layers run fused (quantize_talker): no per-layer reference")
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
