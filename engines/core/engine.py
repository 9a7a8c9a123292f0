"""Assemble models, planner, tick loop, vocalizer and worker into one engine.

``build_engine(...)`` is what the service and the CLI call; the result implements
:class:`engines.contract.SynthesisEngine`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from engines.contract import (
    SAMPLE_RATE,
    AudioChunk,
    Deliver,
    EngineInfo,
    EngineStats,
    EngineUnavailable,
    InvalidRequest,
    RequestHandle,
    SynthesisRequest,
    TickReport,
)
from engines.runtime.devices import canonical_device
from engines.models.codec_decoder import CodecDecoder
from engines.models.codec_head import CodecHead
from engines.models.code_predictor import CodePredictor
from engines.models.condition import ConditionEncoder
from engines.models.configs import ModelConfig
from engines.models.dit import FlowDiT
from engines.models.duration import DurationModel
from engines.models.init import init_module_
from engines.models.text import ByteTokenizer
from engines.pipelines.dit.planner import UtterancePlanner
from engines.config import get_preset
from engines.pipelines.base import DiTSource
from engines.pipelines.dit.denoiser import StreamScheduler
from engines.pipelines.vocoder import Vocalizer
from engines.core.worker import FaultHook, Worker

log = logging.getLogger("streamvox.engine")

VOICE_NAMES = ("default", "aria", "blaze", "cedar", "dune", "ember", "fjord", "gale")
# OpenAI voice names map onto entries of the voice table.
OPENAI_VOICE_ALIASES = {
    "alloy": "aria", "echo": "blaze", "fable": "cedar", "onyx": "dune", "nova": "ember",
    "shimmer": "fjord", "ash": "gale", "ballad": "cedar", "coral": "aria", "sage": "dune",
    "verse": "blaze", "marin": "ember", "cedar": "cedar",
}

# Component name -> attribute on Models; the order of their init seeds is fixed.
COMPONENTS = ("encoder", "duration", "dit", "codec_head", "code_predictor", "decoder")

WEIGHTS_FILE = "streamvox.safetensors"


@dataclass
class Models:
    """All nn.Modules of the DiT source pipeline."""

    config: ModelConfig
    encoder: ConditionEncoder
    duration: DurationModel
    dit: FlowDiT
    codec_head: CodecHead
    code_predictor: CodePredictor
    decoder: CodecDecoder
    random_components: tuple[str, ...]

    def modules(self) -> dict[str, nn.Module]:
        return {name: getattr(self, name) for name in COMPONENTS}

    def to(self, device: torch.device, dtype: torch.dtype) -> "Models":
        for module in self.modules().values():
            module.to(device=device, dtype=dtype).eval()
        return self


def build_models(config: ModelConfig, seed: int = 0) -> Models:
    """Every component with random weights, deterministically from ``seed``."""
    modules = {
        "encoder": ConditionEncoder(config.text),
        "duration": DurationModel(config.duration, config.text),
        "dit": FlowDiT(config.dit),
        "codec_head": CodecHead(config.codec_head),
        "code_predictor": CodePredictor(config.code_predictor),
        "decoder": CodecDecoder(config.decoder),
    }
    for i, name in enumerate(COMPONENTS):
        init_module_(modules[name], seed * 1000 + i)
    return Models(config=config, random_components=COMPONENTS, **modules)


def save_weights(models: Models, path: str | Path) -> None:
    """All components into one safetensors file, keys ``<component>.<param>``."""
    from safetensors.torch import save_file

    tensors = {f"{name}.{k}": v.detach().contiguous().cpu()
               for name, module in models.modules().items() for k, v in module.state_dict().items()}
    save_file(tensors, str(path), metadata={"format": "pt", "preset": models.config.name})


def load_weights(models: Models, path: str | Path, components: tuple[str, ...] = COMPONENTS) -> tuple[str, ...]:
    """Load ``components`` from a streamvox safetensors file (strict); returns what was loaded."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    loaded = []
    for name in components:
        prefix = f"{name}."
        state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        if not state:
            continue
        missing, unexpected = getattr(models, name).load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"{path}: component {name!r}: missing tensors {sorted(missing)[:8]}, "
                             f"unexpected tensors {sorted(unexpected)[:8]}")
        loaded.append(name)
    models.random_components = tuple(c for c in models.random_components if c not in loaded)
    return tuple(loaded)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return canonical_device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no CUDA device")
    if device not in ("cpu",) and not device.startswith("cuda"):
        raise ValueError(f"unknown device {device!r}; use auto, cpu or cuda")
    return canonical_device(device)


