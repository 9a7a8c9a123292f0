"""The talker pipeline behind the seam: utterances with continuous batching (source.py); it
emits code frames directly."""

from __future__ import annotations


import numpy as np
import torch

from engines.contract import SynthesisRequest
from engines.pipelines.base import Capacity, Produced, StepPlan
from engines.pipelines.talker.live_text import LiveText

# Frames before a talker stream's first audio (320 ms). The talker makes one frame per step,
# so a chunk costs time in proportion to its length: later chunks double (see flush_frames).
FIRST_CHUNK_FRAMES = 4


class TalkerPipeline:
    """Qwen3-TTS talker utterances with continuous batching (engines/pipelines/talker/source.py)."""

    name = "talker"

    def __init__(self, talker_source, first_chunk_frames: int = FIRST_CHUNK_FRAMES, chunk_frames: int = 12,
                 graphed: tuple = (), prime=None):
        self.source = talker_source
        self.graphed = graphed  # CUDA-graph wrappers (the code predictor's), captured by capture_graphs
        self.first_chunk_frames = first_chunk_frames
        self.chunk_frames = chunk_frames
        self._waiting: dict[str, SynthesisRequest] = {}
        # In-context cloning: the vocoder runs over the reference codes before the generated
        # frames (the official decode of [reference, generated] with the reference's audio cut).
        self.prime = prime  # callable(stream_id, codes [T, G]) or None
        self._live: dict[str, LiveText] = {}  # live utterances waiting for their first text id
        self._prompt_positions: dict[str, int] = {}  # waiting request -> its prompt's positions

    def prepare(self, request: SynthesisRequest) -> int:
        # The engine checked the request (its voice canonical, language, task) and planned it: its
        # ids and its frame budget (``plan``), which admission uses as they are.
        positions = self.source.prompt_positions(request)  # task, clone, instructions: ValueError now
        self.source.check_fits(positions)  # a prompt that could never be admitted fails now
        self._waiting[request.id] = request
        self._prompt_positions[request.id] = positions
        self._update_kv_wait()
        if request.text_feed is not None:
            self._live[request.id] = LiveText(request.text_feed, self.source.prompt)
        return request.budget.frames  # an upper bound: EOS usually comes first

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

    def _update_kv_wait(self) -> None:
        """The source keeps KV blocks free for the longest prompt still waiting for a row."""
        self.source.wait_for(max(self._prompt_positions.values(), default=0))

    def prepare_many(self, requests: list[SynthesisRequest]) -> list[int | Exception]:
        out: list[int | Exception] = []
        for request in requests:
            try:
                out.append(self.prepare(request))
            except Exception as exc:
                out.append(exc)
        return out

    def wants_slot(self, request_id: str) -> bool:
        if request_id not in self._waiting:
            return False
        live = self._live.get(request_id)  # a live utterance is prefilled once its first text id is known
        return live is None or live.pull() or live.ready

    def start(self, request_id: str) -> None:
        request = self._waiting.pop(request_id)
        self._prompt_positions.pop(request_id, None)
        self._update_kv_wait()
        if self.prime is not None and request.clone is not None and request.clone.in_context:
            self.prime(request.id, torch.from_numpy(np.asarray(request.clone.ref_codes, dtype=np.int64)))
        self.source.admit(request, live=self._live.pop(request_id, None))

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
        self._waiting.pop(request_id, None)
        self._live.pop(request_id, None)
        if self._prompt_positions.pop(request_id, None) is not None:
            self._update_kv_wait()
        self.source.cancel(request_id)

    def capture_graphs(self) -> None:
        for graphed in self.graphed:
            graphed.capture_all()

    def flush_frames(self, frames_emitted: int) -> int:
        """The first chunk small (first audio early; the scheduler may make it smaller still while
        the engine has room), then each chunk as long as all the audio before it, up to
        ``chunk_frames``: a chunk is generated while the audio already handed over plays, which
        holds at any load under real time; a fixed long second chunk after a short first one
        would underrun far sooner."""
        if frames_emitted == 0:
            return self.first_chunk_frames
        return min(self.chunk_frames, frames_emitted)

    @property
    def active_slots(self) -> int:
        return self.source.active_slots

    @property
    def last_batch_rows(self) -> int:
        return self.source.last_batch_rows
