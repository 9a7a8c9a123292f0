"""Size configurations of every model component.

Field names of the Qwen3-TTS-compatible parts (code predictor, codec decoder, codec
head) follow the keys of the official ``config.json`` files, so a real checkpoint's
config maps onto them one to one (see ``engines/checkpoints/files.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping


class FromDict:
    """Mixin of the config dataclasses: built from a checkpoint's config.json section by name."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]):
        """Build from a dict, ignoring keys this dataclass does not know."""
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        kwargs = {k: (tuple(v) if isinstance(v, list) else v) for k, v in data.items() if k in names}
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]


@dataclass(frozen=True)
class TextEncoderConfig(FromDict):
    """Byte-level text frontend + bidirectional condition encoder."""

    vocab_size: int = 259  # 256 bytes + pad/bos/eos
    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 384
    max_text_tokens: int = 512
    max_clause_tokens: int = 200  # longer sentences are split at clause boundaries
    num_voices: int = 8
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0


@dataclass(frozen=True)
class DurationConfig(FromDict):
    """Predicts frames per text token from encoder states (scaled by 1/speed)."""

    hidden_size: int = 128
    # Prior: ~ 12.5 frames/s and ~ 14 chars/s of speech => ~0.9 frames per byte.
    base_frames_per_token: float = 0.9
    min_frames: int = 4
    max_frames_per_clause: int = 400


@dataclass(frozen=True)
class DiTConfig(FromDict):
    """Flow-matching DiT over unit-RMS frame latents of width ``latent_dim``."""

    latent_dim: int = 64  # = talker hidden size D
    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 384
    cond_dim: int = 128  # encoder state width
    context_frames: int = 4  # clean tail of the previous chunk fed as context
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0


@dataclass(frozen=True)
class CodecHeadConfig(FromDict):
    """Talker-side parts the vocalizer needs: final norm, codec head, codec embedding.

    ``vocab_size`` is the talker's codec vocabulary (codebook ids + special ids);
    only ids < ``codebook_size`` are ever sampled as code 0.
    """

    hidden_size: int = 64  # talker hidden = latent width D
    vocab_size: int = 96
    codebook_size: int = 64
    rms_norm_eps: float = 1e-6
    codec_pad_id: int = 80
    codec_bos_id: int = 81
    codec_eos_token_id: int = 82


@dataclass(frozen=True)
class Qwen3LayerConfig(FromDict):
    """The Qwen3 decoder-layer keys (``layers.DecoderLayer``) of the talker and its code predictor."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0


@dataclass(frozen=True)
class CodePredictorConfig(Qwen3LayerConfig):
    """Qwen3-TTS talker code predictor (keys of ``talker_config.code_predictor_config``)."""

    vocab_size: int = 64  # codebook size
    num_code_groups: int = 4  # G: code 0 from the codec head + G-1 predicted here
    talker_hidden_size: int = 64  # input width; != hidden_size => small_to_mtp_projection


@dataclass(frozen=True)
class CodecDecoderConfig(FromDict):
    """Qwen3-TTS 12 Hz speech-tokenizer decoder (keys of ``decoder_config``)."""

    codebook_size: int = 64
    codebook_dim: int = 32
    hidden_size: int = 32
    latent_dim: int = 64
    max_position_embeddings: int = 8000
    rope_theta: float = 10_000.0
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    head_dim: int = 8
    attention_bias: bool = False
    sliding_window: int = 8
    intermediate_size: int = 64
    layer_scale_initial_scale: float = 0.01
    rms_norm_eps: float = 1e-5
    num_hidden_layers: int = 2
    num_quantizers: int = 4
    num_semantic_quantizers: int = 1
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)
    upsampling_ratios: tuple[int, ...] = (2, 2)
    decoder_dim: int = 64


@dataclass(frozen=True)
class StreamConfig(FromDict):
    """Tick-loop knobs (see engines/pipelines/dit/denoiser.py)."""

    max_slots: int = 16  # slots in flight; batch ceiling is 2 * max_slots rows under fused CFG
    batch_ceiling: int = 32  # max rows of one DiT forward
    # First chunk: its audio must outlast the next chunk's generation (every chunk takes
    # `steps` ticks whatever its length, and chunk k+1 waits for chunk k's tail), so it
    # trades a little time to first audio for underrun headroom under load.
    first_chunk_frames: int = 4
    chunk_frames: int = 25  # ~2 s chunks afterwards
    default_steps: int = 8
    schedule_shift: float = 3.0
    guidance: str = "cfg"  # none | cfg | apg
    guidance_timing: str = "full"  # full | initialize
    memo_size: int = 8


@dataclass(frozen=True)
class ModelConfig(FromDict):
    """Everything one preset (or checkpoint) needs to build the models."""

    name: str = "tiny"
    text: TextEncoderConfig = field(default_factory=TextEncoderConfig)
    duration: DurationConfig = field(default_factory=DurationConfig)
    dit: DiTConfig = field(default_factory=DiTConfig)
    codec_head: CodecHeadConfig = field(default_factory=CodecHeadConfig)
    code_predictor: CodePredictorConfig = field(default_factory=CodePredictorConfig)
    decoder: CodecDecoderConfig = field(default_factory=CodecDecoderConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)

    @property
    def latent_dim(self) -> int:
        return self.dit.latent_dim

    @property
    def num_code_groups(self) -> int:
        return self.code_predictor.num_code_groups
