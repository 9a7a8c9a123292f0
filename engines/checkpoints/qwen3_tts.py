"""Reading a Qwen3-TTS checkpoint directory: every part, one loader.

    from engines.checkpoints.qwen3_tts import load_checkpoint, load_talker
    parts = load_checkpoint("/models/Qwen3-TTS-12Hz-0.6B-Base", device="cuda", dtype=torch.bfloat16)
    codes = parts.codes(inputs_embeds)       # [B, 2, H_talker] -> [B, G-1] (codes 1..G-1 of a frame)
    logits = parts.codec_logits(hidden)      # [B, H_talker]    -> [B, V_talker]
    wav = parts.decode(codes_bgt)            # [B, G, T]        -> [B, T * 1920] at 24 kHz
    talker = load_talker(path, device, dtype, predictor=parts.predictor)   # -> Qwen3TTSTalker

The directory is the Hugging Face layout of the released models (REFERENCES.md):
``config.json`` + ``model.safetensors`` (``talker.*``, maybe ``speaker_encoder.*``),
``generation_config.json``, the text tokenizer files (engines/checkpoints/qwen3_text.py) and
``speech_tokenizer/config.json`` + ``speech_tokenizer/model.safetensors``
(``encoder.*``, ``decoder.*``). :func:`load_checkpoint` loads three things and checks them strictly:

* ``talker.code_predictor.*``                      -> ``parts.predictor`` (CodePredictor)
* ``talker.model.norm.weight``, ``talker.codec_head.weight``,
  ``talker.model.codec_embedding.weight``          -> ``parts.head`` (CodecHead)
* ``decoder.*`` of the speech tokenizer             -> ``parts.decoder`` (CodecDecoder)

:func:`load_talker` loads the talker (strict inside ``talker.`` minus the code predictor),
the text tokenizer, the prompt ids and the generation config; it shares a given code
predictor. The speaker encoder and the tokenizer's encoder are left on disk. Sizes come
from the config files; see docs/CHECKPOINTS.md. Nothing here runs generation: the talker
loop is engines/pipelines/talker/reference.py.

(~410 lines: one loader for every part of the directory is the point of this module; the
text side already lives in qwen3_text.py.)
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from engines.checkpoints.files import (
    CheckpointError,
    SafetensorsFiles,
    load_into,
    read_json,
    require,
)
from engines.checkpoints.qwen3_text import PromptConfig, QwenTextTokenizer
from engines.contract import SAMPLES_PER_FRAME
from engines.hardware.devices import canonical_device
from engines.models.code_predictor import CodePredictor
from engines.models.codec_decoder import CodecDecoder, DecoderState
from engines.models.codec_head import CodecHead
from engines.models.configs import (
    CodecDecoderConfig,
    CodecHeadConfig,
    CodePredictorConfig,
    ModelConfig,
)
from engines.models.sampling import FrameSampling
from engines.models.talker import Talker, TalkerConfig

log = logging.getLogger(__name__)

PREDICTOR_PREFIX = "talker.code_predictor."
HEAD_PREFIX = TALKER_PREFIX = "talker."
HEAD_MODULES = ("talker.codec_head.", "talker.model.norm.", "talker.model.codec_embedding.")
DECODER_PREFIX = "decoder."

__all__ = ["CheckpointError", "HARD_DEFAULTS", "Qwen3TTSCheckpointConfig", "Qwen3TTSParts", "Qwen3TTSTalker",
           "TalkerGenerationConfig", "has_talker_weights", "load_checkpoint", "load_talker", "read_configs",
           "talker_config"]


@dataclass(frozen=True)
class Qwen3TTSCheckpointConfig:
    """Sizes of the loaded parts, read from the directory's config files."""

    path: str
    num_code_groups: int  # G: code 0 from the codec head + G-1 from the predictor
    codebook_size: int  # entries per codebook (2048 in the releases)
    talker_hidden_size: int  # latent width D of a frame (1024 / 2048)
    codec_head: CodecHeadConfig
    code_predictor: CodePredictorConfig
    decoder: CodecDecoderConfig
    weight_dtypes: tuple[str, ...] = ()  # dtypes the loaded tensors were stored in

    def model_config(self, preset: ModelConfig) -> ModelConfig:
        """``preset`` with every codec-side size from the checkpoint; the DiT's latent width
        becomes the talker hidden size D; DiT / text / duration sizes stay the preset's."""
        return dataclasses.replace(
            preset, codec_head=self.codec_head, code_predictor=self.code_predictor, decoder=self.decoder,
            dit=dataclasses.replace(preset.dit, latent_dim=self.talker_hidden_size))