def default_preset(device: torch.device) -> str:
    return "base" if device.type == "cuda" else "small"


def default_dtype(device: torch.device) -> torch.dtype:
    # bf16 on CUDA: half the weight bytes the memory-bound steps stream; CPU stays fp32.
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def compile_backend(part: str) -> str | None:
    """torch.compile backend for the modules under the CUDA graphs, or None.

    ``predictor`` (measured on an H100: 11.4 -> 5.2 ms per frame at batch 1): on by default.
    ``dit``: off until measured on a GPU; STREAMVOX_COMPILE_DIT=1 turns it on.
    STREAMVOX_COMPILE=0 turns both off (e.g. to rule compilation out while debugging)."""
    if os.environ.get("STREAMVOX_COMPILE", "1") == "0":
        return None
    if part == "dit" and os.environ.get("STREAMVOX_COMPILE_DIT", "0") != "1":
        return None
    return "inductor"


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Engine:
    """The DiT-source engine: implements :class:`engines.contract.SynthesisEngine`."""

    MAX_STEPS = 64
    MAX_TEXT_CHARS = 100_000

    def __init__(self, models: Models, device: torch.device, dtype: torch.dtype = torch.float32,
                 max_queue: int = 64, fault_hook: FaultHook | None = None, warmup: bool = True,
                 talker=None, talker_slots: int = 8, batch_planning: bool | None = None):
        """``talker``: a TalkerBundle (engines/pipelines/talker/reference.py) selects the talker source;
        the vocalizer then only decodes the talker's codes. ``batch_planning`` (default: on
        CUDA) plans the requests that arrive together with one encoder forward."""
        self.models = models.to(device, dtype)
        self.device = device
        self.dtype = dtype
        cfg = models.config
        self.vocalizer = Vocalizer(models.codec_head, models.code_predictor, models.decoder, device, dtype)
        if device.type == "cuda" and talker is None:  # (talker source: the vocalizer only decodes given codes)
            from engines.runtime.graphed_predictor import GraphedCodePredictor

            self.vocalizer.predictor = GraphedCodePredictor(self.vocalizer.predictor,
                                                            compile_backend=compile_backend("predictor"))
        if device.type == "cuda":  # both sources: the streaming codec decoder over a state pool, graphed
            from engines.runtime.graphed_decoder import GraphedDecoder

            # 2 x the worker's slots: a stream may still decode its tail while a new one has its slot.
            slots = cfg.stream.max_slots if talker is None else talker_slots
            self.vocalizer.graphed_decoder = GraphedDecoder.for_config(self.vocalizer.decoder, cfg, 2 * slots)
        if talker is None:
            self.voice_names = VOICE_NAMES[: cfg.text.num_voices] if cfg.text.num_voices <= len(VOICE_NAMES) else (
                VOICE_NAMES + tuple(f"voice{i}" for i in range(len(VOICE_NAMES), cfg.text.num_voices)))
            self.voice_aliases = {k: v for k, v in OPENAI_VOICE_ALIASES.items() if v in self.voice_names}
            self.planner = UtterancePlanner(ByteTokenizer(), models.encoder, models.duration, cfg, device, dtype)
            dit = models.dit
            if device.type == "cuda" and isinstance(dit, FlowDiT):  # (exported backends run their own engines)
                from engines.runtime.graphed_dit import GraphedDiT

                # One CUDA graph per (rows, encoder-length) bucket, frames padded to the preset's
                # longest context + chunk, rows up to the batch ceiling; captured in start().
                dit = GraphedDiT.for_config(dit, cfg, compile_backend=compile_backend("dit"))
            self.scheduler = StreamScheduler(dit, cfg.stream, device, dtype)
            self.source = DiTSource(self.planner, self.scheduler, cfg.dit.context_frames)
            max_slots, random_components = cfg.stream.max_slots, models.random_components
        else:
            from engines.pipelines.base import TalkerLatentSource
            from engines.pipelines.talker.source import TalkerSource

            speakers = tuple(talker.voices())
            if not speakers:
                raise ValueError(f"{talker.path}: the checkpoint lists no speakers (talker_config.spk_id)")
            # "default" and the OpenAI names map onto the checkpoint's speakers, in order.
            self.voice_names = speakers
            self.voice_aliases = {"default": speakers[0]}
            for i, alias in enumerate(sorted(OPENAI_VOICE_ALIASES)):
                self.voice_aliases.setdefault(alias, speakers[i % len(speakers)])
            talker_source = TalkerSource.from_bundle(talker, max_slots=talker_slots)
            if device.type == "cuda":
                # The talker runs the code predictor for every frame of every step: eager on an
                # H100 that is ~100 ms per step (slower than real time); graphed ~5 ms.
                from engines.runtime.graphed_predictor import DEFAULT_BUCKETS, GraphedCodePredictor

                talker_source.predictor = GraphedCodePredictor(
                    talker_source.predictor, buckets=tuple(b for b in DEFAULT_BUCKETS if b < talker_slots)
                    + (talker_slots,), compile_backend=compile_backend("predictor"))
            self.talker_predictor = talker_source.predictor
            self.source = TalkerLatentSource(talker_source, speakers,
                                             first_chunk_frames=cfg.stream.first_chunk_frames,
                                             chunk_frames=cfg.stream.chunk_frames)
            max_slots = talker_slots
            random_components = ()  # talker, code predictor, codec head and decoder all come from the checkpoint
        self.worker = Worker(self.source, self.vocalizer, self._voice_index, max_slots=max_slots,
                             max_queue=max_queue, fault_hook=fault_hook,
                             batch_planning=device.type == "cuda" if batch_planning is None else batch_planning)
        self._warmup = warmup
        self._ready = threading.Event()
        self.info = EngineInfo(
            model="streamvox", preset=cfg.name, source=self.source.name, device=str(device),
            dtype=str(dtype).replace("torch.", ""), sample_rate=SAMPLE_RATE, voices=self.voice_names,
            voice_aliases=self.voice_aliases, random_components=random_components, max_queue=max_queue,
            extra={"latent_dim": cfg.latent_dim, "num_code_groups": cfg.num_code_groups, "max_slots": max_slots,
                   "batch_ceiling": cfg.stream.batch_ceiling},
        )

    # -- SynthesisEngine ------------------------------------------------------
    def start(self) -> None:
        if self.worker.alive:
            return
        scheduler = getattr(self, "scheduler", None)  # the talker source has none
        for owner in (self.vocalizer.predictor, getattr(self, "talker_predictor", None),
                      self.vocalizer.graphed_decoder,
                      scheduler.dit if scheduler is not None else None):
            capture_all = getattr(owner, "capture_all", None)
            if capture_all is not None:  # CUDA: every predictor / decoder / DiT graph, before the worker and ready
                with torch.no_grad():  # grad mode is per thread; the caller's is left alone
                    capture_all()
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
        self.validate(request)
        if not self.worker.alive:
            raise EngineUnavailable(self.worker.error or "engine is not running")
        return self.worker.submit(request, deliver)

    def stats(self) -> EngineStats:
        return EngineStats(alive=self.worker.alive, ready=self._ready.is_set() and self.worker.alive,
                           queue_depth=self.worker.queue_depth, active_requests=self.worker.active_requests,
                           active_slots=self.source.active_slots, ticks=self.worker.ticks,
                           error=self.worker.error)

    def stage_seconds(self) -> dict[str, float]:
        """Worker wall seconds per loop stage since start (deliver, plan, admit, tick, vocalize)."""
        return dict(self.worker.stage_seconds)

    def add_tick_listener(self, listener: Callable[[TickReport], None]) -> None:
        self.worker.add_tick_listener(listener)

    def resolve_voice(self, name: str) -> str:
        key = (name or "default").strip().lower()
        for canonical in self.voice_names:
            if key == canonical.lower():
                return canonical
        if key in self.voice_aliases:
            return self.voice_aliases[key]
        valid = ", ".join(self.voice_names + tuple(sorted(self.voice_aliases)))
        raise InvalidRequest("voice", f"unknown voice {name!r}; valid voices: {valid}")

    # -- helpers --------------------------------------------------------------
    def validate(self, request: SynthesisRequest) -> None:
        """Raise InvalidRequest naming the first bad field."""
        if not isinstance(request.text, str) or not request.text.strip():
            raise InvalidRequest("text", "must be a non-empty string")
        if len(request.text) > self.MAX_TEXT_CHARS:
            raise InvalidRequest("text", f"longer than {self.MAX_TEXT_CHARS} characters")
        self.resolve_voice(request.voice)
        languages = getattr(self.source, "languages", None)
        if languages is not None and request.language.lower() not in [x.lower() for x in languages()]:
            raise InvalidRequest("language", f"unknown language {request.language!r}; valid: {', '.join(languages())}")
        if not 1 <= int(request.steps) <= self.MAX_STEPS:
            raise InvalidRequest("steps", f"must be between 1 and {self.MAX_STEPS}")
        if not 0.0 <= float(request.guidance_scale) <= 20.0:
            raise InvalidRequest("guidance_scale", "must be between 0 and 20")
        if not 0.25 <= float(request.speed) <= 4.0:
            raise InvalidRequest("speed", "must be between 0.25 and 4.0")
        if not 0.0 < float(request.temperature) <= 5.0:
            raise InvalidRequest("temperature", "must be in (0, 5]")
        if not 0.0 < float(request.top_p) <= 1.0:
            raise InvalidRequest("top_p", "must be in (0, 1]")
        if int(request.top_k) < 0:
            raise InvalidRequest("top_k", "must be >= 0")

    def _voice_index(self, name: str) -> int:
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

    def _warm_up(self) -> None:
        """Requests through the whole pipeline before reporting ready: one on CPU; on CUDA a
        crowd at once, then one alone."""
        voice = self.voice_names[0]
        texts = ("Warm up.",) if self.device.type != "cuda" else self.WARMUP_TEXTS_CUDA
        rounds = [list(texts)] + ([[texts[1]]] if self.device.type == "cuda" else [])
        for batch in rounds:
            events, errors = [], []
            for text in batch:
                done = threading.Event()
                events.append(done)

                def deliver(chunk: AudioChunk, done=done) -> None:
                    if chunk.is_final:
                        if chunk.error:
                            errors.append(chunk.error)
                        done.set()

                self.worker.submit(SynthesisRequest(id=f"warmup-{uuid.uuid4().hex[:8]}", text=text, voice=voice),
                                   deliver)
            if not all(done.wait(300) for done in events):
                raise RuntimeError("engine warm-up did not finish within 300 s")
            if errors:
                raise RuntimeError(f"engine warm-up failed: {errors[0]}")


