"""Prompt-prefix reuse over the paged KV pool: K/V of prompt positions that requests share
(the speaker/system part, a saved voice's x-vector and reference text, instructions, or a
whole repeated prompt) are computed once and read by every later request that starts with
them.

    prefix = PrefixCache(cache, max_blocks=cache.capacity_blocks // 4)
    keys = position_keys(owner, per_position_bytes)       # host: one chained hash per position
    hit = prefix.lookup(keys, limit=len(keys) - 1)        # -> shared full blocks + a partial block
    ... the row adopts hit.blocks, copies hit.partial's first positions into its own block,
        and prefills only positions >= hit.positions ...
    prefix.insert(keys, cache.owned(row), upto=len(keys)) # after its prefill: index its prompt

Position i's key hashes the owner, i, and everything that defines the input at i, chained
over positions 0..i: equal keys mean equal inputs at every position up to i, so (the talker
being causal) equal K/V there. Sharing is copy-on-write at block granularity:
* a FULL block (all its positions matched) is shared by reference: the pool counts its
  holders (rows + this index) and nobody writes it again, since a row only writes positions
  past its prompt prefix;
* the last, partially matched block is copied (its first k slots, every layer) into a block
  of the new row's own, because the new row writes its next positions into that block.
The index holds one reference on every block it indexes; a block only the index holds is
evictable, least recently used first, when the pool runs out (``PagedKVCache.evictor``) or
when the index passes its own ``max_blocks`` budget: the cache lives inside the KV pool's
memory (``--kv-cache-gb``), never beside it.

Owners partition the index: a key never matches a key of another owner, so one API key's
saved voice is never served to another.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from engines.models.paged_kv import PagedKVCache


def position_keys(owner: str, inputs: Iterable[bytes]) -> list[bytes]:
    """Chained 16-byte keys: key[i] = H(key[i-1], i, inputs[i]), key[-1] = H(owner)."""
    prev = hashlib.blake2b(b"owner\0" + owner.encode(), digest_size=16).digest()
    keys = []
    for i, data in enumerate(inputs):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(i.to_bytes(4, "little"))
        h.update(data)
        prev = h.digest()
        keys.append(prev)
    return keys


@dataclass(frozen=True)
class PrefixHit:
    blocks: list[int]  # full blocks to share, in position order (block j holds positions j*bs..)
    partial: tuple[int, int] | None  # (source block, k): copy its first k positions into the next block

    def positions(self, block_size: int) -> int:
        return len(self.blocks) * block_size + (self.partial[1] if self.partial else 0)


class PrefixCache:
    def __init__(self, cache: PagedKVCache, max_blocks: int):
        self.cache = cache
        self.max_blocks = max(0, max_blocks)
        self._where: dict[bytes, tuple[int, int]] = {}  # key of position i -> (block, positions of it valid)
        self._keys: dict[int, list[bytes]] = {}  # block -> the keys that point at it
        self._lru: OrderedDict[int, None] = OrderedDict()  # indexed blocks, least recently used first
        self.hits = self.misses = self.evictions = self.hit_positions = 0
        cache.evictor = self

    @property
    def blocks(self) -> int:
        return len(self._lru)

    def evictable(self) -> int:
        """Indexed blocks nobody else holds (the pool may take them back)."""
        return sum(1 for b in self._lru if self.cache.holders(b) == 1)

    def lookup(self, keys: list[bytes], limit: int) -> PrefixHit:
        """The longest indexed prefix of ``keys``, at most ``limit`` positions (a request keeps
        at least one position to prefill: its last hidden state samples code 0). Counts a hit
        or a miss; touches the blocks it returns."""
        bs = self.cache.block_size
        blocks: list[int] = []
        partial = None
        j = 0
        while j * bs < limit:
            room = min(bs, limit - j * bs)
            found = self._where.get(keys[j * bs + room - 1]) if room == bs else None
            if found is not None and found[1] == bs:
                blocks.append(found[0])
                j += 1
                continue
            for k in range(room, 0, -1):  # the longest partial match inside block j
                found = self._where.get(keys[j * bs + k - 1])
                if found is not None:
                    partial = (found[0], k)
                    break
            break
        hit = PrefixHit(blocks, partial)
        n = hit.positions(bs)
        if n:
            self.hits += 1
            self.hit_positions += n
            for b in blocks + ([partial[0]] if partial else []):
                self._lru.move_to_end(b)
        else:
            self.misses += 1
        return hit

    def insert(self, keys: list[bytes], row_blocks: list[int], upto: int) -> None:
        """Index positions [0, upto) of a row whose blocks are ``row_blocks`` (its K/V there
        written, or queued before any later reader on the device's stream)."""
        bs = self.cache.block_size
        for j in range((upto + bs - 1) // bs):
            block = row_blocks[j]
            n = min(bs, upto - j * bs)
            if block not in self._lru:
                if self.blocks >= self.max_blocks and not self.evict(1):
                    return  # over budget and everything indexed is in use: index no more
                self.cache.hold(block)
                self._lru[block] = None
                self._keys[block] = []
            self._lru.move_to_end(block)
            for k in range(1, n + 1):
                key = keys[j * bs + k - 1]
                if key not in self._where:  # an older block with these positions stays their source
                    self._where[key] = (block, k)
                    self._keys[block].append(key)

    def evict(self, n: int) -> int:
        """Drop up to ``n`` least recently used blocks that only the index holds; -> how many."""
        done = 0
        for block in list(self._lru):
            if done >= n:
                break
            if self.cache.holders(block) != 1:
                continue
            for key in self._keys.pop(block):
                del self._where[key]
            del self._lru[block]
            self.cache.drop(block)
            self.evictions += 1
            done += 1
        return done

    def stats(self) -> dict[str, int]:
        return {"prefix_hits": self.hits, "prefix_misses": self.misses, "prefix_evictions": self.evictions,
                "prefix_hit_positions": self.hit_positions, "prefix_blocks": self.blocks}


__all__ = ["PrefixCache", "PrefixHit", "position_keys"]
