"""The job store, run against both implementations: SQLite + files, and a real PostgreSQL.

Claims, leases, fencing, chunked audio, cancel events, retention, quota. The PostgreSQL-only
part: the versioned schema, concurrent claims from many connections, the leader lock, the
password kept out of messages.
"""

from __future__ import annotations

import asyncio
import logging
import time

import asyncpg
import pytest

from conftest import wait_until
from service.errors import StoreUnavailable
from service.jobs.store.base import CANCELLED, LOST, RENEWED, Progress
from service.db.schema import SCHEMA_VERSION
from service.jobs.store.postgres import PostgresJobStore
from service.jobs.store.sqlite import SqliteJobStore

LEASE = 30.0


async def test_records_list_and_counts(job_store):
    first = await job_store.create({"input": "one"}, owner="alice")
    second = await job_store.create({"input": "two", "response_format": "flac"}, owner="bob")
    got = await job_store.get(first.id)
    assert (got.id, got.status, got.params, got.owner) == (first.id, "queued", {"input": "one"}, "alice")
    assert await job_store.get("0" * 32) is None
    assert [job.id for job in await job_store.list()] == [second.id, first.id]  # newest first
    assert [job.id for job in await job_store.list(owner="alice", any_owner=False)] == [first.id]
    assert [job.id for job in await job_store.list(status="queued", limit=1)] == [second.id]
    assert (await job_store.get(second.id)).response_format == "flac"
    assert await job_store.unfinished() == 2 and await job_store.unfinished("bob", any_owner=False) == 1
    assert await job_store.queued() == 2


async def test_any_text_a_request_can_hold_is_stored(job_store):
    """NUL and other control characters, astral-plane characters: a JSON text column holds what
    a jsonb one refuses (\u0000), and an error message quoting them is stored too."""
    text = "a\x00b \x01\x1f \U0001F600 \u202e end"
    job = await job_store.create({"input": text, "voice": "v\x00"}, owner="addr:127.0.0.1")
    assert (await job_store.get(job.id)).params == {"input": text, "voice": "v\x00"}
    [claimed] = await job_store.claim("a", 1, LEASE)
    assert await job_store.finish(job.id, claimed.lease_token, "failed", error=f"bad input {text!s}")
    assert (await job_store.get(job.id)).error.startswith("bad input a")


async def test_claim_takes_the_oldest_once_under_a_lease(job_store):
    jobs = [await job_store.create({"input": f"job {i}"}) for i in range(3)]
    claimed = await job_store.claim("replica-a", 2, LEASE)
    assert [job.id for job in claimed] == [jobs[0].id, jobs[1].id]
    assert all(job.status == "running" and job.lease_owner == "replica-a" and job.attempts == 1 and not job.taken_over
               for job in claimed)
    assert len({job.lease_token for job in claimed}) == 2
    rest = await job_store.claim("replica-b", 5, LEASE)
    assert [job.id for job in rest] == [jobs[2].id]  # a leased job is not claimable again
    assert await job_store.claim("replica-b", 5, LEASE) == []
    assert await job_store.queued() == 0 and await job_store.unfinished() == 3


async def test_audio_is_stored_in_chunks_and_completion_is_fenced(job_store):
    job = await job_store.create({"input": "x", "response_format": "wav"})
    [claimed] = await job_store.claim("a", 1, LEASE)
    token = claimed.lease_token
    assert await job_store.put_audio(job.id, token, 0, b"HEAD" + b"a" * 6)
    assert await job_store.put_audio(job.id, token, 10, b"b" * 10)
    assert await job_store.put_audio(job.id, token, 0, b"head" + b"a" * 6)  # a rewrite of the first chunk
    assert await job_store.renew(job.id, token, LEASE, Progress(5, 10, 0, 1, 0)) == RENEWED
    assert not await job_store.finish(job.id, "not-the-token", "succeeded", audio_size=20)
    assert await job_store.finish(job.id, token, "succeeded", audio_size=20)
    assert not await job_store.finish(job.id, token, "succeeded", audio_size=20)  # once
    done = await job_store.get(job.id)
    assert (done.status, done.audio_size, done.frames_done, done.frames_total) == ("succeeded", 20, 5, 10)
    assert done.created_at <= done.started_at <= done.finished_at
    audio = b"".join([block async for block in job_store.read_audio(done)])
    assert audio == b"head" + b"a" * 6 + b"b" * 10
    assert await job_store.audio_bytes() >= 20
    assert not await job_store.put_audio(job.id, token, 20, b"late")  # finished: no more writes


