"""The host side of a talker batch, in one place whatever the device: which utterance holds which
row, the prompts still to prefill, the KV blocks a row takes, what the scheduler is told
(``capacity``), the order of one tick, live rows waiting for text, and how an utterance ends (EOS,
its frame limit - its text's budget, a live utterance's once its text is complete -, the runaway
guard). The device work is a :class:`TalkerRunner`'s: the real device's (source.py
``DeviceRunner``) or the virtual device's (engines/virtual/talker.py), so every rule here holds on
both by construction (vLLM: a new device is another model runner behind the same interface).

``runner.cache``: the paged KV pool's host interface (engines/models/paged_kv.py ``PagedKVCache``,
or the virtual device's block ledger): ``blocks_for``, ``row_blocks``, ``reserve`` (KVPoolExhausted
when short), ``release``, ``flush``, ``free_blocks``, ``used_blocks``, ``capacity_blocks``,
``block_size``, ``memory_bytes``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import torch

from engines.checkpoints.qwen3_tts import TalkerGenerationConfig
from engines.contract import FrameBudget, SynthesisRequest
from engines.models.paged_kv import KVPoolExhausted
from engines.pipelines.base import Capacity, StepPlan
from engines.pipelines.talker.budget import frame_budget, plan_budget
from engines.pipelines.talker.live import rows_waiting_for_text
from engines.pipelines.talker.live_text import LiveText
from engines.pipelines.talker.prompt import PromptBuilder, TalkerPrompt
from engines.pipelines.talker.rows import TalkerFrames, Utterance, resolve_settings


class IdsInFlight(Protocol):
    """Sampled code-0 ids on their way to the host (rows.py ``HostIds``, or the virtual device's)."""

    request_ids: list[str]

    def resolve(self) -> list[int]:
        """The codec ids, one per request id (waits for the copy)."""


class TalkerRunner(Protocol):
    """The device work of a talker batch (the host side calls it in a tick's order)."""

    cache: object  # the KV pool's host interface (this module's docstring)
    device: torch.device
    eos_id: int  # the codec id that ends an utterance
    batched_admission: bool  # rows admitted since the last tick start together (a GPU: one set of launches)

    def take_blocks(self, row: int, request: SynthesisRequest, prompt: TalkerPrompt,
                    prompt_len: int) -> tuple[int, list[bytes] | None]:
        """The prompt's KV blocks for ``row`` (KVPoolExhausted, nothing taken, when short) -> the
        positions already in the cache (a shared prefix) and the prompt's prefix keys (None: none)."""

    def start(self, utts: list[Utterance]) -> None:
        """The rows' device state and prompt inputs, for all of ``utts`` at once."""

    def prefill_chunks(self, work: list[tuple[Utterance, int]]) -> IdsInFlight | None:
        """``take`` positions of each prompt from its ``prefilled`` on; the prompts this completes
        sample their code 0 -> those ids' copy to the host (None: none completed)."""

    def write_text(self, u: Utterance, ids: list[int], done: bool) -> None:
        """A live row's newly committed trailing text ids (its parts ``u.fed`` on), ``done``: the
        text is complete."""

    def decode(self, utts: list[Utterance]) -> tuple[torch.Tensor, IdsInFlight]:
        """One decode step of ``utts`` -> their frames' codes [n, G] and the copy of their next
        code-0 ids to the host (started, not waited for)."""

    def kv_cache_stats(self) -> dict[str, float]:
        """The device's own KV figures (a prefix cache's hits, misses, evictions), if any."""


class UtteranceBatch:
    """Stable rows of utterances (an utterance keeps its row and blocks from admission to its end)
    over a :class:`TalkerRunner` (the module docstring)."""

    def __init__(self, prompt: PromptBuilder, generation: TalkerGenerationConfig, num_code_groups: int,
                 runner: TalkerRunner, max_slots: int, max_seq_len: int):
        if max_slots <= 0:
            raise ValueError(f"max_slots must be > 0, got {max_slots}")
        self.prompt = prompt
        self.generation = generation
        self.num_code_groups = num_code_groups
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len  # positions per stream (prompt + frames)
        self.runner = runner
        self.cache = runner.cache
        self.device = runner.device
        self._utts: dict[int, Utterance] = {}  # row -> utterance
        self._prefill_queue: list[Utterance] = []  # admission order
        self._starting: list[Utterance] = []  # admitted, row state and prompt inputs not on the device yet
        self._pending: list[IdsInFlight] = []  # sampled ids on their way to the host
        self._last_batch_rows = 0
        self._admissions = 0
        self.admission_waits = 0  # ticks in which a free row waited for KV blocks
        self.kv_stalls = 0  # row-steps skipped because the pool had no block for the row's next position

    @property
    def batched_admission(self) -> bool:
        """Start the rows admitted since the last tick in one pass (a GPU: one set of kernel
        launches, not one per request); else one by one, each exactly as a lone request."""
        return self.runner.batched_admission

    @batched_admission.setter
    def batched_admission(self, value: bool) -> None:
        self.runner.batched_admission = value

    # ---------------------------------------------------------------- introspection

    def voices(self) -> list[str]:
        return self.prompt.voices()

    def languages(self) -> list[str]:
        return self.prompt.languages()

    def free_rows(self) -> int:
        return self.max_slots - len(self._utts)

    @property
    def active_slots(self) -> int:
        return len(self._utts)

    @property
    def last_batch_rows(self) -> int:
        """Rows in the last tick's decode step."""
        return self._last_batch_rows

    @property
    def rows(self) -> list[str]:
        """Occupied rows' request ids, by row."""
        return [self._utts[r].request_id for r in sorted(self._utts)]

    def capacity(self) -> Capacity:
        """What the scheduler decides from (engines/core/scheduler.py): free rows, free KV blocks,
        the decoding rows' growth, the pool's block size, and the prompt positions each queued
        prompt has left (oldest first)."""
        return Capacity(free_rows=self.free_rows(), free_blocks=self.cache.free_blocks,
                        growth_blocks=sum(1 for u in self._utts.values() if u.decoding),
                        block_size=self.cache.block_size,
                        prefill_waiting=tuple(u.prompt_len - u.prefilled for u in self._prefill_queue
                                              if u.max_frames > 0))

    def check_fits(self, prompt_positions: int) -> None:
        """ValueError for a prompt this batch could never admit (longer than the per-stream
        position limit, or more blocks than the whole pool): it must fail, not wait forever."""
        if prompt_positions >= self.max_seq_len:
            raise ValueError(f"prompt of {prompt_positions} positions does not fit max_seq_len {self.max_seq_len}")
        need = self.cache.blocks_for(prompt_positions + 1) + 1
        if need > self.cache.capacity_blocks:
            raise ValueError(f"prompt of {prompt_positions} positions needs {need} KV cache blocks; the pool has "
                             f"{self.cache.capacity_blocks} (raise --kv-cache-gb)")

    def kv_cache_stats(self) -> dict[str, float]:
        c = self.cache
        return {"blocks_total": c.capacity_blocks, "blocks_used": c.used_blocks, "block_size": c.block_size,
                "bytes": c.memory_bytes(), "admission_waits": self.admission_waits, "stalls": self.kv_stalls,
                **self.runner.kv_cache_stats()}

    # ---------------------------------------------------------------- admission

    def plan(self, request: SynthesisRequest) -> SynthesisRequest:
        """``request`` with its text tokenized (``prompt_ids``; a live one's: the text it holds yet)
        and its frame budget (budget.py), each unless it carries them: what the engine does once
        before it submits a request, and admission (:meth:`admit`) then reads."""
        if request.prompt_ids is None:
            request = replace(request, prompt_ids=tuple(self.prompt.tokenize_assistant(request.text)))
        if request.budget is None:
            request = replace(request, budget=plan_budget(request, self.prompt, self.generation.max_new_tokens,
                                                          self.max_seq_len))
        return request

    def prompt_positions(self, request: SynthesisRequest, non_streaming_mode: bool | None = None,
                         instruct: str | None = None) -> int:
        """Positions the request's prompt takes (tokenizes; no device work). A live utterance's
        prompt holds its first text id only (streaming-text mode), as an empty text's does."""
        if request.text_feed is not None:
            non_streaming_mode = False
        return len(self.prompt.for_request(request, non_streaming_mode, instruct).text_ids)

    @torch.no_grad()
    def admit(self, request: SynthesisRequest, max_new_tokens: int | None = None,
              non_streaming_mode: bool | None = None, instruct: str | None = None,
              live: LiveText | None = None) -> None:
        """Build the prompt, take a row and the KV blocks of the prompt, queue its prefill (done in
        the next ticks). The row runs to the request's planned frame budget (``request.budget``, set
        before it was submitted: :meth:`plan`; a request that never went through the engine, as
        benchmarks and tests admit, is planned here). ``max_new_tokens``: an exact cap that replaces
        the budget (benchmarks and tests that run a row a given number of steps; served requests
        never pass it). ValueError for an unknown voice/language or a prompt that does not fit;
        RuntimeError when no row is free; KVPoolExhausted when the pool cannot hold the prompt."""
        if any(u.request_id == request.id for u in self._utts.values()):
            raise ValueError(f"request {request.id!r} is already active")
        if not self.free_rows():
            raise RuntimeError("no free talker slot")
        if max_new_tokens is not None:
            request = replace(request, max_new_tokens=max_new_tokens,
                              budget=FrameBudget(max(0, max_new_tokens - 1), "max_new_tokens"))
        elif request.budget is None:
            request = self.plan(request)
        settings = resolve_settings(self.generation, request)
        if live is not None:  # --- live text: the prompt of the text committed so far
            prompt = live.prompt(request, instruct=instruct)
        else:
            prompt = self.prompt.for_request(request, non_streaming_mode, instruct)  # task, clone, instructions
        s_len = len(prompt.text_ids)
        # Frame k's input sits at position s_len + k; the per-stream position limit bounds k.
        if s_len > self.max_seq_len:
            raise ValueError(f"prompt of {s_len} positions does not fit max_seq_len {self.max_seq_len}")
        # The budget as planned; the prompt's own positions leave its stream that much room at most.
        max_frames, limit_reason = request.budget.frames, request.budget.bound
        if max_frames > self.max_seq_len - s_len:
            max_frames, limit_reason = self.max_seq_len - s_len, "max_seq_len"
        # A live utterance's text budget is known once its text is complete (``_frame_limit``).
        budgeted = max_new_tokens is None
        row = min(set(range(self.max_slots)) - set(self._utts))
        cached, keys = self.runner.take_blocks(row, request, prompt, s_len)  # raises before anything changes
        self._admissions += 1
        u = Utterance(request, row, settings, prompt=None, prompt_len=s_len, max_frames=max_frames,
                      limit_reason=limit_reason, next_pos=s_len, prefilled=cached, prefix_keys=keys,
                      admitted=self._admissions, live=live, budgeted=budgeted, talker_prompt=prompt)
        self._utts[row] = u
        self._prefill_queue.append(u)
        self._starting.append(u)

    def start_admitted(self) -> None:
        """The row state and prompt inputs of the utterances admitted since the last tick."""
        starting, self._starting = self._starting, []
        if not starting:
            return
        for group in [starting] if self.batched_admission else [[u] for u in starting]:
            self.runner.start(group)
            for u in group:
                u.talker_prompt = None  # its inputs are on the device now

    # ---------------------------------------------------------------- the tick

    @torch.no_grad()
    def tick(self, plan: StepPlan) -> list[TalkerFrames]:
        """The scheduler's prefill positions (``plan``, from :meth:`capacity`), then one decode
        step of the rows that step."""
        out: list[TalkerFrames] = []
        # Utterances allowed no frame at all (max_new_tokens <= 1) end before any compute
        # (``capacity`` left them out of the prefill queue it reported).
        for u in [u for u in self._utts.values() if u.max_frames <= 0]:
            out.append(self._final(u))
            self._release(u)
        self.admission_waits += plan.kv_wait
        self.prefill_step(plan.prefill)
        utts, failed = self._grow(self._rows_to_step())
        self.cache.flush()
        out += failed
        self._last_batch_rows = len(utts)
        if utts:
            out += self._decode(utts)
        return out

    def prefill_step(self, takes: tuple[int, ...]) -> None:
        """A tick's prefill: the rows admitted since the last one start, then the queued prompts
        prefill the positions the scheduler planned (``takes``, oldest first); the prompts that
        complete join this tick's decode step, their code 0 on its way to the host."""
        self.start_admitted()
        work = [(u, take) for u, take in zip(self._prefill_queue, takes) if take > 0]
        if not work:
            return
        for u, take in work:
            if u.prefilled + take > u.prompt_len:
                raise ValueError(f"the plan prefills {take} positions of {u.request_id!r}; it has "
                                 f"{u.prompt_len - u.prefilled} left")
        completed = self.runner.prefill_chunks(work)
        for u, take in work:
            u.prefilled += take
            u.decoding = u.prefilled == u.prompt_len
        if completed is not None:
            self._pending.append(completed)
        self._prefill_queue = [u for u in self._prefill_queue if not u.decoding]

    def _rows_to_step(self) -> list[Utterance]:
        """The utterances that take a decode step this tick, by row. A row left out keeps its
        state untouched and steps again in a later tick: a live row whose next text id has not
        arrived yet sits out until it does (live.py)."""
        waiting = rows_waiting_for_text(self._utts, self.runner.write_text)
        return [self._utts[r] for r in sorted(self._utts) if self._utts[r].decoding and r not in waiting]

    def _grow(self, utts: list[Utterance]) -> tuple[list[Utterance], list[TalkerFrames]]:
        """Blocks for each stepping row's next position. A row the pool cannot serve now sits
        this step out (its state is untouched; blocks free up as other streams end). Only when
        no row at all could step (every one waits for blocks, so none would ever free any) the
        youngest waiting stream ends with ``kv_cache_exhausted``: it has outgrown the pool."""
        ok, blocked, failed = [], [], []
        for u in utts:
            try:
                self.cache.reserve(u.row, u.next_pos + 1)
                ok.append(u)
            except KVPoolExhausted as exc:
                blocked.append((u, exc))
        self.kv_stalls += len(blocked)
        if blocked and not ok and not self._prefill_queue:
            u, exc = max(blocked, key=lambda item: item[0].admitted)
            self._release(u)
            failed.append(replace(self._final(u), error=f"kv_cache_exhausted: {exc}"))
        return ok, failed

    def _decode(self, utts: list[Utterance]) -> list[TalkerFrames]:
        """One decode step of ``utts`` on the runner, then the host's part: the PREVIOUS step's ids
        (copied while this step was queued) decide who ends. A row whose code 0 was EOS ends (its
        frame of this step is dropped, EOS is not a frame); any other emits its frame, the last one
        at its frame limit or when its code 0 has fallen into a loop (guard.py)."""
        codes, in_flight = self.runner.decode(utts)
        for u in utts:
            u.next_pos += 1
        by_id = {u.request_id: u for u in self._utts.values()}
        for record in self._pending:
            for rid, value in zip(record.request_ids, record.resolve()):
                if rid in by_id:
                    by_id[rid].code0 = value
        self._pending = [in_flight]
        out: list[TalkerFrames] = []
        frames = codes.split(1)  # one op for every row's [1, G] view
        for i, u in enumerate(utts):
            if u.code0 is None:
                raise RuntimeError(f"talker: code 0 of {u.request_id!r} never reached the host")
            if u.code0 == self.runner.eos_id:
                out.append(self._final(u))
                self._release(u)
                continue
            limit, reason = self._frame_limit(u)
            looped = u.guard.add(u.code0)  # the runaway guard: its code 0 repeats one pattern
            last = looped or u.frames + 1 >= limit
            truncated = "loop" if looped else reason if last else None
            out.append(TalkerFrames(u.request_id, frames[i], u.frames, last, truncated=truncated))
            u.frames += 1
            u.code0 = None  # the value for the next step arrives with ``in_flight``
            if last:
                self._release(u)
        return out

    @staticmethod
    def _frame_limit(u: Utterance) -> tuple[int, str]:
        """The utterance's frame limit now: a live one's text budget applies once its text is complete."""
        if u.live is None or not u.live.done or not u.budgeted:
            return u.max_frames, u.limit_reason
        return min((frame_budget(len(u.live.ids)), "budget"), (u.max_frames, u.limit_reason), key=lambda b: b[0])

    def _final(self, u: Utterance) -> TalkerFrames:
        """The empty last frames of an utterance that ends without one (EOS, no frame allowed)."""
        empty = torch.zeros(0, self.num_code_groups, dtype=torch.int64, device=self.device)
        return TalkerFrames(u.request_id, empty, u.frames, True)

    # ---------------------------------------------------------------- removal

    def cancel(self, request_id: str) -> bool:
        for u in list(self._utts.values()):
            if u.request_id == request_id:
                self._release(u)
                return True
        return False

    def _release(self, u: Utterance) -> None:
        """The row and its KV blocks are free again; nothing else moves."""
        if self._utts.get(u.row) is u:
            del self._utts[u.row]
            self.cache.release(u.row)
            if u in self._prefill_queue:
                self._prefill_queue.remove(u)
            if u in self._starting:
                self._starting.remove(u)


__all__ = ["IdsInFlight", "TalkerRunner", "UtteranceBatch"]
