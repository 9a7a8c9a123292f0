"""A paged key/value cache: fixed-size blocks from one pool, a block table per row.

    cache = PagedKVCache.for_budget(layers, kv_heads, head_dim, bytes_budget, block_size=16,
                                    rows=64, max_positions=4096, device, dtype)
    cache.reserve(row, positions)         # host: blocks for positions [0, positions) of a row
    slots = cache.slots(rows, positions)  # device: flat slot ids to write K/V at
    write_pool(cache.k[layer], cache.v[layer], slots, k, v)      # device: one layer's K/V into its slots
    k, v = gather_pool(cache.k[layer], cache.v[layer], cache.read_slots(rows, n_blocks))  # [B, KVH, L, hd]
    cache.release(row)                    # the row's blocks go back to the pool

Memory is proportional to the tokens in use (rounded up to blocks), not rows x the longest
utterance. Rows are stable: a finished row frees its blocks and nothing is copied.

Block 0 is the *null block*: never handed out, every unused block-table entry points at it
and padded positions (prefill padding, idle rows of a static batch) write into it. Reads of
it are always masked out, so what lands there never matters.

The pool, the block tables and the slot arithmetic are device tensors; which blocks a row owns
is decided on the host (a free list), and new blocks reach the device table in one batched write per step
(:meth:`flush`, no host read). :class:`KVPoolExhausted` says when the pool cannot hold what a row asks for.
"""

from __future__ import annotations

import math

import torch

from engines.hardware.devices import upload
from engines.models.paged_attention import kernel_available


