"""A sentence is spoken as soon as its end is certain: ``"Hello there. "`` (a terminator and the
whitespace after it) starts its audio on every socket that cuts text into sentences
(``/v1/stream``, vllm-omni's, ElevenLabs', Cartesia's and Deepgram's) without more text, a
flush or ``input.done`` (an abbreviation, ``"Dr. "``, still waits: engines/text/sentences.py; every rule in
tests/engines/models/test_text.py).

Real server on 127.0.0.1 with the tiny DiT (sentence mode), real websockets clients; the wait
for the first audio is a hang guard, not a time limit.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import websockets
from conftest import start_server
from dialect_helpers import CARTESIA_PATH, cartesia_request

HANG_GUARD_S = 120.0


async def first_audio(ws) -> bool:
    """Read until audio arrives (a binary frame, or a vendor's base64 audio)."""
    while True:
        message = await asyncio.wait_for(ws.recv(), HANG_GUARD_S)
        if isinstance(message, bytes):
            return True
        data = json.loads(message)
        if data.get("audio") or data.get("type") == "chunk":
            return True
        assert data.get("type") not in ("error", "Error") and "error" not in data, data


async def open_socket(url: str, surface: str):
    """The socket of ``surface``, configured, ready for text; and how to send text without ending it."""
    base = url.replace("http://", "ws://")
    if surface == "stream":
        ws = await websockets.connect(base + "/v1/stream")
        await ws.recv()  # session.created
        return ws, lambda text: json.dumps({"type": "input.text", "text": text})
    if surface == "omni":
        ws = await websockets.connect(base + "/v1/audio/speech/stream")
        await ws.send(json.dumps({"type": "session.config", "voice": "default"}))
        return ws, lambda text: json.dumps({"type": "input.text", "text": text})
    if surface == "elevenlabs":
        ws = await websockets.connect(base + "/v1/text-to-speech/default/stream-input?output_format=pcm_24000")
        await ws.send(json.dumps({"text": " "}))
        return ws, lambda text: json.dumps({"text": text})
    if surface == "cartesia":
        ws = await websockets.connect(base + CARTESIA_PATH)
        return ws, lambda text: cartesia_request("turn", text, more=True)
    ws = await websockets.connect(base + "/v1/speak?model=aura-2-default-en&encoding=linear16")
    await ws.recv()  # Metadata
    return ws, lambda text: json.dumps({"type": "Speak", "text": text})


@pytest.mark.parametrize("surface", ["stream", "omni", "elevenlabs", "cartesia", "deepgram"])
async def test_a_finished_sentence_is_spoken_without_more_text(engine, tmp_path, surface):
    live = await start_server(engine, tmp_path / "data")
    try:
        ws, text = await open_socket(live.url, surface)
        try:
            await ws.send(text("Hello there. "))
            assert await first_audio(ws)
        finally:
            await ws.close()
    finally:
        await live.stop()
