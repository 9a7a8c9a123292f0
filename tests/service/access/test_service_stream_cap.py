"""The per-key stream cap is a fairness rule, not a quota: a lone client gets the whole server
(three parallel streamed requests on the default settings all get audio, through the openai
SDK and aiohttp), and only while another key (another address with auth off) has speech in
flight does a key beyond --max-streams-per-key get 429 too_many_streams, whose message names
the flag and which identity is counted. Real server on 127.0.0.1, real clients, audio read
back with soundfile."""

from __future__ import annotations

import asyncio
import io
from contextlib import AsyncExitStack

import aiohttp
import numpy as np
import soundfile as sf
from conftest import start_server, wait_until
from openai import AsyncOpenAI

RATE = 24000
SHORT = "Three streams at once. Each one gets its audio."
# Long enough that a client that stops reading holds its stream open: the audio (about two
# minutes at 48 kHz PCM16) exceeds every buffer on the way, so the server pauses it and waits.
LONG = " ".join(f"Sentence number {i} keeps the stream open for a while." for i in range(40))
DOCUMENTED_429 = {"too_many_streams", "overloaded", "rate_limited"}


def pcm_samples(data: bytes) -> np.ndarray:
    audio, rate = sf.read(io.BytesIO(data), format="RAW", subtype="PCM_16", samplerate=RATE, channels=1,
                          dtype="float32")
    assert rate == RATE
    return audio


async def test_three_parallel_streams_from_one_local_client_all_get_audio_on_the_defaults(server):
    """The openai SDK and aiohttp, three streams each, all open at once (each holds its first
    audio until all three have theirs): none is refused, and every one's audio reads back."""
    assert server.state.settings.max_streams_per_key is None  # the defaults
    barrier = asyncio.Barrier(3)
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

    async def with_openai(seed: int) -> bytes:
        async with client.audio.speech.with_streaming_response.create(
                model="tts-1", voice="alloy", input=SHORT, response_format="pcm",
                extra_body={"stream_format": "audio", "seed": seed}) as response:
            assert response.status_code == 200
            chunks = response.iter_bytes()
            data = await chunks.__anext__()
            await barrier.wait()  # all three streams are open together
            async for piece in chunks:
                data += piece
            return data

    pieces = await asyncio.gather(*(with_openai(seed) for seed in range(3)))
    for data in pieces:
        assert pcm_samples(data).size > RATE // 2 and np.abs(pcm_samples(data)).max() > 0

    barrier = asyncio.Barrier(3)
    async with aiohttp.ClientSession() as http:

        async def with_aiohttp(seed: int) -> tuple[bytes, str | None]:
            body = {"input": SHORT, "response_format": "pcm", "stream_format": "audio", "seed": seed}
            async with http.post(server.url + "/v1/audio/speech", json=body) as response:
                assert response.status == 200, await response.text()
                data = await response.content.readany()
                await barrier.wait()
                return data + await response.read(), response.headers.get("X-Streamvox-Random-Weights")

        results = await asyncio.gather(*(with_aiohttp(seed) for seed in range(3)))
    for data, random in results:
        assert pcm_samples(data).size > RATE // 2
        # the tiny preset runs on random weights: every audio response says so
        assert random and "dit" in random.split(","), random


async def open_and_hold(stack: AsyncExitStack, http: aiohttp.ClientSession, url: str, headers: dict,
                        seed: int) -> aiohttp.ClientResponse:
    """A long streamed request whose first audio arrived; the caller stops reading it (the
    server pauses it once the buffers are full), so it stays open until the stack closes."""
    body = {"input": LONG, "response_format": "pcm", "sample_rate": 48000, "stream_format": "audio", "seed": seed}
    response = await stack.enter_async_context(http.post(url + "/v1/audio/speech", json=body, headers=headers))
    assert response.status == 200, await response.text()
    assert await response.content.readany()
    return response


def released(live):
    async def nothing_in_flight() -> bool:
        return live.state.engine.stats().active_requests == 0

    return nothing_in_flight


