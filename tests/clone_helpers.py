"""Reference audio in and official audio out, for the voice-cloning tests."""

from __future__ import annotations

import io

import numpy as np
import soundfile as sf

LSB = 1 / 32768  # one int16 step


def wav_bytes(samples: np.ndarray, rate: int = 24000, channels: int = 1) -> bytes:
    buf = io.BytesIO()
    data = np.stack([samples] * channels, axis=1) if channels > 1 else samples
    sf.write(buf, data, rate, format="WAV", subtype="FLOAT")
    return buf.getvalue()


def voice_form(name: str, audio: bytes, ref_text: str | None = None, consent: str | None = None):
    """The multipart body of ``POST /v1/audio/voices``: a saved voice's name, reference audio,
    and its transcript and consent record when given."""
    import aiohttp

    form = aiohttp.FormData()
    form.add_field("name", name)
    if consent is not None:
        form.add_field("consent", consent)
    if ref_text:
        form.add_field("ref_text", ref_text)
    form.add_field("audio_sample", audio, filename="ref.wav", content_type="audio/wav")
    return form


def assert_matches_official(ours: np.ndarray, official: np.ndarray) -> None:
    assert abs(len(ours) - len(official)) <= 1, (len(ours), len(official))
    n = min(len(ours), len(official))
    np.testing.assert_allclose(ours[-n:], np.clip(official[-n:], -1, 1), atol=2 * LSB, rtol=0)
    assert np.abs(ours).max() > 1e-3
