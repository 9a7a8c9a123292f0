"""A job's progress over its whole plan: codec frames and segments (utterances and pauses) done
of those planned, from the first poll (the route plans a job when it is posted), carried across
attempts (a resumed job starts from what its kept segments hold), with an estimate of when the
running attempt ends.

    planned = planned_frames(plan)                     # each part's frames (POST /v1/jobs and each attempt)
    meter = ProgressMeter(planned, kept)               # kept: the segments earlier attempts finished
    meter.update(chunk.frames_done, audio_samples)     # as this attempt's chunks arrive
    frames = meter.part_ended()                        # a segment ended: the frames it took
    await store.renew(job_id, token, lease, meter.progress())

``frames_total`` is the frames spoken plus the plan's estimate of the rest. A talker plans each
utterance's frame budget from its text (engines/pipelines/talker/budget.py: an upper bound, some
3-6 times what speech takes), so once utterances have ended the rest of the plan is scaled by how
theirs came out: the total settles on the real count as the job goes and equals ``frames_done``
at its end. The DiT's plan is its own duration estimate. A pause is silence: no frames, no engine
time (it counts as a segment).
"""

from __future__ import annotations

import time
from typing import Callable

from service.jobs.store.base import Progress, Segment
from service.synthesis.plan import Pause, RequestPlan


def planned_frames(plan: RequestPlan) -> list[int]:
    """The codec frames each part of a plan (service/synthesis/plan.py) is planned to take: an
    utterance's as the plan counted it (the engine's count), a pause's 0."""
    return [0 if isinstance(part, Pause) else part.frames for part in plan.parts]


class ProgressMeter:
    """One attempt's view of its job's progress (see the module docstring)."""

    def __init__(self, planned: list[int], kept: list[Segment], clock: Callable[[], float] = time.time):
        self.planned = list(planned)
        self.spoken = [segment.frames for segment in kept]  # frames each finished segment took
        self.audio_samples = sum(segment.samples for segment in kept)
        self._clock = clock
        self._attempt_frames = 0  # frames this attempt has spoken (chunk.frames_done of its sequence)
        self._attempt_frames_at_part = 0  # ... when its current part began
        self._started = clock()

    def update(self, attempt_frames: int, audio_samples: int) -> None:
        """This attempt has spoken ``attempt_frames`` frames; the job's audio is ``audio_samples`` long."""
        self._attempt_frames = max(self._attempt_frames, attempt_frames)
        self.audio_samples = audio_samples

    def part_ended(self) -> int:
        """The part being spoken ended: -> the frames it took."""
        frames = self._attempt_frames - self._attempt_frames_at_part
        self._attempt_frames_at_part = self._attempt_frames
        self.spoken.append(frames)
        return frames

    def _scale(self) -> float:
        """How the spoken utterances came out against their plan (1 before any has ended)."""
        pairs = [(spoken, planned) for spoken, planned in zip(self.spoken, self.planned) if spoken and planned]
        planned = sum(p for _, p in pairs)
        return sum(s for s, _ in pairs) / planned if planned else 1.0

    def progress(self) -> Progress:
        done_parts = len(self.spoken)
        frames_done = sum(self.spoken) + self._attempt_frames - self._attempt_frames_at_part
        scale = self._scale()
        rest = [round(p * scale) for p in self.planned[done_parts:]]
        if rest:  # the part being spoken takes at least what it has taken so far
            rest[0] = max(rest[0], self._attempt_frames - self._attempt_frames_at_part)
        frames_total = sum(self.spoken) + sum(rest)
        now = self._clock()
        rate = self._attempt_frames / (now - self._started) if now > self._started else 0.0
        eta_at = now + (frames_total - frames_done) / rate if rate > 0 else None
        return Progress(frames_done=frames_done, frames_total=frames_total, utterances_done=done_parts,
                        utterances_total=len(self.planned), audio_samples=self.audio_samples, eta_at=eta_at)


__all__ = ["ProgressMeter", "planned_frames"]
