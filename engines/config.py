"""The engine's configuration: one :class:`EngineConfig` of sub-configs, and named model sizes.

``EngineConfig`` is what the service's settings build (service/settings.py ``engine_config``) and
``engines.build.build_engine`` takes: which model (:class:`ModelSpec`), where and in what precision
it runs (:class:`RuntimeConfig`, with the :class:`RuntimeSwitches`), how the scheduler batches
(:class:`SchedulerConfig`), what the engine may hold (:class:`LimitsConfig`) and, for scheduling
work on a CPU, a virtual device (:class:`VirtualDeviceConfig`). ``None`` / ``"auto"`` fields are
decided by ``engines.build.resolve_config`` (by device and pipeline) before anything is built.

Named model sizes:

* ``tiny``  - tests: two seconds of audio in well under a second on a CPU.
* ``small`` - the CPU default: shrunken sizes, real-time while serving on 2 cores.
* ``base``  - the GPU default: code predictor and codec decoder at the released
  Qwen3-TTS 0.6B sizes, DiT about 16 layers x 1024.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Mapping

from engines.models.configs import (
    CodecDecoderConfig,
    CodecHeadConfig,
    CodePredictorConfig,
    DiTConfig,
    DurationConfig,
    ModelConfig,
    StreamConfig,
    TextEncoderConfig,
)

if TYPE_CHECKING:  # (the settings import this module: no torch at run time)
    from engines.hardware.cpu_features import ThreadPlan

PRESET_NAMES = ("tiny", "small", "base")


@dataclass(frozen=True)
class RuntimeSwitches:
    """How the engine runs on the device (never what it computes on the CPU). The engine reads no
    environment: the service builds these from it (service/settings.py ``runtime_switches``)."""

    compile: bool = True
    """torch.compile under the CUDA graphs at all (off: rule compilation out while debugging)."""
    compile_dit: bool = False
    """The DiT's blocks compiled: off until measured on a GPU."""
    compile_talker: bool = False
    """The talker's layers (prefill and decode step) compiled: off until measured on a GPU."""
    talker_step_graphs: bool = True
    """CUDA: the whole talker decode step as one graph per bucket (off: the step eager, its code
    predictor graphed)."""
    prefill_graphs: bool = True
    """CUDA, with the step graphs: the prompts' first prefill chunks through CUDA graphs per
    (prompts, width) bucket (off: every prefill eager)."""
    paged_attention: bool = True
    """CUDA: the talker's decode attention reads the paged KV pool in place (a Triton kernel,
    engines/models/paged_attention.py; one step graph serves every length) (off: each row's blocks
    gathered into a contiguous view, one graph per KV-block bucket)."""
    batched_admission: bool = True
    """CUDA: the rows admitted since the last tick start in one pass (off: one by one, as on CPU)."""
    fused_predictor: str = "off"
    """CUDA, with the step graphs: the code predictor's frame as fused Triton kernels
    (engines/models/fused_predictor.py) inside the step's graph, ``persistent`` (one launch per
    frame) or ``phased`` (one launch per dependent step); ``off``: the graphed generic loop. Off
    until measured on a GPU."""
    fused_talker: bool = False
    """CUDA, with the step graphs: the talker's decode layers as fused Triton kernels, five launches
    a layer (engines/models/fused_talker.py). Off until measured on a GPU."""
    static_step_on_cpu: bool = False
    """CPU: run the talker decode step through the static buckets CUDA graphs replay (eagerly), so
    tests see which buckets serving reaches and which a GPU would have captured after start."""
    stage_sync: bool = False
    """CUDA: synchronise the device at the end of each worker stage, so asynchronous GPU work is
    charged to the stage that issued it (profiling; slows the loop)."""
    vocoder_thread: bool = True
    """CPU (two threads or more): the codec decoder on a thread and cores of its own, decoding
    one piece while the talker's next tick runs (off: one after the other on the worker thread)."""
    codec_process: bool = True
    """CPU, with ``vocoder_thread``: that thread hands each piece to the decoder in a process of
    its own (engines/pipelines/vocoder_process.py), off the talker's GIL (off: it decodes in-process)."""

    def __post_init__(self) -> None:
        if self.fused_predictor not in ("off", "phased", "persistent"):
            raise ValueError(f"fused_predictor must be off, phased or persistent, got {self.fused_predictor!r}")

    def compile_backend(self, part: str) -> str | None:
        """torch.compile backend for the modules under the CUDA graphs of ``part`` (``predictor``:
        measured on an H100, 11.4 -> 5.2 ms per frame at batch 1, on by default; ``dit`` and
        ``talker``: opt-in), or None."""
        if not self.compile or (part == "dit" and not self.compile_dit) or (part == "talker" and not self.compile_talker):
            return None
        return "inductor"