# --------------------------------------------------------------------------- configs


def _positive_ints(section: Mapping[str, Any], keys: tuple[str, ...], where: str) -> None:
    for key in keys:
        if require(section, key, int, where) <= 0:
            raise CheckpointError(f"{where}: {key!r} must be > 0, got {section[key]}")


def _predictor_config(talker: Mapping[str, Any], where: str) -> CodePredictorConfig:
    cp = require(talker, "code_predictor_config", dict, where)
    where = f"{where} [talker_config.code_predictor_config]"
    _positive_ints(cp, ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                        "num_attention_heads", "num_key_value_heads", "num_code_groups"), where)
    head_dim = cp.get("head_dim") or cp["hidden_size"] // cp["num_attention_heads"]
    if cp["num_attention_heads"] % cp["num_key_value_heads"]:
        raise CheckpointError(f"{where}: num_attention_heads {cp['num_attention_heads']} is not a multiple of "
                              f"num_key_value_heads {cp['num_key_value_heads']}")
    # What our port implements: SwiGLU, plain 1-D RoPE, full causal attention.
    if cp.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act {cp['hidden_act']!r} is not supported (only 'silu')")
    if cp.get("rope_scaling") not in (None, {}):
        raise CheckpointError(f"{where}: rope_scaling {cp['rope_scaling']!r} is not supported (plain RoPE only)")
    if cp.get("use_sliding_window"):
        raise CheckpointError(f"{where}: use_sliding_window is not supported by the code predictor")
    return CodePredictorConfig.from_dict({
        **cp, "head_dim": head_dim, "talker_hidden_size": talker["hidden_size"],
        "rms_norm_eps": float(cp.get("rms_norm_eps", 1e-6)), "rope_theta": float(cp.get("rope_theta", 10_000.0)),
    })


def _head_config(talker: Mapping[str, Any], codebook_size: int, where: str) -> CodecHeadConfig:
    ids = {k: require(talker, k, int, where) for k in ("codec_pad_id", "codec_bos_id", "codec_eos_token_id")}
    if codebook_size > talker["vocab_size"]:
        raise CheckpointError(f"{where}: codebook size {codebook_size} exceeds the talker's codec vocab_size "
                              f"{talker['vocab_size']}")
    return CodecHeadConfig(hidden_size=talker["hidden_size"], vocab_size=talker["vocab_size"],
                           codebook_size=codebook_size, rms_norm_eps=float(talker.get("rms_norm_eps", 1e-6)), **ids)


def _decoder_config(tokenizer_config: Mapping[str, Any], where: str) -> CodecDecoderConfig:
    dec = require(tokenizer_config, "decoder_config", dict, where)
    where = f"{where} [decoder_config]"
    _positive_ints(dec, ("codebook_size", "codebook_dim", "hidden_size", "latent_dim", "num_attention_heads",
                         "num_key_value_heads", "sliding_window", "intermediate_size", "num_hidden_layers",
                         "num_quantizers", "decoder_dim"), where)
    head_dim = dec.get("head_dim") or dec["hidden_size"] // dec["num_attention_heads"]
    if dec.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act {dec['hidden_act']!r} is not supported (only 'silu')")
    rates = tuple(require(dec, "upsample_rates", list, where)) + tuple(require(dec, "upsampling_ratios", list, where))
    if math.prod(rates) != SAMPLES_PER_FRAME:
        raise CheckpointError(f"{where}: upsample_rates x upsampling_ratios = {math.prod(rates)} samples per "
                              f"frame; streamvox needs {SAMPLES_PER_FRAME} (24 kHz at 12.5 frames/s)")
    return CodecDecoderConfig.from_dict({**dec, "head_dim": head_dim})


