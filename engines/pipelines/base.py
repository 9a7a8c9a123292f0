"""The pipeline seam: what the engine core needs from a producer of code frames.

Every pipeline emits code frames (``[rows, G]`` Qwen3-TTS codec codes, 80 ms each); the
vocoder (engines/pipelines/vocoder.py) turns them into PCM, and nothing downstream of a
pipeline knows which one ran.

* :class:`engines.pipelines.dit.pipeline.DiTPipeline` - the flow DiT stream: a request is planned
  into frame chunks at admission; a slot holds one chunk, which advances one denoising step
  per tick; finished latents go through the pipeline's own codec head and code predictor.
* :class:`engines.pipelines.talker.pipeline.TalkerPipeline` - the Qwen3-TTS talker: a slot
  holds one utterance, which advances one talker step (codes included) per tick.

The core owns queueing, priorities, back-pressure, delivery and errors; a pipeline owns its
slots and per-request model state. Each pipeline folder's adapter (engines/pipelines/profile.py)
builds its pipeline beside the model's profile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

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

    @property
    def num_frames(self) -> int:
        return self.codes.shape[0]


@dataclass(frozen=True)
class Capacity:
    """What a pipeline reports before a step; the scheduler (engines/core/scheduler.py) decides
    from it who is admitted and how many prompt positions each queued prompt prefills."""

    free_rows: int
    free_blocks: int = 0  # KV blocks free now (a pipeline without a KV pool: 0, waiting_blocks 0)
    growth_blocks: int = 0  # blocks the rows already decoding may take for their next positions
    waiting_blocks: int = 0  # blocks the longest prompt waiting for a row needs (0: none waits)
    prefill_waiting: tuple[int, ...] = ()  # prompt positions still to prefill, per queued prompt, oldest first


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

    def prepare(self, request: SynthesisRequest) -> int:
        """Admission-time work on a request as the engine checked and planned it (its voice
        canonical, its text tokenized, its frame budget: nothing is resolved again); returns the
        frame count (an upper bound if unknown). Raises for a request this pipeline cannot serve."""

    def prepare_many(self, requests: list[SynthesisRequest]) -> list[int | Exception]:
        """``prepare`` for several requests at once; per request its frame count or the
        exception that rejects it (the others are prepared)."""

    def wants_slot(self, request_id: str) -> bool:
        """True when the request has work waiting and nothing of it is in a slot."""

    def start(self, request_id: str) -> None:
        """Put the request's next unit of work into a free slot."""

    def capacity(self) -> Capacity:
        """Free rows, and for a KV-paged pipeline its blocks and the prompts it must prefill."""

    def tick(self, plan: StepPlan) -> list[Produced]:
        """One step for every occupied slot, as ``plan`` says; the code frames finished in it."""

    def drop(self, request_id: str) -> None:
        """Forget the request and free its slot (cancel, error or done)."""

    def flush_frames(self, frames_emitted: int) -> int:
        """Frames to gather before vocoding (small first, for time to first audio)."""

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
