"""The talker on the virtual device: what :class:`~engines.pipelines.talker.source.TalkerSource`
does on the host (rows, KV blocks, chunked prefill as the StepPlan says, live text, utterance
ends), with its device work replaced by the cost table's times on a :class:`DeviceClock`. The
host side is the real source's own (engines/pipelines/talker/batch.py); this module prices its
device work and keeps the KV pool's block counts.

One tick, as the real source runs it (source.py's docstring):
 0. the planned prefill chunks, one padded call: a graph replay queued on the stream where the
    table measured the prefill through graphs and the call fits a graphed bucket (every prompt from
    position 0, engines/runtime/graphed_prefill.py), else eager (the host is busy launching it);
    prompts that complete decode in the same tick;
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

import torch

from engines.checkpoints.qwen3_tts import TalkerGenerationConfig
from engines.contract import SynthesisRequest
from engines.models.paged_kv import KVPoolExhausted
from engines.pipelines.talker.batch import UtteranceBatch
from engines.pipelines.talker.prompt import PromptBuilder, TalkerPrompt
from engines.pipelines.talker.rows import TalkerFrames, Utterance
from engines.runtime.cuda_graphs import smallest_bucket
from engines.runtime.graphed_prefill import PROMPT_BUCKETS, WIDTH_BUCKETS
from engines.runtime.graphed_talker import kv_bucket, row_buckets, start_keys
from engines.virtual.clock import DeviceClock, DeviceEvent
from engines.virtual.costs import CostTable
from engines.virtual.graphs import VirtualGraphs

BLOCK_SIZE = 16  # positions per KV block (engines/pipelines/talker/source.py DEFAULT_BLOCK_SIZE)
# Starting admitted rows launches eager device work (the prompts' embeddings, the rows' state
# writes) that the cost table does not price: run 3's admit stage was 3.0 % of the worker's
# wall at 64 streams on the H200 (~105 ms for 64 admissions, one request at a time). A GPU
# source starts the rows admitted since the last tick together, with the launches of one
# request: priced at one request's where the cost table has no ``admit`` entry (an estimate).
ADMIT_MS = 1.6


def prefill_bucket(prompts: int, width: int, max_positions: int) -> tuple[int, int] | None:
    """The graphed prefill bucket of a call (GraphedPrefill's buckets up to ``max_positions``), or None."""
    p, w = smallest_bucket(PROMPT_BUCKETS, prompts), smallest_bucket(WIDTH_BUCKETS, width)
    return None if p is None or w is None or p * w > max_positions else (p, w)


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

    def reserve(self, row: int, positions: int) -> None:
        """Blocks for ``positions`` positions of ``row``; KVPoolExhausted (nothing taken) when the pool is short."""
        need = self.blocks_for(positions) - self.row_blocks(row)
        if need > self.free_blocks:
            raise KVPoolExhausted("the KV pool has no block left")
        if need > 0:
            self._owned[row] = self.row_blocks(row) + need

    def release(self, row: int) -> None:
        self._owned.pop(row, None)

    def flush(self) -> None:
        """(no block table on a device to update)"""

    @staticmethod
    def memory_bytes() -> int:
        return 0


class VirtualTalkerSource(UtteranceBatch):
    """The talker source's interface (what TalkerPipeline and the engine ask of it) on a virtual device."""

    def __init__(self, prompt: PromptBuilder, generation: TalkerGenerationConfig, num_code_groups: int,
                 table: CostTable, clock: DeviceClock, max_slots: int = 8, max_seq_len: int = 4096,
                 kv_blocks: int | None = None, eos_frames: int | None = None):
        super().__init__(prompt, generation, num_code_groups, max_slots, max_seq_len, torch.device("cpu"))
        self.table = table
        self.clock = clock
        self.eos_frames = eos_frames  # None: EOS never wins (the benchmark checkpoint)
        max_blocks_per_row = -(-max_seq_len // BLOCK_SIZE)
        # None: every row may reach max_seq_len (a GPU's pool holds far more than its slots need)
        self.cache = BlockLedger(kv_blocks if kv_blocks is not None else max_slots * max_blocks_per_row)
        self.max_blocks_per_row = max_blocks_per_row
        self.buckets = row_buckets(max_slots)
        self.graphs = VirtualGraphs("talker step", clock, table.capture_ms.decode_step,
                                    start_keys(self.buckets, max_blocks_per_row, bucket_blocks=not table.kv_in_place))
        self._pending: list[tuple[DeviceEvent, list[Utterance]]] = []  # sampled ids on their way to the host
        self.batched_admission = True  # as the talker source on a GPU

    # ---------------------------------------------------------------- admission

    def _take_row(self, row: int, request: SynthesisRequest, prompt: TalkerPrompt, prompt_len: int) -> dict:
        self.cache.reserve(row, prompt_len)
        return {"prompt": None, "prompt_len": prompt_len, "fed": len(prompt.trailing_text_ids)}

    def _start(self, utts: list[Utterance]) -> None:
        measured = self.table.admit_ms(len(utts))
        self.clock.eager(ADMIT_MS if measured is None else measured)  # one set of launches for the group (batch.py)

    # ---------------------------------------------------------------- the tick's device work

    def _prefill(self, takes: tuple[int, ...]) -> None:
        work = list(zip(self._prefill_queue, takes))
        if not work:
            return
        width = max(take for _, take in work)
        cost = self.table.prefill_ms(len(work), width)
        graphed = (all(u.prefilled == 0 for u, _ in work)
                   and prefill_bucket(len(work), width, self.table.prefill_graph_positions) is not None)
        done = self.clock.graphed(cost) if graphed else self.clock.eager(cost)
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
            out.append(TalkerFrames(u.request_id, codes, u.frames, last, truncated=u.limit_reason if last else None))
            u.frames += 1
            if last:
                self._release(u)
        return out


__all__ = ["BlockLedger", "VirtualTalkerSource"]
