"""The engine facade: one pipeline behind the worker thread, voices, validation, warm-up.

Built by :func:`engines.build.build_engine`; implements :class:`engines.contract.SynthesisEngine`.
"""

from __future__ import annotations

import hashlib
import logging
import math
import secrets
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Mapping

import numpy as np
import torch

from engines.checkpoints.qwen3_voice import VoiceEncoders, VoiceFeatures
from engines.config import RuntimeSwitches
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
    VoiceClone,
)
from engines.core.scheduler import DEFAULT_PREFILL_TOKEN_BUDGET
from engines.core.voice_aliases import VENDOR_VOICE_ALIASES, extend_aliases
from engines.core.worker import FaultHook, Worker
from engines.models.dit import FlowDiT
from engines.models.text import ByteTokenizer
from engines.pipelines.dit.codes import FrameCoder
from engines.pipelines.dit.denoiser import Denoiser
from engines.pipelines.dit.planner import UtterancePlanner
from engines.pipelines.dit.source import DiTSource
from engines.pipelines.dit.weights import Models
from engines.pipelines.vocoder import Vocalizer

if TYPE_CHECKING:
    from engines.virtual.device import VirtualDevice

log = logging.getLogger("streamvox.engine")

VOICE_NAMES = ("default", "aria", "blaze", "cedar", "dune", "ember", "fjord", "gale")
# OpenAI voice names map onto entries of the voice table.
OPENAI_VOICE_ALIASES = {
    "alloy": "aria", "echo": "blaze", "fable": "cedar", "onyx": "dune", "nova": "ember",
    "shimmer": "fjord", "ash": "gale", "ballad": "cedar", "coral": "aria", "sage": "dune",
    "verse": "blaze", "marin": "ember", "cedar": "cedar",
}

# The request fields that change each pipeline's output (EngineCapabilities.honoured_fields).
DIT_FIELDS = frozenset({"text", "voice", "seed", "steps", "guidance_scale", "speed", "greedy", "temperature", "top_k",
                        "top_p"})
TALKER_FIELDS = frozenset({"text", "voice", "seed", "language", "greedy", "temperature", "top_k", "top_p",
                           "repetition_penalty", "max_new_tokens", "initial_codec_chunk_frames", "task_type",
                           "non_streaming_mode", "text_feed"})


def voice_key(audio: np.ndarray) -> str:
    """Content key of a reference voice (float32 24 kHz samples): what features are cached under."""
    return hashlib.sha256(np.ascontiguousarray(audio, dtype=np.float32).tobytes()).hexdigest()


