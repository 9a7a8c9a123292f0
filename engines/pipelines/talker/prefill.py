"""The talker's prompts into the KV cache: a new row's blocks (an indexed prompt prefix shared,
engines/models/prefix_cache.py) and chunked batched prefill of the positions the scheduler
planned this step (engines/core/scheduler.py ``prefill_tokens``)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.nn.utils.rnn import pad_sequence

from engines.contract import SynthesisRequest
from engines.hardware.devices import upload
from engines.models.paged_kv import KVPoolExhausted, PagedKVCache
from engines.models.prefix_cache import PrefixCache, position_keys
from engines.models.talker import Talker
from engines.pipelines.talker.decode import DecodeStep
from engines.pipelines.talker.rows import HostIds, Utterance
from engines.runtime.graphed_prefill import PrefillSpec


def prefix_keys(prefix: PrefixCache | None, request: SynthesisRequest, prompt) -> list[bytes] | None:
    """The prompt's per-position prefix-cache keys under the request's owner; None when the
    cache is off, or for a cloned voice whose owner is unknown (never shared by accident)."""
    if prefix is None:
        return None
    owner = request.prefix_owner if request.prefix_owner is not None else request.tenant
    if request.clone is not None and not owner:
        return None
    return position_keys(owner, prompt.position_inputs())


def take_blocks(cache: PagedKVCache, prefix: PrefixCache | None, row: int, s_len: int,
                keys: list[bytes] | None) -> int:
    """The row's blocks for its prompt: an indexed prefix's full blocks shared, its partial
    block copied, the rest new. -> the positions already in the cache (prefill starts
    there). KVPoolExhausted with nothing taken when the pool cannot hold the prompt."""
    if keys is None:
        cache.reserve(row, s_len)
        return 0
    hit = prefix.lookup(keys, limit=s_len - 1)
    source = hit.partial[0] if hit.partial else None
    cache.adopt(row, hit.blocks)  # held now: an eviction while reserving cannot take them
    if source is not None:
        cache.hold(source)
    try:
        cache.reserve(row, s_len)
        if source is not None:  # copy-on-write: the row writes its next positions into this block
            cache.copy_positions(source, cache.owned(row)[len(hit.blocks)], hit.partial[1])
    except KVPoolExhausted:
        cache.release(row)
        raise
    finally:
        if source is not None:
            cache.drop(source)
    return hit.positions(cache.block_size)


class Prefill:
    """Chunked batched prefill: prompt chunks of several rows in one padded talker forward."""

    def __init__(self, talker: Talker, cache: PagedKVCache, prefix: PrefixCache | None, rope,
                 decode: DecodeStep, device, runner: Callable[[PrefillSpec], Any] | None = None, scratch_row: int = 0):
        self.talker = talker
        self.cache = cache
        self.prefix = prefix
        self.rope = rope
        self.decode = decode  # completed prompts sample their code 0 as a decode step does
        self.device = device
        # the talker forward's runner for calls whose prompts all start at 0, made by ``runner`` from
        # the spec (padding in ``scratch_row``): None = eager; a GraphedPrefill replays it per
        # (prompts, width) bucket (engines/runtime/graphed_prefill.py)
        self.runner = runner(self.spec(scratch_row)) if runner is not None else None

    def spec(self, scratch_row: int, max_positions: int = 1024) -> PrefillSpec:
        """What a GraphedPrefill captures: the talker forward over the paged cache."""
        def forward(x, positions, rows, last, write_slots, n_blocks):
            return self.talker.forward_paged(x, positions, self.cache, rows, n_blocks, self.rope, last=last,
                                             write_slots=write_slots)

        return PrefillSpec(forward=forward, hidden=self.talker.cfg.hidden_size, dtype=self.decode.dtype,
                           device=self.device, scratch_row=scratch_row, block_size=self.cache.block_size,
                           max_positions=max_positions)

    def run(self, chunks: list[tuple[Utterance, int]]) -> HostIds | None:
        """Chunks of queued prompts, ``take`` positions each from its ``prefilled`` on (as the
        scheduler planned under the prefill budget), in one padded talker forward (padding writes
        into the null block); the prompts this completes sample their code 0 (the caller counts the
        positions: batch.py). -> the copy of their code-0 ids to the host, None when none completed."""
        work = [(u, u.prefilled, take) for u, take in chunks]
        if not work:
            return None
        self.cache.flush()  # the prompts' blocks (taken at admission) into the device table
        dev = self.device
        x = pad_sequence([u.prompt[start:start + take] for u, start, take in work], batch_first=True)
        width = x.shape[1]
        pos_host = [list(range(start, start + take)) + [0] * (width - take) for _, start, take in work]
        real_host = [[True] * take + [False] * (width - take) for _, _, take in work]
        rows = upload([u.row for u, _, _ in work], torch.int64, dev)
        positions = upload(pos_host, torch.int64, dev)
        slots = torch.where(upload(real_host, torch.bool, dev), self.cache.slots(rows, positions), 0)
        last = upload([take - 1 for _, _, take in work], torch.int64, dev)
        h = None
        if self.runner is not None and all(start == 0 for _, start, _ in work):
            h = self.runner(x, positions, rows, last, slots)  # None: no graphed bucket holds the call
        if h is None:
            n_blocks = max(self.cache.blocks_for(start + take) for _, start, take in work)
            h = self.talker.forward_paged(x, positions, self.cache, rows, n_blocks, self.rope, last=last,
                                          write_slots=slots)
        done = []
        for i, (u, start, take) in enumerate(work):
            if start + take == u.prompt_len:
                done.append(i)
                if u.prefix_keys is not None:  # its prompt's K/V is queued: later requests may share it
                    self.prefix.insert(u.prefix_keys, self.cache.owned(u.row), u.prompt_len)
                    u.prefix_keys = None
        if not done:
            return None
        keep = upload(done, torch.int64, dev)
        utts = [work[i][0] for i in done]
        idx = rows[keep]
        self.decode.state.h.index_copy_(0, idx, h[keep])
        cols = self.decode.sample(h[keep], idx, all_greedy=not any(u.settings.sampled for u in utts),
                                  any_top_p=any(u.settings.any_top_p for u in utts))  # code 0 of frame 0
        for u in utts:
            u.prompt = None  # its inputs are in the cache now
        return self.decode.copy_to_host(cols, [u.request_id for u in utts])


__all__ = ["Prefill", "prefix_keys", "take_blocks"]