SOURCES = ("dit", "talker")


def has_talker_weights(checkpoint: str | Path | None) -> bool:
    """True when ``checkpoint`` is a Qwen3-TTS directory with trained talker layers and tokenizer files."""
    if not checkpoint:
        return False
    root = Path(checkpoint)
    if not (root.is_dir() and (root / "config.json").is_file() and (root / "vocab.json").is_file()):
        return False
    from engines.checkpoints.files import SafetensorsFiles

    try:
        names = SafetensorsFiles(root).keys()
    except Exception:
        return False
    return any(n.startswith("talker.model.layers.") for n in names)


def build_engine(preset: str | None = None, device: str = "auto", checkpoint: str | None = None, seed: int = 0,
                 max_queue: int = 64, dtype: torch.dtype | None = None, fault_hook: FaultHook | None = None,
                 warmup: bool = True, source: str | None = None, talker_slots: int | None = None,
                 backend: str = "torch", artifacts_dir: str | None = None,
                 max_slots: int | None = None, batch_planning: bool | None = None) -> Engine:
    """The engine the service and CLI run. ``preset=None`` picks small on CPU, base on CUDA;
    ``dtype=None`` picks float32 on CPU, bfloat16 on CUDA; ``max_slots`` overrides the
    preset's concurrent-stream slots (the batch ceiling becomes 2 x slots, room for CFG);
    ``source=None`` picks the talker when the checkpoint has trained talker weights, else the DiT.
    ``backend`` runs the DiT and codec decoder with torch, onnxruntime or tensorrt
    (artifacts from ``streamvox export`` / ``build-engines`` in ``artifacts_dir``)."""
    dev = resolve_device(device)
    config = get_preset(preset or default_preset(dev))
    if source is None:
        source = "talker" if has_talker_weights(checkpoint) else "dit"
    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r}; choose one of {', '.join(SOURCES)}")
    if source == "talker" and not checkpoint:
        raise ValueError("--source talker needs --checkpoint DIR (a Qwen3-TTS custom-voice checkpoint)")
    dtype = dtype or default_dtype(dev)
    if max_slots is not None:
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        config = replace(config, stream=replace(config.stream, max_slots=max_slots, batch_ceiling=2 * max_slots))
    t0 = time.perf_counter()
    talker = None
    if checkpoint:
        models = _models_from_checkpoint(Path(checkpoint), config, seed, uses_dit=source == "dit")
        if source == "talker":
            from engines.pipelines.talker.reference import load_talker

            talker = load_talker(checkpoint, dev, dtype, predictor=models.code_predictor.to(dev, dtype))
    else:
        models = build_models(config, seed)
    if backend != "torch":
        from engines.export import apply_backend

        models = apply_backend(models, backend, artifacts_dir, dev)
    log.info("built %s models (source %s, backend %s) in %.2fs", models.config.name, source, backend,
             time.perf_counter() - t0)
    if talker_slots is None:
        talker_slots = max_slots or 8
    return Engine(models, dev, dtype, max_queue=max_queue, fault_hook=fault_hook, warmup=warmup,
                  talker=talker, talker_slots=talker_slots, batch_planning=batch_planning)