@dataclass(frozen=True)
class ModelSpec:
    """Which model the engine serves."""

    checkpoint: str | None = None
    """A Qwen3-TTS directory, a streamvox weights file or a Hugging Face id ``ORG/NAME[@REVISION]``
    (fetched into its cache first: engines/checkpoints/hub.py); None: random weights of the preset."""
    preset: str | None = None
    """Named sizes (tiny | small | base: the DiT's, and every pipeline's stream chunking); None: small
    on CPU, base on CUDA."""
    pipeline: str | None = None
    """A pipeline of engines/pipelines/registry.py (``--source``); None: the checkpoint decides."""
    seed: int = 0
    """The seed random weights are drawn from."""
    aligner: str | None = None
    """A Qwen3-ForcedAligner (a directory or a Hugging Face id) for word timestamps; None: none."""
    voice_aliases: Mapping[str, str | None] = field(default_factory=dict)
    """Voice names added to (None: dropped from) the vendor aliases (engines/pipelines/voice_aliases.py)."""


@dataclass(frozen=True)
class RuntimeConfig:
    """Where the engine runs and in what precision."""

    device: str = "auto"
    """``auto`` (CUDA when torch sees one), ``cpu``, ``cuda`` or ``cuda:N``."""
    dtype: str = "auto"
    """Weights and activations: ``auto`` (bfloat16 on CUDA, float32 on CPU), ``float32`` or ``bfloat16``."""
    codec_precision: str | None = None
    """The codec decoder's: None (the engine's dtype), ``auto`` (bfloat16 on a CPU with native bf16),
    ``float32`` or ``bfloat16`` (the torch backend only; engines/build.py ``resolve_codec_dtype``)."""
    quantize: str | None = None
    """The talker's and code predictor's weights: None / ``none`` (fp32), ``int8``, ``int4``,
    ``int8-int4p`` or ``auto`` (the CPU default of docs/QUANTIZATION.md); engines/models/quantize.py."""
    backend: str = "torch"
    """The DiT's and codec decoder's runtime: torch, onnxruntime or tensorrt."""
    artifacts_dir: str | None = None
    """ONNX files / TensorRT engines for ``backend`` (``streamvox export`` / ``build-engines``)."""
    switches: RuntimeSwitches = RuntimeSwitches()
    """Compilation, graphs, fused kernels (the service reads them from the environment)."""
    threads: ThreadPlan | None = None
    """CPU: the talker's and the codec decoder's torch threads (decided by a probe of the memory
    bandwidth, engines/build.py ``cpu_threads``); None: torch's threads split in two halves."""


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler batches the work."""

    max_slots: int | None = None
    """Requests batched together at most; None: the pipeline's default (engines/pipelines/registry.py)."""
    prefill_token_budget: int | None = None
    """Prompt positions prefilled per step beside decoding; None: by device (engines/core/scheduler.py)."""
    batch_planning: bool | None = None
    """Requests that arrive together prepared at once; None: on CUDA."""


@dataclass(frozen=True)
class LimitsConfig:
    """What the engine may hold."""

    max_queue: int = 64
    """Requests waiting for admission; more are refused (EngineOverloaded)."""
    kv_cache_gb: float | None = None
    """The talker's KV pool in GiB; None: 1 on CPU, 40 % of free device memory on CUDA."""
    prefix_cache_fraction: float | None = None
    """Share of the KV pool that shared prompt prefixes may keep; None: the pipeline's default, 0: off."""


