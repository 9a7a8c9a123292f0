"""The DiT pipeline's adapter: what it loads (its modules: weights file, Qwen3-TTS codec side, or
random weights of the preset), its pipeline (planner, denoiser, frame coder) and its profile (a
preset voice table, no task types, work in frame-steps, seed 0 when none is given)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Mapping

from engines.config import EngineConfig, RuntimeSwitches
from engines.contract import EngineCapabilities, InvalidRequest, PlannedWork, SynthesisRequest
from engines.models.code_predictor import CodePredictor
from engines.models.configs import ModelConfig
from engines.models.dit import FlowDiT
from engines.models.text import ByteTokenizer
from engines.pipelines.dit.codes import FrameCoder
from engines.pipelines.dit.denoiser import Denoiser
from engines.pipelines.dit.pipeline import DiTPipeline
from engines.pipelines.dit.planner import UtterancePlanner
from engines.pipelines.dit.weights import load_models
from engines.pipelines.profile import Adapter, Loaded, PipelineSetup, Profile
from engines.pipelines.voice_aliases import OPENAI_VOICE_ALIASES, VENDOR_VOICE_ALIASES, extend_aliases

VOICE_NAMES = ("default", "aria", "blaze", "cedar", "dune", "ember", "fjord", "gale")

# The request fields that change the DiT's output (EngineCapabilities.honoured_fields).
FIELDS = frozenset({"text", "voice", "seed", "steps", "guidance_scale", "speed", "greedy", "temperature", "top_k",
                    "top_p"})


def load(config: EngineConfig) -> Loaded:
    """The DiT's modules: from the checkpoint (engines/pipelines/dit/weights.py ``load_models``),
    random weights of the preset where none is named."""
    checkpoint = config.model.checkpoint
    return Loaded(load_models(Path(checkpoint) if checkpoint else None, config.sizes(), config.model.seed))


def build(setup: PipelineSetup) -> Adapter:
    models, device, dtype, switches = setup.models, setup.device, setup.dtype, setup.config.runtime.switches
    cfg = models.config
    if setup.max_slots != cfg.stream.max_slots:
        raise ValueError(f"the DiT runs its config's {cfg.stream.max_slots} slots (the config's max_slots sets "
                         f"them), not {setup.max_slots}")
    planner = UtterancePlanner(ByteTokenizer(), models.encoder, models.duration, cfg, device, dtype)
    dit = models.dit
    if device.type == "cuda" and isinstance(dit, FlowDiT):  # (exported backends run their own engines)
        from engines.runtime.graphed_dit import GraphedDiT

        # One CUDA graph per (rows, encoder-length) bucket, frames padded to the preset's
        # longest context + chunk, rows up to the batch ceiling; captured in start().
        dit = GraphedDiT.for_config(dit, cfg, compile_backend=switches.compile_backend("dit"))
    coder = FrameCoder(models.codec_head, models.code_predictor, device, dtype,
                       predictor_graphs=predictor_graphs(device, switches))
    graphed = [] if dit is models.dit else [dit]  # a GraphedDiT (CUDA)
    if device.type == "cuda":
        graphed.append(coder.predictor)  # the GraphedCodePredictor, captured in start()
    profile = DiTProfile(cfg, planner.tokenizer, models.random_components, setup.config.model.voice_aliases)
    pipeline = DiTPipeline(planner, Denoiser(dit, cfg.stream, device, dtype), cfg.dit.context_frames, coder,
                           profile.voices, graphed=tuple(graphed))
    return Adapter(pipeline, profile)


def predictor_graphs(device, switches: RuntimeSwitches) -> Callable[[CodePredictor], Any] | None:
    """What runs the frame coder's code predictor: on CUDA one graph per batch bucket
    (engines/runtime/graphed_predictor.py); elsewhere eager (None)."""
    if device.type != "cuda":
        return None
    from engines.runtime.graphed_predictor import GraphedCodePredictor

    backend = switches.compile_backend("predictor")
    return lambda predictor: GraphedCodePredictor(predictor, compile_backend=backend)


class DiTProfile(Profile):
    """The DiT's policy: a voice table of the preset's size (OpenAI and vendor names as aliases),
    any language, no task types, cloning or instructions; work counted in denoised frame-steps."""

    kind = "a DiT model"

    def __init__(self, config: ModelConfig, tokenizer: ByteTokenizer, random_components: tuple[str, ...],
                 voice_aliases: Mapping[str, str | None]):
        self.config = config
        self.tokenizer = tokenizer
        n = config.text.num_voices
        voices = VOICE_NAMES[:n] if n <= len(VOICE_NAMES) else (
            VOICE_NAMES + tuple(f"voice{i}" for i in range(len(VOICE_NAMES), n)))
        aliases = extend_aliases({k: v for k, v in OPENAI_VOICE_ALIASES.items() if v in voices}, voices,
                                 {**VENDOR_VOICE_ALIASES, **voice_aliases})
        self.capabilities = EngineCapabilities(
            pipeline="dit", task_type=None, voices=voices, voice_aliases=aliases, preset_voices=True, languages=None,
            honoured_fields=FIELDS, max_slots=config.stream.max_slots, random_components=random_components,
            title="DiT", named_by_preset=True)

    def validate(self, request: SynthesisRequest, complete: bool) -> None:
        for name, value in (("task_type", request.task_type), ("ref_audio", request.clone),
                            ("instructions", request.instructions)):
            if value:
                raise InvalidRequest(name, "the DiT pipeline has no task types, voice cloning or instructions; "
                                           "serve a Qwen3-TTS checkpoint (--source talker)")

    def planned_work(self, request: SynthesisRequest) -> PlannedWork:
        """Its UTF-8 bytes x the duration prior / ``speed`` frames (the planner's own count is
        within about 0.7-1.4x of it), each denoised ``steps`` times."""
        tokens = len(self.tokenizer.encode(request.text)) - 2  # without bos / eos
        frames = math.ceil(tokens * self.config.duration.base_frames_per_token / request.speed)
        return PlannedWork(frames, frames * request.steps, "DiT frame-steps")
