"""The CLI clones: ``streamvox synthesize --ref-audio/--ref-text`` in-process and ``streamvox say
--voice NAME`` through a running server with a saved voice, as a user runs them (subprocesses;
oracle fixtures: ``bash scripts/oracle-clone-fixtures.sh``). Audio is compared with the official
generate_voice_clone output within int16 rounding (2 LSB; see tests/service/voices/test_clone_served.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import aiohttp
import numpy as np
import soundfile as sf
from clone_helpers import assert_matches_official, voice_form, wav_bytes
from conftest import start_server

from tests.oracle import clone_fixtures as fx

REPO = Path(__file__).resolve().parents[2]
ENV = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}


def test_synthesize_clones_a_reference_file(tmp_path):
    refs, c = fx.references("base"), fx.info("base")["cases"]["icl_a_stream"]
    ref = tmp_path / "ref.wav"
    ref.write_bytes(wav_bytes(refs["ref/a/wav"].numpy()))
    out = tmp_path / "out.wav"
    proc = subprocess.run(
        [sys.executable, "-m", "clients.cli", "synthesize", "--device", "cpu", "--preset", "tiny",
         "--checkpoint", str(fx.checkpoint_dir("base")), "--ref-audio", str(ref), "--ref-text", c["ref_text"],
         "--language", c["language"], "--text", c["text"], "--temperature", "0", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env=ENV, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    audio, rate = sf.read(out, dtype="float32")
    assert rate == 24000
    assert_matches_official(audio, refs["case/icl_a_stream/wav"].numpy())
    missing = subprocess.run(
        [sys.executable, "-m", "clients.cli", "synthesize", "--device", "cpu", "--preset", "tiny",
         "--checkpoint", str(fx.checkpoint_dir("base")), "--ref-audio", str(ref), "--text", "Hi.",
         "--out", str(tmp_path / "x.wav")], capture_output=True, text=True, timeout=300, env=ENV, cwd=REPO)
    assert missing.returncode == 2 and "--ref-text" in missing.stderr


async def test_say_speaks_with_a_saved_voice(base_engine, tmp_path):  # noqa: F811
    refs, c = fx.references("base"), fx.info("base")["cases"]["icl_a_stream"]
    server = await start_server(base_engine, tmp_path / "data")
    try:
        async with aiohttp.ClientSession() as http:
            form = voice_form("carol", wav_bytes(refs["ref/a/wav"].numpy()), c["ref_text"])
            async with http.post(server.url + "/v1/audio/voices", data=form) as r:
                assert r.status == 201, await r.text()
            async with http.post(server.url + "/v1/audio/speech",
                                 json={"input": c["text"], "voice": "carol", "response_format": "pcm",
                                       "temperature": 0}) as r:
                assert r.status == 200
                expected = np.frombuffer(await r.read(), dtype="<i2").astype(np.float32) / 32768
        out = tmp_path / "say.wav"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "clients.cli", "say", "--url", server.url, "--voice", "carol", "--temperature", "0", "--out", str(out),
            c["text"], stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=ENV, cwd=REPO)
        _, stderr = await asyncio.wait_for(proc.communicate(), timeout=120)
        assert proc.returncode == 0, stderr.decode()
    finally:
        await server.stop()
    audio, rate = sf.read(out, dtype="float32")
    assert rate == 24000 and len(audio) == len(expected) > 0
    # the saved voice over WebSocket = the saved voice over HTTP (both greedy, in-context)
    np.testing.assert_allclose(audio, expected, atol=1 / 32768, rtol=0)
    assert np.abs(audio).max() > 1e-3
