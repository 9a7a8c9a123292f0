"""One versioned migration list for both stores (service/db/schema.py): a database made by an
older streamvox, SQLite or PostgreSQL, upgrades with its rows kept, ends in the shape a new
database has, records each version once, and a second start changes nothing."""

from __future__ import annotations

import json
import sqlite3

import asyncpg
import pytest

from service.db.postgres import Database
from service.db.schema import MIGRATIONS, SCHEMA_VERSION, SchemaTooNew
from service.db.sqlite import migrate
from service.jobs.store.postgres import PostgresJobStore
from service.jobs.store.sqlite import SqliteJobStore

OLD_ID = "a" * 32
# The SQLite jobs table as releases before versions left it (their own DDL, as they wrote it).
FIRST_RELEASE = """CREATE TABLE jobs (id TEXT PRIMARY KEY, status TEXT NOT NULL, params TEXT NOT NULL,
    created_at REAL NOT NULL, started_at REAL, finished_at REAL, error TEXT, frames_done INTEGER NOT NULL DEFAULT 0,
    frames_total INTEGER NOT NULL DEFAULT 0, audio_file TEXT);
CREATE INDEX jobs_status_created ON jobs (status, created_at);"""
LEASES = ("ALTER TABLE jobs ADD COLUMN owner TEXT; ALTER TABLE jobs ADD COLUMN audio_size INTEGER; "
          "ALTER TABLE jobs ADD COLUMN attempts INTEGER NOT NULL DEFAULT 0; ALTER TABLE jobs ADD COLUMN lease_owner TEXT; "
          "ALTER TABLE jobs ADD COLUMN lease_token TEXT; ALTER TABLE jobs ADD COLUMN lease_expires REAL;")
WORDS = "ALTER TABLE jobs ADD COLUMN words TEXT;"
LONG_JOBS = """ALTER TABLE jobs ADD COLUMN plan_key TEXT; ALTER TABLE jobs ADD COLUMN utterances_total INTEGER NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN utterances_done INTEGER NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN audio_samples INTEGER NOT NULL DEFAULT 0;
CREATE TABLE job_segments (job_id TEXT NOT NULL, idx INTEGER NOT NULL, samples INTEGER NOT NULL, pcm BLOB NOT NULL,
    words TEXT, PRIMARY KEY (job_id, idx));"""
UNVERSIONED_SQLITE = {
    "first release": FIRST_RELEASE,
    "with owners": FIRST_RELEASE + "ALTER TABLE jobs ADD COLUMN owner TEXT;",
    "with leases": FIRST_RELEASE + LEASES,
    "with words": FIRST_RELEASE + LEASES + WORDS,
    "with long jobs": FIRST_RELEASE + LEASES + WORDS + LONG_JOBS,  # the last release before versions
}


def _sqlite_shape(path) -> dict:
    db = sqlite3.connect(path)
    try:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
        shape = {table: sorted(tuple(r)[1:] for r in db.execute(f"PRAGMA table_info({table})"))
                 for table in tables}
        shape["indexes"] = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'index' ORDER BY name")]
        return shape
    finally:
        db.close()


def _versions(path) -> list[int]:
    db = sqlite3.connect(path)
    try:
        return [r[0] for r in db.execute("SELECT version FROM streamvox_schema ORDER BY rowid")]
    finally:
        db.close()


def _auto_vacuum(path) -> int:
    db = sqlite3.connect(path)
    try:
        return db.execute("PRAGMA auto_vacuum").fetchone()[0]
    finally:
        db.close()


async def _open_and_close(store) -> None:
    await store.open()
    await store.close()


@pytest.mark.parametrize("release", list(UNVERSIONED_SQLITE))
async def test_an_unversioned_sqlite_database_upgrades_with_its_rows(release, tmp_path):
    fresh = tmp_path / "fresh"
    await _open_and_close(SqliteJobStore(fresh))
    data = tmp_path / "old"
    data.mkdir()
    old = sqlite3.connect(data / "jobs.sqlite3")
    old.executescript(UNVERSIONED_SQLITE[release])
    old.execute("INSERT INTO jobs (id, status, params, created_at, finished_at, error) VALUES (?, 'failed', ?, 1, 2, 'x')",
                (OLD_ID, json.dumps({"input": "kept", "response_format": "flac"})))
    old.commit()
    old.close()

    store = SqliteJobStore(data)
    await store.open()
    try:
        job = await store.get(OLD_ID)
        assert (job.status, job.params["input"], job.response_format, job.error) == ("failed", "kept", "flac", "x")
        assert job.corrupt is None
        [listed] = await store.list()  # a summary: a row from before the format's column reads it from params
        assert listed.to_json() == job.to_json() and listed.response_format == "flac"
        new = await store.create({"input": "new"}, owner="k")  # every column the code writes exists
        [claimed] = await store.claim("r", 1, 30.0)
        assert claimed.id == new.id
        assert await store.put_words(new.id, claimed.lease_token, "[]")
        assert await store.start_plan(new.id, claimed.lease_token, "plan", 2) == []
        assert await store.put_segment(new.id, claimed.lease_token, 0, 4, 1, b"\0" * 8, None, "s16")
    finally:
        await store.close()
    assert _sqlite_shape(data / "jobs.sqlite3") == _sqlite_shape(fresh / "jobs.sqlite3")
    assert _versions(data / "jobs.sqlite3") == [step.version for step in MIGRATIONS]
    assert _auto_vacuum(data / "jobs.sqlite3") == _auto_vacuum(fresh / "jobs.sqlite3") == 2  # INCREMENTAL

    await _open_and_close(SqliteJobStore(data))  # a second start: nothing to do
    assert _versions(data / "jobs.sqlite3") == [step.version for step in MIGRATIONS]
    db = sqlite3.connect(data / "jobs.sqlite3", isolation_level=None)
    try:
        assert migrate(db) == SCHEMA_VERSION
    finally:
        db.close()


