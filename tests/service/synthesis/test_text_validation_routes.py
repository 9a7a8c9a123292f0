"""One text validation for every route: text holding a lone surrogate (``"\\ud800x"`` in JSON,
not valid Unicode) is refused by every door that takes text - a 4xx JSON error on HTTP, an
error message on a socket that keeps working - and never reaches the engine (no 5xx).

Real server on the tiny engine, real aiohttp / websockets clients."""

from __future__ import annotations

import json

import aiohttp
import pytest
import websockets
from dialect_helpers import CARTESIA_PATH, cartesia_request, next_message, ws_base

BAD = "\ud800x"  # json.dumps writes it as the escape "\ud800x"

HTTP_ROUTES = [  # (path, the text's field, other fields)
    ("/v1/audio/speech", "input", {}),
    ("/v1/audio/speech", "input", {"stream_format": "sse"}),
    ("/v1/jobs", "input", {}),
    ("/v1/text-to-speech/default/stream", "text", {}),
    ("/v1/text-to-speech/default/stream/with-timestamps", "text", {}),
    ("/v1/text-to-speech/default/stream?output_format=pcm_24000", "text", {"model_id": "eleven_flash_v2_5"}),
    ("/v1/text-to-speech/default", "text", {}),
    ("/v1/text-to-speech/default/with-timestamps", "text", {}),
    ("/tts/bytes", "transcript", {"model_id": "sonic-2", "voice": {"mode": "id", "id": "default"},
                                  "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}}),
    ("/tts/sse", "transcript", {"model_id": "sonic-2", "voice": {"mode": "id", "id": "default"},
                                "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}}),
    ("/v1/speak?model=aura-2-default-en", "text", {}),
]


@pytest.mark.parametrize("path, field, extra", HTTP_ROUTES)
async def test_http_routes_refuse_a_lone_surrogate_with_a_4xx(server, path, field, extra):
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + path, json={field: BAD, **extra}) as response:
            payload = await response.json()
            assert 400 <= response.status < 500, (response.status, payload)
            assert "surrogate" in json.dumps(payload)
        async with http.post(server.url + path, json={field: "Fine.", **extra}) as response:
            assert response.status < 300  # the same route serves valid text
            await response.read()


async def test_sockets_refuse_a_lone_surrogate_and_keep_serving(server):
    base = ws_base(server)
    async with websockets.connect(server.ws_url) as ws:  # streamvox /v1/stream
        await next_message(ws)  # session.created
        await ws.send(json.dumps({"type": "input.text", "text": BAD}))
        assert (await next_message(ws))["type"] == "error"
    async with websockets.connect(base + "/v1/audio/speech/stream") as ws:  # vllm-omni
        await ws.send(json.dumps({"type": "session.config"}))
        await ws.send(json.dumps({"type": "input.text", "text": BAD}))
        assert (await next_message(ws))["type"] == "error"
    async with websockets.connect(base + CARTESIA_PATH) as ws:
        await ws.send(cartesia_request("c", BAD, False))
        assert (await next_message(ws))["type"] == "error"
        await ws.send(cartesia_request("c", "Fine.", False))
        while (message := await next_message(ws))["type"] != "done":
            assert message["type"] == "chunk", message
    async with websockets.connect(base + "/v1/text-to-speech/default/multi-stream-input") as ws:
        await ws.send(json.dumps({"text": BAD, "context_id": "c"}))
        assert "error" in await next_message(ws)
    async with websockets.connect(base + "/v1/speak") as ws:  # Deepgram
        assert (await next_message(ws))["type"] == "Metadata"
        await ws.send(json.dumps({"type": "Speak", "text": BAD}))
        assert (await next_message(ws))["type"] == "Error"


async def test_the_work_check_refuses_text_no_route_validated(server):
    """The last gate: whatever route forgets to validate, the work check answers 400."""
    from service.errors import ApiError
    from service.synthesis.params import SynthesisParams
    from service.synthesis.plan import check_work

    state = server.state
    with pytest.raises(ApiError) as info:
        check_work(state.engine, BAD, SynthesisParams(), state.settings)
    assert info.value.status == 400
