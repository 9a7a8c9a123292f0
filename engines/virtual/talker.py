"""The talker on the virtual device: what :class:`~engines.pipelines.talker.source.TalkerSource`
does on the host (rows, KV blocks, chunked prefill as the StepPlan says, live text, utterance
ends), with its device work replaced by the cost table's times on a :class:`DeviceClock`.

One tick, as the real source runs it (source.py's docstring):
 0. the planned prefill chunks, one padded call (eager: the host is busy launching it); prompts
    that complete decode in the same tick;
 1-3. one decode step of the rows that step, replayed from the graph of its (rows bucket,
    KV-blocks bucket, sampling mode) - captured first if this is the bucket's first use;
 4. the host reads the ids of the previous step (and of this tick's prefill): it waits until the
    clock has run them. A row ends after its last frame (its text's frame budget, at most
    ``max_new_tokens - 1`` frames and the stream's positions, as the benchmark checkpoint's rows
    do: EOS never wins; an exact ``max_new_tokens`` given to ``admit`` replaces the budget) or, with
    ``eos_frames``, when it samples EOS after that many frames (noticed one step late, as the
    real source notices it).
Frames are zero codes; nothing here allocates per-row device state.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from engines.checkpoints.qwen3_tts import TalkerGenerationConfig
from engines.contract import SynthesisRequest
from engines.pipelines.base import Capacity, StepPlan
from engines.pipelines.talker.budget import frame_limit, planned_frames
from engines.pipelines.talker.live_text import LiveText
from engines.pipelines.talker.prompt import PromptBuilder
from engines.pipelines.talker.rows import TalkerFrames, Utterance, resolve_settings
from engines.runtime.cuda_graphs import smallest_bucket
from engines.runtime.graphed_talker import kv_bucket, row_buckets, start_keys
from engines.virtual.clock import DeviceClock, DeviceEvent
from engines.virtual.costs import CostTable
from engines.virtual.graphs import VirtualGraphs

BLOCK_SIZE = 16  # positions per KV block (engines/pipelines/talker/source.py DEFAULT_BLOCK_SIZE)
# Admitting a request launches eager device work (the prompt's embeddings, the row's state
# writes) that the cost table does not price: run 3's admit stage was 3.0 % of the worker's
# wall at 64 streams on the H200 (~105 ms for 64 admissions).
ADMIT_MS = 1.6


class BlockLedger:
    """The paged KV pool's block counts per row (engines/models/paged_kv.py without the tensors)."""

    def __init__(self, capacity_blocks: int, block_size: int = BLOCK_SIZE):
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self._owned: dict[int, int] = {}

    @property
    def used_blocks(self) -> int:
        return sum(self._owned.values())

    @property
    def free_blocks(self) -> int:
        return self.capacity_blocks - self.used_blocks

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def row_blocks(self, row: int) -> int:
        return self._owned.get(row, 0)

    def reserve(self, row: int, positions: int) -> bool:
        """Blocks for ``positions`` positions of ``row``; False (nothing taken) when the pool is short."""
        need = self.blocks_for(positions) - self.row_blocks(row)
        if need > self.free_blocks:
            return False
        if need > 0:
            self._owned[row] = self.row_blocks(row) + need
        return True

    def release(self, row: int) -> None:
        self._owned.pop(row, None)


