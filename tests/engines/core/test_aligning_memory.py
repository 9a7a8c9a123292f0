"""The audio a request keeps for its word times is bounded: 16-bit samples (half of float32),
and none at all once it grows past what the aligner accepts (it could never be timed)."""

from __future__ import annotations

import numpy as np

from engines.core.aligning import Piece


def test_a_piece_keeps_int16_audio_that_round_trips():
    piece = Piece(state=None, text="hi", language="english", max_samples=10_000)
    pcm = np.linspace(-1.0, 1.0, 4_000, dtype=np.float32)
    piece.keep(pcm)
    piece.keep(pcm[:1_000])
    assert piece.samples == 5_000 and all(a.dtype == np.int16 for a in piece.audio)
    assert sum(a.nbytes for a in piece.audio) == 5_000 * 2
    np.testing.assert_allclose(piece.pcm(), np.concatenate([pcm, pcm[:1_000]]), atol=1 / 32767)


def test_a_piece_longer_than_the_aligner_takes_keeps_nothing():
    piece = Piece(state=None, text="hi", language="english", max_samples=10_000)
    for _ in range(4):
        piece.keep(np.zeros(3_000, np.float32))
    assert piece.too_long and piece.audio == [] and piece.samples == 12_000
    piece.keep(np.zeros(3_000, np.float32))
    assert piece.audio == [] and piece.samples == 15_000
