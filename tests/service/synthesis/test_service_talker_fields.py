"""What depends on the loaded model (voices, languages) is checked by the engine, in one
function (``Engine.validate``); the service asks it when a body or a ``session.config``
arrives, so a bad language is a 400 (or a WebSocket error) at once, for speech, jobs and
sessions alike. The field ranges are the service's (tests/service/synthesis/test_service_schema.py): the
engine trusts them."""

from __future__ import annotations

import json

import aiohttp
import pytest
import websockets
from conftest import start_server

from engines.contract import InvalidRequest, SynthesisRequest


def test_engine_validate_checks_the_models_voices_and_languages_only(talker_engine):
    engine = talker_engine
    language = engine.pipeline.languages()[-1]  # a real one, not "auto"
    engine.validate(SynthesisRequest(id="a", text="Hi.", voice="alloy", language=language.upper()))
    with pytest.raises(InvalidRequest) as exc:
        engine.validate(SynthesisRequest(id="b", text="Hi.", language="Klingon"))
    assert exc.value.field == "language" and language in exc.value.message
    with pytest.raises(InvalidRequest) as exc:
        engine.validate(SynthesisRequest(id="c", text="Hi.", voice="nobody"))
    assert exc.value.field == "voice" and "alloy" in exc.value.message
    engine.validate(SynthesisRequest(id="d", text="Hi.", steps=0, guidance_scale=99.0))  # ranges: the caller's
    with pytest.raises(InvalidRequest) as exc:  # the talker has no speed: the service time-stretches its audio
        engine.validate(SynthesisRequest(id="e", text="Hi.", speed=1.5))
    assert exc.value.field == "speed" and not engine.capabilities.honours("speed")


async def test_a_bad_language_is_refused_at_once_everywhere(talker_engine, tmp_path):
    server = await start_server(talker_engine, tmp_path / "data")
    try:
        async with aiohttp.ClientSession() as http:
            for path in ("/v1/audio/speech", "/v1/jobs"):
                async with http.post(server.url + path, json={"input": "Hi.", "language": "Klingon"}) as r:
                    error = (await r.json())["error"]
                assert (r.status, error["code"]) == (400, "invalid_field") and error["message"].startswith("language:")
            async with http.get(server.url + "/v1/models") as r:
                model = (await r.json())["data"][0]
            assert (model["pipeline"], model["slots"], model["backend"]) == ("talker", 8, "torch")
        async with websockets.connect(server.url.replace("http://", "ws://") + "/v1/stream") as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            await ws.send(json.dumps({"type": "session.config", "language": "Klingon"}))
            reply = json.loads(await ws.recv())
            assert (reply["type"], reply["code"]) == ("error", "invalid_field") and reply["message"].startswith("language:")
    finally:
        await server.stop()
