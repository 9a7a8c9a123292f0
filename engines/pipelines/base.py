"""The latent-source seam: what the worker needs from a producer of frames.

Two sources feed the same worker, vocalizer and protocol:

* :class:`engines.pipelines.dit.source.DiTSource` - the flow DiT stream: a request is planned into frame chunks at
  admission; a slot holds one chunk, which advances one denoising step per tick and
  comes out as unit-RMS latents (the vocalizer turns them into codes, then PCM).
* :class:`engines.pipelines.talker.pipeline.TalkerLatentSource` - the Qwen3-TTS talker: a slot holds one utterance,
  which advances one talker step per tick and comes out as finished codes (the
  vocalizer only decodes them).

The worker owns queueing, priorities, back-pressure, delivery and errors; a source
owns its slots and per-request model state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engines.contract import SynthesisRequest


@dataclass(frozen=True)
class Produced:
    """Frames a source finished for one request in one tick."""

    request_id: str
    frame_start: int
    is_last: bool
    latents: torch.Tensor | None = None  # [T, D] (DiT)
    codes: torch.Tensor | None = None  # [T, G] (talker)
    text: str | None = None  # clause text, on its first frames

    @property
    def num_frames(self) -> int:
        t = self.latents if self.latents is not None else self.codes
        return 0 if t is None else t.shape[0]


class LatentSource(Protocol):
    name: str

    def prepare(self, request: SynthesisRequest, voice_index: int) -> int:
        """Admission-time work; returns the frame count (an upper bound if unknown).
        Raises for a request this source cannot serve."""

    def wants_slot(self, request_id: str) -> bool:
        """True when the request has work waiting and nothing of it is in a slot."""

    def start(self, request_id: str) -> None:
        """Put the request's next unit of work into a free slot."""

    def free_slots(self) -> int: ...

    def tick(self) -> list[Produced]:
        """One step for every occupied slot."""

    def drop(self, request_id: str) -> None:
        """Forget the request and free its slot (cancel, error or done)."""

    def flush_frames(self, frames_emitted: int) -> int:
        """Frames to gather before vocalizing (small first, for time to first audio)."""

    @property
    def active_slots(self) -> int: ...

    @property
    def last_batch_rows(self) -> int: ...