async def test_an_expired_lease_is_taken_over_and_the_old_attempt_is_fenced_out(job_store):
    job = await job_store.create({"input": "x"})
    [old] = await job_store.claim("dead-replica", 1, LEASE)
    assert await job_store.put_audio(job.id, old.lease_token, 0, b"stale-bytes-from-the-first-attempt")
    job_store.clock.advance(LEASE - 1)
    assert await job_store.claim("b", 1, LEASE) == []  # not expired yet
    job_store.clock.advance(2)
    [new] = await job_store.claim("b", 1, LEASE)
    assert (new.id, new.attempts, new.lease_owner) == (job.id, 2, "b") and new.lease_token != old.lease_token
    assert new.taken_over and not old.taken_over
    # the first attempt wakes up: every write it tries is refused
    assert await job_store.renew(job.id, old.lease_token, LEASE) == LOST
    assert not await job_store.put_audio(job.id, old.lease_token, 0, b"zz")
    assert not await job_store.finish(job.id, old.lease_token, "succeeded", audio_size=2)
    assert not await job_store.release(job.id, old.lease_token)
    assert await job_store.put_audio(job.id, new.lease_token, 0, b"new")
    assert await job_store.finish(job.id, new.lease_token, "succeeded", audio_size=3)
    done = await job_store.get(job.id)
    assert b"".join([b async for b in job_store.read_audio(done)]) == b"new"  # nothing of the old attempt


async def test_a_renewal_extends_the_lease_from_the_renewal(job_store):
    job = await job_store.create({"input": "x"})
    [held] = await job_store.claim("a", 1, LEASE)
    job_store.clock.advance(LEASE - 1)
    assert await job_store.renew(job.id, held.lease_token, LEASE, Progress(1, 2, 0, 1, 0)) == RENEWED
    job_store.clock.advance(LEASE - 1)  # past the first expiry, inside the renewed one
    assert await job_store.claim("b", 1, LEASE) == []
    job_store.clock.advance(2)
    [taken] = await job_store.claim("b", 1, LEASE)
    assert taken.taken_over and (taken.frames_done, taken.frames_total) == (0, 2)
    assert await job_store.renew(job.id, held.lease_token, LEASE) == LOST


async def test_cancel_reaches_the_runner_and_the_renewal(job_store):
    queued = await job_store.create({"input": "q"})
    running = await job_store.create({"input": "r"})
    await job_store.claim("a", 1, LEASE)  # takes `queued` (the older)
    [claimed] = await job_store.claim("a", 1, LEASE)
    assert claimed.id == running.id
    assert await job_store.cancel(queued.id)
    assert await job_store.cancel(running.id)
    assert not await job_store.cancel(running.id)  # already ended
    await wait_until(lambda: ("cancelled", running.id) in job_store.events)
    assert await job_store.renew(running.id, claimed.lease_token, LEASE) == CANCELLED
    assert not await job_store.put_audio(running.id, claimed.lease_token, 0, b"x")
    assert not await job_store.finish(running.id, claimed.lease_token, "succeeded", audio_size=1)
    assert (await job_store.get(running.id)).status == "cancelled"


async def test_release_requeues_and_wakes(job_store):
    job = await job_store.create({"input": "x"})
    await wait_until(lambda: ("queued", None) in job_store.events)
    job_store.events.clear()
    [claimed] = await job_store.claim("a", 1, LEASE)
    assert await job_store.release(job.id, claimed.lease_token)
    assert (await job_store.get(job.id)).status == "queued"
    await wait_until(lambda: ("queued", None) in job_store.events)
    [again] = await job_store.claim("b", 1, LEASE)
    assert again.attempts == 2 and not again.taken_over  # given back, not taken over


async def test_failures_and_retention(job_store):
    bad = await job_store.create({"input": "bad"})
    assert await job_store.cancel(bad.id, "no longer valid")
    assert not await job_store.cancel(bad.id, "twice")
    kept = await job_store.create({"input": "kept"})
    [claimed] = await job_store.claim("a", 1, LEASE)
    await job_store.put_audio(kept.id, claimed.lease_token, 0, b"abc")
    await job_store.finish(kept.id, claimed.lease_token, "succeeded", audio_size=3)
    assert await job_store.delete_finished_before(time.time() - 3600) == 0
    assert await job_store.delete_finished_before(time.time() + 1) == 2
    assert await job_store.get(kept.id) is None and await job_store.get(bad.id) is None
    assert await job_store.audio_bytes() == 0


