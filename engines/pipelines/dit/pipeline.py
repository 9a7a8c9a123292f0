"""The DiT pipeline behind the seam: planned frame chunks through the stream tick loop, then
the pipeline's own codec head and code predictor (codes.py), so it emits code frames."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.contract import SynthesisRequest
from engines.models.sampling import GREEDY_SETTINGS
from engines.pipelines.base import Capacity, Chunking, Prepared, Produced, StepPlan
from engines.pipelines.dit.codes import FrameCoder, LatentChunk
from engines.pipelines.dit.denoiser import ChunkJob, Denoiser
from engines.pipelines.dit.planner import UtterancePlanner


@dataclass
class _DiTRequest:
    request: SynthesisRequest
    chunks: list[tuple[torch.Tensor, torch.Tensor, int, int, str | None]]  # enc, enc_null, start, n, text
    next_chunk: int = 0
    in_flight: tuple[str, int] | None = None
    context: torch.Tensor | None = None  # clean tail of the last finished chunk [Tc, D]


class DiTPipeline:
    """Flow-DiT chunks through the stream tick loop (engines/pipelines/dit/denoiser.py), coded
    into code frames by ``coder`` (batched over every chunk finished in a tick).

    ``graphed``: the CUDA-graph wrappers the pipeline replays (``capture_all()`` each), which
    ``capture_graphs`` captures before the engine reports ready."""

    name = "dit"
    chunking = Chunking(1, 1)  # its chunks are sized by the planner: each goes to the vocoder as it is

    def __init__(self, planner: UtterancePlanner, denoiser: Denoiser, context_frames: int,
                 coder: FrameCoder, voices: tuple[str, ...], graphed: tuple = ()):
        self.planner = planner
        self.voices = voices  # the model's voice table, by row
        self.denoiser = denoiser
        self.coder = coder
        self.graphed = graphed
        self.context_frames = context_frames
        self._requests: dict[str, _DiTRequest] = {}
        # CUDA: planning runs on its own stream. Its one host read (the frame counts) then
        # waits only for the planner's kernels, not for the ticks queued on the main stream;
        # the main stream waits for the planner's work through the stream order (an event),
        # never through the host.
        device = planner.device
        self._plan_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _plan_many(self, items: list[SynthesisRequest]):
        # the voice as the engine resolved it, as the row of the model's voice table
        requests = [(r.text, self.voices.index(r.voice), r.speed) for r in items]
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

    def prepare(self, request: SynthesisRequest) -> Prepared:
        [result] = self.prepare_many([request])
        if isinstance(result, Exception):
            raise result
        return result

    def prepare_many(self, items: list[SynthesisRequest]) -> list[Prepared | Exception]:
        """``prepare`` for several requests with one planner forward; per request its frames and
        chunks (one slot unit each, started one after another by the scheduler), or the exception
        that rejects it (the others are prepared)."""
        out: list[Prepared | Exception] = []
        for request, plans in zip(items, self._plan_many(items)):
            if isinstance(plans, Exception):
                out.append(plans)
                continue
            chunks = []
            for clause in plans:
                for i, (start, n) in enumerate(clause.chunks):
                    chunks.append((clause.enc, clause.enc_null, start, n, clause.text if i == 0 else None))
            self._requests[request.id] = _DiTRequest(request, chunks)
            out.append(Prepared(frames=sum(c[3] for c in chunks), units=len(chunks)))
        return out

    def start(self, request_id: str, prepared: Prepared | None = None) -> None:
        r = self._requests[request_id]
        req = r.request
        enc, enc_null, start, n, _ = r.chunks[r.next_chunk]
        context = r.context if r.context is not None else enc.new_zeros((0, self.denoiser.dit.cfg.latent_dim))
        guided = req.guidance_scale > 1.0 and self.denoiser.cfg.guidance != "none"
        key = (req.id, r.next_chunk)
        self.denoiser.admit(ChunkJob(key=key, enc=enc, enc_null=enc_null if guided else None, context=context,
                                      frame_start=start, num_frames=n, seed=req.seed, steps=req.steps,
                                      guidance_scale=req.guidance_scale))
        r.in_flight = key
        r.next_chunk += 1

    def capacity(self) -> Capacity:
        return Capacity(free_rows=self.denoiser.free_slots())  # no KV pool, no prompt prefill

    def tick(self, plan: StepPlan | None = None) -> list[Produced]:
        done = []  # (request id, chunk, latents)
        for fc in self.denoiser.tick():
            r = self._requests.get(fc.key[0])
            if r is None or r.in_flight != fc.key:
                continue  # dropped meanwhile
            r.in_flight = None
            r.context = fc.latents[-self.context_frames:] if self.context_frames > 0 else fc.latents[:0]
            done.append((r, fc.key[1], fc.latents))
        if not done:
            return []
        chunks = []
        for r, index, latents in done:
            s = GREEDY_SETTINGS.for_request(r.request)  # the DiT's codes default to greedy
            chunks.append(LatentChunk(latents, frame_offset=r.chunks[index][2], seed=r.request.seed, greedy=s.greedy,
                                      temperature=s.temperature, top_k=s.top_k, top_p=s.top_p))
        out = []
        for (r, index, _), codes in zip(done, self.coder.codes(chunks)):
            _, _, start, _, text = r.chunks[index]
            out.append(Produced(request_id=r.request.id, frame_start=start, codes=codes, text=text,
                                is_last=r.next_chunk >= len(r.chunks), unit_done=True))
        return out

    def drop(self, request_id: str) -> None:
        r = self._requests.pop(request_id, None)
        if r is not None and r.in_flight is not None:
            self.denoiser.cancel(r.in_flight)

    def languages(self) -> None:
        return None  # the byte frontend reads any language

    def tokenize(self, request: SynthesisRequest) -> SynthesisRequest:
        return request  # the planner reads the text's bytes at admission: nothing to carry

    def kv_cache_stats(self) -> dict[str, float]:
        return {}  # no KV pool

    def capture_graphs(self) -> None:
        for graphed in self.graphed:
            graphed.capture_all()

    @property
    def active_slots(self) -> int:
        return self.denoiser.active_slots

    @property
    def last_batch_rows(self) -> int:
        return self.denoiser.last_batch_rows
