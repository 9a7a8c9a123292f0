"""Where a talker layer's keys and values go and come from: the object its one attention forward
is handed (engines/models/talker.py ``TalkerLayer.forward``).

    a = kv.attend(q, k, v)   # q [B, H, S, hd]; the new k / v [B, KVH, S, hd] -> [B, S, H * hd]

    DenseKV      a contiguous cache [rows, KVH, L, hd] (``Talker.forward``, the reference loop):
                 written at each row's positions, attention over the masked cache
    GatheredKV   the paged pool (engines/models/paged_kv.py): written at flat slots, each row's
                 blocks gathered into a contiguous view (prefill; decode where the kernel is off)
    InPlaceKV    the paged pool read in place by the paged-attention kernel: one position per row,
                 each row's own length read on the device (engines/models/paged_attention.py)

The talker picks one per forward and hands every layer its own (that layer's cache or pools), so
the layer has no branch per caller (gpt-fast: one layer forward, the cache an object). ``core`` is
the attention over contiguous K/V: ``layers.ScaledDotProduct``, or what a quantizer swapped in
(engines/models/quantize_nbits.py ``OrtAttention``). Each is a frozen dataclass of tensors, so a
compiled layer call (``Talker.compile_layers``) takes any of them as an argument: one graph per
kind, not per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engines.models.paged_attention import paged_decode_attention
from engines.models.paged_kv import gather_pool, write_pool


@dataclass(frozen=True)
class DenseKV:
    cache_k: torch.Tensor  # [B, KVH, L, hd] (the rows' slice; slots past a row's position are masked)
    cache_v: torch.Tensor
    rows: torch.Tensor  # [B, 1] indices into the slice
    positions: torch.Tensor  # [B, S]
    mask: torch.Tensor  # [B, 1, S, L] (True = attend)
    core: nn.Module

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.cache_k[self.rows, :, self.positions] = k.transpose(1, 2)  # [B, S, KVH, hd] into slots (b, :, pos)
        self.cache_v[self.rows, :, self.positions] = v.transpose(1, 2)
        return self.core(q, self.cache_k, self.cache_v, self.mask)


@dataclass(frozen=True)
class GatheredKV:
    pool_k: torch.Tensor  # this layer's flat pools [slots, KVH, hd]
    pool_v: torch.Tensor
    write_slots: torch.Tensor  # [B, S]
    read_slots: torch.Tensor  # [B, L], in position order
    mask: torch.Tensor  # [B, 1, S, L] (True = attend)
    core: nn.Module

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        write_pool(self.pool_k, self.pool_v, self.write_slots, k, v)
        return self.core(q, *gather_pool(self.pool_k, self.pool_v, self.read_slots), self.mask)


@dataclass(frozen=True)
class InPlaceKV:
    pool_k: torch.Tensor  # this layer's flat pools [slots, KVH, hd]
    pool_v: torch.Tensor
    write_slots: torch.Tensor  # [B, 1]
    table: torch.Tensor  # [B, max_blocks] the rows' block tables
    lengths: torch.Tensor  # [B] positions each row attends (its own included)
    block_size: int
    scale: float

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One query position per row (the kernel is its own attention core)."""
        write_pool(self.pool_k, self.pool_v, self.write_slots, k, v)
        a = paged_decode_attention(q[:, :, 0], self.pool_k, self.pool_v, self.table, self.lengths, self.scale,
                                   self.block_size)
        return a[:, None]


KVAccess = DenseKV | GatheredKV | InPlaceKV  # what TalkerLayer.forward is handed

__all__ = ["DenseKV", "GatheredKV", "InPlaceKV", "KVAccess"]
