"""Audio encoding for HTTP responses: whole files and progressive streams.

The engine hands us float32 mono PCM at 24 kHz. ``pcm`` is raw int16 little-endian,
``wav`` streams with a header whose sizes say "unknown" (0xFFFFFFFF, as OpenAI does),
``ulaw`` is 8 kHz G.711 mu-law for telephony (resampled with soxr), and flac / mp3 /
opus go through libsndfile, which needs the whole signal, so they arrive in one piece.
"""

from __future__ import annotations

import io
import struct

import numpy as np
import soundfile as sf
import soxr

from engines.contract import SAMPLE_RATE

from .errors import ApiError

ULAW_RATE = 8000

CONTENT_TYPES = {
    "pcm": "audio/pcm",
    "wav": "audio/wav",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "ulaw": "audio/basic",
}
PROGRESSIVE = frozenset({"pcm", "wav", "ulaw"})
# libsndfile container + subtype for the formats it encodes.
_SNDFILE = {"flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III"), "opus": ("OGG", "OPUS")}


def format_available(fmt: str) -> bool:
    if fmt not in _SNDFILE:
        return fmt in CONTENT_TYPES
    container, subtype = _SNDFILE[fmt]
    return container in sf.available_formats() and subtype in sf.available_subtypes(container)


def check_format(fmt: object, allowed: tuple[str, ...] = tuple(CONTENT_TYPES)) -> str:
    if not isinstance(fmt, str) or fmt not in allowed:
        raise ApiError(400, "invalid_field", f"response_format: choose one of {', '.join(allowed)}")
    if not format_available(fmt):
        raise ApiError(400, "format_unavailable",
                       f"response_format: {fmt} is not supported by the installed libsndfile ({sf.__libsndfile_version__})")
    return fmt


def to_pcm16(pcm: np.ndarray) -> bytes:
    clipped = np.clip(np.asarray(pcm, dtype=np.float32), -1.0, 1.0)
    return (clipped * 32767.0).round().astype("<i2").tobytes()


def ulaw_encode(pcm16: np.ndarray) -> bytes:
    """G.711 mu-law of int16 samples (the classic bias/segment formulation)."""
    x = pcm16.astype(np.int32)
    sign = (x < 0).astype(np.int32)
    magnitude = np.minimum(np.abs(x), 32635) + 0x84
    exponent = np.floor(np.log2(magnitude)).astype(np.int32) - 7
    mantissa = (magnitude >> (exponent + 3)) & 0x0F
    return (~((sign << 7) | (exponent << 4) | mantissa) & 0xFF).astype(np.uint8).tobytes()


def wav_stream_header(sample_rate: int = SAMPLE_RATE) -> bytes:
    """A 44-byte PCM16 mono WAV header for a stream whose length is not known yet."""
    byte_rate = sample_rate * 2
    unknown = 0xFFFFFFFF
    return (b"RIFF" + struct.pack("<I", unknown) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, byte_rate, 2, 16)
            + b"data" + struct.pack("<I", unknown))


def encode_file(pcm: np.ndarray, fmt: str) -> bytes:
    """The whole signal as one file of ``fmt``."""
    pcm = np.asarray(pcm, dtype=np.float32)
    if fmt == "pcm":
        return to_pcm16(pcm)
    if fmt == "ulaw":
        return _ulaw_of(soxr.resample(pcm, SAMPLE_RATE, ULAW_RATE, quality="HQ"))
    buffer = io.BytesIO()
    if fmt == "wav":
        sf.write(buffer, pcm, SAMPLE_RATE, format="WAV", subtype="PCM_16")
    else:
        container, subtype = _SNDFILE[fmt]
        if pcm.size == 0:  # some encoders refuse an empty signal
            pcm = np.zeros(SAMPLE_RATE // 100, dtype=np.float32)
        sf.write(buffer, pcm, SAMPLE_RATE, format=container, subtype=subtype)
    return buffer.getvalue()


def _ulaw_of(pcm: np.ndarray) -> bytes:
    return ulaw_encode(np.frombuffer(to_pcm16(pcm), dtype="<i2"))


class StreamEncoder:
    """Turns chunks into response bytes as they arrive; ``finish`` returns the tail."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self._held: list[np.ndarray] = []  # for formats that need the whole signal
        self._resampler = soxr.ResampleStream(SAMPLE_RATE, ULAW_RATE, 1, dtype="float32") if fmt == "ulaw" else None

    def header(self) -> bytes:
        return wav_stream_header() if self.fmt == "wav" else b""

    def encode(self, pcm: np.ndarray) -> bytes:
        pcm = np.asarray(pcm, dtype=np.float32)
        if self.fmt in ("pcm", "wav"):
            return to_pcm16(pcm)
        if self._resampler is not None:
            return _ulaw_of(self._resampler.resample_chunk(pcm))
        self._held.append(pcm)
        return b""

    def finish(self) -> bytes:
        if self._resampler is not None:
            return _ulaw_of(self._resampler.resample_chunk(np.zeros(0, dtype=np.float32), last=True))
        if self.fmt in PROGRESSIVE:
            return b""
        signal = np.concatenate(self._held) if self._held else np.zeros(0, dtype=np.float32)
        return encode_file(signal, self.fmt)
