"""The latent-source seam: what the worker needs from a producer of frames.

Two sources feed the same worker, vocalizer and protocol:

* :class:`DiTSource` - the flow DiT stream: a request is planned into frame chunks at
  admission; a slot holds one chunk, which advances one denoising step per tick and
  comes out as unit-RMS latents (the vocalizer turns them into codes, then PCM).
* :class:`TalkerLatentSource` - the Qwen3-TTS talker: a slot holds one utterance,
  which advances one talker step per tick and comes out as finished codes (the
  vocalizer only decodes them).

The worker owns queueing, priorities, back-pressure, delivery and errors; a source
owns its slots and per-request model state.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch

from engines.contract import SynthesisRequest
from engines.pipelines.dit.planner import UtterancePlanner
from engines.pipelines.dit.denoiser import ChunkJob, StreamScheduler


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


@dataclass
class _DiTRequest:
    request: SynthesisRequest
    chunks: list[tuple[torch.Tensor, torch.Tensor, int, int, str | None]]  # enc, enc_null, start, n, text
    next_chunk: int = 0
    in_flight: tuple[str, int] | None = None
    context: torch.Tensor | None = None  # clean tail of the last finished chunk [Tc, D]


class DiTSource:
    """Flow-DiT chunks through the stream tick loop (engines/pipelines/dit/denoiser.py)."""

    name = "dit"

    def __init__(self, planner: UtterancePlanner, scheduler: StreamScheduler, context_frames: int):
        self.planner = planner
        self.scheduler = scheduler
        self.context_frames = context_frames
        self._requests: dict[str, _DiTRequest] = {}
        # CUDA: planning runs on its own stream. Its one host read (the frame counts) then
        # waits only for the planner's kernels, not for the ticks queued on the main stream;
        # the main stream waits for the planner's work through the stream order (an event),
        # never through the host.
        device = planner.device
        self._plan_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _plan_many(self, items: list[tuple[SynthesisRequest, int]]):
        requests = [(r.text, voice_index, r.speed) for r, voice_index in items]
        if self._plan_stream is None:
            return self.planner.plan_many(requests)
        # The planner reads only its weights (static since start-up) and its own uploads, so the
        # plan stream does not wait for the main stream.
        main = torch.cuda.current_stream(self._plan_stream.device)
        with torch.cuda.stream(self._plan_stream):
            results = self.planner.plan_many(requests)
        main.wait_stream(self._plan_stream)
        for plans in results:
            for clause in plans if isinstance(plans, list) else ():
                # Used on the main stream: keep the allocator from reusing them early.
                clause.enc.record_stream(main)
                clause.enc_null.record_stream(main)
        return results

    def prepare(self, request: SynthesisRequest, voice_index: int) -> int:
        [result] = self.prepare_many([(request, voice_index)])
        if isinstance(result, Exception):
            raise result
        return result

    def prepare_many(self, items: list[tuple[SynthesisRequest, int]]) -> list[int | Exception]:
        """``prepare`` for several requests with one planner forward; per request its frame
        count, or the exception that rejects it (the others are prepared)."""
        out: list[int | Exception] = []
        for (request, _), plans in zip(items, self._plan_many(items)):
            if isinstance(plans, Exception):
                out.append(plans)
                continue
            chunks = []
            for clause in plans:
                for i, (start, n) in enumerate(clause.chunks):
                    chunks.append((clause.enc, clause.enc_null, start, n, clause.text if i == 0 else None))
            self._requests[request.id] = _DiTRequest(request, chunks)
            out.append(sum(c[3] for c in chunks))
        return out

    def wants_slot(self, request_id: str) -> bool:
        r = self._requests[request_id]
        return r.in_flight is None and r.next_chunk < len(r.chunks)

    def start(self, request_id: str) -> None:
        r = self._requests[request_id]
        req = r.request
        enc, enc_null, start, n, _ = r.chunks[r.next_chunk]
        context = r.context if r.context is not None else enc.new_zeros((0, self.scheduler.dit.cfg.latent_dim))
        guided = req.guidance_scale > 1.0 and self.scheduler.cfg.guidance != "none"
        key = (req.id, r.next_chunk)
        self.scheduler.admit(ChunkJob(key=key, enc=enc, enc_null=enc_null if guided else None, context=context,
                                      frame_start=start, num_frames=n, seed=req.seed, steps=req.steps,
                                      guidance_scale=req.guidance_scale))
        r.in_flight = key
        r.next_chunk += 1

    def free_slots(self) -> int:
        return self.scheduler.free_slots()

    def tick(self) -> list[Produced]:
        out = []
        for fc in self.scheduler.tick():
            r = self._requests.get(fc.key[0])
            if r is None or r.in_flight != fc.key:
                continue  # dropped meanwhile
            r.in_flight = None
            r.context = fc.latents[-self.context_frames:] if self.context_frames > 0 else fc.latents[:0]
            _, _, start, _, text = r.chunks[fc.key[1]]
            out.append(Produced(request_id=fc.key[0], frame_start=start, latents=fc.latents, text=text,
                                is_last=r.next_chunk >= len(r.chunks)))
        return out

    def drop(self, request_id: str) -> None:
        r = self._requests.pop(request_id, None)
        if r is not None and r.in_flight is not None:
            self.scheduler.cancel(r.in_flight)

    def flush_frames(self, frames_emitted: int) -> int:
        return 1  # chunks are already sized by the planner

    @property
    def active_slots(self) -> int:
        return self.scheduler.active_slots

    @property
    def last_batch_rows(self) -> int:
        return self.scheduler.last_batch_rows


class TalkerLatentSource:
    """Qwen3-TTS talker utterances with continuous batching (engines/pipelines/talker/source.py)."""

    name = "talker"

    def __init__(self, talker_source, voices: tuple[str, ...], first_chunk_frames: int = 4, chunk_frames: int = 12):
        self.source = talker_source
        self.voices = voices  # voice index -> the checkpoint's speaker name
        self.first_chunk_frames = first_chunk_frames
        self.chunk_frames = chunk_frames
        self._waiting: dict[str, SynthesisRequest] = {}

    def prepare(self, request: SynthesisRequest, voice_index: int) -> int:
        speaker = self.voices[voice_index]
        language = request.language or "Auto"
        if language.lower() not in [name.lower() for name in self.source.languages()]:
            raise ValueError(f"unknown language {language!r}; valid: {', '.join(self.source.languages())}")
        self._waiting[request.id] = replace(request, voice=speaker, language=language)
        return self.source.generation.max_new_tokens - 1  # upper bound (official counting)

    def wants_slot(self, request_id: str) -> bool:
        return request_id in self._waiting

    def start(self, request_id: str) -> None:
        request = self._waiting.pop(request_id)
        self.source.admit(request)

    def free_slots(self) -> int:
        return self.source.free_slots()

    def languages(self) -> list[str]:
        return self.source.languages()

    def tick(self) -> list[Produced]:
        return [Produced(request_id=f.request_id, frame_start=f.frame_start, is_last=f.is_last, codes=f.codes)
                for f in self.source.tick()]

    def drop(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)
        self.source.cancel(request_id)

    def flush_frames(self, frames_emitted: int) -> int:
        return self.first_chunk_frames if frames_emitted == 0 else self.chunk_frames

    @property
    def active_slots(self) -> int:
        return self.source.active_slots

    @property
    def last_batch_rows(self) -> int:
        return self.source.last_batch_rows
