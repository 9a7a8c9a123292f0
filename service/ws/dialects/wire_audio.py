"""Audio as the voice-agent dialects put it on the wire: raw PCM (int16 or float32), G.711
mu-law, or MP3 at a bit rate, at the rate the client asked for, encoded chunk by chunk as it
is generated (by the service's one encoder, :class:`service.synthesis.audio.StreamEncoder`, which
takes these encodings' names); over HTTP optionally in a WAV container whose header says
"length unknown".

    encoder = StreamEncoder("pcm_f32le", 44100)
    data = encoder.encode(pcm_24k)   # bytes for this chunk (the resampler may hold a few samples)
    tail = encoder.finish()           # the rest, at the end of an utterance
"""

from __future__ import annotations

from service.synthesis.audio import wav_stream_header

MIN_RATE, MAX_RATE = 8000, 48000
# WAV's format tag and bits per sample of each raw encoding
_WAV_FORMATS = {"pcm_s16le": (1, 16), "pcm_f32le": (3, 32), "pcm_mulaw": (7, 8)}
CONTENT_TYPES = {"pcm_s16le": "audio/pcm", "pcm_f32le": "audio/pcm", "pcm_mulaw": "audio/basic", "mp3": "audio/mpeg"}


def wav_header(encoding: str, sample_rate: int) -> bytes:
    """A mono WAV header for a stream of ``encoding`` whose length is not known yet."""
    return wav_stream_header(sample_rate, *_WAV_FORMATS[encoding])
