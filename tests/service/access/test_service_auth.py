"""API keys (HTTP bearer; WS header, subprotocol or ?token=) and CORS."""

from __future__ import annotations

import json

import aiohttp
import pytest
import websockets
from conftest import start_server

from clients.client import StreamvoxClient, StreamvoxError

KEY = "s3cret-key"


@pytest.fixture
async def keyed_server(engine, tmp_path):
    live = await start_server(engine, tmp_path / "data", api_keys=(KEY, "other-key"))
    yield live
    await live.stop()


async def status_of(http, url, **kwargs):
    async with http.get(url, **kwargs) as response:
        body = await response.json(content_type=None) if response.status >= 400 else None
        return response.status, body


async def test_http_requires_a_valid_key_except_probes(keyed_server):
    url = keyed_server.url
    async with aiohttp.ClientSession() as http:
        assert (await status_of(http, url + "/healthz"))[0] == 200
        assert (await status_of(http, url + "/readyz"))[0] == 200
        assert (await status_of(http, url + "/metrics"))[0] == 200  # metrics auth is off by default
        status, body = await status_of(http, url + "/v1/models")
        assert (status, body["error"]["code"]) == (401, "unauthorized")
        status, _ = await status_of(http, url + "/v1/models", headers={"Authorization": "Bearer wrong"})
        assert status == 401
        assert (await status_of(http, url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}))[0] == 200
        assert (await status_of(http, url + "/v1/voices", headers={"Authorization": "Bearer other-key"}))[0] == 200


async def test_metrics_auth_when_enabled(engine, tmp_path):
    live = await start_server(engine, tmp_path / "data", api_keys=(KEY,), metrics_auth=True)
    try:
        async with aiohttp.ClientSession() as http:
            assert (await status_of(http, live.url + "/metrics"))[0] == 401
            assert (await status_of(http, live.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}))[0] == 200
    finally:
        await live.stop()


async def test_ws_without_key_gets_unauthorized_and_1008(keyed_server):
    async with websockets.connect(keyed_server.ws_url) as ws:
        reply = json.loads(await ws.recv())
        assert (reply["type"], reply["code"]) == ("error", "unauthorized")
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await ws.recv()
    assert closed.value.rcvd.code == 1008


@pytest.mark.parametrize("how", ["header", "subprotocol", "query"])
async def test_ws_accepts_key_three_ways(keyed_server, how):
    url, kwargs = keyed_server.ws_url, {}
    if how == "header":
        kwargs["additional_headers"] = {"Authorization": f"Bearer {KEY}"}
    elif how == "subprotocol":  # what a browser can do
        kwargs["subprotocols"] = ["streamvox", f"bearer.{KEY}"]
    else:
        url += f"?token={KEY}"
    async with websockets.connect(url, **kwargs) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        if how == "subprotocol":
            assert ws.subprotocol == "streamvox"


async def test_client_library_passes_the_key(keyed_server):
    async with StreamvoxClient(keyed_server.url, api_key=KEY) as client:
        result = await client.say("Authorized speech.")
        assert result.utterances[0].samples > 0
        assert (await client.voices())["voices"]
    async with StreamvoxClient(keyed_server.url, api_key="bad") as client:
        with pytest.raises(StreamvoxError) as error:
            await client.models()
        assert (error.value.status, error.value.code) == (401, "unauthorized")
        with pytest.raises(StreamvoxError) as error:
            await client.say("Not authorized.")
        assert error.value.code == "unauthorized"


async def test_cors_only_for_configured_origins(engine, tmp_path):
    live = await start_server(engine, tmp_path / "data", cors_origins=("https://app.example",))
    try:
        async with aiohttp.ClientSession() as http:
            preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
            async with http.options(live.url + "/v1/audio/speech", headers=preflight) as response:
                assert response.status == 204
                assert response.headers["Access-Control-Allow-Origin"] == "https://app.example"
                assert "POST" in response.headers["Access-Control-Allow-Methods"]
            async with http.get(live.url + "/v1/voices", headers={"Origin": "https://app.example"}) as response:
                assert response.headers["Access-Control-Allow-Origin"] == "https://app.example"
                assert "X-Request-Id" in response.headers["Access-Control-Expose-Headers"]
            async with http.get(live.url + "/v1/voices", headers={"Origin": "https://evil.example"}) as response:
                assert "Access-Control-Allow-Origin" not in response.headers
    finally:
        await live.stop()


async def test_cors_off_by_default(server):
    async with aiohttp.ClientSession() as http:
        async with http.get(server.url + "/v1/voices", headers={"Origin": "https://app.example"}) as response:
            assert response.status == 200
            assert "Access-Control-Allow-Origin" not in response.headers