async def test_a_listing_reads_summaries_not_the_inputs(job_store):
    """GET /v1/jobs over many long jobs: the store's list reads a summary of each (no params, no
    word times), so what it allocates does not grow with the inputs. (Before, every listed job's
    whole input was read and parsed: 150 jobs of 198k characters took 126-162 MB per call.)"""
    import tracemalloc

    text = "Long job input. " * 12_500  # 200,000 characters each
    made = [await job_store.create({"input": text + str(i), "response_format": "flac" if i == 3 else "wav"},
                               frames_total=2000 + i, utterances_total=40) for i in range(24)]
    tracemalloc.start()
    try:
        listed = await job_store.list(limit=100)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < len(text) * 2, peak  # the inputs are 4.8 MB; one would be 200 KB
    assert [job.id for job in listed] == [job.id for job in reversed(made)]
    assert all(job.params == {} for job in listed)  # a summary holds no input
    for job in listed:  # and says what a whole record says
        whole = await job_store.get(job.id)
        assert job.to_json(now=1.0) == whole.to_json(now=1.0)
    assert [job.response_format for job in listed if job.response_format != "wav"] == ["flac"]


async def test_progress_is_planned_at_submit_and_kept_across_attempts(job_store):
    """Frames and utterances planned when the job is made; the first start kept when an attempt
    gives the job back and another resumes it, which starts from what its kept segments hold."""
    job = await job_store.create({"input": "x"}, frames_total=300, utterances_total=3)
    progress = (await job_store.get(job.id)).to_json()["progress"]
    assert (progress["frames_total"], progress["utterances_total"], progress["percent"]) == (300, 3, 0.0)
    [first] = await job_store.claim("a", 1, LEASE)
    assert first.attempts == 1 and first.started_at is not None
    assert await job_store.start_plan(job.id, first.lease_token, "plan", 3) == []
    assert await job_store.put_segment(job.id, first.lease_token, 0, 48_000, 25, b"\0\0" * 48_000, None, "s16")
    assert await job_store.renew(job.id, first.lease_token, LEASE,
                                 Progress(40, 90, 1, 3, 60_000, eta_at=time.time() + 9))
    running = await job_store.get(job.id)
    assert (running.frames_done, running.frames_total, running.utterances_done, running.audio_samples) == \
        (40, 90, 1, 60_000)
    assert 0 < running.to_json()["progress"]["seconds_left"] <= 9 and running.to_json()["progress"]["percent"] == 44.4
    assert [j.frames_done for j in await job_store.list()] == [40]
    assert await job_store.release(job.id, first.lease_token)  # a restart: the part being spoken is lost
    queued = await job_store.get(job.id)
    assert (queued.status, queued.started_at, queued.attempts) == ("queued", first.started_at, 1)
    assert (queued.frames_done, queued.utterances_done, queued.audio_samples) == (25, 1, 48_000)
    assert queued.to_json()["progress"]["seconds_left"] is None
    job_store.clock.advance(5)
    [second] = await job_store.claim("b", 1, LEASE)
    assert (second.attempts, second.started_at, second.frames_done) == (2, first.started_at, 25)
    [kept] = await job_store.start_plan(job.id, second.lease_token, "plan", 3)
    assert (kept.index, kept.samples, kept.frames) == (0, 48_000, 25)
    assert await job_store.read_segment(job.id, 0) == (b"\0\0" * 48_000, "s16")
    assert (await job_store.get(job.id)).to_json()["attempt"] == 2


async def test_what_a_job_keeps_is_counted_and_given_back_when_it_ends(job_store, tmp_path):
    """``stored_bytes`` (the quota's measure) counts a running job's kept segments; when the job
    fails they are dropped and their space goes back: SQLite's file and WAL shrink to what they
    were (incremental vacuum, WAL truncated), PostgreSQL stores none of them."""
    idle = await job_store.stored_bytes()
    job = await job_store.create({"input": "x"})
    [claimed] = await job_store.claim("a", 1, LEASE)
    await job_store.start_plan(job.id, claimed.lease_token, "plan", 8)
    segment = 24_000 * 10 * 2  # 10 s of int16
    for index in range(6):
        assert await job_store.put_segment(job.id, claimed.lease_token, index, segment // 2, 125,
                                       bytes([index]) * segment, None, "s16")
    assert await job_store.put_audio(job.id, claimed.lease_token, 0, b"a" * 100_000)
    assert await job_store.stored_bytes() >= idle + 6 * segment + 100_000
    assert await job_store.finish(job.id, claimed.lease_token, "failed", error="storage_full: test")
    assert await job_store.stored_bytes() <= idle + 64 * 1024
    if job_store.kind == "sqlite":
        on_disk = sum(path.stat().st_size for path in (tmp_path / "data").rglob("*") if path.is_file())
        assert on_disk <= idle + 64 * 1024, on_disk


