"""The talker pipeline's adapter: its pipeline (a :class:`TalkerSource` behind
:class:`TalkerPipeline`, graphed as the device and switches say) and its profile (the release's
speakers or none, its task's rules, work in talker steps, a random seed when none is given).

``setup.options``: ``talker`` (the checkpoint's :class:`TalkerBundle`, required) and the source's
``kv_cache_gb`` / ``prefix_cache_fraction``. ``build(setup, make_source)``: another maker of the
talker source (the virtual device's, engines/virtual/) replaces the real one.
"""

from __future__ import annotations

import secrets
from dataclasses import replace
from typing import Callable, Mapping

import numpy as np

from engines.checkpoints.qwen3_voice import VoiceFeatures
from engines.contract import EngineCapabilities, InvalidRequest, PlannedWork, SynthesisRequest, VoiceClone
from engines.models.configs import ModelConfig
from engines.pipelines.profile import Adapter, PipelineSetup, Profile
from engines.pipelines.talker.pipeline import FIRST_CHUNK_FRAMES, TalkerPipeline
from engines.pipelines.talker.reference import TalkerBundle
from engines.pipelines.talker.source import TalkerSource
from engines.pipelines.voice_aliases import OPENAI_VOICE_ALIASES, VENDOR_VOICE_ALIASES, extend_aliases

# The request fields that change the talker's output (EngineCapabilities.honoured_fields); a
# release that follows instructions or clones adds those.
FIELDS = frozenset({"text", "voice", "seed", "language", "greedy", "temperature", "top_k", "top_p",
                    "repetition_penalty", "max_new_tokens", "initial_codec_chunk_frames", "task_type",
                    "non_streaming_mode", "text_feed"})
SOURCE_OPTIONS = ("kv_cache_gb", "prefix_cache_fraction")

SourceMaker = Callable[..., tuple]
"""``(setup, bundle, **source options) -> (talker source, graph wrappers it replays)``."""


def real_source(setup: PipelineSetup, bundle: TalkerBundle, **options) -> tuple[TalkerSource, tuple]:
    """The talker source on the device, with the runtime's graphs the device and switches ask for."""
    device, switches, slots = setup.device, setup.switches, setup.max_slots
    source = TalkerSource.from_bundle(bundle, max_slots=slots, paged_attention=switches.paged_attention, **options)
    source.batched_admission = source.batched_admission and switches.batched_admission
    backend = switches.compile_backend("talker")
    if backend:  # opt-in (compile_talker); compiled by the warm-up, before ready
        source.talker.compile_layers(backend)
    if (device.type == "cuda" and switches.talker_step_graphs) or (device.type == "cpu" and switches.static_step_on_cpu):
        # The whole decode step (predictor included) as one CUDA graph per bucket
        # (engines/runtime/graphed_talker.py): eager, the step is launch bound.
        from engines.runtime.graphed_prefill import GraphedPrefill
        from engines.runtime.graphed_talker import GraphedTalkerStep

        if device.type == "cuda":
            use_fused_kernels(source, switches)
        source.step_runner = GraphedTalkerStep(source.step_spec(), compile_backend=switches.compile_backend("predictor"))
        # and the prompts' first chunks, on the path to every first audio (eager: launch bound)
        if device.type == "cuda" and not switches.prefill_graphs:
            return source, (source.step_runner,)
        source.prefill.runner = GraphedPrefill(source.prefill_spec())
        return source, (source.step_runner, source.prefill.runner)
    if device.type == "cuda":
        # switches.talker_step_graphs off: the talker step eager, the code predictor it runs
        # for every frame graphed (eager on an H100 it is ~100 ms per step).
        from engines.runtime.graphed_predictor import DEFAULT_BUCKETS, GraphedCodePredictor

        source.predictor = GraphedCodePredictor(
            source.predictor, buckets=tuple(b for b in DEFAULT_BUCKETS if b < slots) + (slots,),
            compile_backend=switches.compile_backend("predictor"))
        return source, (source.predictor,)
    return source, ()


def sampling_defaults(bundle: TalkerBundle) -> dict[str, float | int | bool]:
    """The checkpoint's sampling of code 0, in the request fields' names (what /v1/models shows)."""
    gen = bundle.generation
    return {"greedy": not gen.do_sample, "temperature": gen.temperature, "top_k": gen.top_k, "top_p": gen.top_p,
            "repetition_penalty": gen.repetition_penalty}


def use_fused_kernels(source: TalkerSource, switches) -> None:
    """The switches' fused Triton kernels inside the step's graphs (off by default until measured on
    a GPU): the code predictor's frame (one launch per frame, or per dependent step) in place of the
    generic loop, the talker's decode layers (five launches a layer, set after any compiled ones)."""
    if switches.fused_talker:
        from engines.models.fused_talker import FusedDecodeLayers

        source.talker.fused_decode_step = FusedDecodeLayers(source.talker)
    if switches.fused_predictor != "off":
        from engines.models.fused_predictor import FusedCodePredictor

        source.predictor = FusedCodePredictor(source.predictor, mode=switches.fused_predictor)


def build(setup: PipelineSetup, make_source: SourceMaker = real_source) -> Adapter:
    bundle: TalkerBundle = setup.options["talker"]
    source, graphed = make_source(setup, bundle, **{k: setup.options[k] for k in SOURCE_OPTIONS if k in setup.options})
    profile = TalkerProfile(bundle, source, setup.models.config, setup.max_slots, setup.voice_aliases)
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
