"""Audio as the voice-agent dialects put it on the wire: raw PCM (int16 or float32), G.711
mu-law, or MP3 at a bit rate, at the rate the client asked for, encoded chunk by chunk as it
is generated; over HTTP optionally in a WAV container whose header says "length unknown".

    encoder = WireEncoder("pcm_f32le", 44100)
    data = encoder.encode(pcm_24k)   # bytes for this chunk (the resampler may hold a few samples)
    tail = encoder.finish()           # the rest, at the end of an utterance
"""

from __future__ import annotations

import numpy as np
import soxr

from engines.contract import SAMPLE_RATE
from service.synthesis.audio import StreamEncoder, to_pcm16, ulaw_encode, wav_stream_header

ENCODINGS = ("pcm_s16le", "pcm_f32le", "pcm_mulaw", "mp3")
MIN_RATE, MAX_RATE = 8000, 48000
# WAV's format tag and bits per sample of each raw encoding
_WAV_FORMATS = {"pcm_s16le": (1, 16), "pcm_f32le": (3, 32), "pcm_mulaw": (7, 8)}
WAV_ENCODINGS = tuple(_WAV_FORMATS)
CONTENT_TYPES = {"pcm_s16le": "audio/pcm", "pcm_f32le": "audio/pcm", "pcm_mulaw": "audio/basic", "mp3": "audio/mpeg"}


def wav_header(encoding: str, sample_rate: int) -> bytes:
    """A mono WAV header for a stream of ``encoding`` whose length is not known yet."""
    return wav_stream_header(sample_rate, *_WAV_FORMATS[encoding])


class WireEncoder:
    """``bit_rate``: MP3 bits per second (None: the encoder's default)."""

    def __init__(self, encoding: str, sample_rate: int, bit_rate: int | None = None):
        if encoding not in ENCODINGS:
            raise ValueError(f"unknown encoding {encoding!r}")
        self.encoding = encoding
        self.sample_rate = sample_rate
        self._mp3 = StreamEncoder("mp3", sample_rate, bit_rate=bit_rate) if encoding == "mp3" else None
        self._resampler = (soxr.ResampleStream(SAMPLE_RATE, sample_rate, 1, dtype="float32")
                           if self._mp3 is None and sample_rate != SAMPLE_RATE else None)

    def encode(self, pcm: np.ndarray, last: bool = False) -> bytes:
        if self._mp3 is not None:
            return self._mp3.encode(pcm)
        pcm = np.asarray(pcm, dtype=np.float32)
        if self._resampler is not None:
            pcm = self._resampler.resample_chunk(pcm, last=last)
        if self.encoding == "pcm_f32le":
            return np.clip(pcm, -1.0, 1.0).astype("<f4").tobytes()
        pcm16 = to_pcm16(pcm)
        if self.encoding == "pcm_mulaw":
            return ulaw_encode(np.frombuffer(pcm16, dtype="<i2"))
        return pcm16

    def finish(self) -> bytes:
        if self._mp3 is not None:
            return self._mp3.finish()
        if self._resampler is not None:
            return self.encode(np.zeros(0, dtype=np.float32), last=True)
        return b""