async def test_a_sqlite_database_at_an_older_version_takes_only_the_later_steps(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    db = sqlite3.connect(data / "jobs.sqlite3")  # made by a streamvox whose list ended at v2
    db.executescript(MIGRATIONS[0].sqlite + MIGRATIONS[1].sqlite +
                     "CREATE TABLE streamvox_schema (version INTEGER NOT NULL); INSERT INTO streamvox_schema VALUES (1), (2);")
    db.execute("INSERT INTO jobs (id, status, params, created_at, owner) VALUES (?, 'queued', '{}', 1, 'k')", (OLD_ID,))
    db.commit()
    db.close()
    store = SqliteJobStore(data)
    await store.open()
    try:
        [claimed] = await store.claim("r", 1, 30.0)
        assert (claimed.id, claimed.owner, claimed.utterances_total) == (OLD_ID, "k", 0)
    finally:
        await store.close()
    assert _versions(data / "jobs.sqlite3") == [step.version for step in MIGRATIONS]


async def test_a_sqlite_database_from_a_newer_streamvox_is_refused_untouched(tmp_path):
    data = tmp_path / "data"
    await _open_and_close(SqliteJobStore(data))
    db = sqlite3.connect(data / "jobs.sqlite3")
    db.execute("INSERT INTO streamvox_schema VALUES (?)", (SCHEMA_VERSION + 1,))
    db.commit()
    db.close()
    before = _sqlite_shape(data / "jobs.sqlite3")
    store = SqliteJobStore(data)
    with pytest.raises(SchemaTooNew, match="newer than this streamvox"):
        await store.open()
    await store.close()
    assert _sqlite_shape(data / "jobs.sqlite3") == before


async def _pg_shape(conn) -> dict:
    rows = await conn.fetch("SELECT table_name, column_name, data_type, is_nullable, column_default "
                            "FROM information_schema.columns WHERE table_schema = 'public' ORDER BY 1, 2")
    indexes = await conn.fetch("SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'public' ORDER BY 1")
    return {"columns": [tuple(r) for r in rows], "indexes": [tuple(r) for r in indexes]}


async def test_a_postgresql_database_at_v1_upgrades_with_its_rows(postgres):
    fresh_url, old_url = postgres.create_database(), postgres.create_database()
    fresh = Database(fresh_url, pool_size=1)
    await fresh.open()
    await fresh.close()
    conn = await asyncpg.connect(old_url)
    try:  # the first versioned release's database: v1 applied, a job and an (unowned) voice in it
        await conn.execute("CREATE TABLE streamvox_schema (version integer NOT NULL)")
        await conn.execute(MIGRATIONS[0].postgresql)
        await conn.execute("INSERT INTO streamvox_schema VALUES (1)")
        await conn.execute("INSERT INTO jobs (id, status, params, created_at, finished_at, audio_size) "
                           "VALUES ($1, 'succeeded', '{\"input\": \"kept\"}', 1, 2, 3)", OLD_ID)
        await conn.execute("INSERT INTO job_audio (job_id, pos, token, data) VALUES ($1, 0, 't', 'abc')", OLD_ID)
        await conn.execute("INSERT INTO voices (name, meta, tensors, created_at) VALUES ('v', '{}', 'x', 1)")
    finally:
        await conn.close()

    for _ in range(2):  # the second start changes nothing
        store = PostgresJobStore(old_url, pool_size=1)
        await store.open()
        try:
            job = await store.get(OLD_ID)
            assert (job.status, job.params, job.utterances_total) == ("succeeded", {"input": "kept"}, 0)
            assert [listed.to_json(now=0) for listed in await store.list()] == [job.to_json(now=0)]
            assert b"".join([block async for block in store.read_audio(job)]) == b"abc"
        finally:
            await store.close()
        conn = await asyncpg.connect(old_url)
        try:
            assert [r[0] for r in await conn.fetch("SELECT version FROM streamvox_schema ORDER BY version")] == \
                [step.version for step in MIGRATIONS]
            assert await conn.fetchval("SELECT owner FROM voices WHERE name = 'v'") == ""
            fresh_conn = await asyncpg.connect(fresh_url)
            try:
                assert await _pg_shape(conn) == await _pg_shape(fresh_conn)
            finally:
                await fresh_conn.close()
        finally:
            await conn.close()