class VirtualTalkerSource:
    """The talker source's interface (what TalkerPipeline and the engine ask of it) on a virtual device."""

    def __init__(self, prompt: PromptBuilder, generation: TalkerGenerationConfig, num_code_groups: int,
                 table: CostTable, clock: DeviceClock, max_slots: int = 8, max_seq_len: int = 4096,
                 kv_blocks: int | None = None, eos_frames: int | None = None):
        if max_slots <= 0:
            raise ValueError(f"max_slots must be > 0, got {max_slots}")
        self.prompt = prompt
        self.generation = generation
        self.num_code_groups = num_code_groups
        self.table = table
        self.clock = clock
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len
        self.eos_frames = eos_frames  # None: EOS never wins (the benchmark checkpoint)
        max_blocks_per_row = -(-max_seq_len // BLOCK_SIZE)
        # None: every row may reach max_seq_len (a GPU's pool holds far more than its slots need)
        self.cache = BlockLedger(kv_blocks if kv_blocks is not None else max_slots * max_blocks_per_row)
        self.max_blocks_per_row = max_blocks_per_row
        self.buckets = row_buckets(max_slots)
        self.graphs = VirtualGraphs("talker step", clock, table.capture_ms.decode_step,
                                    start_keys(self.buckets, max_blocks_per_row, bucket_blocks=not table.kv_in_place))
        self._utts: dict[int, Utterance] = {}
        self._prefill_queue: list[Utterance] = []
        self._pending: list[tuple[DeviceEvent, list[Utterance]]] = []  # sampled ids on their way to the host
        self._waiting_prompt_blocks = 0
        self._last_batch_rows = 0
        self._admissions = 0
        self.admission_waits = 0
        self.kv_stalls = 0

    # ---------------------------------------------------------------- what the pipeline asks

    def voices(self) -> list[str]:
        return self.prompt.voices()

    def languages(self) -> list[str]:
        return self.prompt.languages()

    @property
    def active_slots(self) -> int:
        return len(self._utts)

    @property
    def last_batch_rows(self) -> int:
        return self._last_batch_rows

    @property
    def rows(self) -> list[str]:
        return [self._utts[r].request_id for r in sorted(self._utts)]

    def free_rows(self) -> int:
        return self.max_slots - len(self._utts)

    def capacity(self) -> Capacity:
        return Capacity(free_rows=self.free_rows(), free_blocks=self.cache.free_blocks,
                        growth_blocks=sum(1 for u in self._utts.values() if u.decoding),
                        waiting_blocks=self._waiting_prompt_blocks,
                        prefill_waiting=tuple(u.prompt_len - u.prefilled for u in self._prefill_queue
                                              if u.max_frames > 0))

    def prompt_positions(self, request: SynthesisRequest, non_streaming_mode: bool | None = None,
                         instruct: str | None = None) -> int:
        if request.text_feed is not None:
            non_streaming_mode = False
        return len(self.prompt.for_request(request, non_streaming_mode, instruct).text_ids)

    def check_fits(self, prompt_positions: int) -> None:
        if prompt_positions >= self.max_seq_len:
            raise ValueError(f"prompt of {prompt_positions} positions does not fit max_seq_len {self.max_seq_len}")
        need = self.cache.blocks_for(prompt_positions + 1) + 1
        if need > self.cache.capacity_blocks:
            raise ValueError(f"prompt of {prompt_positions} positions needs {need} KV cache blocks; the pool has "
                             f"{self.cache.capacity_blocks}")

    def wait_for(self, prompt_positions: int) -> None:
        self._waiting_prompt_blocks = self.cache.blocks_for(prompt_positions + 1) if prompt_positions else 0

    def kv_cache_stats(self) -> dict[str, float]:
        return {"blocks_total": self.cache.capacity_blocks, "blocks_used": self.cache.used_blocks,
                "block_size": self.cache.block_size, "bytes": 0, "admission_waits": self.admission_waits,
                "stalls": self.kv_stalls}

    # ---------------------------------------------------------------- admission

    def planned_frames(self, request: SynthesisRequest) -> int:
        """As the real source's (engines/pipelines/talker/budget.py)."""
        return planned_frames(request, self.prompt, self.generation.max_new_tokens, self.max_seq_len)

    def admit(self, request: SynthesisRequest, max_new_tokens: int | None = None,
              non_streaming_mode: bool | None = None, instruct: str | None = None,
              live: LiveText | None = None) -> None:
        if any(u.request_id == request.id for u in self._utts.values()):
            raise ValueError(f"request {request.id!r} is already active")
        if not self.free_rows():
            raise RuntimeError("no free talker slot")
        if max_new_tokens is not None:
            request = replace(request, max_new_tokens=max_new_tokens)
        budgeted = max_new_tokens is None  # an exact cap replaces the text's budget (as the real source)
        settings = resolve_settings(self.generation, request)
        prompt = live.prompt(request, instruct=instruct) if live is not None else self.prompt.for_request(
            request, non_streaming_mode, instruct)
        s_len = len(prompt.text_ids)
        if s_len > self.max_seq_len:
            raise ValueError(f"prompt of {s_len} positions does not fit max_seq_len {self.max_seq_len}")
        text_tokens = self.prompt.text_tokens(request) if budgeted and live is None else None
        max_frames, _ = frame_limit(settings.max_new_tokens, self.max_seq_len - s_len, text_tokens)
        row = min(set(range(self.max_slots)) - set(self._utts))
        if not self.cache.reserve(row, s_len):
            raise RuntimeError(f"the KV pool cannot hold a prompt of {s_len} positions")
        self.clock.eager(ADMIT_MS)
        self._admissions += 1
        u = Utterance(request, row, settings, None, s_len, max_frames=max_frames, next_pos=s_len,
                      admitted=self._admissions, live=live, fed=len(prompt.trailing_text_ids))
        self._utts[row] = u
        self._prefill_queue.append(u)

    def cancel(self, request_id: str) -> bool:
        for u in list(self._utts.values()):
            if u.request_id == request_id:
                self._release(u)
                return True
        return False

    # ---------------------------------------------------------------- the tick

    def tick(self, plan: StepPlan) -> list[TalkerFrames]:
        out: list[TalkerFrames] = []
        for u in [u for u in self._utts.values() if u.max_frames <= 0]:
            out.append(self._final(u))
            self._release(u)
        self.admission_waits += plan.kv_wait
        self._prefill(plan.prefill)
        utts, failed = self._grow(self._rows_to_step())
        out += failed
        self._last_batch_rows = len(utts)
        if utts:
            out += self._decode(utts)
        return out

    def _prefill(self, takes: tuple[int, ...]) -> None:
        work = list(zip(self._prefill_queue, takes))
        if not work:
            return
        done = self.clock.eager(self.table.prefill_ms(len(work), max(take for _, take in work)))
        completed = []
        for u, take in work:
            u.prefilled += take
            if u.prefilled == u.prompt_len:
                u.decoding = True
                completed.append(u)
        if completed:  # their code 0 is sampled with the prefill; its copy is read in this tick's decode
            self._pending.append((done, completed))
            self._prefill_queue = [u for u in self._prefill_queue if not u.decoding]

    def _rows_to_step(self) -> list[Utterance]:
        """Decoding rows, but a live row whose next text id has not arrived sits out (talker/live.py)."""
        stepping = []
        for row in sorted(self._utts):
            u = self._utts[row]
            if not u.decoding:
                continue
            if u.live is not None:
                u.live.pull()
                u.fed = len(u.live.trailing_ids())
                if not u.live.done and u.next_pos - u.prompt_len >= u.fed:
                    continue
            stepping.append(u)
        return stepping

    def _grow(self, utts: list[Utterance]) -> tuple[list[Utterance], list[TalkerFrames]]:
        ok, blocked = [], []
        for u in utts:
            (ok if self.cache.reserve(u.row, u.next_pos + 1) else blocked).append(u)
        self.kv_stalls += len(blocked)
        failed = []
        if blocked and not ok and not self._prefill_queue:
            u = max(blocked, key=lambda b: b.admitted)
            self._release(u)
            failed.append(replace(self._final(u), error="kv_cache_exhausted: the KV pool has no block left"))
        return ok, failed

    def _decode(self, utts: list[Utterance]) -> list[TalkerFrames]:
        rows = smallest_bucket(self.buckets, len(utts))
        held = max(self.cache.row_blocks(u.row) for u in utts)
        blocks = kv_bucket(held, self.max_blocks_per_row, bucket_blocks=not self.table.kv_in_place)
        key = (rows, blocks, not any(u.settings.sampled for u in utts), any(u.settings.any_top_p for u in utts))
        self.graphs.ensure(key)
        in_flight = self.clock.graphed(self.table.decode_step_ms(rows, held if self.table.kv_in_place else blocks))
        for u in utts:
            u.next_pos += 1
        for event, _ in self._pending:  # the previous ids (admission or an earlier step)
            event.synchronize()
        self._pending = [(in_flight, utts)]
        frames = torch.zeros(len(utts), self.num_code_groups, dtype=torch.int64).split(1)
        out: list[TalkerFrames] = []
        for u, codes in zip(utts, frames):
            if self.eos_frames is not None and u.frames >= self.eos_frames:  # its code 0 was EOS
                out.append(self._final(u))
                self._release(u)
                continue
            last = u.frames + 1 >= u.max_frames
            out.append(TalkerFrames(u.request_id, codes, u.frames, last))
            u.frames += 1
            if last:
                self._release(u)
        return out

    def _final(self, u: Utterance) -> TalkerFrames:
        return TalkerFrames(u.request_id, torch.zeros(0, self.num_code_groups, dtype=torch.int64), u.frames, True)

    def _release(self, u: Utterance) -> None:
        if self._utts.get(u.row) is u:
            del self._utts[u.row]
            self.cache.release(u.row)
            if u in self._prefill_queue:
                self._prefill_queue.remove(u)


__all__ = ["BlockLedger", "VirtualTalkerSource"]