class Engine:
    """The DiT-source engine: implements :class:`engines.contract.SynthesisEngine`."""


    task_type: str | None = None  # talker: "CustomVoice" | "VoiceDesign" | "Base"; DiT: None
    instructions_apply: bool = False
    voice_encoders: VoiceEncoders | None = None  # Base checkpoints
    FEATURE_CACHE_VOICES = 64  # reference voices whose features stay cached (by content)

    def __init__(self, models: Models, device: torch.device, dtype: torch.dtype = torch.float32,
                 max_queue: int = 64, fault_hook: FaultHook | None = None, warmup: bool = True,
                 talker=None, talker_slots: int = 8, batch_planning: bool | None = None, backend: str = "torch",
                 talker_options: dict | None = None, switches: RuntimeSwitches = RuntimeSwitches(),
                 aligner=None, prefill_token_budget: int = DEFAULT_PREFILL_TOKEN_BUDGET,
                 virtual: VirtualDevice | None = None,
                 voice_aliases: Mapping[str, str | None] | None = None):
        """``talker``: a TalkerBundle (engines/pipelines/talker/reference.py) selects the talker source;
        either pipeline emits code frames, which the vocalizer decodes. ``batch_planning`` (default: on
        CUDA) plans the requests that arrive together with one encoder forward. ``switches``: how it
        runs on the device (compilation, talker step graphs, stage timing), from the service's settings.
        ``aligner``: a loaded engines.pipelines.aligner.Aligner: word timestamps (None: none).
        ``prefill_token_budget``: prompt positions the scheduler lets the talker prefill per step.
        ``virtual``: the talker's and the codec decoder's device work replaced by a cost table's
        waits (engines/virtual/; ``talker`` then carries only the prompt side, no model runs).
        ``voice_aliases``: names added to (None: removed from) the vendor voice aliases
        (engines/core/voice_aliases.py); ValueError when one names no voice of the model."""
        self.models = models.to(device, dtype)
        self.device = device
        self.dtype = dtype
        cfg = models.config
        self.virtual = virtual
        # 2 x the worker's slots: a stream may still decode its tail while a new one has its slot.
        slots_for_decoder = cfg.stream.max_slots if talker is None else talker_slots
        self.vocalizer = virtual.vocalizer(cfg, 2 * slots_for_decoder) if virtual else Vocalizer(
            models.decoder, device, dtype)
        if device.type == "cuda":  # both pipelines: the streaming codec decoder over a state pool, graphed
            from engines.runtime.graphed_decoder import GraphedDecoder

            self.vocalizer.graphed_decoder = GraphedDecoder.for_config(self.vocalizer.decoder, cfg, 2 * slots_for_decoder)
        if talker is None:
            self.voice_names = VOICE_NAMES[: cfg.text.num_voices] if cfg.text.num_voices <= len(VOICE_NAMES) else (
                VOICE_NAMES + tuple(f"voice{i}" for i in range(len(VOICE_NAMES), cfg.text.num_voices)))
            self.voice_aliases = extend_aliases(
                {k: v for k, v in OPENAI_VOICE_ALIASES.items() if v in self.voice_names}, self.voice_names,
                {**VENDOR_VOICE_ALIASES, **(voice_aliases or {})})
            self.planner = UtterancePlanner(ByteTokenizer(), models.encoder, models.duration, cfg, device, dtype)
            dit = models.dit
            if device.type == "cuda" and isinstance(dit, FlowDiT):  # (exported backends run their own engines)
                from engines.runtime.graphed_dit import GraphedDiT

                # One CUDA graph per (rows, encoder-length) bucket, frames padded to the preset's
                # longest context + chunk, rows up to the batch ceiling; captured in start().
                dit = GraphedDiT.for_config(dit, cfg, compile_backend=switches.compile_backend("dit"))
            self.scheduler = Denoiser(dit, cfg.stream, device, dtype)
            coder = FrameCoder(models.codec_head, models.code_predictor, device, dtype)
            graphed = [] if dit is models.dit else [dit]  # a GraphedDiT (CUDA)
            if device.type == "cuda":
                from engines.runtime.graphed_predictor import GraphedCodePredictor

                coder.predictor = GraphedCodePredictor(coder.predictor,
                                                       compile_backend=switches.compile_backend("predictor"))
                graphed.append(coder.predictor)
            self.source = DiTSource(self.planner, self.scheduler, cfg.dit.context_frames, coder, graphed=tuple(graphed))
            max_slots, random_components = cfg.stream.max_slots, models.random_components
        else:
            from engines.pipelines.talker.pipeline import FIRST_CHUNK_FRAMES, TalkerPipeline
            from engines.pipelines.talker.source import TalkerSource

            self.task_type = talker.task_type
            self.instructions_apply = talker.prompt.instructions_apply
            self.voice_encoders = talker.voice_encoders
            speakers = tuple(talker.voices())
            if self.task_type != "CustomVoice":
                # Base clones the request's reference, VoiceDesign follows its instructions: no presets.
                speakers = ("default",)
                self.voice_names, self.voice_aliases = speakers, {}
            elif not speakers:
                raise ValueError(f"{talker.path}: the checkpoint lists no speakers (talker_config.spk_id)")
            else:
                # "default" and the OpenAI names map onto the checkpoint's speakers, in order.
                self.voice_names = speakers
                self.voice_aliases = {"default": speakers[0]}
                for i, alias in enumerate(sorted(OPENAI_VOICE_ALIASES)):
                    self.voice_aliases.setdefault(alias, speakers[i % len(speakers)])
                self.voice_aliases = extend_aliases(self.voice_aliases, speakers,
                                                    {**VENDOR_VOICE_ALIASES, **(voice_aliases or {})})
            # talker_options: kv_cache_gb, prefix_cache_fraction (engines/pipelines/talker/source.py)
            if virtual is not None:
                talker_source = virtual.talker_source(talker, talker_slots, **(talker_options or {}))
            else:
                talker_source = TalkerSource.from_bundle(talker, max_slots=talker_slots, **(talker_options or {}))
            talker_backend = virtual is None and switches.compile_backend("talker")  # opt-in (compile_talker)
            if talker_backend:  # compiled by the warm-up, before ready
                talker_source.talker.compile_layers(talker_backend)
            step_graphs = (device.type == "cuda" and switches.talker_step_graphs) or (
                device.type == "cpu" and switches.static_step_on_cpu)
            if step_graphs:
                # The whole decode step (predictor included) as one CUDA graph per bucket
                # (engines/runtime/graphed_talker.py): eager, the step is launch bound.
                from engines.runtime.graphed_prefill import GraphedPrefill
                from engines.runtime.graphed_talker import GraphedTalkerStep

                talker_source.step_runner = GraphedTalkerStep(talker_source.step_spec(),
                                                              compile_backend=switches.compile_backend("predictor"))
                # and the prompts' first chunks, on the path to every first audio (eager: launch bound)
                talker_source.prefill.runner = GraphedPrefill(talker_source.prefill_spec())
            elif device.type == "cuda":
                # switches.talker_step_graphs off: the talker step eager, the code predictor it runs
                # for every frame graphed (eager on an H100 it is ~100 ms per step).
                from engines.runtime.graphed_predictor import (
                    DEFAULT_BUCKETS,
                    GraphedCodePredictor,
                )

                talker_source.predictor = GraphedCodePredictor(
                    talker_source.predictor, buckets=tuple(b for b in DEFAULT_BUCKETS if b < talker_slots)
                    + (talker_slots,), compile_backend=switches.compile_backend("predictor"))
            if virtual is not None:
                graphed = (talker_source.graphs,)  # captured at start as the real step graphs are
            else:
                graphed = (talker_source.step_runner, talker_source.prefill.runner) if step_graphs else (
                    (talker_source.predictor,) if device.type == "cuda" else ())
            self.source = TalkerPipeline(talker_source, speakers,
                                             first_chunk_frames=min(FIRST_CHUNK_FRAMES, cfg.stream.first_chunk_frames),
                                             chunk_frames=cfg.stream.chunk_frames, graphed=graphed,
                                             prime=self.vocalizer.prime)
            max_slots = talker_slots
            random_components = ()  # talker, code predictor, codec head and decoder all come from the checkpoint
        self.worker = Worker(self.source, self.vocalizer, self._voice_index, max_slots=max_slots,
                             max_queue=max_queue, fault_hook=fault_hook, stage_sync=switches.stage_sync,
                             batch_planning=device.type == "cuda" if batch_planning is None else batch_planning,
                             aligner=aligner, prefill_token_budget=prefill_token_budget,
                             host_copy_event=virtual.clock.record if virtual is not None else None)
        self.aligner = aligner
        self._warmup = warmup
        self._ready = threading.Event()
        self.info = EngineInfo(
            model="streamvox", preset=cfg.name, source=self.source.name,
            device=virtual.describe() if virtual is not None else str(device),
            dtype=str(dtype).replace("torch.", ""), sample_rate=SAMPLE_RATE, voices=self.voice_names,
            voice_aliases=self.voice_aliases, random_components=random_components, max_queue=max_queue,
            max_slots=max_slots, backend=backend, latent_dim=cfg.latent_dim, num_code_groups=cfg.num_code_groups,
            batch_ceiling=cfg.stream.batch_ceiling,
        )
        self.capabilities = self._with_timestamps(self._capabilities(talker, max_slots, random_components))
        self._features_cache: OrderedDict[str, VoiceFeatures] = OrderedDict()
        self._features_lock = threading.Lock()

    # -- SynthesisEngine ------------------------------------------------------
    def start(self) -> None:
        if self.worker.alive:
            return
        with torch.no_grad():  # grad mode is per thread; the caller's is left alone
            self.source.capture_graphs()  # CUDA: every graph the pipeline and the vocoder replay, before ready
            self.vocalizer.capture_graphs()
        self.worker.start()
        if self._warmup:
            self._warm_up()
        self._ready.set()
        log.info("engine ready: preset=%s device=%s random=%s", self.info.preset, self.device,
                 ",".join(self.info.random_components) or "none")

    def stop(self, timeout: float = 10.0) -> None:
        self._ready.clear()
        self.worker.stop(timeout)

    def submit(self, request: SynthesisRequest, deliver: Deliver) -> RequestHandle:
        request = self.validate(request)  # tokenizes only a request that validate did not return
        if request.seed is None:  # sampling talker: two unseeded requests differ; the DiT keeps seed 0
            request = replace(request, seed=secrets.randbelow(2**63) if self.source.name == "talker" else 0)
        if not self.worker.alive:
            raise EngineUnavailable(self.worker.error or "engine is not running")
        if request.text_feed is not None:  # live text: arriving text wakes the worker
            request.text_feed.on_change = self.worker.wake
        return self.worker.submit(request, deliver)

    def planned_work(self, request: SynthesisRequest) -> PlannedWork:
        """The work ``request`` plans, for limits checked before any engine time. DiT: its UTF-8
        bytes x the duration prior / ``speed`` frames (the planner's own count is within about
        0.7-1.4x of it), each denoised ``steps`` times. Talker: the frames its text's budget
        allows (engines/pipelines/talker/budget.py), at most ``max_new_tokens`` - 1 and its
        stream's positions: an untrained or unlucky talker that never samples EOS stops there.
        A live utterance is counted on the text it holds now (its budget grows with its text)."""
        if self.source.name != "talker":
            tokens = len(self.planner.tokenizer.encode(request.text)) - 2  # without bos / eos
            prior = self.models.config.duration.base_frames_per_token
            frames = math.ceil(tokens * prior / request.speed)
            return PlannedWork(frames, frames * request.steps, "DiT frame-steps")
        frames = self.source.source.planned_frames(request if request.text_feed is None else
                                                   replace(request, text_feed=None))
        return PlannedWork(frames, frames, "talker steps")

    def with_prompt_ids(self, request: SynthesisRequest) -> SynthesisRequest:
        if self.source.name != "talker" or request.prompt_ids is not None or request.text_feed is not None:
            return request
        return replace(request, prompt_ids=tuple(self.source.source.prompt.tokenize_assistant(request.text)))

    def stats(self) -> EngineStats:
        return EngineStats(alive=self.worker.alive, ready=self._ready.is_set() and self.worker.alive,
                           queue_depth=self.worker.queue_depth, active_requests=self.worker.active_requests,
                           active_slots=self.source.active_slots, ticks=self.worker.ticks,
                           error=self.worker.error)

    def kv_cache_stats(self) -> dict[str, float]:
        """The talker's KV pool (blocks total/used, admission waits); empty for the DiT."""
        stats = getattr(self.source, "kv_cache_stats", None)
        return stats() if stats is not None else {}

    def graph_captures_after_start(self) -> int:
        """CUDA graphs captured after start, on first use (each stalled every stream while it ran;
        without graphs: the ones a GPU would have captured). Serving should keep this at 0."""
        wrappers = (*getattr(self.source, "graphed", ()), self.vocalizer.graphed_decoder)
        return sum(w.late_captures for w in wrappers if w is not None)

    def stage_seconds(self) -> dict[str, float]:
        """Worker wall seconds per loop stage since start (deliver, plan, admit, tick, vocalize)."""
        return dict(self.worker.stage_seconds)

    def add_tick_listener(self, listener: Callable[[TickReport], None]) -> None:
        self.worker.add_tick_listener(listener)

    def voice_features(self, audio: np.ndarray) -> VoiceFeatures:
        """x-vector and reference codes of float32 mono 24 kHz audio (Base checkpoints), computed
        once per content (an LRU cache keyed by its sha256). Thread-safe; call it off the event
        loop. InvalidRequest when the loaded checkpoint cannot clone."""
        if self.voice_encoders is None:
            raise InvalidRequest("ref_audio", "voice cloning needs a Base checkpoint; the loaded one is "
                                              f"{self.task_type or 'a DiT model'}")
        audio = np.ascontiguousarray(audio, dtype=np.float32)
        key = voice_key(audio)
        with self._features_lock:
            cached = self._features_cache.get(key)
            if cached is not None:
                self._features_cache.move_to_end(key)
                return cached
        features = self.voice_encoders.features(audio)
        with self._features_lock:
            self._features_cache[key] = features
            while len(self._features_cache) > self.FEATURE_CACHE_VOICES:
                self._features_cache.popitem(last=False)
        return features

    def resolve_voice(self, name: str) -> str:
        if self.task_type in ("Base", "VoiceDesign"):
            # No preset speakers: the voice comes with the request (reference / instructions); a
            # name here may be a saved voice, which the service resolved into the request's clone.
            return (name or "default").strip() or "default"
        key = (name or "default").strip().lower()
        for canonical in self.voice_names:
            if key == canonical.lower():
                return canonical
        for alias, voice in self.voice_aliases.items():  # (a few dozen; vendor ids keep their case)
            if key == alias.lower():
                return voice
        valid = ", ".join(sorted(set(self.voice_names) | set(self.voice_aliases)))
        raise InvalidRequest("voice", f"unknown voice {str(name)[:64]!r}; valid voices: {valid}")

    def validate(self, request: SynthesisRequest, complete: bool = True) -> SynthesisRequest:
        """Every rule that depends on the loaded model, in one place: the voice, the language, the
        release's task (reference audio, instructions, task_type), ``speed`` (refused where the model
        does not honour it) and live text; then, for a ``complete`` request, its text tokenized once
        (``prompt_ids``) and its prompt checked to fit. Returns the request to submit; InvalidRequest
        naming the field.

        Field ranges (steps, speed, sampling, text length, ...) are the caller's to check
        (the service validates them at its boundary, :mod:`service.synthesis.schema`); the engine
        trusts them."""
        voice = self.resolve_voice(request.voice)
        languages = self.capabilities.languages
        if languages is not None and str(request.language).strip().lower() not in [x.lower() for x in languages]:
            raise InvalidRequest("language", f"unknown language {str(request.language)[:64]!r}; "
                                             f"valid: {', '.join(languages)}")
        self._validate_task(request, complete)
        if request.text_feed is not None and not self.capabilities.live_text:
            raise InvalidRequest("text_streaming", "live text needs a talker checkpoint")
        if voice != request.voice:
            request = replace(request, voice=voice)
        if complete:  # tokenized here unless it carries its ids; checked to fit either way
            try:
                request = self.source.tokenize(request)
            except ValueError as exc:
                raise InvalidRequest("input", str(exc)) from None
        return request

    # -- helpers --------------------------------------------------------------
    def _capabilities(self, talker, max_slots: int, random_components: tuple[str, ...]) -> EngineCapabilities:
        languages = self.source.languages()
        if talker is None:
            return EngineCapabilities(
                pipeline=self.source.name, task_type=None, voices=self.voice_names, voice_aliases=self.voice_aliases,
                preset_voices=True, languages=None, honoured_fields=DIT_FIELDS, max_slots=max_slots,
                random_components=random_components)
        fields = TALKER_FIELDS | ({"instructions"} if self.instructions_apply else set()) | (
            {"clone"} if self.voice_encoders is not None else set())
        return EngineCapabilities(
            pipeline=self.source.name, task_type=self.task_type, voices=self.voice_names,
            voice_aliases=self.voice_aliases, preset_voices=self.task_type == "CustomVoice",
            languages=tuple(languages), honoured_fields=frozenset(fields), max_slots=max_slots,
            max_new_tokens=talker.generation.max_new_tokens, instructions=self.instructions_apply,
            voice_cloning=self.voice_encoders is not None, live_text=True, random_components=random_components)

    def _with_timestamps(self, capabilities: EngineCapabilities) -> EngineCapabilities:
        if self.aligner is None:
            return capabilities
        return replace(capabilities, timestamps=True, aligner=self.aligner.name,
                       timestamp_languages=self.worker.aligning.languages)

    def _validate_task(self, request: SynthesisRequest, complete: bool) -> None:
        """What the loaded release can do: Base needs a reference, VoiceDesign instructions (in a
        ``complete`` request); only Base clones; a named task_type must be the loaded one."""
        task = self.task_type
        if task is None:
            for name, value in (("task_type", request.task_type), ("ref_audio", request.clone),
                                ("instructions", request.instructions)):
                if value:
                    raise InvalidRequest(name, "the DiT pipeline has no task types, voice cloning or instructions; "
                                               "serve a Qwen3-TTS checkpoint (--source talker)")
            return
        if request.speed != 1.0 and not self.capabilities.honours("speed"):
            raise InvalidRequest("speed", "the Qwen3-TTS talker has no speed control (the official generate has "
                                          "none) and streamvox does not time-stretch talker audio; send speed 1.0")
        if request.task_type is not None and request.task_type != task:
            raise InvalidRequest("task_type", f"the loaded checkpoint is a {task} release; it cannot do "
                                              f"{str(request.task_type)[:32]}")
        if task == "Base":
            if request.clone is not None:
                self._check_clone(request.clone)
            if request.clone is None and complete:
                raise InvalidRequest("ref_audio", "this Base (voice-clone) checkpoint needs reference audio "
                                                  "(ref_audio, or voice naming a saved voice)")
            if request.instructions:
                raise InvalidRequest("instructions", "Base checkpoints take no instructions (the official "
                                                     "generate_voice_clone has none)")
        elif request.clone is not None:
            raise InvalidRequest("ref_audio", f"voice cloning needs a Base checkpoint; the loaded one is {task}")
        elif task == "VoiceDesign" and complete and not (request.instructions or "").strip():
            raise InvalidRequest("instructions", "a VoiceDesign checkpoint needs instructions describing the voice")

    def _check_clone(self, clone: VoiceClone) -> None:
        """A clone's features may come from a store (a hand-made data dir, another model's voice):
        their shapes and values must fit this model, else InvalidRequest, not a failed step."""
        cfg = self.models.config
        xvector = np.asarray(clone.xvector)
        if xvector.shape != (cfg.latent_dim,) or xvector.dtype.kind != "f" or not np.isfinite(xvector).all():
            raise InvalidRequest("voice", f"the voice's x-vector ({xvector.dtype} {list(xvector.shape)}) does not fit "
                                          f"this model (finite floats, [{cfg.latent_dim}]); upload the voice again")
        if clone.ref_codes is None:
            return
        codes = np.asarray(clone.ref_codes)
        fits = (codes.ndim == 2 and codes.shape[0] >= 1 and codes.shape[1] == cfg.num_code_groups
                and codes.dtype.kind in "iu" and 0 <= codes.min() and codes.max() < cfg.codec_head.codebook_size)
        if not fits:
            raise InvalidRequest("voice", f"the voice's reference codes ({codes.dtype} {list(codes.shape)}) do not "
                                          f"fit this model ([frames, {cfg.num_code_groups}] ids below "
                                          f"{cfg.codec_head.codebook_size}); upload the voice again")

    def _voice_index(self, name: str) -> int:
        if self.task_type in ("Base", "VoiceDesign"):
            return 0
        return self.voice_names.index(self.resolve_voice(name))

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

    def _warmup_task(self) -> dict:
        """The fields a warm-up request needs on this release (a neutral x-vector; an instruction)."""
        if self.task_type == "Base":
            return {"clone": VoiceClone(np.zeros(self.voice_encoders.xvector_dim, dtype=np.float32))}
        if self.task_type == "VoiceDesign":
            return {"instructions": "A clear, neutral voice."}
        return {}

    # What a stream can expect on a CPU, measured once the first-run costs are paid: a sentence of
    # ordinary length, alone, the median of a few runs (tests/service/test_service_model_info.py
    # sends the same sentence to a fresh server and finds the same within 30 %). A run slower than
    # real time is answer enough: more would only hold a slow machine's start back.
    SPEED_TEXT = "This sentence measures how fast one stream runs."
    SPEED_RUNS = 3

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
            rtfs: list[float] = []  # wall seconds per audio second, > 1 = slower than real time
            while len(rtfs) < self.SPEED_RUNS and not (rtfs and rtfs[-1] > 1):
                wall, samples = self._run_alone([self.SPEED_TEXT])
                if not samples:
                    break
                rtfs.append(wall / (samples / SAMPLE_RATE))
            if rtfs:
                self.info = replace(self.info, warmup_rtf=round(sorted(rtfs)[len(rtfs) // 2], 3))

    def _run_alone(self, texts: list[str]) -> tuple[float, int]:
        """``texts`` submitted together to the worker and waited for: (wall seconds, samples)."""
        voice = self.voice_names[0]
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

            self.worker.submit(SynthesisRequest(id=f"warmup-{uuid.uuid4().hex[:8]}", text=text, voice=voice,
                                                **self._warmup_task()), deliver)
        if not all(done.wait(300) for done in events):
            raise RuntimeError("engine warm-up did not finish within 300 s")
        if errors:
            raise RuntimeError(f"engine warm-up failed: {errors[0]}")
        return time.perf_counter() - t0, samples[0]