# -- PostgreSQL only --------------------------------------------------------------------

async def test_schema_is_versioned_and_migrated_once(pg_url):
    stores = [PostgresJobStore(pg_url, pool_size=2) for _ in range(3)]
    await asyncio.gather(*(s.open() for s in stores))  # replicas starting together
    try:
        conn = await asyncpg.connect(pg_url)
        try:
            # each version applied once, in order
            versions = [r[0] for r in await conn.fetch("SELECT version FROM streamvox_schema ORDER BY version")]
            assert versions == list(range(1, SCHEMA_VERSION + 1))
            tables = {r[0] for r in await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
            assert {"jobs", "job_audio", "voices", "streamvox_schema"} <= tables
            await conn.execute("INSERT INTO streamvox_schema VALUES ($1)", SCHEMA_VERSION + 1)
        finally:
            await conn.close()
        newer = PostgresJobStore(pg_url)
        with pytest.raises(RuntimeError, match="newer than this streamvox"):
            await newer.open()
    finally:
        await asyncio.gather(*(s.close() for s in stores))


async def test_concurrent_claims_from_many_replicas_take_each_job_once(pg_url):
    stores = [PostgresJobStore(pg_url, pool_size=4) for _ in range(4)]
    for s in stores:
        await s.open()
    try:
        created = [await stores[0].create({"input": f"{i}"}) for i in range(60)]

        async def drain(s: PostgresJobStore, worker: str) -> list[str]:
            taken = []
            while batch := await s.claim(worker, 2, LEASE):
                taken += [job.id for job in batch]
            return taken

        results = await asyncio.gather(*(drain(s, f"r{i}-{k}") for i, s in enumerate(stores) for k in range(3)))
        taken = [job_id for result in results for job_id in result]
        assert sorted(taken) == sorted(job.id for job in created)  # every job, none twice
        assert sum(1 for result in results if result) > 1  # really concurrent
    finally:
        for s in stores:
            await s.close()


async def test_one_leader_and_a_successor(pg_url):
    first, second = PostgresJobStore(pg_url), PostgresJobStore(pg_url)
    await first.open()
    await second.open()
    try:
        assert [first.leader, second.leader] == [True, False]
        await first.close()  # its listening connection, and the lock, go
        await second.maintain()
        assert second.leader
    finally:
        await second.close()


async def test_cancel_on_one_replica_is_heard_by_another(pg_url):
    here, there = PostgresJobStore(pg_url), PostgresJobStore(pg_url)
    heard = []
    there.set_listener(lambda event, job_id: heard.append((event, job_id)))
    await here.open()
    await there.open()
    try:
        job = await here.create({"input": "x"})
        await wait_until(lambda: ("queued", None) in heard)
        await there.claim("there", 1, LEASE)
        await here.cancel(job.id)
        await wait_until(lambda: ("cancelled", job.id) in heard)
    finally:
        await here.close()
        await there.close()


async def test_an_unreachable_database_is_store_unavailable_without_the_password(postgres, caplog):
    caplog.set_level(logging.DEBUG)
    url = f"postgresql://streamvox:s3cr3t-pw@127.0.0.1:{postgres.port + 1}/postgres"  # nothing listens there
    store = PostgresJobStore(url)
    assert "s3cr3t-pw" not in repr(store)
    with pytest.raises(StoreUnavailable) as raised:
        await store.open()
    assert "s3cr3t-pw" not in str(raised.value) and "***" in str(raised.value)
    with pytest.raises(StoreUnavailable):
        await store.get("0" * 32)
    assert "s3cr3t-pw" not in caplog.text


async def test_saved_voices_live_in_the_same_store(job_store, tmp_path):
    """Both backends keep a voice's tensors exactly and refuse a second voice of a name."""
    import numpy as np

    from service.voices.store import SavedVoice, VoiceExists

    voices = job_store.voice_store(tmp_path / "data")
    rng = np.random.default_rng(0)
    alice = SavedVoice(name="alice", xvector=rng.standard_normal(192).astype(np.float32),
                       codes=rng.integers(0, 2048, (22, 16)), ref_text="Hello\x00 there.", consent="yes", seconds=1.75)
    await voices.add(alice)
    with pytest.raises(VoiceExists):
        await voices.add(alice)
    got = await voices.get("alice", None)
    np.testing.assert_array_equal(got.xvector, alice.xvector)
    np.testing.assert_array_equal(got.codes, alice.codes)
    assert got.codes.dtype == np.int64 and got.describe() == alice.describe()
    assert [v.name for v in (await voices.list()).voices] == ["alice"]
    assert await voices.get("nobody", None) is None and await voices.get("../etc", None) is None
    assert await voices.delete("alice", None) and not await voices.delete("alice", None)
    assert (await voices.list()).voices == []


async def test_a_sqlite_store_from_before_leases_opens_with_its_jobs_and_audio(tmp_path):
    """An upgrade: the database and audio files of the previous release (no lease or size
    columns; a succeeded job's audio at audio/<id>.wav; a job left running by a crash)."""
    import sqlite3

    data = tmp_path / "data"
    (data / "audio").mkdir(parents=True)
    old = sqlite3.connect(data / "jobs.sqlite3")
    old.executescript("""
        CREATE TABLE jobs (id TEXT PRIMARY KEY, status TEXT NOT NULL, params TEXT NOT NULL, created_at REAL NOT NULL,
            started_at REAL, finished_at REAL, error TEXT, frames_done INTEGER NOT NULL DEFAULT 0,
            frames_total INTEGER NOT NULL DEFAULT 0, audio_file TEXT, owner TEXT);
        INSERT INTO jobs (id, status, params, created_at, finished_at, audio_file)
            VALUES ('aa' || printf('%030d', 0), 'succeeded', '{"input": "old"}', 1, 2, 'aa000000000000000000000000000000.wav');
        INSERT INTO jobs (id, status, params, created_at, started_at)
            VALUES ('bb' || printf('%030d', 0), 'running', '{"input": "crashed"}', 3, 4);
    """)
    old.commit()
    old.close()
    (data / "audio" / "aa000000000000000000000000000000.wav").write_bytes(b"RIFF-old-audio")
    store = SqliteJobStore(data)
    await store.open()
    try:
        assert await store.requeue_interrupted() == 1
        done = await store.get("aa" + "0" * 30)
        assert done.status == "succeeded"
        assert b"".join([block async for block in store.read_audio(done)]) == b"RIFF-old-audio"
        [claimed] = await store.claim("new-replica", 5, LEASE)
        assert (claimed.id, claimed.attempts) == ("bb" + "0" * 30, 1)
    finally:
        await store.close()


async def test_passwords_come_from_a_file_or_the_environment_and_a_wrong_one_is_a_503(engine, tmp_path, monkeypatch,
                                                                                      caplog):
    """A server that requires a password (scram-sha-256): the store logs in with the password
    given apart from the URL (--jobs-db-password-file, or libpq's PGPASSWORD); a wrong one makes
    the store unavailable - job requests a 503, never a 500 - and no message holds a password."""
    import aiohttp
    from conftest import start_server
    from testsupport.postgres import start_postgres

    caplog.set_level(logging.DEBUG)
    server = start_postgres(password="right-pw-123")
    try:
        url = server.url()  # no password in it
        from_file = PostgresJobStore(url, password="right-pw-123")
        await from_file.open()
        assert (await from_file.create({"input": "x"})).status == "queued"
        await from_file.close()
        monkeypatch.setenv("PGPASSWORD", "right-pw-123")
        from_env = PostgresJobStore(url)
        await from_env.open()
        assert await from_env.queued() == 1
        await from_env.close()

        monkeypatch.setenv("PGPASSWORD", "wrong-pw-456")
        with pytest.raises(StoreUnavailable, match="password authentication failed"):
            await PostgresJobStore(url).open()
        live = await start_server(engine, tmp_path / "data", jobs_db=url)
        try:
            async with aiohttp.ClientSession() as http:
                async with http.get(live.url + "/v1/jobs") as response:
                    assert response.status == 503 and response.headers["Retry-After"]
                    assert (await response.json())["error"]["code"] == "database_unavailable"
                async with http.get(live.url + "/readyz") as response:
                    assert response.status == 503
                    assert "password authentication failed" in (await response.json())["jobs_db"]["error"]
        finally:
            await live.stop()
        assert "wrong-pw-456" not in caplog.text and "right-pw-123" not in caplog.text
    finally:
        server.cleanup()
