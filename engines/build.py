"""Composition root: an :class:`engines.config.EngineConfig` -> one pipeline + its engine.

``build_engine(config)`` is what the service and the CLI call (the service's settings build the
config: service/settings.py ``engine_config``); the result implements
:class:`engines.contract.SynthesisEngine`. Which pipeline and what it loads is the registry's
(engines/pipelines/registry.py); nothing here names one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import torch

from engines.checkpoints.hub import resolve_model
from engines.config import EngineConfig, RuntimeSwitches
from engines.core.engine import Engine
from engines.core.scheduler import DEFAULT_PREFILL_TOKEN_BUDGET, DEFAULT_PREFILL_TOKEN_BUDGET_GPU
from engines.core.worker import FaultHook
from engines.hardware.cpu_features import ThreadPlan, available_threads, has_native_bf16, plan_threads
from engines.hardware.devices import DTYPES, canonical_device, dtype_name, dtype_named
from engines.pipelines.registry import pipeline_for, registered
from engines.pipelines.vocoder import WINDOW_THREADS, rounds_per_chunk_shape

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


def build_engine(config: EngineConfig, fault_hook: FaultHook | None = None) -> Engine:
    """The engine the service and CLI run, built from ``config`` (:class:`engines.config.EngineConfig`:
    the service's settings build it, ``EngineConfig.for_tests`` in tests); its ``None`` / ``auto``
    fields are decided first (:func:`resolve_config`). ``fault_hook``: the worker's (tests inject
    failures there). The model's pipeline loads what it needs (engines/pipelines/registry.py: its
    ``load``); a ``backend`` other than torch runs the DiT and codec decoder from ``artifacts_dir``;
    an ``aligner`` is loaded for word timestamps. A ``virtual`` device: the talker's and the codec
    decoder's device work become waits of its cost table on this CPU (engines/virtual/; only the
    checkpoint's config and tokenizer files are read). A checkpoint that names a Hugging Face id is
    fetched into its cache first (ModelUnavailable, a ValueError, when it can't be)."""
    config = resolve_config(config)
    if config.virtual is not None:
        from engines.virtual.device import VirtualDevice

        virtual = VirtualDevice.load(config.virtual.table, eos_frames=config.virtual.eos_frames)
        loaded = virtual.model_parts(config)
        log.info("serving on a %s", virtual.describe())
        return Engine(loaded, config, fault_hook, virtual=virtual)
    t0 = time.perf_counter()
    loaded = registered(config.model.pipeline or "").load(config)
    runtime = config.runtime
    if runtime.backend != "torch":
        from engines.export import apply_backend

        loaded = replace(loaded, models=apply_backend(loaded.models, runtime.backend, runtime.artifacts_dir,
                                                      canonical_device(runtime.device)))
    seconds = time.perf_counter() - t0
    if config.model.aligner:
        loaded = replace(loaded, aligner=load_aligner(config))
    engine = Engine(loaded, config, fault_hook)
    caps = engine.capabilities
    built = caps.title or f"{caps.pipeline} pipeline"
    if caps.named_by_preset:  # (a talker's preset names no model: only its stream's chunking)
        built += f", preset {engine.info.preset}"
    log.info("built the %s (backend %s) in %.2fs", built, runtime.backend, seconds)
    return engine


def resolve_config(config: EngineConfig) -> EngineConfig:
    """``config`` with every choice left open decided: the checkpoint fetched (a Hugging Face id),
    the device (``auto``: CUDA when torch sees one; a virtual device runs on the CPU), the preset
    (small on CPU, base on CUDA), the dtypes, the pipeline (the checkpoint's: engines/pipelines/registry.py)
    and the prefill token budget (by device)."""
    model, runtime, scheduler = config.model, config.runtime, config.scheduler
    checkpoint = model.checkpoint
    if checkpoint and not Path(checkpoint).exists():
        checkpoint = str(resolve_model(checkpoint))
    if config.virtual is not None:
        return _resolve_virtual(config, checkpoint)
    device = resolve_device(runtime.device)
    dtype = default_dtype(device) if runtime.dtype in (None, "auto") else dtype_named(runtime.dtype)
    pipeline = model.pipeline or pipeline_for(checkpoint)
    registered(pipeline)  # ValueError naming the registered ones
    codec = resolve_codec_dtype(runtime.codec_precision, device, dtype) if runtime.backend == "torch" else dtype
    budget = scheduler.prefill_token_budget or (
        DEFAULT_PREFILL_TOKEN_BUDGET_GPU if device.type == "cuda" else DEFAULT_PREFILL_TOKEN_BUDGET)
    threads = runtime.threads or cpu_threads(device, runtime.switches, codec)
    return replace(config, model=replace(model, checkpoint=checkpoint, pipeline=pipeline,
                                         preset=model.preset or default_preset(device)),
                   runtime=replace(runtime, device=str(device), dtype=dtype_name(dtype),
                                   codec_precision=dtype_name(codec), threads=threads),
                   scheduler=replace(scheduler, prefill_token_budget=budget))


def _resolve_virtual(config: EngineConfig, checkpoint: str | None) -> EngineConfig:
    """A virtual device's config: the CPU in float32 standing for its GPU (whose prefill budget it
    keeps), the pipeline it runs."""
    from engines.virtual.device import VirtualDevice

    model, runtime = config.model, config.runtime
    if runtime.device not in ("auto", "cpu"):
        raise ValueError(f"--virtual-device runs on the CPU (it stands for the GPU its table was measured on); "
                         f"got --device {runtime.device}")
    if model.pipeline not in (None, VirtualDevice.PIPELINE):
        raise ValueError(f"--virtual-device serves the {VirtualDevice.PIPELINE} pipeline "
                         f"(--source {VirtualDevice.PIPELINE})")
    return replace(config, model=replace(model, checkpoint=checkpoint, pipeline=VirtualDevice.PIPELINE,
                                         preset=model.preset or "small"),
                   runtime=replace(runtime, device="cpu", dtype="float32", codec_precision=None),
                   scheduler=replace(config.scheduler, prefill_token_budget=(
                       config.scheduler.prefill_token_budget or DEFAULT_PREFILL_TOKEN_BUDGET_GPU)))


def load_aligner(config: EngineConfig):
    """The forced aligner ``config.model.aligner`` names (a directory or a Hugging Face id): fp32 on
    CPU; on CUDA the engine's dtype (the aligner's official inference runs in bf16)."""
    from engines.pipelines.aligner import Aligner

    name = config.model.aligner
    aligner = Aligner.load(Path(name) if Path(name).exists() else name,
                           device=canonical_device(config.runtime.device), dtype=dtype_named(config.runtime.dtype))
    log.info("loaded the forced aligner %s (word timestamps)", name)
    return aligner


def cpu_threads(device: torch.device, switches: RuntimeSwitches, codec_dtype: torch.dtype) -> ThreadPlan | None:
    """On a CPU whose codec decoder gets threads of its own (two or more available): the talker's
    and the decoder's, by a probe of the memory bandwidth (engines/hardware/cpu_features.py); a decoder on
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
        registered(source)
