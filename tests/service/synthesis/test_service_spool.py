"""Whole-file audio through a spool: long responses are encoded as they
arrive and spill to a temporary file beyond a threshold, and the bytes are the same as the
one-shot encoder's (the reference: ``service.synthesis.audio.encode_file``; Opus/OGG streams carry a
random serial number, so Opus is compared decoded)."""

from __future__ import annotations

import io

import aiohttp
import numpy as np
import pytest
import soundfile as sf
from conftest import start_server

from service.synthesis.audio import encode_file, format_available
from service.synthesis.spool import AudioSpool

FORMATS = [f for f in ("pcm", "wav", "flac", "mp3", "opus", "ulaw") if format_available(f)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_spool_spills_beyond_its_threshold_and_matches_the_one_shot_encoder(fmt):
    signal = (np.random.default_rng(0).standard_normal(24_000 * 3) * 0.1).astype(np.float32)
    spool = AudioSpool(fmt, memory_bytes=4096)
    try:
        for part in np.array_split(signal, 37):  # chunks as the engine delivers them
            spool.write(part)
        size = spool.finish()
        data = b"".join(iter(spool.read, b""))
        assert len(data) == size and spool.spilled  # beyond 4 KiB it lives on disk
        reference = encode_file(signal, fmt)
        if fmt == "opus":
            got, _ = sf.read(io.BytesIO(data), dtype="float32")
            want, _ = sf.read(io.BytesIO(reference), dtype="float32")
            assert got.shape == want.shape and np.abs(got - want).max() < 1e-3  # same encoder, same input
        else:
            assert data == reference
    finally:
        spool.close()


def test_small_files_stay_in_memory():
    spool = AudioSpool("wav", memory_bytes=1 << 20)
    spool.write(np.zeros(2400, dtype=np.float32))
    spool.finish()
    assert not spool.spilled
    spool.close()


async def test_a_spilled_whole_file_response_is_the_same_audio(engine, tmp_path):
    """The same request served from memory and from a spilled spool: identical bytes."""
    body = {"input": "Hello there. This is a whole file.", "response_format": "wav", "seed": 3, "stream": False}
    results = []
    for memory_bytes in (1 << 20, 1024):
        live = await start_server(engine, tmp_path / f"data{memory_bytes}", whole_file_memory_bytes=memory_bytes)
        try:
            async with aiohttp.ClientSession() as http:
                async with http.post(live.url + "/v1/audio/speech", json=body) as response:
                    assert response.status == 200
                    assert int(response.headers["Content-Length"]) > 1024  # it did outgrow 1 KiB
                    results.append(await response.read())
        finally:
            await live.stop()
    assert results[0] == results[1]
    audio, rate = sf.read(io.BytesIO(results[1]), dtype="float32")
    assert rate == 24_000 and audio.size > 0
