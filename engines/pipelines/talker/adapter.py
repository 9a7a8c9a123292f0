"""The talker pipeline's adapter: what it loads (the checkpoint's codec side and its
:class:`TalkerBundle`, quantized as asked), its pipeline (a :class:`TalkerSource` behind
:class:`TalkerPipeline`, run as the device and switches say) and its profile (the release's speakers
or none, its task's rules, work in talker steps, a random seed when none is given).

``setup.parts`` is the bundle; ``setup.config.limits`` sizes the source's KV pool.
``build(setup, make_source)``: another maker of the talker source (the virtual device's,
engines/virtual/) replaces the real one.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import replace
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from engines.checkpoints.qwen3_tts import load_checkpoint
from engines.checkpoints.qwen3_voice import VoiceFeatures
from engines.config import EngineConfig, RuntimeSwitches
from engines.contract import EngineCapabilities, InvalidRequest, PlannedWork, SynthesisRequest, VoiceClone
from engines.hardware.devices import canonical_device, dtype_named
from engines.models.configs import ModelConfig
from engines.models.quantize import quantize_talker, resolve_quantize
from engines.models.talker import Talker
from engines.pipelines.modules import Models
from engines.pipelines.profile import Adapter, Loaded, PipelineSetup, Profile
from engines.pipelines.talker.pipeline import FIRST_CHUNK_FRAMES, TalkerPipeline
from engines.pipelines.talker.reference import TalkerBundle
from engines.pipelines.talker.source import SourceRunners, TalkerSource
from engines.pipelines.voice_aliases import OPENAI_VOICE_ALIASES, VENDOR_VOICE_ALIASES, extend_aliases

log = logging.getLogger("streamvox.engine")

# The request fields that change the talker's output (EngineCapabilities.honoured_fields); a
# release that follows instructions or clones adds those.
FIELDS = frozenset({"text", "voice", "seed", "language", "greedy", "temperature", "top_k", "top_p",
                    "repetition_penalty", "max_new_tokens", "initial_codec_chunk_frames", "task_type",
                    "non_streaming_mode", "text_feed"})

SourceMaker = Callable[[PipelineSetup], tuple]
"""``setup -> (talker source, graph wrappers it replays)``."""


def load(config: EngineConfig) -> Loaded:
    """The checkpoint's codec side (its DiT side is never built) and talker bundle, the talker and
    code predictor quantized as ``config.runtime.quantize`` resolves (engines/models/quantize.py)."""
    checkpoint = config.model.checkpoint
    if not checkpoint:
        raise ValueError("--source talker needs --model (a Qwen3-TTS CustomVoice, Base or VoiceDesign release)")
    device, dtype = canonical_device(config.runtime.device), dtype_named(config.runtime.dtype)
    parts = load_checkpoint(Path(checkpoint))
    models = Models.codec_only(parts.model_config(config.sizes()), parts.head, parts.predictor, parts.decoder)
    bundle = TalkerBundle.from_checkpoint(checkpoint, device, dtype, predictor=models.code_predictor.to(device, dtype))
    quantize = resolve_quantize(config.runtime.quantize, device, dtype, talker=True)
    if quantize:
        threads = config.runtime.threads
        quantize_talker(bundle.talker, bundle.predictor, quantize, threads=threads.talker if threads else None)
        log.info("talker and code predictor weights: %s (--quantize none: fp32)", quantize)
    return Loaded(models, bundle, quantize=quantize or "none")


def real_source(setup: PipelineSetup) -> tuple[TalkerSource, tuple]:
    """The talker source on the device, run by the runtime's graphs and kernels the device and
    switches ask for."""
    bundle: TalkerBundle = setup.parts
    switches = setup.config.runtime.switches
    prepare_talker(bundle.talker, setup.device, switches)
    limits = setup.config.limits
    kv = {k: v for k, v in (("kv_cache_gb", limits.kv_cache_gb),
                            ("prefix_cache_fraction", limits.prefix_cache_fraction)) if v is not None}
    source = TalkerSource.from_bundle(bundle, max_slots=setup.max_slots, paged_attention=switches.paged_attention,
                                      runners=source_runners(setup.device, switches, setup.max_slots), **kv)
    return source, source.graphed


def source_runners(device, switches: RuntimeSwitches, slots: int) -> SourceRunners:
    """What runs the source's device work: on CUDA (or, to see its buckets, the CPU's static step)
    the whole decode step as one CUDA graph per bucket (engines/runtime/graphed_talker.py; eager,
    the step is launch bound) and the prompts' first chunks graphed too (on the path to every first
    audio); with the step graphs off on CUDA, the code predictor graphed alone (eager on an H100 it
    is ~100 ms per step); the switches' fused kernels inside the step's graph."""
    admission = None if switches.batched_admission else False
    step_graphs = ((device.type == "cuda" and switches.talker_step_graphs)
                   or (device.type == "cpu" and switches.static_step_on_cpu))
    if step_graphs:
        from engines.runtime.graphed_prefill import GraphedPrefill
        from engines.runtime.graphed_talker import GraphedTalkerStep

        predictor_backend = switches.compile_backend("predictor")
        return SourceRunners(
            step=lambda spec: GraphedTalkerStep(spec, compile_backend=predictor_backend),
            prefill=GraphedPrefill if device.type != "cuda" or switches.prefill_graphs else None,
            predictor_kernels=fused_predictor(switches) if device.type == "cuda" else None,
            batched_admission=admission)
    if device.type == "cuda":
        from engines.runtime.graphed_predictor import DEFAULT_BUCKETS, GraphedCodePredictor

        buckets = tuple(b for b in DEFAULT_BUCKETS if b < slots) + (slots,)
        return SourceRunners(predictor_graphs=lambda predictor: GraphedCodePredictor(
            predictor, buckets=buckets, compile_backend=switches.compile_backend("predictor")),
            batched_admission=admission)
    return SourceRunners(batched_admission=admission)


def fused_predictor(switches: RuntimeSwitches):
    """The switches' code predictor frame as fused Triton kernels (one launch per frame, or per
    dependent step) in place of the generic loop; None: off (the default until measured on a GPU)."""
    if switches.fused_predictor == "off":
        return None
    from engines.models.fused_predictor import FusedCodePredictor

    return lambda predictor: FusedCodePredictor(predictor, mode=switches.fused_predictor)


def prepare_talker(talker: Talker, device, switches: RuntimeSwitches) -> None:
    """The talker model as the switches run it, before a source is built on it: its layers compiled
    (opt-in, compile_talker; compiled by the warm-up, before ready) and, on CUDA with the step
    graphs, its decode layers as fused Triton kernels (five launches a layer; off by default until
    measured on a GPU)."""
    backend = switches.compile_backend("talker")
    if backend:
        talker.compile_layers(backend)
    if device.type == "cuda" and switches.talker_step_graphs and switches.fused_talker:
        from engines.models.fused_talker import FusedDecodeLayers

        talker.fused_decode_step = FusedDecodeLayers(talker)


def sampling_defaults(bundle: TalkerBundle) -> dict[str, float | int | bool]:
    """The checkpoint's sampling of code 0, in the request fields' names (what /v1/models shows)."""
    gen = bundle.generation
    return {"greedy": not gen.do_sample, "temperature": gen.temperature, "top_k": gen.top_k, "top_p": gen.top_p,
            "repetition_penalty": gen.repetition_penalty}


def build(setup: PipelineSetup, make_source: SourceMaker = real_source) -> Adapter:
    bundle: TalkerBundle = setup.parts
    source, graphed = make_source(setup)
    profile = TalkerProfile(bundle, source, setup.models.config, setup.max_slots, setup.config.model.voice_aliases)
    stream = setup.models.config.stream
    pipeline = TalkerPipeline(source, first_chunk_frames=min(FIRST_CHUNK_FRAMES, stream.first_chunk_frames),
                              chunk_frames=stream.chunk_frames, graphed=graphed, prime=setup.vocalizer.prime)
    return Adapter(pipeline, profile)


class TalkerProfile(Profile):
    """A Qwen3-TTS release's policy. CustomVoice: its speakers (``default`` and the OpenAI and
    vendor names as aliases); Base clones the request's reference and VoiceDesign follows its
    instructions (no preset voices). Work counted in talker steps, the text's frame budget."""

    def __init__(self, bundle: TalkerBundle, source, config: ModelConfig, max_slots: int,
                 voice_aliases: Mapping[str, str | None]):
        self.source = source  # TalkerSource or the virtual device's: frame budgets, the prompt's tokenizer
        self.config = config
        self.kind = task = bundle.task_type
        self.voice_encoders = bundle.voice_encoders  # Base checkpoints
        speakers = tuple(bundle.voices())
        if task != "CustomVoice":
            speakers, aliases = ("default",), {}
        elif not speakers:
            raise ValueError(f"{bundle.path}: the checkpoint lists no speakers (talker_config.spk_id)")
        else:
            # "default" and the OpenAI names map onto the checkpoint's speakers, in order.
            aliases = {"default": speakers[0]}
            for i, alias in enumerate(sorted(OPENAI_VOICE_ALIASES)):
                aliases.setdefault(alias, speakers[i % len(speakers)])
            aliases = extend_aliases(aliases, speakers, {**VENDOR_VOICE_ALIASES, **voice_aliases})
        self.speakers = speakers  # voice index -> the checkpoint's speaker name
        instructions = bundle.prompt.instructions_apply
        cloning = self.voice_encoders is not None
        self.capabilities = EngineCapabilities(
            pipeline="talker", task_type=task, voices=speakers, voice_aliases=aliases,
            preset_voices=task == "CustomVoice", languages=tuple(source.languages()),
            honoured_fields=FIELDS | ({"instructions"} if instructions else set()) | ({"clone"} if cloning else set()),
            max_slots=max_slots, max_new_tokens=bundle.generation.max_new_tokens, instructions=instructions,
            voice_cloning=cloning, live_text=True, random_components=(), sampling_defaults=sampling_defaults(bundle))

    def validate(self, request: SynthesisRequest, complete: bool) -> None:
        """Base needs a reference, VoiceDesign instructions (in a ``complete`` request); only Base
        clones; a named task_type must be the loaded one; no speed control."""
        task = self.kind
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
        ceiling = self.source.max_seq_len - 1
        if request.budget is not None and not 0 <= request.budget.frames <= ceiling:
            raise InvalidRequest("budget", f"{request.budget.frames} frames: a stream holds at most {ceiling}")

    def _check_clone(self, clone: VoiceClone) -> None:
        """A clone's features may come from a store (a hand-made data dir, another model's voice):
        their shapes and values must fit this model, else InvalidRequest, not a failed step."""
        cfg = self.config
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

    def plan(self, request: SynthesisRequest) -> SynthesisRequest:
        """Its text's ids and its frame budget (budget.py): the frames its text's budget allows, at
        most ``max_new_tokens`` - 1 and its stream's positions (an untrained or unlucky talker that
        never samples EOS stops there)."""
        return self.source.plan(request)

    def planned_work(self, request: SynthesisRequest) -> PlannedWork:
        """Its planned budget, in talker steps (one frame each). A live utterance is counted on the
        text it holds now (its budget grows with its text)."""
        if request.text_feed is not None:
            request = replace(request, text_feed=None, budget=None)
        frames = self.plan(request).budget.frames
        return PlannedWork(frames, frames, "talker steps")

    def default_seed(self) -> int:
        return secrets.randbelow(2**63)  # sampled: two unseeded requests differ

    def warmup_fields(self) -> dict:
        """A neutral x-vector (Base); an instruction (VoiceDesign)."""
        if self.kind == "Base":
            return {"clone": VoiceClone(np.zeros(self.voice_encoders.xvector_dim, dtype=np.float32))}
        if self.kind == "VoiceDesign":
            return {"instructions": "A clear, neutral voice."}
        return {}

    def voice_features(self, audio: np.ndarray) -> VoiceFeatures:
        if self.voice_encoders is None:
            return super().voice_features(audio)
        return self.voice_encoders.features(audio)