def talker_config(config: Mapping[str, Any], where: str) -> TalkerConfig:
    """The talker's sizes from ``config.json`` (``talker_config``), checked against what our port runs."""
    talker = require(config, "talker_config", dict, where)
    tw = f"{where} [talker_config]"
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "text_vocab_size", "text_hidden_size", "num_code_groups",
                "codec_eos_token_id"):
        require(talker, key, int, tw)
    if talker.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{tw}: hidden_act {talker['hidden_act']!r} is not supported (only 'silu')")
    if talker.get("attention_bias"):
        raise CheckpointError(f"{tw}: attention_bias is not supported")
    if talker.get("use_sliding_window"):
        raise CheckpointError(f"{tw}: use_sliding_window is not supported by the talker")
    rope = talker.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise CheckpointError(f"{tw}: rope_type {rope.get('rope_type')!r} is not supported (default M-RoPE only)")
    try:
        return TalkerConfig.from_dict(talker)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{tw}: {exc}") from None


def read_configs(path: str | Path) -> Qwen3TTSCheckpointConfig:
    """Parse and cross-check ``config.json`` and ``speech_tokenizer/config.json``."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a directory")
    main_file = root / "config.json"
    main = read_json(main_file)
    where = str(main_file)
    talker = require(main, "talker_config", dict, where)
    twhere = f"{where} [talker_config]"
    _positive_ints(talker, ("hidden_size", "vocab_size", "num_code_groups"), twhere)
    predictor = _predictor_config(talker, twhere)

    st_file = root / "speech_tokenizer" / "config.json"
    decoder = _decoder_config(read_json(st_file), str(st_file))

    g = talker["num_code_groups"]
    if predictor.num_code_groups != g:
        raise CheckpointError(f"{twhere}: num_code_groups {g} != code_predictor_config.num_code_groups "
                              f"{predictor.num_code_groups}")
    if decoder.num_quantizers != g:
        raise CheckpointError(f"{st_file}: decoder_config.num_quantizers {decoder.num_quantizers} != "
                              f"num_code_groups {g} in {main_file}")
    if decoder.codebook_size != predictor.vocab_size:
        raise CheckpointError(f"{st_file}: decoder_config.codebook_size {decoder.codebook_size} != code predictor "
                              f"vocab_size {predictor.vocab_size} in {main_file}")
    head = _head_config(talker, predictor.vocab_size, twhere)
    return Qwen3TTSCheckpointConfig(
        path=str(root), num_code_groups=g, codebook_size=predictor.vocab_size,
        talker_hidden_size=talker["hidden_size"],
        codec_head=head, code_predictor=predictor, decoder=decoder)


# --------------------------------------------------------------------------- parts


class Qwen3TTSParts:
    """The loaded modules plus the calls the tests, benchmarks and engine use."""

    def __init__(self, config: Qwen3TTSCheckpointConfig, head: CodecHead, predictor: CodePredictor,
                 decoder: CodecDecoder, device: torch.device, dtype: torch.dtype):
        self.config = config
        self.head = head.eval()
        self.predictor = predictor.eval()
        self.decoder = decoder.eval()
        self.device = device
        self.dtype = dtype

    def model_config(self, preset: ModelConfig) -> ModelConfig:
        """``preset`` with the checkpoint's codec-side sizes (:meth:`Qwen3TTSCheckpointConfig.model_config`)."""
        return self.config.model_config(preset)

    def _check_embeds(self, inputs_embeds: torch.Tensor) -> None:
        d = self.config.talker_hidden_size
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[1:] != (2, d):
            raise ValueError(f"inputs_embeds must be [B, 2, {d}], got {tuple(inputs_embeds.shape)}")

    @torch.no_grad()
    def codes(self, inputs_embeds: torch.Tensor, greedy: bool = True, seed: int = 0) -> torch.Tensor:
        """Code predictor for one frame: [B, 2, H_talker] (talker hidden after its final norm,
        codec embedding of code 0) -> LongTensor [B, G-1], codes 1..G-1."""
        return self.codes_and_logits(inputs_embeds, greedy, seed)[0]

    @torch.no_grad()
    def codes_and_logits(self, inputs_embeds: torch.Tensor, greedy: bool = True,
                         seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`codes`, plus the raw logits of every step [B, G-1, V] (float32)."""
        self._check_embeds(inputs_embeds)
        x = inputs_embeds.to(device=self.device, dtype=self.dtype)
        sampling = FrameSampling.for_stream(x.shape[0], seed, 0, self.device, greedy=greedy)
        return self.predictor.predict(x[:, 0], x[:, 1], sampling, return_logits=True)

    @torch.no_grad()
    def codec_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The talker's codec head: hidden [B, H_talker] (after the final norm) -> [B, V_talker]."""
        d = self.config.talker_hidden_size
        if hidden.dim() != 2 or hidden.shape[1] != d:
            raise ValueError(f"hidden must be [B, {d}], got {tuple(hidden.shape)}")
        return self.head.logits_from_hidden(hidden.to(device=self.device, dtype=self.dtype))

    def _check_codes(self, codes: torch.Tensor) -> torch.Tensor:
        g, cb = self.config.num_code_groups, self.config.codebook_size
        if codes.dim() != 3 or codes.shape[1] != g:
            raise ValueError(f"codes must be [B, {g}, T], got {tuple(codes.shape)}")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= cb):
            raise ValueError(f"codes must lie in [0, {cb}), got [{int(codes.min())}, {int(codes.max())}]")
        return codes.to(device=self.device, dtype=torch.long)

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Full decode: codes [B, G, T] -> PCM [B, T * 1920] in [-1, 1] at 24 kHz
        (float32; float64 when loaded in float64)."""
        return _pcm(self.decoder(self._check_codes(codes)))

    @torch.no_grad()
    def decode_stream(self, codes: torch.Tensor, chunk_frames: int) -> Iterator[torch.Tensor]:
        """Streamed decode with carried state: yields PCM [B, t * 1920] per chunk of
        ``chunk_frames`` frames; the concatenation equals :meth:`decode`."""
        if chunk_frames <= 0:
            raise ValueError(f"chunk_frames must be > 0, got {chunk_frames}")
        codes = self._check_codes(codes)
        state: DecoderState = self.decoder.init_state(codes.shape[0], self.device, self.dtype)
        for start in range(0, codes.shape[-1], chunk_frames):
            wav, state = self.decoder.decode_step(codes[..., start:start + chunk_frames], state)
            yield _pcm(wav)


def _pcm(wav: torch.Tensor) -> torch.Tensor:
    return wav if wav.dtype == torch.float64 else wav.float()


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32) -> Qwen3TTSParts:
    """Load the codec head, code predictor and codec decoder of a Qwen3-TTS directory.

    Weights may be stored as float32, bfloat16 or float16; they are cast to ``dtype``
    (float32 / bfloat16 / float16, or float64 for reference comparisons).
    Raises :class:`CheckpointError` (naming the file and tensors) for anything missing,
    unexpected or malformed inside what is loaded.
    """
    if dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise ValueError(f"dtype must be float32, bfloat16, float16 or float64, got {dtype}")
    config = read_configs(path)
    root = Path(config.path)
    device = canonical_device(device)

    talker_files = SafetensorsFiles(root)
    predictor = CodePredictor(config.code_predictor)
    stored = load_into(predictor, talker_files, PREDICTOR_PREFIX, device=device, dtype=dtype)
    head = CodecHead(config.codec_head)
    stored |= load_into(head, talker_files, HEAD_PREFIX, device=device, dtype=dtype,
                        only=list(head.state_dict()))
    # Within the three head modules, anything our head does not hold (e.g. a bias) is wrong.
    head_keys = {HEAD_PREFIX + k for k in head.state_dict()}
    extra = [k for p in HEAD_MODULES for k in talker_files.under(p) if k not in head_keys]
    if extra:
        raise CheckpointError(f"{talker_files.label}: unexpected tensors in the codec head modules "
                              f"({', '.join(HEAD_MODULES)}): {', '.join(sorted(extra))}")

    decoder = CodecDecoder(config.decoder)
    stored |= load_into(decoder, SafetensorsFiles(root / "speech_tokenizer"), DECODER_PREFIX,
                        device=device, dtype=dtype)
    config = dataclasses.replace(config, weight_dtypes=tuple(sorted(str(d).removeprefix("torch.") for d in stored)))
    parts = Qwen3TTSParts(config, head, predictor, decoder, device, dtype)
    log.info("loaded Qwen3-TTS parts from %s: G=%d codebook=%d D=%d weights=%s -> %s on %s", root,
             config.num_code_groups, config.codebook_size, config.talker_hidden_size,
             "/".join(config.weight_dtypes), str(dtype).removeprefix("torch."), device)
    return parts


# --------------------------------------------------------------------------- talker

# Qwen3TTSModel._merge_generate_kwargs: used when generation_config.json lacks a key.
HARD_DEFAULTS: dict[str, Any] = dict(
    do_sample=True, top_k=50, top_p=1.0, temperature=0.9, repetition_penalty=1.05, subtalker_dosample=True,
    subtalker_top_k=50, subtalker_top_p=1.0, subtalker_temperature=0.9, max_new_tokens=2048)
MIN_NEW_TOKENS = 2  # hard-coded in the official generate()


@dataclass(frozen=True)
class TalkerGenerationConfig:
    """``generation_config.json``, every missing key filled with the official package's default."""

    do_sample: bool
    top_k: int
    top_p: float
    temperature: float
    repetition_penalty: float
    subtalker_dosample: bool
    subtalker_top_k: int
    subtalker_top_p: float
    subtalker_temperature: float
    max_new_tokens: int
    min_new_tokens: int = MIN_NEW_TOKENS

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TalkerGenerationConfig":
        return cls(**{k: data.get(k, v) for k, v in HARD_DEFAULTS.items()})

    @classmethod
    def from_dir(cls, directory: str | Path) -> "TalkerGenerationConfig":
        path = Path(directory) / "generation_config.json"
        return cls.from_dict(read_json(path) if path.is_file() else {})


