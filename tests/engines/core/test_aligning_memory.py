"""The audio a request keeps for its word times is bounded: 16-bit samples (half of float32),
and none at all once it grows past what the aligner accepts (it could never be timed)."""

from __future__ import annotations

import numpy as np

from engines.core.aligning import KeptAudio


def test_kept_audio_is_int16_and_round_trips():
    kept = KeptAudio(text="hi", language="english", max_samples=10_000)
    pcm = np.linspace(-1.0, 1.0, 4_000, dtype=np.float32)
    kept.keep(pcm)
    kept.keep(pcm[:1_000])
    assert kept.samples == 5_000 and all(a.dtype == np.int16 for a in kept.audio)
    assert sum(a.nbytes for a in kept.audio) == 5_000 * 2
    np.testing.assert_allclose(kept.pcm(), np.concatenate([pcm, pcm[:1_000]]), atol=1 / 32767)


def test_audio_longer_than_the_aligner_takes_is_not_kept():
    kept = KeptAudio(text="hi", language="english", max_samples=10_000)
    for _ in range(4):
        kept.keep(np.zeros(3_000, np.float32))
    assert kept.too_long and kept.audio == [] and kept.samples == 12_000
    kept.keep(np.zeros(3_000, np.float32))
    assert kept.audio == [] and kept.samples == 15_000
