"""Qwen3-TTS talker: the autoregressive decoder that yields code 0 and the frame hidden.

Plain-torch port of ``Qwen3TTSTalkerForConditionalGeneration`` (minus its code
predictor, see ``code_predictor.py``). State-dict keys equal the official ones under
``talker.``:

    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight, ...q_norm/k_norm.weight
    model.layers.{i}.mlp.{gate,up,down}_proj.weight, model.layers.{i}.{input,post_attention}_layernorm.weight
    model.norm.weight, model.codec_embedding.weight, model.text_embedding.weight
    text_projection.linear_fc{1,2}.{weight,bias}, codec_head.weight

Input position = text part ``text_projection(text_embedding(id))`` + codec part
``codec_embedding(id)`` (see ``engines/pipelines/talker/prompt.py``). Positions use 3-section
interleaved M-RoPE; for text-only input the three position ids are equal, so it is
numerically the 1-D RoPE, but we compute it the official way.

``forward`` runs any number of rows and positions over a static KV cache
[rows, KVH, L, hd]: each row writes its K/V at its own positions and attends to
cache slots <= its position; only the last position goes through the final norm.
``forward_paged`` does the same over the paged pool (engines/models/paged_kv.py). Both run the
one layer forward; what differs is the K/V access object each layer is handed
(engines/models/kv_access.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from engines.models.configs import Qwen3LayerConfig
from engines.models.kv_access import DenseKV, GatheredKV, InPlaceKV, KVAccess
from engines.models.layers import (
    DecoderLayer,
    RMSNorm,
    ScaledDotProduct,
    choose_fused_rows,
    compile_block_call,
    mrope_cos_sin,
    prepare_rope,
    rope_inv_freq,
)
from engines.models.paged_kv import PagedKVCache


@dataclass(frozen=True)
class TalkerConfig(Qwen3LayerConfig):
    """Keys of ``config.json`` ``talker_config`` that the talker needs."""

    mrope_section: tuple[int, ...] = (2, 3, 3)  # in rotary pairs (sums to head_dim / 2)
    mrope_interleaved: bool = True
    vocab_size: int = 3072  # codec vocabulary (codebook ids + special ids)
    text_vocab_size: int = 151936
    text_hidden_size: int = 2048
    num_code_groups: int = 16
    codec_eos_token_id: int = 2150
    max_position_embeddings: int = 32768
    suppressed_width: int = 1024  # the official generate() suppresses [V - 1024, V) except EOS

    @classmethod
    def from_dict(cls, talker: Mapping[str, Any]) -> "TalkerConfig":
        rope = talker.get("rope_scaling") or {}
        head_dim = talker.get("head_dim") or talker["hidden_size"] // talker["num_attention_heads"]
        section = tuple(rope.get("mrope_section") or (head_dim // 2, 0, 0))
        return super().from_dict({**talker, "head_dim": head_dim, "mrope_section": section,
                                  "mrope_interleaved": bool(rope.get("interleaved", False)),
                                  "rope_theta": float(talker.get("rope_theta", 10_000.0)),
                                  "rms_norm_eps": float(talker.get("rms_norm_eps", 1e-6))})

    def valid_code0_ids(self) -> list[int]:
        """Ids the official generate() can emit as code 0: [0, V - 1024) and EOS, ascending."""
        ids = set(range(max(0, self.vocab_size - self.suppressed_width))) | {self.codec_eos_token_id}
        return sorted(ids)


# --------------------------------------------------------------------------- model


class ResizeMLP(nn.Module):
    """text_projection: Linear(text_hidden, text_hidden) -> SiLU -> Linear(text_hidden, hidden), with biases."""

    def __init__(self, d_in: int, d_mid: int, d_out: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(d_in, d_mid, bias=True)
        self.linear_fc2 = nn.Linear(d_mid, d_out, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class TalkerLayer(DecoderLayer):
    """The Qwen3 layer, one forward whatever holds its K/V: ``kv`` (engines/models/kv_access.py)
    writes the new K/V where they live and attends over the row's. A quantized talker runs the same
    forward on the modules quantize_talker swapped in (engines/models/quantize.py)."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVAccess) -> torch.Tensor:
        """x [B, S, D]; cos/sin prepared (``prepare_rope``: [B, 1, S, hd]) -> [B, S, D]."""
        q, k, v = self.qkv(x, cos, sin)
        return self.after_attention(x, self.self_attn.o_proj(kv.attend(q, k, v)))


def _call_layer(layer: TalkerLayer, x, cos, sin, kv: KVAccess):
    return layer(x, cos, sin, kv)


