"""The talker's prompt-prefix cache, served: a second request of one key that starts with the
same prompt (speaker, language) reuses the first one's KV blocks, with identical greedy audio,
and /metrics counts it; another key's identical request is a miss (prefixes are never shared
across keys). Real server on the oracle CustomVoice checkpoint, real HTTP clients."""

from __future__ import annotations

import aiohttp
from conftest import metric_value, same_pcm16, start_server

BODY = {"input": "Hello there, how are you?", "voice": "ryan", "temperature": 0, "response_format": "pcm",
        "stream": False}
KEYS = ("key-a", "key-b")


async def speak(http: aiohttp.ClientSession, url: str, key: str) -> bytes:
    async with http.post(url + "/v1/audio/speech", json=BODY, headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status == 200, await r.text()
        return await r.read()


async def lookups(url: str, outcome: str) -> float:
    return await metric_value(url, "streamvox_prefix_cache_lookups_total", f'{{outcome="{outcome}"}}',
                              headers={"Authorization": f"Bearer {KEYS[0]}"})


async def test_a_keys_repeated_prompt_is_served_from_the_prefix_cache_and_never_another_keys(talker_engine, tmp_path):
    live = await start_server(talker_engine, tmp_path / "data", api_keys=KEYS)
    try:
        async with aiohttp.ClientSession() as http:
            hits0, misses0 = await lookups(live.url, "hit"), await lookups(live.url, "miss")
            first = await speak(http, live.url, KEYS[0])
            second = await speak(http, live.url, KEYS[0])
            hits1, misses1 = await lookups(live.url, "hit"), await lookups(live.url, "miss")
            assert same_pcm16(second, first) and len(first) > 0  # greedy: a cache hit changes nothing audible
            assert hits1 - hits0 >= 1, (hits0, hits1, misses0, misses1)
            other = await speak(http, live.url, KEYS[1])
            assert same_pcm16(other, first)
            assert await lookups(live.url, "hit") == hits1, "key B was served key A's prefix"
            assert await lookups(live.url, "miss") > misses1
            reused = await metric_value(live.url, "streamvox_prefix_cache_reused_positions_total",
                                        headers={"Authorization": f"Bearer {KEYS[0]}"})
            assert reused > 0
    finally:
        await live.stop()
