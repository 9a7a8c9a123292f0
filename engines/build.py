"""Composition root: settings + checkpoint -> one pipeline + its engine.

``build_engine(...)`` is what the service and the CLI call; the result implements
:class:`engines.contract.SynthesisEngine`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Mapping

import torch

from engines.checkpoints.hub import resolve_model
from engines.checkpoints.qwen3_tts import has_talker_weights, load_checkpoint
from engines.config import RuntimeSwitches, get_preset
from engines.core.engine import Engine
from engines.core.scheduler import DEFAULT_PREFILL_TOKEN_BUDGET, DEFAULT_PREFILL_TOKEN_BUDGET_GPU
from engines.core.worker import FaultHook
from engines.cpu_features import ThreadPlan, available_threads, has_native_bf16, plan_threads
from engines.devices import canonical_device
from engines.models.configs import ModelConfig
from engines.models.quantize import quantize_talker, resolve_quantize
from engines.pipelines.registry import pipeline_builder
from engines.pipelines.vocoder import WINDOW_THREADS, rounds_per_chunk_shape
from engines.pipelines.dit.weights import (
    WEIGHTS_FILE,
    Models,
    build_models,
    load_weights,
)

log = logging.getLogger("streamvox.engine")

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


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_codec_dtype(requested: str | None, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The codec decoder's precision: None -> the engine's ``dtype``; ``"auto"`` -> bfloat16 on a CPU
    with native bf16 (the official code decodes in the model's dtype, bf16 in its evaluation and
    examples; docs/QUANTIZATION.md measures ours against it), else ``dtype``; or as named."""
    if requested is None or (requested == "auto" and not (device.type == "cpu" and has_native_bf16())):
        return dtype
    if requested == "auto":
        return torch.bfloat16
    if requested not in DTYPES:
        raise ValueError(f"codec precision must be auto, float32 or bfloat16, got {requested!r}")
    return DTYPES[requested]


