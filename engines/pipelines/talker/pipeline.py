"""The talker pipeline behind the seam: utterances with continuous batching (source.py); it
emits code frames directly. It keeps no queue: a prepared utterance (its planned request, its
prompt's positions, its live text) waits in the core's scheduler, which starts it."""

from __future__ import annotations

import numpy as np
import torch

from engines.contract import SynthesisRequest
from engines.pipelines.base import Capacity, Chunking, Prepared, Produced, StepPlan
from engines.pipelines.talker.live_text import LiveText

# A talker stream's first chunks on a loaded device (320 ms; the scheduler starts every stream with
# one frame and ramps to this). The talker makes one frame per step, so a chunk costs time in
# proportion to its length: later chunks double up to ``chunk_frames`` (engines/core/scheduler.py
# ``flush_frames``).
FIRST_CHUNK_FRAMES = 4


class TalkerPipeline:
    """Qwen3-TTS talker utterances with continuous batching (engines/pipelines/talker/source.py)."""

    name = "talker"

    def __init__(self, talker_source, first_chunk_frames: int = FIRST_CHUNK_FRAMES, chunk_frames: int = 12,
                 graphed: tuple = (), prime=None):
        self.source = talker_source
        self.graphed = graphed  # CUDA-graph wrappers (the code predictor's), captured by capture_graphs
        self.chunking = Chunking(first_chunk_frames, chunk_frames)
        # In-context cloning: the vocoder runs over the reference codes before the generated
        # frames (the official decode of [reference, generated] with the reference's audio cut).
        self.prime = prime  # callable(stream_id, codes [T, G]) or None

    def prepare(self, request: SynthesisRequest) -> Prepared:
        """The request's prompt positions (the scheduler keeps KV blocks for them) and, for a live
        utterance, its text gate (it starts once its first text id is known)."""
        # The engine checked the request (its voice canonical, language, task) and planned it: its
        # ids and its frame budget (``plan``), which admission uses as they are.
        positions = self.source.prompt_positions(request)  # task, clone, instructions: ValueError now
        self.source.check_fits(positions)  # a prompt that could never be admitted fails now
        live = LiveText(request.text_feed, self.source.prompt) if request.text_feed is not None else None
        return Prepared(frames=request.budget.frames,  # an upper bound: EOS usually comes first
                        work=request, prompt_positions=positions, text=live)

    def tokenize(self, request: SynthesisRequest) -> SynthesisRequest:
        """The planned request (its ids: the one tokenization of the request; the prompt is built
        from them at admission) checked to fit. ValueError when its prompt could never be admitted
        (longer than a stream's positions or than the KV pool): the engine refuses it at
        submission (a 400), not later."""
        try:
            positions = self.source.prompt_positions(request)
        except ValueError:
            return request  # the prompt needs what the request lacks yet (a Base reference): checked at submit
        self.source.check_fits(positions)
        return request

    def prepare_many(self, requests: list[SynthesisRequest]) -> list[Prepared | Exception]:
        out: list[Prepared | Exception] = []
        for request in requests:
            try:
                out.append(self.prepare(request))
            except Exception as exc:
                out.append(exc)
        return out

    def start(self, request_id: str, prepared: Prepared) -> None:
        request: SynthesisRequest = prepared.work
        if self.prime is not None and request.clone is not None and request.clone.in_context:
            self.prime(request.id, torch.from_numpy(np.asarray(request.clone.ref_codes, dtype=np.int64)))
        self.source.admit(request, live=prepared.text)

    def capacity(self) -> Capacity:
        return self.source.capacity()

    def languages(self) -> list[str]:
        return self.source.languages()

    def tick(self, plan: StepPlan) -> list[Produced]:
        return [Produced(request_id=f.request_id, frame_start=f.frame_start, is_last=f.is_last, codes=f.codes,
                         error=f.error, truncated=f.truncated) for f in self.source.tick(plan)]

    def kv_cache_stats(self) -> dict[str, float]:
        return self.source.kv_cache_stats()

    def drop(self, request_id: str) -> None:
        self.source.cancel(request_id)

    def capture_graphs(self) -> None:
        for graphed in self.graphed:
            graphed.capture_all()

    @property
    def active_slots(self) -> int:
        return self.source.active_slots

    @property
    def last_batch_rows(self) -> int:
        return self.source.last_batch_rows