async def refusal(http: aiohttp.ClientSession, url: str, headers: dict) -> tuple[int, dict, str | None]:
    body = {"input": SHORT, "response_format": "pcm", "stream_format": "audio"}
    async with http.post(url + "/v1/audio/speech", json=body, headers=headers) as response:
        payload = await response.json() if response.status != 200 else {}
        if response.status == 200:
            await response.read()
        return response.status, payload, response.headers.get("Retry-After")


async def test_fourth_stream_of_a_key_gets_429_naming_the_flag_while_another_key_streams(engine, tmp_path):
    live = await start_server(engine, tmp_path / "data", api_keys=("key-a", "key-b"), max_streams_per_key=3)
    a, b = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
    try:
        async with aiohttp.ClientSession() as http:
            async with AsyncExitStack() as other:
                await open_and_hold(other, http, live.url, b, seed=9)  # key B is streaming
                async with AsyncExitStack() as mine:
                    for seed in range(3):
                        await open_and_hold(mine, http, live.url, a, seed)
                    status, payload, retry_after = await refusal(http, live.url, a)
                    # the server's promise: a 429 with Retry-After and a documented code
                    assert status == 429 and int(retry_after) >= 1, (status, payload)
                    assert payload["error"]["code"] in DOCUMENTED_429
                    message = payload["error"]["message"]
                    assert payload["error"]["code"] == "too_many_streams", payload  # the only limit set here
                    assert "--max-streams-per-key" in message and "STREAMVOX_MAX_STREAMS_PER_KEY" in message
                    assert "per API key" in message and "3" in message, message
                    # key B is not refused for key A's streams
                    status_b, _, _ = await refusal(http, live.url, b)
                    assert status_b == 200

            # Key B is gone (its request released once the server saw the disconnect): key A
            # alone is never capped, its fourth and fifth streams get in.
            await wait_until(released(live), timeout_s=60)
            async with AsyncExitStack() as mine:
                for seed in range(5):
                    await open_and_hold(mine, http, live.url, a, seed)
    finally:
        await live.stop()


async def test_with_auth_off_the_cap_counts_client_addresses_and_says_so(engine, tmp_path):
    """Two loopback addresses (127.0.0.1 and 127.0.0.2) are two clients with auth off."""
    live = await start_server(engine, tmp_path / "data", max_streams_per_key=1)
    try:
        other_address = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
        async with aiohttp.ClientSession() as http, aiohttp.ClientSession(connector=other_address) as elsewhere:
            async with AsyncExitStack() as stack:
                await open_and_hold(stack, http, live.url, {}, seed=1)
                # alone, 127.0.0.1 may stream beyond the cap
                assert (await refusal(http, live.url, {}))[0] == 200
                await open_and_hold(stack, elsewhere, live.url, {}, seed=2)  # 127.0.0.2 streams too
                status, payload, retry_after = await refusal(http, live.url, {})
                assert status == 429 and int(retry_after) >= 1
                assert payload["error"]["code"] == "too_many_streams"
                assert "per client address" in payload["error"]["message"]
                assert "--max-streams-per-key" in payload["error"]["message"]
    finally:
        await live.stop()


def test_cap_arithmetic_and_who_counts_as_another_client():
    from service.errors import ApiError
    from service.access.limits import KeyLimits

    limits = KeyLimits(0, 1, 0, max_streams=2)
    for _ in range(5):
        limits.open_stream("a")  # alone: never refused
    limits.open_whole("b")  # a whole-file request of another client is contention
    try:
        limits.open_stream("a")
        raise AssertionError("the cap did not bind while b had speech in flight")
    except ApiError as exc:
        assert exc.status == 429 and exc.code == "too_many_streams" and exc.headers["Retry-After"] == "1"
    limits.open_stream("b")  # b holds fewer than the cap
    limits.close_whole("b")
    limits.close_stream("b")
    assert not limits.others_active("a")
    assert limits.open_session("c") and limits.others_active("a")  # an open WebSocket session counts too
    limits.close_session("c")
    limits.open_stream("a")
    for _ in range(6):
        limits.close_stream("a")
    assert not limits._streams and not limits._whole and not limits._sessions  # nothing leaks
