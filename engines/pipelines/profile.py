"""One adapter per pipeline: what a pipeline folder registers, what the engine hands its builder,
and what it gets back.

A pipeline folder (``dit/``, ``talker/``) has a ``load(config) -> Loaded`` (what it reads from the
checkpoint) and a ``build(setup) -> Adapter``, listed once in :mod:`engines.pipelines.registry` as a
:class:`Registration`. The adapter pairs the pipeline (the seam of
:mod:`engines.pipelines.base`: steps that emit code frames) with its profile: the loaded model's
policy that is not a step - its voices and aliases, what it can do (``EngineCapabilities``),
the model-dependent request rules, a request's plan (its ids, its frame budget) and the work it plans, the seed of an unseeded request,
its warm-up request, its voice features. The engine (engines/core/engine.py) is a facade over
the two and never asks which pipeline it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np
import torch

from engines.config import EngineConfig
from engines.contract import EngineCapabilities, InvalidRequest, PlannedWork, SynthesisRequest
from engines.pipelines.voice_aliases import voice_key

if TYPE_CHECKING:
    from engines.checkpoints.qwen3_voice import VoiceFeatures
    from engines.pipelines.base import Pipeline
    from engines.pipelines.modules import Models
    from engines.pipelines.vocoder import Vocalizer


@dataclass(frozen=True)
class Loaded:
    """What a pipeline's ``load`` read, which the engine is built from."""

    models: Models  # the modules (codec side, the DiT's where it runs), as loaded: not yet on the device
    parts: Any = None  # the pipeline's own (the talker: its TalkerBundle), handed to its builder
    quantize: str = "none"  # the talker's and code predictor's weights as they run (EngineInfo.quantize)
    aligner: Any = None  # a loaded engines.pipelines.aligner.Aligner (word timestamps); None: none


@dataclass(frozen=True)
class PipelineSetup:
    """What the engine hands a pipeline's builder."""

    models: Models  # on the device, in the engine's dtype
    parts: Any  # Loaded.parts: the pipeline's own
    device: torch.device
    dtype: torch.dtype
    max_slots: int  # requests batched together at most (the vocoder keeps twice as many streams)
    vocalizer: Vocalizer  # where the frames go; a pipeline may prime a stream (in-context cloning)
    config: EngineConfig = EngineConfig()  # the rest: switches, voice aliases, limits (KV pool)


class Profile:
    """The loaded model's policy (see the module docstring). Subclasses set ``capabilities`` and
    override what their model decides; the defaults suit a model of preset voices that needs
    nothing beyond its text."""

    capabilities: EngineCapabilities
    kind = "this model"  # how refusals name the loaded model

    @property
    def name(self) -> str:
        return self.capabilities.pipeline

    @property
    def voices(self) -> tuple[str, ...]:
        return self.capabilities.voices

    @property
    def voice_aliases(self) -> Mapping[str, str]:
        return self.capabilities.voice_aliases

    def resolve_voice(self, name: str) -> str:
        """The canonical voice for ``name`` (a voice or alias, any case); InvalidRequest if
        unknown. Without preset voices the voice comes with the request (reference audio,
        instructions): a name is kept (a saved voice the service resolved into the clone)."""
        if not self.capabilities.preset_voices:
            return (name or "default").strip() or "default"
        key = voice_key(name or "default")
        for canonical in self.voices:
            if key == voice_key(canonical):
                return canonical
        for alias, voice in self.voice_aliases.items():  # (a few dozen; vendor ids keep their case)
            if key == voice_key(alias):
                return voice
        valid = ", ".join(sorted(set(self.voices) | set(self.voice_aliases)))
        raise InvalidRequest("voice", f"unknown voice {str(name)[:64]!r}; valid voices: {valid}")

    def validate(self, request: SynthesisRequest, complete: bool) -> None:
        """The rules of the loaded release beyond voice, language and live text (which the engine
        checks from the capabilities); InvalidRequest naming the field."""

    def plan(self, request: SynthesisRequest) -> SynthesisRequest:
        """``request`` with what this model plans before it is submitted (its text's ids, its frame
        budget), each unless it carries them: the one place it is planned. A model that plans its
        frames at admission (the DiT) plans nothing here."""
        return request

    def planned_work(self, request: SynthesisRequest) -> PlannedWork:
        raise NotImplementedError

    def default_seed(self) -> int:
        """The seed of a request that names none."""
        return 0

    def warmup_fields(self) -> dict:
        """The fields a warm-up request needs besides its text and voice."""
        return {}

    def voice_features(self, audio: np.ndarray) -> VoiceFeatures:
        """x-vector and reference codes of a reference (a model that clones); InvalidRequest here."""
        raise InvalidRequest("ref_audio", f"voice cloning needs a Base checkpoint; the loaded one is {self.kind}")


@dataclass(frozen=True)
class Adapter:
    """A built pipeline and its profile."""

    pipeline: Pipeline
    profile: Profile


Builder = Callable[[PipelineSetup], Adapter]
"""A pipeline folder's ``build``: the setup -> its adapter (engines/pipelines/registry.py)."""

Loader = Callable[[EngineConfig], Loaded]
"""A pipeline folder's ``load``: a resolved config (engines/build.py ``resolve_config``) -> what it
read (its checkpoint's modules and parts; random weights of the preset where it has none)."""


@dataclass(frozen=True)
class Registration:
    """A pipeline as engines/pipelines/registry.py lists it: how it loads, how it is built, and what
    it declares before it is built."""

    build: Builder
    load: Loader
    default_slots: int | None = None
    """Requests batched together when the config names no ``max_slots``; None: its model config's
    (the preset's stream, which ``max_slots`` sets)."""

    def slots(self, requested: int | None, model_config) -> int:
        if self.default_slots is None:
            return model_config.stream.max_slots
        return requested or self.default_slots


__all__ = ["Adapter", "Builder", "Loaded", "Loader", "PipelineSetup", "Profile", "Registration"]
