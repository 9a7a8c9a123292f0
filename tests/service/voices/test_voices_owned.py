"""Saved voices belong to the API key that uploaded them, on both stores (SQLite/files under
--data-dir and a real PostgreSQL): another key cannot list, use (speech, /v1/stream, the
vllm-omni socket, jobs), delete or take over a key's voice; admin keys see all. Uploads are
rate-limited like other writes and capped per key and in total; the list is paged. Real
servers on 127.0.0.1, real aiohttp clients, the tiny Base (voice-clone) checkpoint."""

from __future__ import annotations

import asyncio
import io
import json

import aiohttp
import pytest
import soundfile as sf
from clone_helpers import voice_form
from conftest import same_pcm16, start_server

from tests.oracle import clone_fixtures as fx

KEY_A, KEY_B, ADMIN = "key-a-0123456789", "key-b-0123456789", "admin.root-0123456789"


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def reference() -> tuple[bytes, str]:
    refs, case = fx.references("base"), fx.info("base")["cases"]["icl_a_stream"]
    buf = io.BytesIO()
    sf.write(buf, refs["ref/a/wav"].numpy(), 24000, format="WAV", subtype="PCM_16")
    return buf.getvalue(), case["ref_text"]


async def upload(http, url: str, key: str | None, name: str, reference) -> tuple[int, dict]:
    async with http.post(url + "/v1/audio/voices", data=voice_form(name, reference[0], reference[1], "A's consent record"),
                         headers=auth(key) if key else {}) as r:
        return r.status, await r.json()


async def listed(http, url: str, key: str, **query) -> dict:
    async with http.get(url + "/v1/audio/voices", params=query, headers=auth(key)) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def speak(http, url: str, key: str, voice: str) -> tuple[int, bytes]:
    body = {"input": "Hello there.", "voice": voice, "temperature": 0, "response_format": "pcm"}
    async with http.post(url + "/v1/audio/speech", json=body, headers=auth(key)) as r:
        return r.status, await r.read()


async def ws_speak(url: str, path: str, key: str, voice: str) -> tuple[list[dict], bytes]:
    events, pcm = [], bytearray()
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(url + path, headers=auth(key), max_msg_size=0) as ws:
            if path == "/v1/stream":
                assert (await ws.receive_json(timeout=30))["type"] == "session.created"
            await ws.send_json({"type": "session.config", "voice": voice, "temperature": 0})
            await ws.send_json({"type": "input.text", "text": "Hello there."})
            await ws.send_json({"type": "input.done"})
            while not events or events[-1]["type"] not in ("session.done", "error"):
                message = await ws.receive(timeout=120)
                if message.type == aiohttp.WSMsgType.BINARY:
                    pcm += message.data
                elif message.type == aiohttp.WSMsgType.TEXT:
                    events.append(json.loads(message.data))
                else:
                    break
    return events, bytes(pcm)


async def test_another_key_cannot_list_use_delete_or_shadow_a_voice(base_engine, reference, store_settings, tmp_path):
    server = await start_server(base_engine, tmp_path / "data", api_keys=(KEY_A, KEY_B, ADMIN), **store_settings)
    try:
        async with aiohttp.ClientSession() as http:
            status, body = await upload(http, server.url, KEY_A, "alice", reference)
            assert status == 201, body
            a_sha = body["voice"]["audio_sha256"]
            # list: B sees nothing of A's (not the name, not ref_text or consent)
            b_list = await listed(http, server.url, KEY_B)
            assert b_list["uploaded_voices"] == [] and "consent record" not in json.dumps(b_list)
            assert [v["name"] for v in (await listed(http, server.url, KEY_A))["uploaded_voices"]] == ["alice"]
            # use: speech, jobs, both WebSocket dialects
            status, a_pcm = await speak(http, server.url, KEY_A, "alice")
            assert status == 200 and len(a_pcm) > 0
            status, raw = await speak(http, server.url, KEY_B, "alice")
            assert status == 400 and json.loads(raw)["error"]["message"].startswith("voice:"), raw[:200]
            async with http.post(server.url + "/v1/jobs", json={"input": "Hi.", "voice": "alice"},
                                 headers=auth(KEY_B)) as r:
                assert r.status == 400 and (await r.json())["error"]["message"].startswith("voice:")
            for path in ("/v1/stream", "/v1/audio/speech/stream"):
                a_events, a_ws = await ws_speak(server.url, path, KEY_A, "alice")
                assert a_ws and not [e for e in a_events if e["type"] == "error"], a_events
                b_events, b_ws = await ws_speak(server.url, path, KEY_B, "alice")
                assert b_ws != a_ws, f"{path}: key B spoke with key A's voice"
            # delete: 404 for B, and A's voice is still there
            async with http.delete(server.url + "/v1/audio/voices/alice", headers=auth(KEY_B)) as r:
                assert r.status == 404 and (await r.json())["error"]["code"] == "voice_not_found"
            # shadow: B's own "alice" is B's alone; A keeps speaking with its own
            status, body = await upload(http, server.url, KEY_B, "alice", reference)
            assert status == 201, body
            a_voices = (await listed(http, server.url, KEY_A))["uploaded_voices"]
            assert [(v["name"], v["audio_sha256"]) for v in a_voices] == [("alice", a_sha)]
            status, again = await speak(http, server.url, KEY_A, "alice")
            assert status == 200 and same_pcm16(again, a_pcm)
            # admin: every key's voices, each with its owner; deletes one named by owner
            everyone = (await listed(http, server.url, ADMIN))["uploaded_voices"]
            assert sorted(v["name"] for v in everyone) == ["alice", "alice"]
            owners = {v["owner"] for v in everyone}
            assert len(owners) == 2 and all(o.startswith("key:") and KEY_A not in o for o in owners)
            async with http.delete(server.url + "/v1/audio/voices/alice", headers=auth(KEY_B)) as r:
                assert r.status == 200  # B's own
            assert [v["name"] for v in (await listed(http, server.url, KEY_A))["uploaded_voices"]] == ["alice"]
            a_owner = [v["owner"] for v in (await listed(http, server.url, ADMIN))["uploaded_voices"]]
            async with http.delete(server.url + "/v1/audio/voices/alice", params={"owner": a_owner[0]},
                                   headers=auth(ADMIN)) as r:
                assert r.status == 200
            assert (await listed(http, server.url, KEY_A))["uploaded_voices"] == []
    finally:
        await server.stop()


