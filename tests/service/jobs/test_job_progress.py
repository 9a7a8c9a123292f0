"""A job's progress estimate (service/jobs/progress.py) and its kept segments' audio
(service/jobs/segments.py), without a server: the meter on a clock the test moves; the segments
through the job's own encoders (WAV and FLAC, read back with soundfile)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf

from service.jobs.progress import ProgressMeter
from service.jobs.segments import FORMAT_ENCODINGS, segment_bytes, segment_pcm
from service.jobs.store.base import Segment
from service.synthesis.spool import AudioSpool


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_estimate_follows_how_the_spoken_utterances_came_out():
    """A talker plans each utterance's budget (an upper bound): once one has ended, the rest of
    the plan is scaled by how it came out, and the total ends equal to the frames spoken."""
    clock = Clock()
    meter = ProgressMeter([400, 0, 400, 400], [], clock)  # utterance, pause, utterance, utterance
    start = meter.progress()
    assert (start.frames_done, start.frames_total, start.utterances_done, start.utterances_total) == (0, 1200, 0, 4)
    assert start.eta_at is None  # no pace yet
    clock.now += 10
    meter.update(60, 60 * 1920)
    assert meter.progress().frames_total == 1200 and meter.progress().frames_done == 60
    meter.update(100, 100 * 1920)
    assert meter.part_ended() == 100  # a quarter of its budget
    after = meter.progress()
    assert (after.frames_done, after.frames_total, after.utterances_done) == (100, 300, 1)
    assert after.eta_at == pytest.approx(clock.now + 200 / 10)  # 10 frames a second so far
    assert meter.part_ended() == 0  # the pause: no frames
    meter.update(150, 0)
    clock.now += 5
    meter.update(250, 0)
    assert meter.part_ended() == 150
    meter.update(330, 0)
    meter.update(350, 0)
    assert meter.part_ended() == 100
    end = meter.progress()
    assert (end.frames_done, end.frames_total, end.utterances_done) == (350, 350, 4)


def test_a_resumed_attempt_starts_from_its_kept_segments():
    clock = Clock()
    kept = [Segment(0, 48_000, frames=25), Segment(1, 24_000)]  # an utterance and a pause
    meter = ProgressMeter([100, 0, 100], kept, clock)
    first = meter.progress()
    assert (first.frames_done, first.frames_total, first.utterances_done, first.audio_samples) == (25, 50, 2, 72_000)
    meter.update(40, 72_000 + 40 * 1920)  # this attempt's frames run past the scaled plan of its part
    assert meter.progress().frames_total == 65 and meter.progress().frames_done == 65


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_a_kept_segment_replays_to_the_samples_the_uninterrupted_file_holds(fmt):
    """Segments are kept as int16, quantized as the job's file is (WAV by 32767, libsndfile's FLAC
    by 32768): replayed into the job's encoder they give back exactly the samples the file of an
    uninterrupted run holds (every int16 value, and audio beyond +-1)."""
    rng = np.random.default_rng(0)
    signal = np.concatenate([np.linspace(-1.0, 1.0, 65_536 * 4, dtype=np.float32),
                             rng.uniform(-1.0, 1.0, 48_000).astype(np.float32),
                             np.array([1.5, -1.5, 1.0, -1.0, 0.0], dtype=np.float32)])

    def encoded(pcm: np.ndarray) -> np.ndarray:
        spool = AudioSpool(fmt, 1 << 30)
        for piece in np.array_split(pcm, 7):
            spool.write(piece)
        spool.finish()
        data = spool.read(spool.size + 1)
        spool.close()
        return sf.read(io.BytesIO(data), dtype="int16")[0]

    encoding = FORMAT_ENCODINGS[fmt]
    kept = segment_pcm(segment_bytes(signal, encoding), encoding)
    assert kept.dtype == np.float32
    np.testing.assert_array_equal(encoded(kept), encoded(signal))
