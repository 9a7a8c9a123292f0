"""A virtual device: one cost table and one clock, and the talker pipeline's parts built on them.

    device = VirtualDevice.load("benchmarks/costs/h200-0.6b.json")
    bundle = device.talker_bundle(checkpoint_dir)        # prompt side only: config and tokenizer files
    source = device.talker_source(bundle, max_slots=64)  # the talker batch over engines/virtual/talker.py's runner
    vocalizer = device.vocalizer(model_config, max_streams=128)   # engines/virtual/vocoder.py

The engine (engines/core/engine.py) takes what it is built from (``model_parts``), its vocalizer and its
pipeline from here (``build_pipeline``): the talker's adapter (engines/pipelines/talker/adapter.py) over the virtual
source; the service, worker, scheduler and outbox run unchanged (the outbox waits on the
clock's events).
Only the checkpoint's ``config.json``, ``speech_tokenizer/config.json``, tokenizer files and
``generation_config.json`` are read: prompts are tokenized as served, no weight is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from engines.checkpoints.files import read_json
from engines.checkpoints.qwen3_text import PromptConfig, QwenTextTokenizer
from engines.checkpoints.qwen3_tts import TalkerGenerationConfig, read_configs, talker_config
from engines.config import EngineConfig
from engines.contract import SAMPLES_PER_FRAME
from engines.models.configs import ModelConfig
from engines.pipelines.modules import Models
from engines.pipelines.profile import Adapter, Loaded, PipelineSetup
from engines.pipelines.talker import adapter as talker_adapter
from engines.pipelines.talker.batch import UtteranceBatch
from engines.pipelines.talker.prompt import PromptBuilder
from engines.pipelines.talker.reference import TalkerBundle
from engines.pipelines.vocoder import Vocalizer
from engines.virtual.clock import DeviceClock
from engines.virtual.costs import CostTable
from engines.virtual.talker import BLOCK_SIZE, VirtualRunner, virtual_talker_source
from engines.virtual.vocoder import VirtualCodecDecoder

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass
class VirtualDevice:
    PIPELINE = "talker"  # the pipeline it runs (its source stands for the talker's)

    table: CostTable
    clock: DeviceClock = field(default_factory=DeviceClock)
    eos_frames: int | None = None  # frames after which every utterance samples EOS (None: never)
    path: str = ""
    _runner: VirtualRunner | None = None
    _decoder: VirtualCodecDecoder | None = None

    @classmethod
    def load(cls, path: str | Path, eos_frames: int | None = None) -> "VirtualDevice":
        return cls(CostTable.load(path), eos_frames=eos_frames, path=str(path))

    def describe(self) -> str:
        t = self.table
        return f"virtual {t.device} ({self.path}: {t.size} {t.dtype}, measured {t.date} at {t.commit})"

    def model_config(self, checkpoint: str | Path, preset: ModelConfig) -> ModelConfig:
        return read_configs(checkpoint).model_config(preset)

    def talker_bundle(self, checkpoint: str | Path) -> TalkerBundle:
        """The checkpoint's prompt builder and generation defaults, without its models."""
        root = Path(checkpoint)
        config = read_json(root / "config.json")
        prompt = PromptBuilder(PromptConfig.from_config(config, str(root / "config.json")),
                               QwenTextTokenizer.from_dir(root), frame_embeddings=self._frame_embeddings(config))
        return TalkerBundle(talker=None, predictor=None, prompt=prompt,  # type: ignore[arg-type]
                            generation=TalkerGenerationConfig.from_dir(root), path=str(root),
                            device=torch.device("cpu"), dtype=torch.float32)

    @staticmethod
    def _frame_embeddings(config: dict):
        hidden = talker_config(config, "config.json").hidden_size

        def zeros(codes: torch.Tensor) -> torch.Tensor:  # in-context cloning's reference frames: only their count matters
            return torch.zeros(codes.shape[0], hidden)
        return zeros

    def talker_source(self, bundle: TalkerBundle, max_slots: int, max_seq_len: int = 4096,
                      kv_cache_gb: float | None = None, prefix_cache_fraction: float | None = None
                      ) -> UtteranceBatch:
        """The talker batch (the real one's host side) over the virtual runner. ``kv_cache_gb``: a pool of that size at the table's dtype (None: as many
        blocks as every row can use). ``prefix_cache_fraction`` is accepted and ignored: a prefix hit
        only narrows a prefill chunk, which the table prices by call, not by position."""
        cfg = talker_config(read_json(Path(bundle.path) / "config.json"), "config.json")
        kv_blocks = None
        if kv_cache_gb is not None:
            block_bytes = (2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * BLOCK_SIZE
                           * DTYPE_BYTES.get(self.table.dtype, 2))
            kv_blocks = int(kv_cache_gb * 2**30 // block_bytes)
        source = virtual_talker_source(bundle.prompt, bundle.generation, cfg, self.table, self.clock,
                                       max_slots=max_slots, max_seq_len=max_seq_len, kv_blocks=kv_blocks,
                                       eos_frames=self.eos_frames)
        self._runner = source.runner
        return source

    def model_parts(self, config: EngineConfig) -> Loaded:
        """What the engine is built from: the checkpoint's sizes and prompt side, no model."""
        checkpoint = config.model.checkpoint
        if not checkpoint:
            raise ValueError("--virtual-device needs --model: a Qwen3-TTS directory whose config and tokenizer files "
                             "shape the prompts (no weights are read; benchmarks/costs/prompt-0.6b has them)")
        return Loaded(Models.codec_only(self.model_config(checkpoint, config.sizes())), self.talker_bundle(checkpoint))

    def build_pipeline(self, setup: PipelineSetup) -> Adapter:
        """The talker's adapter with this device's source in place of the real one."""
        def make_source(setup: PipelineSetup) -> tuple[UtteranceBatch, tuple]:
            limits = setup.config.limits
            source = self.talker_source(setup.parts, setup.max_slots, kv_cache_gb=limits.kv_cache_gb,
                                        prefix_cache_fraction=limits.prefix_cache_fraction)
            return source, (source.runner.graphs,)  # captured at start as the real step graphs are
        return talker_adapter.build(setup, make_source)

    def vocalizer(self, model_cfg: ModelConfig, max_streams: int) -> Vocalizer:
        """The real vocalizer over the virtual codec decoder (the graphed path, as on the GPU it stands for)."""
        self._decoder = VirtualCodecDecoder(self.table, self.clock, model_cfg.stream, max_streams, SAMPLES_PER_FRAME,
                                            model_cfg.decoder.num_quantizers, model_cfg.decoder.codebook_size)
        return Vocalizer(None, "cpu", graphed_decoder=self._decoder)

    def stats(self) -> dict[str, float]:
        """Captures after start (talker step, codec decoder), device busy seconds, host wait seconds."""
        out = {"busy_s": self.clock.busy_s, "host_waited_s": self.clock.waited_s}
        for name, part in (("talker_step", self._runner), ("codec_decoder", self._decoder)):
            if part is not None:
                out[f"{name}_captures_after_start"] = part.graphs.late_captures
        return out


__all__ = ["VirtualDevice"]