async def test_a_flood_of_uploads_is_rate_limited_then_capped(base_engine, reference, store_settings, tmp_path):
    """1,000 uploads from one key: under --rate-limit most are refused before their body is
    read; without it, the per-key cap and then the total cap stop them. Nothing past a cap is stored."""
    server = await start_server(base_engine, tmp_path / "data", api_keys=(KEY_A, KEY_B, ADMIN), rate_limit=1.0,
                                rate_burst=3, max_voices_per_key=2, max_voices=3, **store_settings)
    try:
        async with aiohttp.ClientSession() as http:
            statuses: dict[tuple[int, str], int] = {}

            async def one(i: int) -> None:
                status, body = await upload(http, server.url, KEY_A, f"v{i}", reference)
                code = body.get("error", {}).get("code", "")
                statuses[(status, code)] = statuses.get((status, code), 0) + 1

            for start in range(0, 1000, 50):
                await asyncio.gather(*(one(i) for i in range(start, start + 50)))
            assert sum(statuses.values()) == 1000
            assert statuses.get((201, ""), 0) == 2, statuses  # the cap, within the burst of 3
            assert statuses.get((429, "rate_limited"), 0) >= 990, statuses
            assert set(statuses) <= {(201, ""), (429, "rate_limited"), (429, "too_many_voices")}, statuses
            assert len((await listed(http, server.url, KEY_A))["uploaded_voices"]) == 2
        server.state.limits.rate = 0  # the same server without a rate limit: the caps alone
        async with aiohttp.ClientSession() as http:
            status, body = await upload(http, server.url, KEY_A, "third", reference)
            assert (status, body["error"]["code"]) == (429, "too_many_voices"), body
            assert "2 saved voices" in body["error"]["message"]
            status, _ = await upload(http, server.url, KEY_B, "b1", reference)
            assert status == 201
            status, body = await upload(http, server.url, KEY_B, "b2", reference)  # the server's 3
            assert (status, body["error"]["code"]) == (429, "too_many_voices") and "server holds 3" in body["error"]["message"]
            assert len((await listed(http, server.url, ADMIN))["uploaded_voices"]) == 3
    finally:
        await server.stop()


async def test_the_voice_list_is_paged(base_engine, reference, store_settings, tmp_path):
    server = await start_server(base_engine, tmp_path / "data", api_keys=(KEY_A, KEY_B, ADMIN), max_voice_page=3,
                                **store_settings)
    try:
        async with aiohttp.ClientSession() as http:
            names = ["e1", "a1", "c1", "b1", "d1"]
            for name in names:
                assert (await upload(http, server.url, KEY_A, name, reference))[0] == 201
            assert (await upload(http, server.url, KEY_B, "c1", reference))[0] == 201
            for key, expected in ((KEY_A, sorted(names)), (ADMIN, sorted(names + ["c1"]))):
                seen, after, pages = [], None, 0
                while True:
                    query = {"limit": "2", **({"after": after} if after else {})}
                    page = await listed(http, server.url, key, **query)
                    assert len(page["uploaded_voices"]) <= 2
                    seen += [(v["name"], v.get("owner")) for v in page["uploaded_voices"]]
                    pages += 1
                    after = page["next_after"]
                    if after is None:
                        break
                assert [name for name, _ in seen] == expected and len(set(seen)) == len(seen) and pages == 3
            assert len((await listed(http, server.url, KEY_A))["uploaded_voices"]) == 3  # default: the page cap
            for bad in ("0", "4", "x"):
                async with http.get(server.url + "/v1/audio/voices", params={"limit": bad}, headers=auth(KEY_A)) as r:
                    assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_field"
    finally:
        await server.stop()


async def test_with_auth_off_there_is_one_namespace_as_before(base_engine, reference, tmp_path):
    server = await start_server(base_engine, tmp_path / "data", rate_limit=0.0)
    try:
        async with aiohttp.ClientSession() as http:
            assert (await upload(http, server.url, None, "alice", reference))[0] == 201
            assert (await upload(http, server.url, None, "alice", reference))[0] == 409
            async with http.get(server.url + "/v1/audio/voices") as r:
                body = await r.json()
            assert [v["name"] for v in body["uploaded_voices"]] == ["alice"] and "owner" not in body["uploaded_voices"][0]
            async with http.delete(server.url + "/v1/audio/voices/alice") as r:
                assert r.status == 200
    finally:
        await server.stop()