def write_pool(pool_k: torch.Tensor, pool_v: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> None:
    """One layer's k/v [B, KVH, S, hd] into its flat pools [slots, KVH, hd] at ``slots`` [B, S]
    (an index_put_: in place under torch.compile as well, never a copy of the pool)."""
    flat = slots.reshape(-1)
    b, kvh, s, hd = k.shape
    pool_k.index_put_((flat,), k.transpose(1, 2).reshape(b * s, kvh, hd))
    pool_v.index_put_((flat,), v.transpose(1, 2).reshape(b * s, kvh, hd))


def gather_pool(pool_k: torch.Tensor, pool_v: torch.Tensor,
                read_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K/V [B, KVH, L, hd] at ``read_slots`` [B, L] (their layout: position order).
    ``index_select`` copies each slot's [KVH, hd] whole: the same values as ``pool[read_slots]``,
    2-5x faster on CPU (that advanced index copied element by element)."""
    b, n = read_slots.shape
    flat = read_slots.reshape(-1)
    return (pool_k.index_select(0, flat).view(b, n, *pool_k.shape[1:]).transpose(1, 2),
            pool_v.index_select(0, flat).view(b, n, *pool_v.shape[1:]).transpose(1, 2))


class KVPoolExhausted(RuntimeError):
    """The pool has too few free blocks for a row's next positions."""


class PagedKVCache:
    def __init__(self, layers: int, kv_heads: int, head_dim: int, num_blocks: int, block_size: int, rows: int,
                 max_positions: int, device, dtype: torch.dtype, read_in_place: bool = True):
        if num_blocks < 2:
            raise ValueError(f"a paged KV cache needs at least 2 blocks (one is the null block), got {num_blocks}")
        if block_size <= 0 or rows <= 0 or max_positions <= 0:
            raise ValueError("block_size, rows and max_positions must be > 0")
        self.block_size = block_size
        self.num_blocks = num_blocks
        # one-position attention reads the pool in place where the kernel runs (engines/models/paged_attention.py);
        # False (RuntimeSwitches.paged_attention off): every read gathers the row's blocks
        self.reads_in_place = read_in_place and kernel_available(torch.device(device))
        self.max_blocks_per_row = math.ceil(max_positions / block_size)
        slots = num_blocks * block_size
        # flat [slots, KVH, hd]: a write is one index_copy_, a read one gather
        self.k = [torch.zeros(slots, kv_heads, head_dim, device=device, dtype=dtype) for _ in range(layers)]
        self.v = [torch.zeros(slots, kv_heads, head_dim, device=device, dtype=dtype) for _ in range(layers)]
        self.table = torch.zeros(rows, self.max_blocks_per_row, dtype=torch.int64, device=device)
        self._owned: list[list[int]] = [[] for _ in range(rows)]
        self._free = list(range(num_blocks - 1, 0, -1))  # pop() hands out low ids first; 0 is the null block
        self._table_writes: list[tuple[int, int, int]] = []  # (row, column, block) not yet on the device
        self._offsets = torch.arange(block_size, device=device, dtype=torch.int64)
        # Holders per block: rows that own it + the prefix index (engines/models/prefix_cache.py);
        # a block returns to the free list when its last holder lets go.
        self._holders = [0] * num_blocks
        # A prefix index (engines/models/prefix_cache.py) sets itself here: evictable() -> blocks
        # only it holds, evict(n) -> how many of them it gave back to the free list.
        self.evictor = None

    @classmethod
    def for_budget(cls, layers: int, kv_heads: int, head_dim: int, budget_bytes: float, block_size: int, rows: int,
                   max_positions: int, device, dtype: torch.dtype, read_in_place: bool = True) -> "PagedKVCache":
        """As many blocks as ``budget_bytes`` holds (K and V of every layer), never more than
        every row at ``max_positions`` could use (plus the null block)."""
        per_block = 2 * layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        useful = rows * math.ceil(max_positions / block_size) + 1
        return cls(layers, kv_heads, head_dim, max(2, min(useful, int(budget_bytes // per_block))), block_size, rows,
                   max_positions, device, dtype, read_in_place)

    # ---------------------------------------------------------------- host: ownership

    @property
    def capacity_blocks(self) -> int:
        """Blocks a row can ever be given (the pool minus the null block)."""
        return self.num_blocks - 1

    @property
    def free_blocks(self) -> int:
        """Blocks a row can be given now: the free list plus prefix-index blocks nobody uses."""
        return len(self._free) + (self.evictor.evictable() if self.evictor is not None else 0)

    @property
    def used_blocks(self) -> int:
        return self.capacity_blocks - self.free_blocks

    def blocks_for(self, positions: int) -> int:
        return math.ceil(positions / self.block_size)

    def row_blocks(self, row: int) -> int:
        return len(self._owned[row])

    def reserve(self, row: int, positions: int) -> None:
        """Make sure ``row`` owns blocks for positions [0, positions). KVPoolExhausted (nothing
        taken) when the pool has too few free blocks or the row would pass its table width."""
        need = self.blocks_for(positions) - len(self._owned[row])
        if need <= 0:
            return
        if self.blocks_for(positions) > self.max_blocks_per_row:
            raise KVPoolExhausted(f"{positions} positions pass the cache's {self.max_blocks_per_row * self.block_size}"
                                  f"-position limit per stream")
        if need > len(self._free) and self.evictor is not None:
            self.evictor.evict(need - len(self._free))
        if need > len(self._free):
            raise KVPoolExhausted(f"the KV cache pool has {len(self._free)} free blocks of {self.block_size} "
                                  f"positions, {need} more needed (pool: {self.capacity_blocks} blocks; raise "
                                  f"--kv-cache-gb)")
        owned = self._owned[row]
        for _ in range(need):
            block = self._free.pop()
            self._holders[block] = 1
            self._table_writes.append((row, len(owned), block))
            owned.append(block)

    def adopt(self, row: int, blocks: list[int]) -> None:
        """Append blocks another holder keeps (a shared prompt prefix) to an empty ``row``:
        read-only for it, since it writes only positions past them."""
        owned = self._owned[row]
        if owned:
            raise ValueError("a row adopts shared blocks before it takes any of its own")
        for block in blocks:
            self.hold(block)
            self._table_writes.append((row, len(owned), block))
            owned.append(block)

    def owned(self, row: int) -> list[int]:
        return list(self._owned[row])

    def holders(self, block: int) -> int:
        return self._holders[block]

    def hold(self, block: int) -> None:
        self._holders[block] += 1

    def drop(self, block: int) -> None:
        """One holder lets go; the last one returns the block to the free list."""
        self._holders[block] -= 1
        if self._holders[block] == 0:
            self._free.append(block)

    def copy_positions(self, src: int, dst: int, n: int) -> None:
        """The first ``n`` slots of block ``src`` into block ``dst``, every layer's K and V
        (copy-on-write of a partially shared block)."""
        a, b = src * self.block_size, dst * self.block_size
        for pool in (*self.k, *self.v):
            pool[b:b + n] = pool[a:a + n]

    def flush(self) -> None:
        """The block-table entries handed out since the last flush reach the device: one upload
        and one scatter whatever their number (zero included), so a step's op count is fixed."""
        rows, cols, blocks = zip(*self._table_writes) if self._table_writes else ((), (), ())
        dev = self.table.device
        self.table.index_put_((upload(list(rows), torch.int64, dev), upload(list(cols), torch.int64, dev)),
                              upload(list(blocks), torch.int64, dev))
        self._table_writes.clear()

    def release(self, row: int) -> None:
        """The row's blocks go back to the pool; its table points at the null block again."""
        owned = self._owned[row]
        if owned:
            self.flush()  # entries still queued for this row land before they are cleared
            self.table[row, : len(owned)] = 0
            for block in reversed(owned):
                self.drop(block)
            owned.clear()

    # ---------------------------------------------------------------- device: addressing

    def slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """rows [B], positions [B, S] (int64, device) -> flat slot ids [B, S]."""
        blocks = self.table[rows[:, None], positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def read_slots(self, rows: torch.Tensor, n_blocks: int) -> torch.Tensor:
        """Flat slot ids [B, n_blocks * block_size] of positions 0.. of ``rows`` (computed once per
        forward, shared by every layer)."""
        blocks = self.table[rows, :n_blocks]  # [B, nb]
        return (blocks[:, :, None] * self.block_size + self._offsets).reshape(rows.shape[0], -1)

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))


__all__ = ["KVPoolExhausted", "PagedKVCache", "gather_pool", "write_pool"]