def _models_from_checkpoint(path: Path, preset_config: ModelConfig, seed: int, uses_dit: bool = True) -> Models:
    """A streamvox weights file, or a Qwen3-TTS directory (codec side real, DiT random)."""
    if path.is_file():
        models = build_models(preset_config, seed)
        load_weights(models, path)
        return models
    weights = path / WEIGHTS_FILE
    if (path / "config.json").exists():
        from engines.checkpoints.qwen3_tts import load_checkpoint

        parts = load_checkpoint(path)
        config = parts.model_config(preset_config)
        models = build_models(config, seed)
        models.codec_head = parts.head
        models.code_predictor = parts.predictor
        models.decoder = parts.decoder
        models.random_components = ("encoder", "duration", "dit")
        if weights.exists():
            load_weights(models, weights, components=("encoder", "duration", "dit"))
        elif uses_dit:
            log.warning("%s has no %s: the DiT and condition encoder run on RANDOM weights "
                        "(no trained DiT exists); the audio will not be speech", path, WEIGHTS_FILE)
        return models
    if weights.exists():
        models = build_models(preset_config, seed)
        load_weights(models, weights)
        return models
    raise FileNotFoundError(f"{path}: neither a Qwen3-TTS checkpoint directory (config.json) nor {WEIGHTS_FILE}")
