"""The voice-cloning side of a Qwen3-TTS Base directory: speaker encoder + speech-tokenizer encoder.

    encoders = load_voice_encoders("/models/Qwen3-TTS-12Hz-0.6B-Base", device="cpu")   # None if not a Base dir
    features = encoders.features(wav_24k)     # float32 [N] -> VoiceFeatures(xvector [D], codes [T, G])

* ``model.safetensors`` ``speaker_encoder.*`` (config.json ``speaker_encoder_config``) ->
  :class:`~engines.models.speaker_encoder.SpeakerEncoder`, fed by the official log-mel
  (:class:`~engines.models.mel.LogMel`);
* ``speech_tokenizer/model.safetensors`` ``encoder.*`` (``encoder_config``,
  ``encoder_valid_num_quantizers``) -> :class:`~engines.models.speech_encoder.SpeechEncoder`.

Both are loaded strictly (engines/checkpoints/files.py). They run once per reference voice,
never per frame; :meth:`VoiceEncoders.features` is thread-safe (one lock) so the service may
call it off the event loop while the worker thread generates.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engines.checkpoints.files import (
    CheckpointError,
    SafetensorsFiles,
    load_into,
    read_json,
    require,
)
from engines.contract import SAMPLE_RATE, SAMPLES_PER_FRAME
from engines.hardware.devices import canonical_device
from engines.models.mel import LogMel
from engines.models.speaker_encoder import SpeakerEncoder, SpeakerEncoderConfig
from engines.models.speech_encoder import SpeechEncoder, SpeechEncoderConfig

SPEAKER_PREFIX = "speaker_encoder."
ENCODER_PREFIX = "encoder."


@dataclass(frozen=True)
class VoiceFeatures:
    """What a reference voice contributes to the prompt (both computed from 24 kHz audio)."""

    xvector: np.ndarray  # [D] float32: takes the speaker's codec-embedding slot
    codes: np.ndarray  # [T, G] int64: the reference codes of in-context cloning


class VoiceEncoders:
    def __init__(self, mel: LogMel, speaker: SpeakerEncoder, speech: SpeechEncoder, device: torch.device,
                 dtype: torch.dtype):
        self.mel, self.speaker, self.speech = mel.to(device), speaker.eval(), speech.eval()
        self.device, self.dtype = device, dtype
        self.sample_rate = SAMPLE_RATE
        self._lock = threading.Lock()

    @property
    def xvector_dim(self) -> int:
        return self.speaker.cfg.enc_dim

    @torch.no_grad()
    def xvector(self, wav: torch.Tensor) -> torch.Tensor:
        """[N] float32 at 24 kHz -> [D] (the official extract_speaker_embedding: fp32 mel, model dtype after)."""
        mels = self.mel(wav.to(self.device, torch.float32)[None])
        return self.speaker(mels.to(self.dtype))[0]

    @torch.no_grad()
    def features(self, wav: np.ndarray) -> VoiceFeatures:
        audio = torch.from_numpy(np.ascontiguousarray(wav, dtype=np.float32))
        with self._lock:
            xvec = self.xvector(audio).float().cpu().numpy()
            codes = self.speech.encode(audio).cpu().numpy()
        return VoiceFeatures(xvector=xvec, codes=codes)


def load_voice_encoders(path: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32) -> VoiceEncoders | None:
    """The speaker encoder and speech-tokenizer encoder of a Base directory; None when the
    directory has no speaker encoder (CustomVoice / VoiceDesign). CheckpointError for a Base
    directory whose tensors or configs do not fit."""
    root = Path(path)
    config_file = root / "config.json"
    config = read_json(config_file)
    files = SafetensorsFiles(root)
    if str(config.get("tts_model_type") or "") != "base" and not files.under(SPEAKER_PREFIX):
        return None
    device = canonical_device(device)
    where = str(config_file)
    try:
        spk_cfg = SpeakerEncoderConfig.from_dict(require(config, "speaker_encoder_config", dict, where))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{where} [speaker_encoder_config]: {exc}") from None
    if spk_cfg.sample_rate != SAMPLE_RATE or spk_cfg.mel_dim != 128:
        raise CheckpointError(f"{where} [speaker_encoder_config]: streamvox runs the official 24 kHz 128-bin "
                              f"log-mel; got sample_rate {spk_cfg.sample_rate}, mel_dim {spk_cfg.mel_dim}")
    speaker = SpeakerEncoder(spk_cfg)
    load_into(speaker, files, SPEAKER_PREFIX, device=device, dtype=dtype)

    st_file = root / "speech_tokenizer" / "config.json"
    st_config = read_json(st_file)
    st_where = str(st_file)
    try:
        enc_cfg = SpeechEncoderConfig.from_dict(require(st_config, "encoder_config", dict, st_where))
        valid = int(st_config.get("encoder_valid_num_quantizers", enc_cfg.num_quantizers))
        if int(st_config.get("encode_downsample_rate", SAMPLES_PER_FRAME)) != SAMPLES_PER_FRAME:
            raise ValueError(f"encode_downsample_rate must be {SAMPLES_PER_FRAME}")
        speech = SpeechEncoder(enc_cfg, valid_quantizers=valid)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{st_where} [encoder_config]: {exc}") from None
    load_into(speech, SafetensorsFiles(root / "speech_tokenizer"), ENCODER_PREFIX, device=device, dtype=dtype)
    return VoiceEncoders(LogMel(), speaker, speech, device, dtype)


__all__ = ["VoiceEncoders", "VoiceFeatures", "load_voice_encoders"]
