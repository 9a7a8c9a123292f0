"""Log-mel front ends: the speaker encoder's (24 kHz, :class:`LogMel`) and the forced
aligner's (16 kHz Whisper features, :class:`WhisperLogMel`).

The speaker encoder's: 24 kHz audio -> the official 128-bin log-mel.

    mel = LogMel()                       # n_fft 1024, hop 256, win 1024, fmin 0, fmax 12 kHz
    frames = mel(wav[None])              # [B, N] float32 -> [B, T, 128]

The maths of ``qwen_tts``' ``mel_spectrogram`` in float32 (reflect padding of
(n_fft - hop) / 2 on both sides, ``torch.stft`` with a periodic Hann window and
``center=False``, magnitude sqrt(re^2 + im^2 + 1e-9), slaney mel filterbank, log of the
values clamped at 1e-5). The filterbank is librosa's ``filters.mel`` (slaney mel scale,
slaney area normalisation) computed here without librosa; tests/engines/pipelines/talker/test_clone_parity.py
proves it equal to librosa's in the oracle venv.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

_F_SP = 200.0 / 3  # slaney mel scale: linear below 1 kHz ...
_MIN_LOG_HZ = 1000.0
_MIN_LOG_MEL = _MIN_LOG_HZ / _F_SP
_LOGSTEP = math.log(6.4) / 27.0  # ... logarithmic above


def hz_to_mel(hz: np.ndarray) -> np.ndarray:
    hz = np.asarray(hz, dtype=np.float64)
    mel = hz / _F_SP
    log_part = _MIN_LOG_MEL + np.log(np.maximum(hz, _MIN_LOG_HZ) / _MIN_LOG_HZ) / _LOGSTEP
    return np.where(hz >= _MIN_LOG_HZ, log_part, mel)


def mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    hz = _F_SP * mel
    log_part = _MIN_LOG_HZ * np.exp(_LOGSTEP * (mel - _MIN_LOG_MEL))
    return np.where(mel >= _MIN_LOG_MEL, log_part, hz)


def slaney_mel_filterbank(sample_rate: int, n_fft: int, n_mels: int, fmin: float, fmax: float) -> np.ndarray:
    """[n_mels, 1 + n_fft // 2] float32, the numbers ``librosa.filters.mel(sr, n_fft, n_mels,
    fmin, fmax)`` returns (triangles in float64, stored float32, then area-normalised)."""
    fft_freqs = np.fft.rfftfreq(n=n_fft, d=1.0 / sample_rate)
    mel_f = mel_to_hz(np.linspace(hz_to_mel(fmin), hz_to_mel(fmax), n_mels + 2))
    fdiff = np.diff(mel_f)
    ramps = np.subtract.outer(mel_f, fft_freqs)
    weights = np.zeros((n_mels, 1 + n_fft // 2), dtype=np.float32)
    for i in range(n_mels):
        lower = -ramps[i] / fdiff[i]
        upper = ramps[i + 2] / fdiff[i + 1]
        weights[i] = np.maximum(0, np.minimum(lower, upper))
    weights *= (2.0 / (mel_f[2: n_mels + 2] - mel_f[:n_mels]))[:, None]
    return weights


class LogMel(nn.Module):
    """[B, N] float waveform at ``sample_rate`` -> [B, T, n_mels] log-mel frames (float32 maths)."""

    def __init__(self, sample_rate: int = 24_000, n_fft: int = 1024, n_mels: int = 128, hop: int = 256,
                 win: int = 1024, fmin: float = 0.0, fmax: float = 12_000.0):
        super().__init__()
        self.n_fft, self.hop, self.win = n_fft, hop, win
        self.register_buffer("filterbank", torch.from_numpy(
            slaney_mel_filterbank(sample_rate, n_fft, n_mels, fmin, fmax)), persistent=False)
        self.register_buffer("window", torch.hann_window(win), persistent=False)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        wav = wav.float()
        pad = (self.n_fft - self.hop) // 2
        wav = torch.nn.functional.pad(wav[:, None], (pad, pad), mode="reflect")[:, 0]
        spec = torch.stft(wav, self.n_fft, hop_length=self.hop, win_length=self.win, window=self.window.float(),
                          center=False, normalized=False, onesided=True, return_complex=True)
        magnitude = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
        mel = torch.matmul(self.filterbank.float(), magnitude)
        return torch.log(torch.clamp(mel, min=1e-5)).transpose(1, 2)


def whisper_mel_filterbank(sample_rate: int, n_fft: int, n_mels: int, fmin: float, fmax: float) -> np.ndarray:
    """[1 + n_fft // 2, n_mels] float64: transformers' ``mel_filter_bank(..., norm="slaney",
    mel_scale="slaney")`` (the Whisper feature extractor's), triangles and area
    normalisation all in float64 (librosa's, above, stores the triangles in float32)."""
    fft_freqs = np.linspace(0, sample_rate // 2, 1 + n_fft // 2)
    filter_freqs = mel_to_hz(np.linspace(hz_to_mel(fmin), hz_to_mel(fmax), n_mels + 2))
    slopes = filter_freqs[None, :] - fft_freqs[:, None]
    fdiff = np.diff(filter_freqs)
    down = -slopes[:, :-2] / fdiff[:-1]
    up = slopes[:, 2:] / fdiff[1:]
    weights = np.maximum(np.zeros(1), np.minimum(down, up))
    return weights * (2.0 / (filter_freqs[2: n_mels + 2] - filter_freqs[:n_mels]))[None, :]


class WhisperLogMel(nn.Module):
    """16 kHz waveform [N] -> Whisper log-mel [n_mels, N // hop] (transformers'
    ``WhisperFeatureExtractor`` torch path for one unpadded waveform: centred STFT with
    reflect padding, the last frame dropped, power spectrum, log10 clamped at 1e-10 and
    at 8 below the item's maximum, then (x + 4) / 4)."""

    def __init__(self, sample_rate: int = 16_000, n_fft: int = 400, hop: int = 160, n_mels: int = 128,
                 fmax: float = 8_000.0):
        super().__init__()
        self.n_fft, self.hop = n_fft, hop
        self.register_buffer("filterbank", torch.from_numpy(
            whisper_mel_filterbank(sample_rate, n_fft, n_mels, 0.0, fmax)).float(), persistent=False)
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        spec = torch.stft(wav.float(), self.n_fft, self.hop, window=self.window, return_complex=True)
        power = spec[..., :-1].abs() ** 2
        log_spec = torch.clamp(self.filterbank.T @ power, min=1e-10).log10()
        log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
        return (log_spec + 4.0) / 4.0


__all__ = ["LogMel", "WhisperLogMel", "hz_to_mel", "mel_to_hz", "slaney_mel_filterbank", "whisper_mel_filterbank"]
