"""The talker on the virtual device: a runner (engines/pipelines/talker/batch.py
:class:`TalkerRunner`) whose device work is the cost table's times on a :class:`DeviceClock`, under
the real batch - rows, KV blocks, the order of a tick, live rows waiting for text, how an
utterance ends (its text's budget, a live utterance's once its text is complete, the runaway
guard, EOS): every host rule of the real path holds here because it is the same code.

The device work, as the real runner does it (engines/pipelines/talker/source.py):
 * rows admitted since the last tick start together: the table's ``admit`` cost, else ``ADMIT_MS``;
 * the planned prefill chunks, one padded call: a graph replay queued on the stream where the
   table measured the prefill through graphs and the call fits a graphed bucket (every prompt from
   position 0, engines/runtime/graphed_prefill.py), else eager (the host is busy launching it);
   the prompts it completes sample their code 0 with it;
 * one decode step of the rows that step, replayed from the graph of its (rows bucket, KV-blocks
   bucket, sampling mode) - captured first if this is the bucket's first use;
 * a step's (or a prefill's) code-0 ids reach the host when the clock has run it (the batch reads
   them one step later, waiting on their event, as on a GPU).
Code 0, as a talker with random weights gives it: sampled rows draw it from the request's seed and
the frame (counter-based, like engines/models/sampling.py), so it never loops; greedy rows repeat
one id (fixed logits), so the runaway guard ends them; EOS never wins (the benchmark checkpoint's
rows run to their frame limit) unless ``eos_frames``, after which every row samples EOS. The codes
1..G-1 are zeros; nothing here allocates per-row device state.
"""

from __future__ import annotations

import torch

from engines.checkpoints.qwen3_tts import TalkerGenerationConfig
from engines.contract import SynthesisRequest
from engines.models.talker import TalkerConfig
from engines.models.paged_kv import KVPoolExhausted
from engines.pipelines.talker.batch import UtteranceBatch
from engines.pipelines.talker.prompt import PromptBuilder, TalkerPrompt
from engines.pipelines.talker.rows import Utterance
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
MASK64 = (1 << 64) - 1


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


class VirtualIds:
    """Code-0 ids the clock is making: they reach the host when its event has run (batch.py ``IdsInFlight``)."""

    def __init__(self, request_ids: list[str], event: DeviceEvent, values: list[int]):
        self.request_ids, self.event, self.values = request_ids, event, values

    def resolve(self) -> list[int]:
        self.event.synchronize()
        return self.values


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a counter -> 64 well-mixed bits."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & MASK64
    return x ^ (x >> 31)


class VirtualRunner:
    """The talker's device work on a virtual device (the module docstring)."""

    def __init__(self, table: CostTable, clock: DeviceClock, talker: TalkerConfig, max_slots: int,
                 max_seq_len: int, kv_blocks: int | None = None, eos_frames: int | None = None):
        self.device = torch.device("cpu")
        self.num_code_groups = talker.num_code_groups
        self.table = table
        self.clock = clock
        self.eos_id = eos_id = talker.codec_eos_token_id
        # the codebook a sampled code 0 is drawn from
        self.code0_ids = [i for i in talker.valid_code0_ids() if i != eos_id]
        self.eos_frames = eos_frames  # None: EOS never wins (the benchmark checkpoint)
        max_blocks_per_row = -(-max_seq_len // BLOCK_SIZE)
        # None: every row may reach max_seq_len (a GPU's pool holds far more than its slots need)
        self.cache = BlockLedger(kv_blocks if kv_blocks is not None else max_slots * max_blocks_per_row)
        self.max_blocks_per_row = max_blocks_per_row
        self.buckets = row_buckets(max_slots)
        self.graphs = VirtualGraphs("talker step", clock, table.capture_ms.decode_step,
                                    start_keys(self.buckets, max_blocks_per_row, bucket_blocks=not table.kv_in_place))
        self.batched_admission = True  # as the talker source on a GPU
        self._sampled: dict[int, int] = {}  # row -> code-0 ids it has sampled (the next one's frame)

    def kv_cache_stats(self) -> dict[str, float]:
        return {}  # no prefix cache modelled

    def take_blocks(self, row: int, request: SynthesisRequest, prompt: TalkerPrompt,
                    prompt_len: int) -> tuple[int, None]:
        self.cache.reserve(row, prompt_len)
        return 0, None

    def start(self, utts: list[Utterance]) -> None:
        measured = self.table.admit_ms(len(utts))
        self.clock.eager(ADMIT_MS if measured is None else measured)  # one set of launches for the group
        for u in utts:
            self._sampled[u.row] = 0

    def prefill_chunks(self, work: list[tuple[Utterance, int]]) -> VirtualIds | None:
        width = max(take for _, take in work)
        cost = self.table.prefill_ms(len(work), width)
        graphed = (all(u.prefilled == 0 for u, _ in work)
                   and prefill_bucket(len(work), width, self.table.prefill_graph_positions) is not None)
        done = self.clock.graphed(cost) if graphed else self.clock.eager(cost)
        completed = [u for u, take in work if u.prefilled + take == u.prompt_len]
        if not completed:
            return None
        return VirtualIds([u.request_id for u in completed], done, [self._sample(u) for u in completed])

    def write_text(self, u: Utterance, ids: list[int], done: bool) -> None:
        """(a live row's text parts: eager writes the table does not price)"""

    def decode(self, utts: list[Utterance]) -> tuple[torch.Tensor, VirtualIds]:
        rows = smallest_bucket(self.buckets, len(utts))
        held = max(self.cache.row_blocks(u.row) for u in utts)
        blocks = kv_bucket(held, self.max_blocks_per_row, bucket_blocks=not self.table.kv_in_place)
        key = (rows, blocks, not any(u.settings.sampled for u in utts), any(u.settings.any_top_p for u in utts))
        self.graphs.ensure(key)
        step = self.clock.graphed(self.table.decode_step_ms(rows, held if self.table.kv_in_place else blocks))
        codes = torch.zeros(len(utts), self.num_code_groups, dtype=torch.int64)
        return codes, VirtualIds([u.request_id for u in utts], step, [self._sample(u) for u in utts])

    def _sample(self, u: Utterance) -> int:
        """The row's next code 0 (the module docstring)."""
        frame = self._sampled[u.row]
        self._sampled[u.row] = frame + 1
        if self.eos_frames is not None and frame >= self.eos_frames:
            return self.eos_id
        if u.settings.talker.greedy:
            return self.code0_ids[0]
        seed = (u.request.seed or 0) & MASK64
        return self.code0_ids[_mix64(_mix64(seed) ^ frame) % len(self.code0_ids)]


def virtual_talker_source(prompt: PromptBuilder, generation: TalkerGenerationConfig, talker: TalkerConfig,
                          table: CostTable, clock: DeviceClock, max_slots: int = 8, max_seq_len: int = 4096,
                          kv_blocks: int | None = None, eos_frames: int | None = None) -> UtteranceBatch:
    """The talker batch (engines/pipelines/talker/batch.py, unchanged) over a :class:`VirtualRunner`."""
    runner = VirtualRunner(table, clock, talker, max_slots, max_seq_len, kv_blocks, eos_frames)
    return UtteranceBatch(prompt, generation, talker.num_code_groups, runner, max_slots, max_seq_len)


__all__ = ["BlockLedger", "VirtualIds", "VirtualRunner", "virtual_talker_source"]
