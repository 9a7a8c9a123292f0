"""The pipeline seam: what the engine core needs from a producer of code frames.

Every pipeline emits code frames (``[rows, G]`` Qwen3-TTS codec codes, 80 ms each); the
vocoder (engines/pipelines/vocoder.py) turns them into PCM, and nothing downstream of a
pipeline knows which one ran.

* :class:`engines.pipelines.dit.pipeline.DiTPipeline` - the flow DiT stream: a request is planned
  into frame chunks at admission; a slot holds one chunk, which advances one denoising step
  per tick; finished latents go through the pipeline's own codec head and code predictor.
* :class:`engines.pipelines.talker.pipeline.TalkerPipeline` - the Qwen3-TTS talker: a slot
  holds one utterance, which advances one talker step (codes included) per tick.

The core owns every queue and budget (engines/core/scheduler.py: the requests waiting for a slot,
when a live utterance's text lets it start, the KV blocks a waiting prompt needs, the prompt
positions each step prefills, the chunk sizes), priorities, back-pressure, delivery and errors; a
pipeline prepares a request (:class:`Prepared`: what the scheduler needs to queue it), executes
what the scheduler hands it (``start``, a :class:`StepPlan` per ``tick``) and reports what it
produced (:class:`Produced`) and what it holds (:class:`Capacity`). vLLM's split: the Scheduler owns
the queues and the KV manager; a step only schedules, executes and updates. Each pipeline folder's
adapter (engines/pipelines/profile.py) builds its pipeline beside the model's profile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engines.contract import SynthesisRequest


@dataclass(frozen=True)
class Produced:
    """Code frames a pipeline finished for one request in one tick."""

    request_id: str
    frame_start: int
    is_last: bool
    codes: torch.Tensor  # [T, G] int64
    text: str | None = None  # clause text, on its first frames
    error: str | None = None  # the request failed in the pipeline (is_last; the core ends it with this error)
    truncated: str | None = None  # it ended before its natural end (is_last): what cut it (AudioChunk.truncated)
    unit_done: bool = False  # the unit of work in its slot is done, the slot free (implied by is_last)

    @property
    def num_frames(self) -> int:
        return self.codes.shape[0]

    @property
    def frees_slot(self) -> bool:
        return self.is_last or self.unit_done


class TextGate(Protocol):
    """Text still arriving for a prepared request (the talker's live utterance: engines/pipelines/
    talker/live_text.py): the scheduler pulls it and starts the request once it is ``ready``."""

    def pull(self) -> bool:
        """Read the text that arrived; -> whether something new is usable."""

    @property
    def ready(self) -> bool:
        """The request can start (its first text unit is known, or its text is complete)."""

    @property
    def done(self) -> bool:
        """Its text is complete."""


@dataclass(frozen=True)
class Prepared:
    """A request a pipeline prepared: what the scheduler needs to queue it (it keeps this until the
    request leaves), and the pipeline's own work, handed back to ``start``."""

    frames: int  # the most frames it may take (an upper bound if unknown)
    work: Any = None  # the pipeline's prepared unit, opaque to the core
    units: int = 1  # slot units it needs, one after another (the talker: 1; the DiT: one per planned chunk)
    prompt_positions: int = 0  # positions its prompt takes in the pipeline's KV pool (0: none)
    text: TextGate | None = None  # its text is still arriving: it starts once the gate is ready


@dataclass(frozen=True)
class Chunking:
    """How a pipeline's frames gather into vocoder chunks; the scheduler sizes each chunk from it
    (engines/core/scheduler.py ``flush_frames``): a loaded device's first chunks ``first_frames``,
    then each as long as all the audio before it, up to ``longest_frames``."""

    first_frames: int = 1
    longest_frames: int = 1


@dataclass(frozen=True)
class Capacity:
    """What a pipeline reports before a step; the scheduler (engines/core/scheduler.py) decides
    from it who is admitted and how many prompt positions each queued prompt prefills."""

    free_rows: int
    free_blocks: int = 0  # KV blocks free now (a pipeline without a KV pool: 0)
    growth_blocks: int = 0  # blocks the rows already decoding may take for their next positions
    block_size: int = 0  # positions per KV block (0: no KV pool)
    prefill_waiting: tuple[int, ...] = ()  # prompt positions still to prefill, per started prompt, oldest first

    def blocks_for(self, prompt_positions: int) -> int:
        """KV blocks a prompt of that many positions takes with its first frame (0: no pool, no prompt)."""
        if not self.block_size or not prompt_positions:
            return 0
        return -(-(prompt_positions + 1) // self.block_size)


@dataclass(frozen=True)
class StepPlan:
    """The scheduler's decision for one step, which the pipeline executes."""

    # positions each queued prompt prefills this step (oldest first; at most the scheduler's
    # prefill_token_budget in all): the pipeline's whole prefill allowance, it keeps none of its own
    prefill: tuple[int, ...] = ()
    kv_wait: bool = False  # a free row waits for KV blocks this step (counted in kv_cache_stats)


class Pipeline(Protocol):
    name: str
    graphed: tuple  # the CUDA-graph wrappers it replays (``capture_all()``, ``late_captures`` each)
    chunking: Chunking  # how its frames gather into vocoder chunks (the scheduler sizes them)

    def prepare(self, request: SynthesisRequest) -> Prepared:
        """Admission-time work on a request as the engine checked and planned it (its voice
        canonical, its text tokenized, its frame budget: nothing is resolved again; nothing enters
        a slot). Raises for a request this pipeline cannot serve."""

    def prepare_many(self, requests: list[SynthesisRequest]) -> list[Prepared | Exception]:
        """``prepare`` for several requests at once; per request its :class:`Prepared` or the
        exception that rejects it (the others are prepared)."""

    def start(self, request_id: str, prepared: Prepared) -> None:
        """Put the request's next unit of work into a free slot (the scheduler picked it)."""

    def capacity(self) -> Capacity:
        """Free rows, and for a KV-paged pipeline its blocks and the prompts it must prefill."""

    def tick(self, plan: StepPlan) -> list[Produced]:
        """One step for every occupied slot, as ``plan`` says; the code frames finished in it."""

    def drop(self, request_id: str) -> None:
        """Forget the request and free its slot (cancel, error or done)."""

    def languages(self) -> list[str] | None:
        """The request languages this pipeline accepts; None: any."""

    def tokenize(self, request: SynthesisRequest) -> SynthesisRequest:
        """The request (planned: engines.contract.SynthesisEngine.plan) checked to fit: ValueError
        when its prompt could never be served (too long for the model)."""

    def kv_cache_stats(self) -> dict[str, float]:
        """The KV pool's figures (blocks total/used, admission waits); empty without a pool."""

    def capture_graphs(self) -> None:
        """CUDA: capture every graph the pipeline replays (engine start, before /readyz);
        elsewhere a no-op."""

    @property
    def active_slots(self) -> int: ...

    @property
    def last_batch_rows(self) -> int: ...
