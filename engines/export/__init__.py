"""Backends: who runs the DiT and the codec decoder behind the seam the tick loop and
the vocalizer already call (see base.py).

* ``torch``       - the nn.Modules themselves (eager).
* ``onnxruntime`` - graphs from ``streamvox export`` run by ONNX Runtime (CPU hosts).
* ``tensorrt``    - engines from ``streamvox build-engines`` (CUDA, via TensorRT).

The one call an engine builder needs::

    models = build_models(...) / load weights ...          # fp32, as loaded
    models = apply_backend(models, backend, artifacts_dir, device)
    Engine(Loaded(models), resolve_config(config))         # unchanged

``apply_backend`` verifies the artifacts against the loaded weights (manifest hash),
swaps ``models.dit`` / ``models.decoder`` for runners with the same call signatures,
and lowers ``config.stream.batch_ceiling`` (and ``max_slots``) to the DiT profile's max
batch, so the scheduler fuses CFG exactly when 2n rows fit the engine.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from engines.export.base import (
    ArtifactMismatch,
    AxisRange,
    BackendError,
    BackendUnavailable,
    DecoderRunner,
    DiTRunner,
    ShapeOutsideProfile,
)
from engines.export.manifest import Manifest

BACKENDS = ("torch", "onnxruntime", "tensorrt")

__all__ = ["BACKENDS", "apply_backend", "make_dit_runner", "make_decoder_runner", "ArtifactMismatch", "AxisRange",
           "BackendError", "BackendUnavailable", "DecoderRunner", "DiTRunner", "ShapeOutsideProfile", "Manifest"]


def _check_backend(backend: str, artifacts_dir) -> Path:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if artifacts_dir is None:
        made_by = "streamvox export" if backend == "onnxruntime" else "streamvox build-engines"
        raise ValueError(f"--backend {backend} needs the artifacts directory written by {made_by}")
    return Path(artifacts_dir)


def make_dit_runner(dit, backend: str, artifacts_dir: str | Path | None, device, threads: int | None = None,
                    manifest: Manifest | None = None):
    """A callable like ``dit`` (FlowDiT) for ``backend``; ``dit`` itself for torch.

    The torch module is needed for its config and its weights hash (ArtifactMismatch when
    the artifacts were exported from other weights)."""
    if backend == "torch":
        return dit
    directory = _check_backend(backend, artifacts_dir)
    if backend == "tensorrt":
        from engines.export.tensorrt_backend import require_tensorrt
        require_tensorrt()  # fail on a missing runtime before reading anything
    manifest = manifest or Manifest.load(directory)
    manifest.verify("dit", dit, dit.cfg.to_dict(), str(directory))
    if backend == "onnxruntime":
        from engines.export.onnxruntime_backend import OrtDiT
        return OrtDiT(directory, manifest, dit.cfg, threads)
    from engines.export.tensorrt_backend import TrtDiT
    return TrtDiT.from_artifacts(directory, manifest, dit.cfg, torch.device(device))


def make_decoder_runner(decoder, backend: str, artifacts_dir: str | Path | None, device, threads: int | None = None,
                        manifest: Manifest | None = None):
    """An object like ``decoder`` (CodecDecoder: forward, decode_step, init_state) for ``backend``."""
    if backend == "torch":
        return decoder
    directory = _check_backend(backend, artifacts_dir)
    if backend == "tensorrt":
        from engines.export.tensorrt_backend import require_tensorrt
        require_tensorrt()
    manifest = manifest or Manifest.load(directory)
    manifest.verify("decoder", decoder, decoder.cfg.to_dict(), str(directory))
    dtype = getattr(torch, manifest.dtype)
    template = decoder.init_state(1, torch.device(device), dtype)
    if backend == "onnxruntime":
        from engines.export.onnxruntime_backend import OrtDecoder
        return OrtDecoder(directory, manifest, decoder.cfg, decoder.samples_per_frame, template, threads)
    from engines.export.tensorrt_backend import TrtDecoder
    return TrtDecoder.from_artifacts(directory, manifest, decoder.cfg, decoder.samples_per_frame, template,
                                     torch.device(device))


def apply_backend(models, backend: str, artifacts_dir: str | Path | None, device, threads: int | None = None):
    """``models`` (engines.pipelines.modules.Models, weights as loaded, before any dtype cast) with the
    DiT and codec decoder run by ``backend``; a new Models, the input is not modified.

    The stream config's batch ceiling becomes min(ceiling, DiT profile max batch)."""
    if backend == "torch":
        return models
    directory = _check_backend(backend, artifacts_dir)
    if backend == "tensorrt":
        from engines.export.tensorrt_backend import require_tensorrt
        require_tensorrt()
    manifest = Manifest.load(directory)
    dit = make_dit_runner(models.dit, backend, directory, device, threads, manifest)
    decoder = make_decoder_runner(models.decoder, backend, directory, device, threads, manifest)
    return dataclasses.replace(models, dit=dit, decoder=decoder,
                               config=fit_stream_to_profile(models.config, dit.max_batch))


def fit_stream_to_profile(config, max_batch: int):
    """ModelConfig whose stream batch ceiling (and max_slots) fit a DiT that takes at most ``max_batch`` rows."""
    s = config.stream
    ceiling = min(s.batch_ceiling, max_batch)
    stream = dataclasses.replace(s, batch_ceiling=ceiling, max_slots=min(s.max_slots, ceiling))
    return dataclasses.replace(config, stream=stream)
