"""The engine facade: one pipeline behind the worker thread, voices, validation, warm-up.

Built by :func:`engines.build.build_engine`; implements :class:`engines.contract.SynthesisEngine`.
The pipeline comes from its folder's adapter (engines/pipelines/registry.py), with its profile:
every rule that depends on the loaded model is the profile's; nothing here asks which
pipeline it holds.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import replace
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from engines.checkpoints.qwen3_voice import VoiceFeatures
from engines.config import EngineConfig, RuntimeSwitches
from engines.contract import (
    SAMPLE_RATE,
    AudioChunk,
    Deliver,
    EngineCapabilities,
    EngineInfo,
    EngineStats,
    EngineUnavailable,
    InvalidRequest,
    PlannedWork,
    RequestHandle,
    SynthesisRequest,
    TickReport,
)
from engines.core.executor import split_cpu_threads
from engines.core.scheduler import DEFAULT_PREFILL_TOKEN_BUDGET
from engines.core.worker import FaultHook, Worker, WorkerConfig
from engines.hardware.cpu_features import ThreadPlan
from engines.hardware.devices import canonical_device, dtype_name, dtype_named
from engines.pipelines.profile import Loaded, PipelineSetup
from engines.pipelines.registry import registered
from engines.pipelines.vocoder import Vocalizer
from engines.pipelines.vocoder_process import VocoderProcess

if TYPE_CHECKING:
    from engines.virtual.device import VirtualDevice

log = logging.getLogger("streamvox.engine")


def voice_key(audio: np.ndarray) -> str:
    """Content key of a reference voice (float32 24 kHz samples): what features are cached under."""
    return hashlib.sha256(np.ascontiguousarray(audio, dtype=np.float32).tobytes()).hexdigest()


class Engine:
    """One pipeline and its profile behind the worker thread: implements
    :class:`engines.contract.SynthesisEngine`."""

    FEATURE_CACHE_VOICES = 64  # reference voices whose features stay cached (by content)

    def __init__(self, loaded: Loaded, config: EngineConfig, fault_hook: FaultHook | None = None,
                 virtual: VirtualDevice | None = None):
        """``loaded``: what the pipeline's ``load`` read (its modules, its own parts), built into the
        pipeline named by ``config.model.pipeline`` by its adapter (engines/pipelines/registry.py);
        either pipeline emits code frames, which the vocalizer decodes. ``config``: a resolved
        :class:`engines.config.EngineConfig` (engines/build.py ``resolve_config``: device, dtypes,
        pipeline and budgets decided). ``fault_hook``: the worker's (tests inject failures there).
        ``virtual``: the pipeline's and the codec decoder's device work replaced by a cost table's
        waits (engines/virtual/; it builds the pipeline, no model runs). A voice alias naming no voice
        of the model is a ValueError."""
        runtime, scheduler = config.runtime, config.scheduler
        if config.model.pipeline is None or "auto" in (runtime.device, runtime.dtype):
            raise ValueError("the engine takes a resolved EngineConfig (engines.build.resolve_config)")
        registration = registered(config.model.pipeline)
        device, dtype = canonical_device(runtime.device), dtype_named(runtime.dtype)
        self.models = loaded.models.to(device, dtype)
        self.device = device
        self.dtype = dtype
        self.config = config
        cfg = self.models.config
        self.virtual = virtual
        max_slots = registration.slots(scheduler.max_slots, cfg)
        # 2 x the worker's slots: a stream may still decode its tail while a new one has its slot.
        self.vocalizer = virtual.vocalizer(cfg, 2 * max_slots) if virtual else Vocalizer(
            self.models.decoder, device, dtype_named(runtime.codec_precision or runtime.dtype))
        if device.type == "cuda":  # the streaming codec decoder over a state pool, graphed
            from engines.runtime.graphed_decoder import GraphedDecoder

            self.vocalizer.graphed_decoder = GraphedDecoder.for_config(self.vocalizer.decoder, cfg, 2 * max_slots)
        switches = runtime.switches
        self.threads = self._threads(switches, runtime.threads)
        # CPU: the decoder in a process of its own, off the talker's GIL (vocoder_process.py)
        self.codec_process = (VocoderProcess(self.vocalizer, self.threads.codec)
                              if self.threads.codec and switches.codec_process else None)
        if self.codec_process is not None:
            self.vocalizer = self.codec_process
        setup = PipelineSetup(self.models, loaded.parts, device, dtype, max_slots, self.vocalizer, config)
        adapter = virtual.build_pipeline(setup) if virtual is not None else registration.build(setup)
        self.pipeline, self.profile = adapter.pipeline, adapter.profile
        self.aligner = aligner = loaded.aligner
        batch_planning = device.type == "cuda" if scheduler.batch_planning is None else scheduler.batch_planning
        self.worker = Worker(self.pipeline, self.vocalizer, WorkerConfig(
            max_slots, config.limits.max_queue, batch_planning=batch_planning, stage_sync=runtime.switches.stage_sync,
            prefill_token_budget=scheduler.prefill_token_budget or DEFAULT_PREFILL_TOKEN_BUDGET,
            threads=self.threads if self.threads.codec else None), aligner=aligner, fault_hook=fault_hook,
            host_copy_event=virtual.clock.record if virtual is not None else None)
        self._warmup = config.warmup
        self._ready = threading.Event()
        caps = self.profile.capabilities
        self.info = EngineInfo(
            model="streamvox", preset=cfg.name, source=self.pipeline.name,
            device=virtual.describe() if virtual is not None else str(device),
            dtype=dtype_name(dtype), codec_dtype=dtype_name(self.vocalizer.dtype),
            sample_rate=SAMPLE_RATE, voices=caps.voices,
            voice_aliases=caps.voice_aliases, random_components=caps.random_components,
            max_queue=config.limits.max_queue, max_slots=max_slots, backend=runtime.backend,
            latent_dim=cfg.latent_dim, num_code_groups=cfg.num_code_groups,
            batch_ceiling=cfg.stream.batch_ceiling, quantize=loaded.quantize, threads=self._describe_threads(),
        )
        self.capabilities = self._with_timestamps(caps)
        self._features_cache: OrderedDict[str, VoiceFeatures] = OrderedDict()
        self._features_lock = threading.Lock()

    def _threads(self, switches: RuntimeSwitches, plan: ThreadPlan | None) -> ThreadPlan:
        """The talker's and the codec decoder's threads. The decoder gets its own (``codec`` > 0:
        a thread of the worker's process, or that thread's process) on a real CPU with two threads
        or more (a virtual device keeps its GPU's one stream; CUDA orders both on one device
        stream already); else it decodes on the worker thread after each tick (``codec`` 0)."""
        available = torch.get_num_threads()
        if not (switches.vocoder_thread and self.device.type == "cpu" and self.virtual is None and available >= 2):
            return ThreadPlan(available, 0)
        return plan if plan is not None and plan.codec else ThreadPlan(*split_cpu_threads(available))

    def _describe_threads(self) -> str | None:
        """``talker 1, codec 1 (a process)``: what the start-up line and /v1/models say (CPU)."""
        if self.device.type != "cpu" or self.virtual is not None:
            return None
        where = ("a process" if self.codec_process is not None else "a thread") if self.threads.codec else "after each tick"
        return f"talker {self.threads.talker}, codec {self.threads.codec or self.threads.talker} ({where})"

    # -- SynthesisEngine ------------------------------------------------------
    def start(self) -> None:
        if self.worker.alive:
            return
        with torch.no_grad():  # grad mode is per thread; the caller's is left alone
            self.pipeline.capture_graphs()  # CUDA: every graph the pipeline and the vocoder replay, before ready
            self.vocalizer.capture_graphs()
        if self.codec_process is not None:
            self.codec_process.start()  # before the warm-up, which measures the speed as served
        self.worker.start()
        if self._warmup:
            self._warm_up()
        self._ready.set()
        served = self.info.source + (f" preset={self.info.preset}" if self.capabilities.named_by_preset else "")
        log.info("engine ready: %s device=%s random=%s", served, self.device, ",".join(self.info.random_components) or "none")

    def stop(self, timeout: float = 10.0) -> None:
        self._ready.clear()
        self.worker.stop(timeout)
        if self.codec_process is not None:
            self.codec_process.shutdown()

    def submit(self, request: SynthesisRequest, deliver: Deliver) -> RequestHandle:
        request = self.validate(request)  # checked once; planned here only when it was not before
        if request.seed is None:  # the profile's policy (a sampling talker: two unseeded requests differ)
            request = replace(request, seed=self.profile.default_seed())
        if not self.worker.alive:
            raise EngineUnavailable(self.worker.error or "engine is not running")
        if request.text_feed is not None:  # live text: arriving text wakes the worker
            request.text_feed.on_change = self.worker.wake
        return self.worker.enqueue(request, deliver)

    def planned_work(self, request: SynthesisRequest) -> PlannedWork:
        """The work ``request`` plans (the profile counts it), for limits checked before any engine time."""
        return self.profile.planned_work(request)

    def plan(self, request: SynthesisRequest) -> SynthesisRequest:
        """``request`` planned once, as the profile plans it (its ids, its frame budget)."""
        return self.profile.plan(request)

    def stats(self) -> EngineStats:
        return EngineStats(alive=self.worker.alive, ready=self._ready.is_set() and self.worker.alive,
                           queue_depth=self.worker.queue_depth, active_requests=self.worker.active_requests,
                           active_slots=self.pipeline.active_slots, ticks=self.worker.ticks,
                           error=self.worker.error)

    def kv_cache_stats(self) -> dict[str, float]:
        """The pipeline's KV pool (blocks total/used, admission waits); empty without one."""
        return self.pipeline.kv_cache_stats()

    def graph_captures_after_start(self) -> int:
        """CUDA graphs captured after start, on first use (each stalled every stream while it ran;
        without graphs: the ones a GPU would have captured). Serving should keep this at 0."""
        wrappers = (*self.pipeline.graphed, self.vocalizer.graphed_decoder)
        return sum(w.late_captures for w in wrappers if w is not None)

    def stage_seconds(self) -> dict[str, float]:
        """Worker wall seconds per loop stage since start (deliver, plan, admit, tick, vocalize, align)
        and the codec decoder's own (decode)."""
        return self.worker.stage_seconds_now()

    def add_tick_listener(self, listener: Callable[[TickReport], None]) -> None:
        self.worker.add_tick_listener(listener)

    def voice_features(self, audio: np.ndarray) -> VoiceFeatures:
        """x-vector and reference codes of float32 mono 24 kHz audio (a model that clones: the
        profile's), computed once per content (an LRU cache keyed by its sha256). Thread-safe;
        call it off the event loop. InvalidRequest when the loaded model cannot clone."""
        audio = np.ascontiguousarray(audio, dtype=np.float32)
        key = voice_key(audio)
        with self._features_lock:
            cached = self._features_cache.get(key)
            if cached is not None:
                self._features_cache.move_to_end(key)
                return cached
        features = self.profile.voice_features(audio)
        with self._features_lock:
            self._features_cache[key] = features
            while len(self._features_cache) > self.FEATURE_CACHE_VOICES:
                self._features_cache.popitem(last=False)
        return features

    def resolve_voice(self, name: str) -> str:
        return self.profile.resolve_voice(name)

    def validate(self, request: SynthesisRequest, complete: bool = True) -> SynthesisRequest:
        """Every rule that depends on the loaded model, in one place: the voice, the language and
        live text (from the capabilities), the release's own rules (the profile's ``validate``:
        reference audio, instructions, task_type, ``speed`` where the model does not honour it, a
        planned frame budget within what a stream holds); then, for a ``complete`` request, its
        plan (:meth:`plan`: as it was planned, or planned now) and its prompt checked to fit.
        Returns the request to submit; InvalidRequest naming the field.

        Field ranges (steps, speed, sampling, text length, ...) are the caller's to check
        (the service validates them at its boundary, :mod:`service.synthesis.schema`); the engine
        trusts them."""
        voice = self.profile.resolve_voice(request.voice)
        languages = self.capabilities.languages
        if languages is not None and str(request.language).strip().lower() not in [x.lower() for x in languages]:
            raise InvalidRequest("language", f"unknown language {str(request.language)[:64]!r}; "
                                             f"valid: {', '.join(languages)}")
        self.profile.validate(request, complete)
        if request.text_feed is not None and not self.capabilities.live_text:
            raise InvalidRequest("text_streaming", "live text needs a talker checkpoint")
        if voice != request.voice:
            request = replace(request, voice=voice)
        if complete:  # planned here unless it was (the service plans every request); checked to fit
            request = self.profile.plan(request)
            try:
                request = self.pipeline.tokenize(request)
            except ValueError as exc:
                raise InvalidRequest("input", str(exc)) from None
        return request

    # -- helpers --------------------------------------------------------------
    def _with_timestamps(self, capabilities: EngineCapabilities) -> EngineCapabilities:
        if self.aligner is None:
            return capabilities
        return replace(capabilities, timestamps=True, aligner=self.aligner.name,
                       timestamp_languages=self.worker.aligning.languages)

    # On CUDA the first use of each kernel shape loads modules and picks GEMM algorithms (tens
    # of ms each): a crowd of texts of several lengths (first / middle / short last chunks,
    # several batch sizes in planner and vocalizer) pays that before /readyz, not the first user.
    WARMUP_TEXTS_CUDA = (
        "Warm up.",
        "A somewhat longer sentence warms up the middle chunks of the stream as well.",
        "Two clauses, one pause; then the rest of the sentence follows.",
        "Short one.",
        "This request is the longest of the warm-up set, so that several full chunks are denoised, "
        "vocalized and decoded while the others run beside it, with a short last chunk at the end.",
    )

    # What a stream can expect on a CPU, measured once the first-run costs are paid: a sentence of
    # ordinary length, alone, through the worker's loop as served (the same threads, the decoder in
    # its process or thread, the same precision), in the steady state: runs until two in a row agree
    # within SPEED_AGREE, their mean (else the median of SPEED_RUNS). One run right after the warm-up
    # may still pay first-use costs or a neighbour's burst, and a line from it said RTF 2.17 where
    # `say` measured 1.31 (tests/service/test_service_model_info.py slows such a run on purpose).
    SPEED_TEXT = "This sentence measures how fast one stream runs."
    SPEED_RUNS = 4
    SPEED_AGREE = 0.1

    def _warm_up(self) -> None:
        """Requests through the whole pipeline before reporting ready: one on CPU; on CUDA (and on
        a virtual device, which stands for one) a crowd at once, then one alone. On CPU the speed a
        stream can expect is measured after it (``EngineInfo.warmup_rtf``): the first, cold request
        says little about the next ones."""
        on_gpu = self.device.type == "cuda" or self.virtual is not None  # a virtual device warms up as its GPU
        # (on CPU the sentence measured next: its own first run pays for its shapes)
        texts = self.WARMUP_TEXTS_CUDA if on_gpu else (self.SPEED_TEXT,)
        for batch in [list(texts)] + ([[texts[1]]] if on_gpu else []):
            self._run_alone(batch)
        if not on_gpu:
            # On CUDA the warm-up is a crowd of requests, which says nothing about one stream: not reported.
            rtf = self._steady_rtf()
            if rtf is not None:
                self.info = replace(self.info, warmup_rtf=round(rtf, 3))

    def _steady_rtf(self) -> float | None:
        """Wall seconds per audio second (> 1: slower than real time) of SPEED_TEXT alone, in the
        steady state (the comment above); None without audio."""
        rtfs: list[float] = []
        steady = False
        while len(rtfs) < self.SPEED_RUNS and not steady:
            wall, samples = self._run_alone([self.SPEED_TEXT])
            if not samples:
                return None
            rtfs.append(wall / (samples / SAMPLE_RATE))
            steady = len(rtfs) >= 2 and abs(rtfs[-1] - rtfs[-2]) <= self.SPEED_AGREE * min(rtfs[-2:])
        rtf = (rtfs[-1] + rtfs[-2]) / 2 if steady else sorted(rtfs)[len(rtfs) // 2]
        log.info("speed after the warm-up: real-time factors %s -> %.2f (%s)", ", ".join(f"{x:.2f}" for x in rtfs),
                 rtf, "the last two agree" if steady else "no two in a row agreed: their median")
        return rtf

    def _run_alone(self, texts: list[str]) -> tuple[float, int]:
        """``texts`` submitted together to the worker and waited for: (wall seconds, samples)."""
        voice = self.capabilities.voices[0]
        events, errors = [], []
        samples = [0]
        t0 = time.perf_counter()
        for text in texts:
            done = threading.Event()
            events.append(done)

            def deliver(chunk: AudioChunk, done=done) -> None:
                samples[0] += chunk.pcm.size  # (worker thread only)
                if chunk.is_final:
                    if chunk.error:
                        errors.append(chunk.error)
                    done.set()

            self.worker.enqueue(self.plan(SynthesisRequest(id=f"warmup-{uuid.uuid4().hex[:8]}", text=text, voice=voice,
                                                           **self.profile.warmup_fields())), deliver)
        if not all(done.wait(300) for done in events):
            raise RuntimeError("engine warm-up did not finish within 300 s")
        if errors:
            raise RuntimeError(f"engine warm-up failed: {errors[0]}")
        return time.perf_counter() - t0, samples[0]