def build_engine(preset: str | None = None, device: str = "auto", checkpoint: str | None = None, seed: int = 0,
                 max_queue: int = 64, dtype: torch.dtype | None = None, fault_hook: FaultHook | None = None,
                 warmup: bool = True, source: str | None = None, talker_slots: int | None = None,
                 backend: str = "torch", artifacts_dir: str | None = None,
                 max_slots: int | None = None, batch_planning: bool | None = None, kv_cache_gb: float | None = None,
                 prefill_token_budget: int | None = None, switches: RuntimeSwitches | None = None,
                 aligner: str | None = None, prefix_cache_fraction: float | None = None,
                 quantize: str | None = None, virtual_device: str | None = None,
                 virtual_eos_frames: int | None = None, codec_precision: str | None = None,
                 voice_aliases: Mapping[str, str | None] | None = None) -> Engine:
    """The engine the service and CLI run. ``preset=None`` picks small on CPU, base on CUDA;
    ``dtype=None`` picks float32 on CPU, bfloat16 on CUDA; ``max_slots`` overrides the
    preset's concurrent-stream slots (the batch ceiling becomes 2 x slots, room for CFG);
    ``source=None`` picks the talker when the checkpoint has trained talker weights, else the DiT.
    ``backend`` runs the DiT and codec decoder with torch, onnxruntime or tensorrt
    (artifacts from ``streamvox export`` / ``build-engines`` in ``artifacts_dir``).
    ``prefix_cache_fraction``: share of the talker's KV pool that shared prompt prefixes may
    keep (engines/models/prefix_cache.py; None = the source's default, 0 = off).
    ``quantize``: the talker's and code predictor's weights: None or ``"none"`` fp32 (the official
    greedy codes), ``"int8"`` / ``"int4"`` / ``"int8-int4p"`` (CPU, float32; engines/models/quantize.py), ``"auto"``
    the CPU default of docs/QUANTIZATION.md on a CPU, fp32 elsewhere; ``engine.info.quantize`` says
    which ran. ``codec_precision``: the codec decoder's (:func:`resolve_codec_dtype`; the torch
    backend only); ``engine.info.codec_dtype`` says which ran.
    ``checkpoint`` may be a Hugging Face id, ``ORG/NAME[@REVISION]``: it is fetched into the
    cache first (engines/checkpoints/hub.py; ModelUnavailable, a ValueError, when it can't be).
    ``switches``: how it runs on the device (:class:`engines.config.RuntimeSwitches`; the defaults
    when None; the service builds them from the environment). ``aligner``: a Qwen3-ForcedAligner
    (an official-layout directory or a Hugging Face id) for word timestamps; None: none.
    ``virtual_device``: a device cost table (benchmarks/costs/*.json): the talker's and the codec
    decoder's device work become waits of its costs on this CPU (engines/virtual/; only the
    checkpoint's config and tokenizer files are read); ``virtual_eos_frames``: every utterance
    then samples EOS after that many frames (None: it runs to its frame budget).
    ``voice_aliases``: voice names added to (None: dropped from) the vendor aliases
    (engines/pipelines/voice_aliases.py)."""
    if checkpoint and not Path(checkpoint).exists():
        checkpoint = str(resolve_model(checkpoint))
    if virtual_device:
        return _virtual_engine(virtual_device, virtual_eos_frames, preset, device, checkpoint, max_queue, fault_hook,
                               warmup, source, talker_slots or max_slots or 8, kv_cache_gb, prefill_token_budget,
                               prefix_cache_fraction, voice_aliases)
    dev = resolve_device(device)
    config = get_preset(preset or default_preset(dev))
    if source is None:
        source = "talker" if has_talker_weights(checkpoint) else "dit"
    check_source(source)
    if source == "talker" and not checkpoint:
        raise ValueError("--source talker needs --model (a Qwen3-TTS CustomVoice, Base or VoiceDesign release)")
    dtype = dtype or default_dtype(dev)
    if max_slots is not None:
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        config = replace(config, stream=replace(config.stream, max_slots=max_slots, batch_ceiling=2 * max_slots))
    codec_dtype = resolve_codec_dtype(codec_precision, dev, dtype) if backend == "torch" else dtype
    threads = cpu_threads(dev, switches or RuntimeSwitches(), codec_dtype)
    t0 = time.perf_counter()
    options: dict = {}  # the pipeline's own (engines/pipelines/<name>/adapter.py)
    if checkpoint:
        models = load_models(Path(checkpoint), config, seed, uses_dit=source == "dit")
        if source == "talker":
            from engines.pipelines.talker.reference import TalkerBundle

            talker = options["talker"] = TalkerBundle.from_checkpoint(checkpoint, dev, dtype,
                                                                      predictor=models.code_predictor.to(dev, dtype))
            quantize = resolve_quantize(quantize, dev, dtype, talker=True)
            if quantize:
                quantize_talker(talker.talker, talker.predictor, quantize, threads=threads.talker if threads else None)
                log.info("talker and code predictor weights: %s (--quantize none: fp32)", quantize)
    else:
        models = build_models(config, seed)
    if backend != "torch":
        from engines.export import apply_backend

        models = apply_backend(models, backend, artifacts_dir, dev)
    built = f"the DiT, preset {config.name}" if source == "dit" else f"the {source} pipeline"  # a preset is a DiT notion
    log.info("built %s (backend %s) in %.2fs", built, backend, time.perf_counter() - t0)
    loaded_aligner = None
    if aligner:
        from engines.pipelines.aligner import Aligner

        # fp32 on CPU; on CUDA the engine's dtype (the aligner's official inference runs in bf16)
        loaded_aligner = Aligner.load(Path(aligner) if Path(aligner).exists() else aligner, device=dev, dtype=dtype)
        log.info("loaded the forced aligner %s (word timestamps)", aligner)
    if prefill_token_budget is None:  # the scheduler's, which decides each step's prefill
        prefill_token_budget = DEFAULT_PREFILL_TOKEN_BUDGET_GPU if dev.type == "cuda" else DEFAULT_PREFILL_TOKEN_BUDGET
    slots = None  # the config's stream.max_slots (the DiT's, set above)
    if source == "talker":
        options.update(_kv_options(kv_cache_gb, prefix_cache_fraction))
        slots = talker_slots or max_slots or 8
    engine = Engine(models, dev, dtype, codec_dtype=codec_dtype, threads=threads, max_queue=max_queue, fault_hook=fault_hook, warmup=warmup,
                    pipeline=source, max_slots=slots,
                    batch_planning=batch_planning, backend=backend, options=options,
                    switches=switches or RuntimeSwitches(), aligner=loaded_aligner,
                    prefill_token_budget=prefill_token_budget, voice_aliases=voice_aliases)
    if source == "talker" and quantize:
        engine.info = replace(engine.info, quantize=quantize)
    return engine


