"""The saved-voice stores keep one namespace per owner (files under --data-dir, and a real
PostgreSQL): names unique per owner, pages in (name, owner) order, caps checked with the
insert. Voices saved before owners existed (the old file layout, a schema-v1 database) come
through the upgrade unowned: with keys on, only admin keys see and use them."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import asyncpg
import numpy as np
import pytest
from conftest import start_server
from safetensors.numpy import save as save_tensors

from service.db.postgres import Database
from service.db.schema import MIGRATIONS
from service.voices.store import FileVoiceStore, SavedVoice, VoiceExists, VoiceLimitReached
from service.voices.store_postgres import PostgresVoiceStore

A, B = "key:" + "a" * 32, "key:" + "b" * 32


def voice(name: str, owner: str | None, seed: int = 0) -> SavedVoice:
    rng = np.random.default_rng(seed)
    return SavedVoice(name=name, owner=owner, xvector=rng.standard_normal(8).astype(np.float32),
                      codes=rng.integers(0, 64, (3, 4)), ref_text=f"{name} of {owner}")


@pytest.fixture(params=["files", "postgresql"])
async def voices(request, tmp_path):
    if request.param == "files":
        yield FileVoiceStore(tmp_path / "voices")
        return
    db = Database(request.getfixturevalue("pg_url"), pool_size=4)
    await db.open()
    try:
        yield PostgresVoiceStore(db)
    finally:
        await db.close()


async def test_names_are_unique_per_owner_and_never_cross(voices):
    for owner in (A, B, None):
        await voices.add(voice("alice", owner, seed=hash(owner) % 100))
    with pytest.raises(VoiceExists):
        await voices.add(voice("alice", A))
    for owner in (A, B, None):
        got = await voices.get("alice", owner)
        assert got.owner == owner and got.ref_text == f"alice of {owner}"
    assert await voices.get("alice", "key:" + "c" * 32) is None
    assert [v.owner for v in (await voices.list(A)).voices] == [A]
    assert await voices.delete("alice", B) and not await voices.delete("alice", B)
    assert await voices.get("alice", A) is not None and await voices.get("alice", None) is not None
    assert await voices.count(A) == 1 and await voices.count(any_owner=True) == 2


async def test_pages_cover_every_voice_once_in_order(voices):
    names = {A: ["d", "a", "c"], B: ["a", "b"], None: ["c"]}
    for owner, owned in names.items():
        for name in owned:
            await voices.add(voice(name, owner))
    for owner, any_owner, expected in ((A, False, 3), (B, False, 2), (None, True, 6)):
        seen, after = [], None
        while True:
            page = await voices.list(owner, any_owner=any_owner, limit=2, after=after)
            assert len(page.voices) <= 2
            seen += [(v.name, v.owner) for v in page.voices]
            if (after := page.next_after) is None:
                break
        assert len(seen) == expected == len(set(seen))
        assert [name for name, _ in seen] == sorted(name for name, _ in seen)


async def test_caps_hold_under_concurrent_adds(voices):
    async def add(i: int, owner: str):
        try:
            await voices.add(voice(f"v{i}", owner), max_per_owner=3, max_total=5)
            return "added"
        except VoiceLimitReached as exc:
            return str(exc)
    results = await asyncio.gather(*(add(i, A) for i in range(10)), *(add(i, B) for i in range(10)))
    assert results.count("added") == 5
    assert await voices.count(A) <= 3 and await voices.count(B) <= 3 and await voices.count(any_owner=True) == 5
    assert all("limit" in r for r in results if r != "added")


async def _schema_v1_database_with_a_voice(url: str, old: SavedVoice) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("CREATE TABLE streamvox_schema (version integer NOT NULL)")
        await conn.execute(MIGRATIONS[0].postgresql)
        await conn.execute("INSERT INTO streamvox_schema VALUES (1)")
        meta = {k: getattr(old, k) for k in ("name", "ref_text", "consent", "speaker_description", "audio_sha256",
                                             "seconds", "created_at")}  # as v1 wrote it: no owner
        await conn.execute("INSERT INTO voices (name, meta, tensors, created_at) VALUES ($1, $2, $3, $4)", old.name,
                           json.dumps(meta), save_tensors({"xvector": old.xvector, "codes": old.codes}), old.created_at)
    finally:
        await conn.close()


@pytest.mark.parametrize("store", ["files", "postgresql"])
async def test_voices_saved_before_owners_are_admin_only_with_keys_on(store, tmp_path, request):
    """The safe choice for voices of unknown owner: no ordinary key lists or uses them (their
    consent and transcript may be anyone's); admin keys do; with auth off everyone, as before."""
    from tests.oracle import clone_fixtures as fx

    engine = request.getfixturevalue("owned_base_engine")
    features = engine.voice_features(fx.references("base")["ref/a/wav"].numpy().astype(np.float32))
    old = SavedVoice(name="legacy", xvector=features.xvector, codes=features.codes)  # x-vector only
    settings = {}
    if store == "files":
        await FileVoiceStore(tmp_path / "data" / "voices").add(old)  # the layout before owners: voices/<name>.*
    else:
        settings["jobs_db"] = request.getfixturevalue("pg_url")
        await _schema_v1_database_with_a_voice(settings["jobs_db"], old)
    keyed = await start_server(engine, tmp_path / "data", api_keys=("plain-key-0001", "admin.key-0001"), **settings)
    try:
        async with aiohttp.ClientSession() as http:
            for key, visible in (("plain-key-0001", False), ("admin.key-0001", True)):
                headers = {"Authorization": f"Bearer {key}"}
                async with http.get(keyed.url + "/v1/audio/voices", headers=headers) as r:
                    names = [v["name"] for v in (await r.json())["uploaded_voices"]]
                assert names == (["legacy"] if visible else [])
                async with http.post(keyed.url + "/v1/audio/speech", headers=headers,
                                     json={"input": "Hi.", "voice": "legacy", "response_format": "pcm"}) as r:
                    assert r.status == (200 if visible else 400), await r.text()
    finally:
        await keyed.stop()
    open_server = await start_server(engine, tmp_path / "data", **settings)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(open_server.url + "/v1/audio/voices") as r:
                assert [v["name"] for v in (await r.json())["uploaded_voices"]] == ["legacy"]
    finally:
        await open_server.stop()


@pytest.fixture(scope="module")
def owned_base_engine():
    from engines.build import build_engine
    from engines.config import EngineConfig
    from tests.oracle import clone_fixtures as fx

    engine = build_engine(EngineConfig.for_tests(checkpoint=str(fx.checkpoint_dir("base")), max_slots=2))
    engine.start()
    yield engine
    engine.stop()