@dataclass(frozen=True)
class VirtualDeviceConfig:
    """A GPU's cost table the device work waits out on a CPU (engines/virtual/, docs/VIRTUAL_DEVICE.md)."""

    table: str
    """The cost table (benchmarks/costs/*.json)."""
    eos_frames: int | None = None
    """Every utterance samples EOS after this many frames; None: each runs to its frame budget."""


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from (see the module docstring)."""

    model: ModelSpec = ModelSpec()
    runtime: RuntimeConfig = RuntimeConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    limits: LimitsConfig = LimitsConfig()
    virtual: VirtualDeviceConfig | None = None
    warmup: bool = True
    """Requests through the whole pipeline before the engine reports ready."""

    def updated(self, **values: Any) -> "EngineConfig":
        """A copy with ``values`` set where they live: each name is a field of exactly one sub-config
        (``checkpoint=``, ``device=``, ``max_slots=``, ...) or of this class (``warmup=``, ``virtual=``)."""
        parts: dict[str, dict[str, Any]] = {}
        for name, value in values.items():
            owner = _FIELD_OWNER.get(name)
            if owner is None:
                raise TypeError(f"EngineConfig has no field {name!r}")
            parts.setdefault(owner, {})[name] = value
        top = parts.pop("", {})
        return replace(self, **top, **{owner: replace(getattr(self, owner), **changed)
                                       for owner, changed in parts.items()})

    def sizes(self) -> ModelConfig:
        """The preset's model sizes (a resolved config: ``model.preset`` named), its stream's slots
        ``scheduler.max_slots`` when given, the batch ceiling twice that (room for CFG)."""
        config = get_preset(self.model.preset or "")
        slots = self.scheduler.max_slots
        if slots is None:
            return config
        if slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {slots}")
        return replace(config, stream=replace(config.stream, max_slots=slots, batch_ceiling=2 * slots))

    @classmethod
    def for_tests(cls, **values: Any) -> "EngineConfig":
        """The tiny preset on the CPU, with ``values`` set (:meth:`updated`)."""
        return cls(model=ModelSpec(preset="tiny"), runtime=RuntimeConfig(device="cpu")).updated(**values)


# field name -> the sub-config that holds it ("": EngineConfig itself); names are unique across them
_FIELD_OWNER = {f.name: "" for f in fields(EngineConfig) if f.name in ("warmup", "virtual")}
_FIELD_OWNER.update({f.name: part for part, kind in (("model", ModelSpec), ("runtime", RuntimeConfig),
                                                     ("scheduler", SchedulerConfig), ("limits", LimitsConfig))
                     for f in fields(kind)})


def _tiny() -> ModelConfig:
    d = 64
    return ModelConfig(
        name="tiny",
        text=TextEncoderConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128),
        duration=DurationConfig(hidden_size=64),
        dit=DiTConfig(latent_dim=d, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=128, cond_dim=64, context_frames=4),
        codec_head=CodecHeadConfig(hidden_size=d, vocab_size=96, codebook_size=64,
                                   codec_pad_id=80, codec_bos_id=81, codec_eos_token_id=82),
        code_predictor=CodePredictorConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                           head_dim=8, num_code_groups=4, talker_hidden_size=d),
        decoder=CodecDecoderConfig(codebook_size=64, codebook_dim=32, hidden_size=32, latent_dim=32,
                                   num_attention_heads=4, num_key_value_heads=4, head_dim=8, sliding_window=8,
                                   intermediate_size=64, num_hidden_layers=2, num_quantizers=4, decoder_dim=32),
        stream=StreamConfig(max_slots=16, batch_ceiling=32, first_chunk_frames=4, chunk_frames=12),
    )


def _small() -> ModelConfig:
    d = 256
    return ModelConfig(
        name="small",
        text=TextEncoderConfig(hidden_size=192, num_hidden_layers=3, num_attention_heads=6, intermediate_size=512),
        duration=DurationConfig(hidden_size=192),
        dit=DiTConfig(latent_dim=d, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                      intermediate_size=768, cond_dim=192, context_frames=6),
        codec_head=CodecHeadConfig(hidden_size=d, vocab_size=1056, codebook_size=1024,
                                   codec_pad_id=1036, codec_bos_id=1037, codec_eos_token_id=1038),
        code_predictor=CodePredictorConfig(vocab_size=1024, hidden_size=256, intermediate_size=512,
                                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                           head_dim=64, num_code_groups=8, talker_hidden_size=d),
        decoder=CodecDecoderConfig(codebook_size=1024, codebook_dim=128, hidden_size=128, latent_dim=256,
                                   num_attention_heads=4, num_key_value_heads=4, head_dim=32, sliding_window=72,
                                   intermediate_size=256, num_hidden_layers=2, num_quantizers=8, decoder_dim=128),
        stream=StreamConfig(max_slots=16, batch_ceiling=32, first_chunk_frames=12, chunk_frames=25),
    )


def _base() -> ModelConfig:
    d = 1024  # Qwen3-TTS 0.6B talker hidden
    return ModelConfig(
        name="base",
        text=TextEncoderConfig(hidden_size=768, num_hidden_layers=6, num_attention_heads=12, intermediate_size=2304),
        duration=DurationConfig(hidden_size=768),
        dit=DiTConfig(latent_dim=d, hidden_size=1024, num_hidden_layers=16, num_attention_heads=16,
                      intermediate_size=3072, cond_dim=768, context_frames=8),
        codec_head=CodecHeadConfig(hidden_size=d, vocab_size=3072, codebook_size=2048,
                                   codec_pad_id=2148, codec_bos_id=2149, codec_eos_token_id=2150),
        code_predictor=CodePredictorConfig(vocab_size=2048, hidden_size=1024, intermediate_size=3072,
                                           num_hidden_layers=5, num_attention_heads=16, num_key_value_heads=8,
                                           head_dim=128, num_code_groups=16, talker_hidden_size=d),
        decoder=CodecDecoderConfig(codebook_size=2048, codebook_dim=512, hidden_size=512, latent_dim=1024,
                                   num_attention_heads=16, num_key_value_heads=16, head_dim=64, sliding_window=72,
                                   intermediate_size=1024, num_hidden_layers=8, num_quantizers=16, decoder_dim=1536),
        stream=StreamConfig(max_slots=64, batch_ceiling=128, first_chunk_frames=12, chunk_frames=25),
    )


_BUILDERS = {"tiny": _tiny, "small": _small, "base": _base}


def get_preset(name: str) -> ModelConfig:
    """The :class:`ModelConfig` of a named preset; ValueError lists the valid names."""
    try:
        return _BUILDERS[name]()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESET_NAMES)}") from None