def cpu_threads(device: torch.device, switches: RuntimeSwitches, codec_dtype: torch.dtype) -> ThreadPlan | None:
    """On a CPU whose codec decoder gets threads of its own (two or more available): the talker's
    and the decoder's, by a probe of the memory bandwidth (engines/cpu_features.py); a decoder on
    fixed windows (a reduced precision: engines/pipelines/vocoder.py) decodes on one. None elsewhere."""
    if device.type != "cpu" or not switches.vocoder_thread or available_threads() < 2:
        return None
    plan = plan_threads(available_threads(), codec_fixed=WINDOW_THREADS if rounds_per_chunk_shape(codec_dtype) else None)
    log.info("threads: talker %d, codec decoder %d (%s)", plan.talker, plan.codec, plan.reason)
    return plan


def check_source(source: str | None) -> None:
    """ValueError naming the registered pipelines (engines/pipelines/registry.py) when ``source`` is
    none of them; None (the checkpoint decides) passes."""
    if source is not None:
        pipeline_builder(source)


def _virtual_engine(table: str, eos_frames: int | None, preset: str | None, device: str, checkpoint: str | None,
                    max_queue: int, fault_hook: FaultHook | None, warmup: bool, source: str | None, talker_slots: int,
                    kv_cache_gb: float | None, prefill_token_budget: int | None,
                    prefix_cache_fraction: float | None,
                    voice_aliases: Mapping[str, str | None] | None = None) -> Engine:
    """The talker engine on a virtual device (engines/virtual/): the checkpoint's prompt side, no models."""
    from engines.virtual.device import VirtualDevice

    if device not in ("auto", "cpu"):
        raise ValueError(f"--virtual-device runs on the CPU (it stands for the GPU its table was measured on); "
                         f"got --device {device}")
    if source not in (None, "talker"):
        raise ValueError("--virtual-device serves the talker (--source talker)")
    if not checkpoint:
        raise ValueError("--virtual-device needs --model: a Qwen3-TTS directory whose config and tokenizer files "
                         "shape the prompts (no weights are read; benchmarks/costs/prompt-0.6b has them)")
    virtual = VirtualDevice.load(table, eos_frames=eos_frames)
    config = virtual.model_config(checkpoint, get_preset(preset or "small"))
    models = Models(config=config, encoder=None, duration=None, dit=None, codec_head=None,  # type: ignore[arg-type]
                    code_predictor=None, decoder=None, random_components=())  # type: ignore[arg-type]
    log.info("serving on a %s", virtual.describe())
    return Engine(models, canonical_device("cpu"), torch.float32, max_queue=max_queue, fault_hook=fault_hook,
                  warmup=warmup, pipeline="talker", max_slots=talker_slots,
                  options={"talker": virtual.talker_bundle(checkpoint), **_kv_options(kv_cache_gb, prefix_cache_fraction)},
                  prefill_token_budget=prefill_token_budget or DEFAULT_PREFILL_TOKEN_BUDGET_GPU, virtual=virtual,
                  voice_aliases=voice_aliases)


def _kv_options(kv_cache_gb: float | None, prefix_cache_fraction: float | None) -> dict:
    """The talker source's KV pool options that were given (engines/pipelines/talker/source.py)."""
    return {k: v for k, v in (("kv_cache_gb", kv_cache_gb), ("prefix_cache_fraction", prefix_cache_fraction))
            if v is not None}


def load_models(path: Path | None, preset_config: ModelConfig, seed: int, uses_dit: bool = True) -> Models:
    """The modules a pipeline runs on (codec side, and the DiT's unless ``uses_dit`` is False): from a
    streamvox weights file, or a Qwen3-TTS directory (codec side real, DiT random); random weights
    of ``preset_config`` when ``path`` is None (``streamvox export`` loads them here too)."""
    if path is None:
        return build_models(preset_config, seed)
    if path.is_file():
        models = build_models(preset_config, seed)
        load_weights(models, path)
        return models
    weights = path / WEIGHTS_FILE
    if (path / "config.json").exists():
        parts = load_checkpoint(path)
        config = parts.model_config(preset_config)
        if not uses_dit:  # the talker: the DiT side (encoder, duration model, DiT) is never built
            return Models(config=config, encoder=None, duration=None, dit=None, codec_head=parts.head,
                          code_predictor=parts.predictor, decoder=parts.decoder, random_components=())
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
