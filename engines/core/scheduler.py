"""Scheduling policy, nothing else: which waiting requests get a slot, and which finished code
frames the vocoder decodes this step (vLLM's ``schedule()``; the executor runs what it picks).

* Slots: realtime first, first come first served within a class; batch work (jobs,
  non-streamed calls) holds at most ``batch_slot_limit`` slots, so a realtime arrival always
  finds one within a chunk's lifetime.
* Vocoder: one bounded piece per step, taken by earliest playback deadline - the moment a
  listener runs out of audio - so a burst of finished chunks from many streams never holds
  up the next generation step by more than one piece. The bound is ``vocoder_frames`` code
  frames, raised to ``keep_up`` x the average frames produced per step, so that sustained
  production above the floor (a talker with hundreds of rows) never builds an endless backlog.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from engines.contract import Deliver, Priority, RequestHandle, SynthesisRequest
from engines.pipelines.base import Produced

FRAME_SECONDS = 0.08  # one code frame of audio (12.5 Hz codec)


@dataclass
class RequestState:
    """One admitted request, as the core tracks it."""

    handle: RequestHandle
    deliver: Deliver
    frames_total: int = 0
    frames_done: int = 0  # frames vocoded (their audio is delivered or on its way)
    delivered: int = 0  # chunks delivered
    started_at: float | None = None  # first slot
    first_audio_at: float | None = None  # first audio handed to the outbox: playback starts
    finished_source: bool = False  # the pipeline produced its last frames
    pending: list[Produced] = field(default_factory=list)  # produced, not yet vocoded

    @property
    def request(self) -> SynthesisRequest:
        return self.handle.request

    @property
    def request_id(self) -> str:
        return self.handle.request_id

    def in_slot(self, wants_slot: Callable[[str], bool]) -> bool:
        return self.started_at is not None and not self.finished_source and not wants_slot(self.request_id)


@dataclass(frozen=True)
class VocoderWork:
    """A request's gathered frames, taken for this step's vocoder piece."""

    state: RequestState
    pieces: list[Produced]

    @property
    def num_frames(self) -> int:
        return sum(p.num_frames for p in self.pieces)


class Scheduler:
    def __init__(self, max_slots: int, batch_slot_share: float = 0.75, vocoder_frames: int = 128,
                 keep_up: float = 2.0):
        if vocoder_frames < 1:
            raise ValueError(f"vocoder_frames must be >= 1, got {vocoder_frames}")
        # Batch work may hold at most this share of the slots, so realtime arrivals always find one.
        self.batch_slot_limit = max(1, int(max_slots * batch_slot_share))
        self.vocoder_frames = vocoder_frames
        self.keep_up = keep_up
        self._rate = 0.0  # frames produced per generation step, moving average

    def observe(self, frames_produced: int) -> None:
        """One generation step produced this many frames."""
        self._rate += 0.1 * (frames_produced - self._rate)

    @property
    def piece_frames(self) -> int:
        """This step's bound on a vocoder piece, in code frames."""
        return max(self.vocoder_frames, math.ceil(self.keep_up * self._rate))

    def slot_order(self, states: list[RequestState], free: int, wants_slot: Callable[[str], bool]
                   ) -> list[RequestState]:
        """The waiting requests to start now, in order (at most ``free``), under the batch budget."""
        if free <= 0:
            return []
        waiting = [s for s in states if not s.handle.paused and wants_slot(s.request_id)]
        waiting.sort(key=lambda s: s.request.priority != Priority.REALTIME)  # stable: FIFO within a class
        batch_busy = sum(1 for s in states if s.request.priority == Priority.BATCH and s.in_slot(wants_slot))
        chosen = []
        for s in waiting:
            if len(chosen) == free:
                break
            if s.request.priority == Priority.BATCH:
                if batch_busy >= self.batch_slot_limit:
                    continue
                batch_busy += 1
            chosen.append(s)
        return chosen

    @staticmethod
    def playback_deadline(state: RequestState) -> float:
        """When the request's listener runs out of audio: before first audio its submission
        time (it is already waiting), then first audio + the audio handed over so far."""
        if state.first_audio_at is None:
            return state.handle.submitted_at
        return state.first_audio_at + state.frames_done * FRAME_SECONDS

    def ready(self, state: RequestState, flush_frames: Callable[[int], int]) -> bool:
        """The request has gathered enough frames to vocode (all of them once its source is done)."""
        if state.handle.paused or not state.pending:
            return False  # back-pressure: hold the (small) codes, not the PCM
        gathered = sum(p.num_frames for p in state.pending)
        return state.finished_source or gathered >= self.flush_size(state, flush_frames)

    @staticmethod
    def flush_size(state: RequestState, flush_frames: Callable[[int], int]) -> int:
        """Frames to gather before the next vocoder piece: the request's own
        ``initial_codec_chunk_frames`` for its first audio when it set one, else the pipeline's."""
        first = state.request.initial_codec_chunk_frames
        if state.frames_done == 0 and first is not None:
            return first
        return flush_frames(state.frames_done)

    def vocoder_piece(self, states: list[RequestState], flush_frames: Callable[[int], int]) -> list[VocoderWork]:
        """This step's bounded vocoder piece: ready requests by earliest playback deadline (realtime
        before batch), each a prefix of its gathered frames, at most ``piece_frames`` in all.
        A request's prefix reaches at least its flush size; the piece's first one always goes."""
        ready = [s for s in states if self.ready(s, flush_frames)]
        ready.sort(key=lambda s: (s.request.priority != Priority.REALTIME, self.playback_deadline(s)))
        bound = self.piece_frames
        piece: list[VocoderWork] = []
        frames = 0
        for s in ready:
            need, take, n = self.flush_size(s, flush_frames), [], 0
            for p in s.pending:
                if n >= need and frames + n + p.num_frames > bound:
                    break
                take.append(p)
                n += p.num_frames
            if piece and frames + n > bound:
                continue  # a smaller one later in deadline order may still fit
            piece.append(VocoderWork(s, take))
            frames += n
        return piece
