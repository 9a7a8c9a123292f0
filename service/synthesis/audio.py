"""Audio encoding for HTTP responses: whole files and progressive streams.

The engine hands us float32 mono PCM at 24 kHz. A response may ask for another rate
(``sample_rate``, 8-48 kHz): resampled with soxr as the audio arrives. mp3, opus and aac
encoders take only some rates; any other asked rate is served at the nearest one they take
(:func:`output_rate`, the rate the file declares), so every rate the schema accepts encodes. ``pcm`` is raw
int16 little-endian, ``wav`` streams with a header whose sizes say "unknown"
(0xFFFFFFFF, as OpenAI does), ``ulaw`` is 8 kHz G.711 mu-law for telephony, mp3 / opus
(Ogg) / aac (ADTS) are encoded incrementally by FFmpeg through PyAV, so every format but
flac (libsndfile, needs the whole signal) streams as it is generated. The same encoder writes
the voice-agent dialects' raw encodings (``pcm_s16le``, ``pcm_f32le``, ``pcm_mulaw`` at the rate
the client asked: service/ws/dialects/wire_audio.py).

On the event loop, :meth:`StreamEncoder.encode_async` / :meth:`StreamEncoder.finish_async`: FFmpeg's
encoders and soxr run on a thread (they release the GIL), so a long signal (minutes of pauses
in mp3: 4 ms of lame per second of audio at 44.1 kHz) never holds the loop; raw PCM at 24 kHz,
microseconds per chunk, stays inline.
"""

from __future__ import annotations

import asyncio
import functools
import io
import struct

import av
import numpy as np
import soundfile as sf
import soxr

from engines.contract import SAMPLE_RATE
from service.errors import ApiError

ULAW_RATE = 8000
MIN_RATE, MAX_RATE = 8000, 48000

CONTENT_TYPES = {
    "pcm": "audio/pcm",
    "wav": "audio/wav",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "ulaw": "audio/basic",
}
# Formats whose bytes can go out as the audio is generated (all but flac).
STREAMABLE = frozenset({"pcm", "wav", "ulaw", "mp3", "opus", "aac"})
# FFmpeg muxer and encoder per format.
_FFMPEG = {"mp3": ("mp3", "libmp3lame"), "opus": ("ogg", "libopus"), "aac": ("adts", "aac")}
OGG_PAGE_MICROSECONDS = "20000"  # an Ogg page every 20 ms, not every second: opus bytes flow as they are made


def format_available(fmt: str) -> bool:
    if fmt in _FFMPEG:
        return _FFMPEG[fmt][1] in av.codecs_available
    if fmt == "flac":
        return "FLAC" in sf.available_formats()
    return fmt in CONTENT_TYPES


def check_format(fmt: object, allowed: tuple[str, ...] = tuple(CONTENT_TYPES)) -> str:
    if not isinstance(fmt, str) or fmt not in allowed:
        raise ApiError(400, "invalid_field", f"response_format: choose one of {', '.join(allowed)}")
    if not format_available(fmt):
        raise ApiError(400, "format_unavailable", f"response_format: {fmt} is not supported by the installed encoders")
    return fmt


@functools.cache
def encoder_rates(fmt: str) -> tuple[int, ...] | None:
    """The rates the format's encoder takes (from FFmpeg itself), or None when any rate goes."""
    if fmt not in _FFMPEG or not format_available(fmt):
        return None
    rates = av.codec.Codec(_FFMPEG[fmt][1], "w").audio_rates
    return tuple(sorted(rates)) if rates else None


def output_rate(fmt: str, sample_rate: int | None) -> int:
    """The rate of the response's audio: ulaw is always 8 kHz; others the asked rate or 24 kHz,
    or for an encoder that takes only some rates the nearest of those (a tie: the higher)."""
    if fmt == "ulaw":
        return ULAW_RATE
    rate = sample_rate or SAMPLE_RATE
    rates = encoder_rates(fmt)
    if rates and rate not in rates:
        rate = min(rates, key=lambda r: (abs(r - rate), -r))
    return rate


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


def to_ulaw(pcm: np.ndarray) -> bytes:
    return ulaw_encode(np.frombuffer(to_pcm16(pcm), dtype="<i2"))


def to_pcm_f32(pcm: np.ndarray) -> bytes:
    return np.clip(np.asarray(pcm, dtype=np.float32), -1.0, 1.0).astype("<f4").tobytes()


# Raw samples, by format: the responses' (pcm, the data of wav, ulaw: 8 kHz G.711) and the
# voice-agent dialects' names (pcm_mulaw at any rate, float32 too).
_RAW = {"pcm": to_pcm16, "wav": to_pcm16, "ulaw": to_ulaw,
        "pcm_s16le": to_pcm16, "pcm_f32le": to_pcm_f32, "pcm_mulaw": to_ulaw}


def wav_stream_header(sample_rate: int = SAMPLE_RATE, format_tag: int = 1, bits: int = 16) -> bytes:
    """A 44-byte mono WAV header for a stream whose length is not known yet: PCM16 by default
    (``format_tag`` 3 with 32 bits: float; 7 with 8 bits: mu-law)."""
    block = bits // 8
    unknown = 0xFFFFFFFF
    return (b"RIFF" + struct.pack("<I", unknown) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, format_tag, 1, sample_rate, sample_rate * block, block, bits)
            + b"data" + struct.pack("<I", unknown))


