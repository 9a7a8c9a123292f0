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


def assert_matches_official(ours: np.ndarray, official: np.ndarray) -> None:
    assert abs(len(ours) - len(official)) <= 1, (len(ours), len(official))
    n = min(len(ours), len(official))
    np.testing.assert_allclose(ours[-n:], np.clip(official[-n:], -1, 1), atol=2 * LSB, rtol=0)
    assert np.abs(ours).max() > 1e-3
