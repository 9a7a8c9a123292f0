"""The reference-audio decoder and its worker pool, in process: what it decodes equals
libsndfile's reading of the same file (PCM WAV / FLAC: to float32 rounding, 1e-7), stereo is
averaged, codecs outside the allow-list and mid-stream changes are refused with a reason, and
the pool survives a worker that is killed or runs past its time budget."""

from __future__ import annotations

import asyncio
import io
import os

import av
import numpy as np
import pytest
import ref_audio_samples as samples
import soundfile as sf
import soxr

from service.errors import ApiError
from service.voices.decode import Refused, decode_reference, sniff_container
from service.voices.decoder_pool import DecoderPool


@pytest.mark.parametrize("subtype", ["PCM_16", "PCM_24", "FLOAT"])
@pytest.mark.parametrize("container", ["WAV", "FLAC"])
def test_decoding_equals_libsndfile(container, subtype):
    if container == "FLAC" and subtype == "FLOAT":
        pytest.skip("FLAC holds integers only")
    rate = 22050
    signal = samples.voice_like(1.5, rate)
    stereo = np.stack([signal, 0.5 * signal], axis=1)
    buffer = io.BytesIO()
    sf.write(buffer, stereo, rate, format=container, subtype=subtype)
    data = buffer.getvalue()
    reference, _ = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    expected = soxr.resample(reference.mean(axis=1), rate, 24000, quality="HQ")
    ours = decode_reference(data, 30.0, 24000)
    assert ours.dtype == np.float32 and ours.shape == expected.shape
    np.testing.assert_allclose(ours, expected, atol=1e-6, rtol=0)


def test_every_allowed_container_is_named_by_its_magic_and_decodes():
    kinds = {"wav": "wav", "flac": "flac", "ogg-opus": "ogg", "ogg-vorbis": "ogg", "mp3": "mp3", "aac": "aac",
             "m4a": "m4a", "webm": "webm"}
    for name, data in samples.all_containers().items():
        assert sniff_container(data) == kinds[name], name
        audio = decode_reference(data, 30.0, 24000)
        assert abs(audio.size / 24000 - 1.5) < 0.1, (name, audio.size)  # codec padding at most
        assert np.abs(audio).max() > 0.05, name


def test_refusals_name_the_reason():
    adpcm = io.BytesIO()
    with av.open(adpcm, mode="w", format="wav") as box:  # a WAV holding a codec outside the allow-list
        stream = box.add_stream("adpcm_ms", rate=24000, layout="mono")
        pcm = (samples.voice_like(1.5, 24000) * 32767).astype(np.int16)[None, :]
        for start in range(0, pcm.shape[1], 2048):
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm[:, start:start + 2048]), format="s16",
                                               layout="mono")
            frame.sample_rate, frame.pts = 24000, start
            for packet in stream.encode(frame):
                box.mux(packet)
        for packet in stream.encode(None):
            box.mux(packet)
    cases = {
        b"": "empty",
        samples.sdp(9): "not decodable as an allowed audio file",
        b"#EXTM3U\n": "not decodable as an allowed audio file",
        adpcm.getvalue(): "holds adpcm_ms audio",
        samples.flac_declaring(30.0, 655350, 8): "sample rate of 655350 Hz",
        samples.flac_declaring(5.0, 48000, 6): "6 channels",
        samples.flac_declaring(600.0, 48000, 1): "600.0 s of audio",
        samples.flac_bomb(35_000): "longer than allowed: at most 30 s",
        samples.encode("wav", seconds=0.5): "at least 1 s",
        b"RIFF\x24\x00\x00\x00WAVEfmt " + b"\x00" * 40: "not",
    }
    for data, words in cases.items():
        with pytest.raises(Refused) as refused:
            decode_reference(data, 30.0, 24000)
        assert words in str(refused.value), (words, refused.value)


def test_the_pool_outlives_a_killed_worker_and_a_decode_past_its_budget():
    async def run():
        pool = DecoderPool(workers=1, budget_s=10.0)
        good = samples.encode("flac", seconds=2.0)
        try:
            assert (await pool.decode(good, 30.0, "ref_audio")).size == 48000
            (worker,) = list(pool._idle.queue)
            os.kill(worker.process.pid, 9)  # a decoder crash, as a segfault would end it
            worker.process.wait(5)
            with pytest.raises(ApiError) as refused:
                await pool.decode(good, 30.0, "ref_audio")
            assert refused.value.status == 400 and refused.value.message.startswith("ref_audio:")
            assert (await pool.decode(good, 30.0, "ref_audio")).size == 48000  # a replacement took over
            pool.budget_s = 1e-4  # nothing decodes in 0.1 ms: the worker is killed and replaced
            with pytest.raises(ApiError) as late:
                await pool.decode(samples.encode("wav", seconds=20.0), 30.0, "audio_sample")
            assert late.value.status == 400 and "longer than" in late.value.message
            pool.budget_s = 10.0
            assert (await pool.decode(good, 30.0, "ref_audio")).size == 48000
        finally:
            pool.close()

    asyncio.run(run())