def wav_sizes(header: bytes, file_size: int) -> bytes:
    """A streamed WAV header (sizes "unknown") with the real sizes of a finished file."""
    return (header[:4] + struct.pack("<I", file_size - 8) + header[8:40]
            + struct.pack("<I", file_size - 44) + header[44:])


def encode_file(pcm: np.ndarray, fmt: str, sample_rate: int | None = None) -> bytes:
    """The whole signal as one file of ``fmt`` (at ``sample_rate``, default 24 kHz)."""
    pcm = np.asarray(pcm, dtype=np.float32)
    rate = output_rate(fmt, sample_rate)
    if fmt in STREAMABLE:
        encoder = StreamEncoder(fmt, sample_rate)
        data = encoder.header() + encoder.encode(pcm) + encoder.finish()
        return wav_sizes(data, len(data)) if fmt == "wav" else data
    if rate != SAMPLE_RATE:
        pcm = soxr.resample(pcm, SAMPLE_RATE, rate, quality="HQ")
    buffer = io.BytesIO()
    sf.write(buffer, pcm, rate, format="FLAC", subtype="PCM_16")
    return buffer.getvalue()


class _Sink:
    """A write-only file for FFmpeg's muxer: not seekable, so the muxer never goes back to
    patch a header (what it wrote is final and can be sent at once)."""

    def __init__(self):
        self.pending = bytearray()

    def write(self, data) -> int:
        self.pending += data
        return len(data)

    def take(self) -> bytes:
        data = bytes(self.pending)
        self.pending.clear()
        return data


class _FfmpegEncoder:
    """mp3 / opus / aac, one container written as the PCM arrives; ``bit_rate`` in bits per
    second (None: FFmpeg's default for the codec, 64 kbps for mp3)."""

    def __init__(self, fmt: str, rate: int, bit_rate: int | None = None):
        muxer, codec = _FFMPEG[fmt]
        self.rate = rate
        self.sink = _Sink()
        options = {"page_duration": OGG_PAGE_MICROSECONDS} if muxer == "ogg" else {}
        self.container = av.open(self.sink, mode="w", format=muxer, options=options,
                                 container_options={"flush_packets": "1"})
        self.stream = self.container.add_stream(codec, rate=rate, layout="mono")  # a rate it takes: output_rate
        if bit_rate:
            self.stream.bit_rate = bit_rate
        self.pts = 0

    def encode(self, pcm: np.ndarray) -> bytes:
        if pcm.size:
            frame = av.AudioFrame.from_ndarray(pcm[None, :], format="flt", layout="mono")
            frame.sample_rate, frame.pts = self.rate, self.pts  # PyAV converts to the encoder's sample format
            self.pts += pcm.size
            for packet in self.stream.encode(frame):
                self.container.mux(packet)
        return self.sink.take()

    def finish(self) -> bytes:
        for packet in self.stream.encode(None):
            self.container.mux(packet)
        self.container.close()
        return self.sink.take()


class StreamEncoder:
    """Turns 24 kHz chunks into bytes of ``fmt`` (a response format, or a dialect's raw encoding)
    as they arrive; ``finish`` returns the tail. ``bit_rate``: mp3 / opus / aac bits per second
    (None: the encoder's default)."""

    def __init__(self, fmt: str, sample_rate: int | None = None, bit_rate: int | None = None):
        if fmt not in _RAW and fmt not in _FFMPEG and fmt != "flac":
            raise ValueError(f"unknown audio format {fmt!r}")
        self.fmt = fmt
        self.rate = output_rate(fmt, sample_rate)
        self._held: list[np.ndarray] = []  # flac needs the whole signal
        self._resampler = (soxr.ResampleStream(SAMPLE_RATE, self.rate, 1, dtype="float32")
                           if self.rate != SAMPLE_RATE else None)
        self._ffmpeg = _FfmpegEncoder(fmt, self.rate, bit_rate) if fmt in _FFMPEG else None

    def header(self) -> bytes:
        return wav_stream_header(self.rate) if self.fmt == "wav" else b""

    def encode(self, pcm: np.ndarray, last: bool = False) -> bytes:
        pcm = np.asarray(pcm, dtype=np.float32)
        if self.fmt == "flac":
            self._held.append(pcm)
            return b""
        if self._resampler is not None:
            pcm = self._resampler.resample_chunk(pcm, last=last)
        if self._ffmpeg is not None:
            return self._ffmpeg.encode(pcm)
        return _RAW[self.fmt](pcm)

    @property
    def costly(self) -> bool:
        """Its work is worth a thread: FFmpeg encoding, resampling or (at the end) FLAC."""
        return self._ffmpeg is not None or self._resampler is not None or self.fmt == "flac"

    async def encode_async(self, pcm: np.ndarray) -> bytes:
        """:meth:`encode` from the event loop: on a thread when it is costly (one call at a time:
        the caller awaits each before the next)."""
        if self.costly and self.fmt != "flac" and np.size(pcm):
            return await asyncio.to_thread(self.encode, pcm)
        return self.encode(pcm)

    async def finish_async(self) -> bytes:
        """:meth:`finish` from the event loop (on a thread when it is costly)."""
        return await asyncio.to_thread(self.finish) if self.costly else self.finish()

    def finish(self) -> bytes:
        if self.fmt == "flac":
            signal = np.concatenate(self._held) if self._held else np.zeros(0, dtype=np.float32)
            return encode_file(signal, "flac", self.rate)
        tail = self.encode(np.zeros(0, dtype=np.float32), last=True) if self._resampler is not None else b""
        if self._ffmpeg is not None:
            tail += self._ffmpeg.finish()
        return tail