@dataclass
class Qwen3TTSTalker:
    """The talker side of a directory, as loaded: models, text tokenizer, prompt ids, generation defaults."""

    talker: Talker
    predictor: CodePredictor
    prompt: PromptConfig
    tokenizer: QwenTextTokenizer
    generation: TalkerGenerationConfig
    path: str
    device: torch.device
    dtype: torch.dtype


def load_talker(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                predictor: CodePredictor | None = None) -> Qwen3TTSTalker:
    """The talker (strict inside ``talker.`` minus ``talker.code_predictor.``), the code
    predictor (loaded here unless one is passed, e.g. ``parts.predictor``), the text
    tokenizer, the prompt ids and the generation config of a Qwen3-TTS directory."""
    root = Path(path)
    device = canonical_device(device)
    config_file = root / "config.json"
    config = read_json(config_file)
    where = str(config_file)
    tcfg = talker_config(config, where)
    files = SafetensorsFiles(root)
    talker = Talker(tcfg)
    names = list(talker.state_dict())
    load_into(talker, files, TALKER_PREFIX, device=device, dtype=dtype, only=names)
    known = {TALKER_PREFIX + n for n in names}
    extra = [k for k in files.under(TALKER_PREFIX) if k not in known and not k.startswith(PREDICTOR_PREFIX)]
    if extra:
        raise CheckpointError(f"{files.label}: unexpected tensors under {TALKER_PREFIX!r}: {', '.join(sorted(extra)[:8])}")
    if predictor is None:
        predictor = CodePredictor(_predictor_config(require(config, "talker_config", dict, where),
                                                    f"{where} [talker_config]"))
        load_into(predictor, files, PREDICTOR_PREFIX, device=device, dtype=dtype)
    prompt = PromptConfig.from_config(config, where)
    bad_ids = [n for n, i in {"tts_pad": prompt.tts_pad_token_id, "tts_bos": prompt.tts_bos_token_id,
                               "tts_eos": prompt.tts_eos_token_id}.items() if not 0 <= i < tcfg.text_vocab_size]
    if bad_ids:
        raise CheckpointError(f"{config_file}: {', '.join(bad_ids)} ids outside text_vocab_size {tcfg.text_vocab_size}")
    return Qwen3TTSTalker(talker.eval(), predictor.eval(), prompt, QwenTextTokenizer.from_dir(root),
                          TalkerGenerationConfig.from_dir(root), str(root), device, dtype)


def has_talker_weights(path: str | Path | None) -> bool:
    """True when ``path`` is a Qwen3-TTS directory with trained talker layers and tokenizer files."""
    if not path:
        return False
    root = Path(path)
    if not (root.is_dir() and (root / "config.json").is_file() and (root / "vocab.json").is_file()):
        return False
    try:
        names = SafetensorsFiles(root).keys()
    except Exception:
        return False
    return any(n.startswith("talker.model.layers.") for n in names)