class TalkerModel(nn.Module):
    def __init__(self, cfg: TalkerConfig):
        super().__init__()
        self.layers = nn.ModuleList(TalkerLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.codec_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.text_embedding = nn.Embedding(cfg.text_vocab_size, cfg.text_hidden_size)


@dataclass
class TalkerKVCache:
    """Per-layer K/V [rows, KVH, max_len, hd], allocated once and written in place."""

    k: list[torch.Tensor]  # unused slots are masked (position > the row's), never read
    v: list[torch.Tensor]

    @property
    def rows(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]


class Talker(nn.Module):
    def __init__(self, cfg: TalkerConfig):
        super().__init__()
        if sum(cfg.mrope_section) * 2 != cfg.head_dim:
            raise ValueError(f"mrope_section {cfg.mrope_section} must sum to head_dim / 2 = {cfg.head_dim // 2}")
        self.cfg = cfg
        self.model = TalkerModel(cfg)
        self.text_projection = ResizeMLP(cfg.text_hidden_size, cfg.text_hidden_size, cfg.hidden_size)
        self.codec_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta), persistent=False)
        self.register_buffer("valid_ids", torch.tensor(cfg.valid_code0_ids(), dtype=torch.long), persistent=False)
        # the attention over contiguous K/V that DenseKV and GatheredKV run (a quantizer may swap it)
        self.attention_core: nn.Module = ScaledDotProduct(cfg.head_dim ** -0.5)
        self.layer_step = None  # compile_layers(): the layer call through torch.compile
        # a layer call that runs a decode step's layers as fused kernels over the pool read in place
        # (engines/models/fused_talker.py; opt-in on CUDA): it takes the InPlaceKV the layer would
        self.fused_decode_step = None

    def compile_layers(self, backend: str = "inductor") -> None:
        """Run the layers through ``torch.compile``: fused norms, RoPE and activations, so a step
        (and a prefill chunk) launches a fraction of the kernels; eager, the 28-layer forward is
        launch bound (~23 ms on an H200 at any batch). One compiled function serves every layer,
        batch and length (dynamic shapes), a graph per kind of K/V access."""
        self.layer_step = compile_block_call(_call_layer, backend)

    def _layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kvs: list[KVAccess]) -> torch.Tensor:
        step = self.layer_step or _call_layer
        if self.fused_decode_step is not None and kvs and isinstance(kvs[0], InPlaceKV):
            step = self.fused_decode_step
        for layer, kv in zip(self.model.layers, kvs):
            x = step(layer, x, cos, sin, kv)
        return x

    # ---------------------------------------------------------------- embeddings

    def text_part(self, ids: torch.Tensor) -> torch.Tensor:
        """text ids [...] -> [..., D]."""
        return self.text_projection(self.model.text_embedding(ids))

    def codec_part(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.codec_embedding(ids)

    def prompt_embeds(self, text_ids: torch.Tensor, codec_ids: torch.Tensor) -> torch.Tensor:
        """text_ids, codec_ids [S] (codec -1 = no codec part) -> inputs [S, D]."""
        x = self.text_part(text_ids)
        codec = self.codec_part(codec_ids.clamp_min(0))
        return torch.where((codec_ids >= 0)[:, None], x + codec, x)

    # ---------------------------------------------------------------- cache / forward

    def new_cache(self, rows: int, max_len: int, device, dtype) -> TalkerKVCache:
        shape = (rows, self.cfg.num_key_value_heads, max_len, self.cfg.head_dim)
        n = self.cfg.num_hidden_layers
        return TalkerKVCache([torch.zeros(shape, device=device, dtype=dtype) for _ in range(n)],
                             [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n)])

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: TalkerKVCache, row0: int = 0,
                attend_len: int | None = None) -> torch.Tensor:
        """x [B, S, D] for cache rows row0..row0+B-1 at positions [B, S] (int64, device)
        -> hidden after the final norm at the last position [B, D].

        ``attend_len`` (host-known, > every position) bounds the cache slots read."""
        b, s, _ = x.shape
        length = attend_len or cache.max_len
        cos, sin = prepare_rope(*mrope_cos_sin(self.inv_freq, positions[None].expand(3, b, s), self.cfg.mrope_section,
                                               self.cfg.mrope_interleaved, x.dtype))
        rows = torch.arange(b, device=x.device)[:, None]  # into the row-sliced cache views
        slots = torch.arange(length, device=x.device)
        mask = (slots[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, S, L]
        kvs = [DenseKV(k[row0:row0 + b, :, :length], v[row0:row0 + b, :, :length], rows, positions, mask,
                       self.attention_core) for k, v in zip(cache.k, cache.v)]
        return self.model.norm(self._layers(x, cos, sin, kvs)[:, -1])

    def fuse_projections(self, measure: bool | None = None) -> None:
        """At load: each layer's q/k/v and gate/up weights as one matrix each (one GEMM instead of
        three / two; the parameters become views, so no extra memory). Bitwise the same
        outputs on CPU (tests/engines/pipelines/talker/test_talker_paged.py); call once the talker is on its device.
        ``measure`` (default: on CPU) times fused against separate GEMMs on the first layer
        and keeps the fused one only up to the rows where it is not slower (``choose_fused_rows``);
        on CUDA the step is launch bound and fused always."""
        for layer in self.model.layers:
            layer.self_attn.fuse_qkv()
            layer.mlp.fuse()
        first = self.model.layers[0]
        if measure is None:
            measure = first.mlp.gate_up is not None and first.mlp.gate_up.device.type == "cpu"
        if not measure or first.self_attn.qkv_weight is None or first.mlp.gate_up is None:
            return
        with torch.no_grad():
            attn_rows = choose_fused_rows(first.self_attn.qkv_weight, first.self_attn._qkv_sizes)
            mlp_rows = choose_fused_rows(first.mlp.gate_up, [first.mlp.gate_up.shape[0] // 2] * 2)
        for layer in self.model.layers:
            layer.self_attn.fused_rows, layer.mlp.fused_rows = attn_rows, mlp_rows

    def rope_table(self, positions: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [positions, hd] for text-only positions 0..positions-1 (the three M-RoPE
        position ids equal), computed once the official way: a step gathers its rows from it."""
        device = self.inv_freq.device
        pos = torch.arange(positions, device=device)[None, None].expand(3, 1, positions)
        cos, sin = mrope_cos_sin(self.inv_freq, pos, self.cfg.mrope_section, self.cfg.mrope_interleaved, dtype)
        return cos[0], sin[0]

    def forward_paged(self, x: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache, rows: torch.Tensor,
                      n_blocks: int, rope: tuple[torch.Tensor, torch.Tensor], last: torch.Tensor | None = None,
                      write_slots: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, S, D] of cache rows ``rows`` [B] at ``positions`` [B, S] -> hidden after the
        final norm [B, D] at index ``last`` [B] of each row (default the last, S - 1).

        Attention reads the rows' first ``n_blocks`` blocks (host-known, covering every
        position) masked to slots <= the query's position; ``write_slots`` (default: the
        positions' own slots) lets padding write into the null block. ``rope`` is
        :meth:`rope_table`'s (cos, sin). One position per row where the cache ``reads_in_place``:
        attention reads each row's own blocks in place and ``n_blocks`` is not used."""
        b, s, _ = x.shape
        cos, sin = prepare_rope(rope[0][positions], rope[1][positions])  # [B, 1, S, hd], once for every layer
        if write_slots is None:
            write_slots = cache.slots(rows, positions)
        if s == 1 and cache.reads_in_place:
            table = cache.table[rows]  # [B, max_blocks]
            # a row that owns no block (a padding row: its table is the null block) attends to one
            # position only, so padding never walks a long table
            lengths = torch.where(table[:, 0] != 0, positions[:, 0] + 1, 1)
            kvs = [InPlaceKV(k, v, write_slots, table, lengths, cache.block_size, self.attention_core.scale)
                   for k, v in zip(cache.k, cache.v)]
        else:
            read_slots = cache.read_slots(rows, n_blocks)
            slot_pos = torch.arange(read_slots.shape[1], device=x.device)
            mask = (slot_pos[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, S, L]
            kvs = [GatheredKV(k, v, write_slots, read_slots, mask, self.attention_core)
                   for k, v in zip(cache.k, cache.v)]
        x = self._layers(x, cos, sin, kvs)
        if last is None:
            return self.model.norm(x[:, -1])
        return self.model.norm(x[torch.arange(b, device=x.device), last])

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [B, D] (post-norm) -> full codec logits [B, V]."""
        return self.codec_head(h)

    def valid_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [B, D] -> logits over the compact valid range [B, n_valid] (columns = ``valid_ids``)."""
        w = self.codec_head.weight
        if w.device.type != "cpu":  # gathered per call: nothing kept that a CUDA graph capture would own
            return F.linear(h, w[self.valid_ids])
        key = (w.data_ptr(), w._version, w.dtype)
        if self._valid_head_key != key:  # on CPU the rows are gathered once (~1 ms a step at the 0.6B sizes)
            self._valid_head, self._valid_head_key = w.detach()[self.valid_ids], key
        return F.linear(h, self._valid_head)

    _valid_head_key = None
    _valid_head: torch.Tensor | None = None


__all__ = ["Talker", "TalkerConfig", "TalkerKVCache"]
