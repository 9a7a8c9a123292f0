"""Word timestamps in both job stores (SQLite, and a real PostgreSQL through its schema
migration): written by the attempt holding the lease only, read back as stored."""

from __future__ import annotations

import json

from service.jobs.store.sqlite import SqliteJobStore

WORDS = json.dumps([{"word": "Hello", "start_ms": 0.0, "end_ms": 80.0, "char_start": 0, "char_end": 5},
                    {"word": "\u4f60", "start_ms": 80.0, "end_ms": 160.0, "char_start": 7, "char_end": 8}])


async def test_words_are_fenced_and_kept(job_store):
    job = await job_store.create({"input": "Hello, \u4f60"}, owner="alice")
    assert await job_store.get_words(job.id) is None
    [claimed] = await job_store.claim("a", 1, 30.0)
    assert not await job_store.put_words(job.id, "not-the-token", WORDS)
    assert await job_store.get_words(job.id) is None
    assert await job_store.put_words(job.id, claimed.lease_token, WORDS)
    assert await job_store.finish(job.id, claimed.lease_token, "succeeded", audio_size=0)
    assert json.loads(await job_store.get_words(job.id)) == json.loads(WORDS)
    assert not await job_store.put_words(job.id, claimed.lease_token, "[]")  # finished: no longer the attempt's
    assert await job_store.get_words("0" * 32) is None


async def test_an_older_sqlite_database_gains_the_column(tmp_path):
    import sqlite3

    data = tmp_path / "data"
    data.mkdir()
    db = sqlite3.connect(data / "jobs.sqlite3")  # the first release's table
    db.executescript("CREATE TABLE jobs (id TEXT PRIMARY KEY, status TEXT NOT NULL, params TEXT NOT NULL, "
                     "created_at REAL NOT NULL, started_at REAL, finished_at REAL, error TEXT, "
                     "frames_done INTEGER NOT NULL DEFAULT 0, frames_total INTEGER NOT NULL DEFAULT 0, "
                     "audio_file TEXT, owner TEXT)")
    db.close()
    store = SqliteJobStore(data)
    await store.open()
    try:
        job = await store.create({"input": "x"})
        [claimed] = await store.claim("a", 1, 30.0)
        assert await store.put_words(job.id, claimed.lease_token, WORDS)
        assert await store.get_words(job.id) == WORDS
    finally:
        await store.close()
