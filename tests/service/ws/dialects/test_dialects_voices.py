"""The voice-agent dialects find voices through the one resolver (service/voices/clones.py
``find_voice``) on every release. On a Base (voice-clone) checkpoint a voice is a saved voice of the
caller's: a name that is none is refused before the socket upgrades (ElevenLabs, Deepgram) and by
the HTTP routes, as on the DiT; another key's saved voice is no voice; Deepgram's
``aura-2-<saved voice>-en`` speaks the saved voice as ``model=<saved voice>`` does. Real server
on 127.0.0.1, websockets and aiohttp clients, audio read back with soundfile."""

from __future__ import annotations

import io
import json

import aiohttp
import numpy as np
import pytest
import soundfile as sf
import websockets
from clone_helpers import voice_form, wav_bytes
from conftest import start_server

from tests.oracle import clone_fixtures as fx

KEY_A, KEY_B = "key-a", "key-b"
TEXT = "Hello there."
RAW = {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}


@pytest.fixture
async def base_server(base_engine, tmp_path):
    server = await start_server(base_engine, tmp_path / "data", api_keys=(KEY_A, KEY_B))
    reference = fx.references("base")["ref/a/wav"].numpy()
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + "/v1/audio/voices", data=voice_form("myvoice", wav_bytes(reference)),
                             headers={"Authorization": f"Bearer {KEY_A}"}) as r:
            assert r.status == 201, await r.text()
    yield server
    await server.stop()


async def handshake_status(url: str, headers: dict) -> tuple[int, dict | None]:
    """101 and None when the socket opens; else the refusal's status and JSON body."""
    try:
        async with websockets.connect(url, additional_headers=headers, open_timeout=30):
            return 101, None
    except websockets.InvalidStatus as exc:
        return exc.response.status_code, json.loads(exc.response.body)


async def test_a_voice_that_does_not_exist_is_refused_before_the_upgrade_on_base(base_server):
    ws = base_server.url.replace("http", "ws", 1)
    eleven_a, eleven_b = {"xi-api-key": KEY_A}, {"xi-api-key": KEY_B}
    deepgram_a, deepgram_b = {"Authorization": f"Token {KEY_A}"}, {"Authorization": f"Token {KEY_B}"}
    refused = [  # (url, headers): none of these names a voice this caller can speak in
        (f"{ws}/v1/text-to-speech/nobody/stream-input", eleven_a),
        (f"{ws}/v1/text-to-speech/nobody/multi-stream-input", eleven_a),
        (f"{ws}/v1/text-to-speech/default/stream-input", eleven_a),  # Base's default needs ref_audio
        (f"{ws}/v1/text-to-speech/myvoice/stream-input", eleven_b),  # another key's saved voice
        (f"{ws}/v1/speak?model=nobody", deepgram_a),
        (f"{ws}/v1/speak?model=aura-2-nobody-en", deepgram_a),
        (f"{ws}/v1/speak?model=aura-2-thalia-en", deepgram_a),  # a stock alias: Base has no stock voices
        (f"{ws}/v1/speak?model=aura-2-myvoice-en", deepgram_b),
    ]
    for url, headers in refused:
        status, body = await handshake_status(url, headers)
        assert status == 400, (url, status)
        message = json.dumps(body)
        assert "not a voice of this server" in message and "saved voice" in message, (url, body)
    for url, headers in [(f"{ws}/v1/text-to-speech/myvoice/stream-input", eleven_a),
                         (f"{ws}/v1/text-to-speech/myvoice/multi-stream-input", eleven_a),
                         (f"{ws}/v1/speak?model=myvoice", deepgram_a),
                         (f"{ws}/v1/speak?model=aura-2-myvoice-en", deepgram_a)]:
        assert (await handshake_status(url, headers))[0] == 101, url


async def test_the_http_routes_refuse_it_and_speak_a_saved_voice_by_deepgrams_model_name(base_server):
    a = {"Authorization": f"Bearer {KEY_A}"}
    async with aiohttp.ClientSession() as http:
        for path, body, headers in [
                ("/v1/text-to-speech/nobody", {"text": TEXT}, {"xi-api-key": KEY_A}),
                ("/v1/text-to-speech/myvoice/stream", {"text": TEXT}, {"xi-api-key": KEY_B}),
                ("/v1/speak?model=aura-2-nobody-en", {"text": TEXT}, {"Authorization": f"Token {KEY_A}"}),
                ("/tts/bytes", {"transcript": TEXT, "voice": "nobody", "output_format": RAW}, {"X-API-Key": KEY_A}),
                ("/tts/bytes", {"transcript": TEXT, "voice": "default", "output_format": RAW}, {"X-API-Key": KEY_A}),
                ("/v1/audio/speech", {"input": TEXT, "voice": "nobody"}, a),
                ("/v1/jobs", {"input": TEXT, "voice": "nobody"}, a)]:
            async with http.post(base_server.url + path, json=body, headers=headers) as r:
                assert r.status == 400, (path, r.status, await r.text())
                assert "not a voice of this server" in await r.text() or path == "/v1/jobs", path
        audio = {}
        for model in ("myvoice", "aura-2-myvoice-en"):
            async with http.post(f"{base_server.url}/v1/speak?model={model}&encoding=linear16&container=wav",
                                 json={"text": TEXT}, headers={"Authorization": f"Token {KEY_A}"}) as r:
                assert r.status == 200, await r.text()
                audio[model], rate = sf.read(io.BytesIO(await r.read()), dtype="float32")
                assert rate == 24000 and audio[model].size > 2400 and np.abs(audio[model]).max() > 1e-3
    # WebSocket session.config naming a voice that is none: an error at once, not at the first utterance
    async with websockets.connect(base_server.url.replace("http", "ws", 1) + "/v1/stream",
                                  additional_headers=a) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        await ws.send(json.dumps({"type": "session.config", "voice": "nobody"}))
        error = json.loads(await ws.recv())
        assert error["type"] == "error" and error["message"].startswith("voice:"), error
