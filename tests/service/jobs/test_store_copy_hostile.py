"""`streamvox migrate-store` treats the directory it copies as hostile, and the job dispatcher
survives any row it cannot parse. Crafted data dirs (a job's audio symlinked out of the
directory, a ``wav/../…`` response_format, params that are a JSON list or not JSON, an id that
is a path, broken voices, a database that is not one) are skipped with a report or refused in
one line, never a traceback; what is skipped never reaches the database. Real command, real
PostgreSQL, real servers."""

from __future__ import annotations

import json
import os
import sqlite3
import uuid

import aiohttp
import asyncpg
import numpy as np
import pytest
from conftest import start_server
from test_store_copy import migrate

from clients.client import StreamvoxClient
from service.voices.store import FileVoiceStore, SavedVoice

SECRET = "top secret outside the data dir\n"


def _insert(db: sqlite3.Connection, template: dict, **changes) -> str:
    row = {**template, **changes}
    if "id" not in changes:
        row["id"] = uuid.uuid4().hex
    names = ", ".join(row)
    db.execute(f"INSERT INTO jobs ({names}) VALUES ({', '.join('?' for _ in row)})", tuple(row.values()))
    return row["id"]


async def test_crafted_data_dir_is_skipped_with_a_report(engine, tmp_path, pg_url):
    data_dir = tmp_path / "embedded"
    embedded = await start_server(engine, data_dir)
    try:
        async with StreamvoxClient(embedded.url) as client:
            good = await client.wait_job((await client.submit_job("Kept.", seed=1))["id"])
            linked = await client.wait_job((await client.submit_job("Its audio is swapped.", seed=2))["id"])
            good_audio = await client.fetch_audio(good["id"])
    finally:
        await embedded.stop()
    outside = tmp_path / "secret.wav"
    outside.write_text(SECRET)
    audio_file = data_dir / "audio" / f"{linked['id']}.wav"
    audio_file.unlink()
    audio_file.symlink_to(outside)  # a job whose audio points out of the directory
    db = sqlite3.connect(data_dir / "jobs.sqlite3")
    db.row_factory = sqlite3.Row
    template = dict(db.execute("SELECT * FROM jobs WHERE id = ?", (good["id"],)).fetchone())
    crafted = {
        "traversal": _insert(db, template, params=json.dumps({"input": "x", "response_format": "wav/../../secret"})),
        "list": _insert(db, template, params="[1, 2]"),
        "not json": _insert(db, template, params="{\"input\": "),
        "nested": _insert(db, template, params="[" * 100_000 + "]" * 100_000),
        "bad status": _insert(db, template, status="exploded"),
        "text time": _insert(db, template, created_at="yesterday"),
    }
    path_id = _insert(db, template, id="../../../../tmp/x")
    db.commit()
    db.close()
    rng = np.random.default_rng(0)
    voices = FileVoiceStore(data_dir / "voices")
    await voices.add(SavedVoice(name="fine", xvector=rng.standard_normal(8).astype(np.float32),
                                codes=rng.integers(0, 64, (3, 4))))
    (data_dir / "voices" / "garbage.json").write_text("{\"name\": [")
    (data_dir / "voices" / "garbage.safetensors").write_bytes(b"\x00" * 16)
    (data_dir / "voices" / "linked.json").symlink_to(outside)
    (data_dir / "voices" / "linked.safetensors").symlink_to(outside)
    (data_dir / "voices" / "typed.json").write_text(json.dumps({"name": "typed", "ref_text": ["a", "list"]}))

    code, out, err = await migrate(data_dir, pg_url)
    assert code == 0 and "Traceback" not in out + err, (out, err)
    assert "voices: 1 copied" in out and "jobs: 1 copied" in out and "11 skipped" in out, out
    assert f"skipped job '{linked['id']}': audio: a symbolic link" in out, out
    for job_id in crafted.values():
        assert f"skipped job '{job_id}'" in out, (job_id, out)
    assert "response_format" in out and "params are a JSON list" in out
    assert "skipped job '../../../../tmp/x'" in out and path_id
    for name in ("garbage", "linked", "typed"):
        assert f"skipped voice '{name}'" in out, out
    assert "skipped voice 'linked': a symbolic link" in out

    shared = await start_server(engine, tmp_path / "replica", jobs_db=pg_url, job_workers=0)
    try:
        async with StreamvoxClient(shared.url) as client:
            assert [job["id"] for job in await client.list_jobs()] == [good["id"]]
            assert await client.fetch_audio(good["id"]) == good_audio
        async with aiohttp.ClientSession() as http:
            async with http.get(shared.url + f"/v1/jobs/{linked['id']}/audio") as r:
                assert r.status == 404 and SECRET not in await r.text()
    finally:
        await shared.stop()


async def test_a_store_that_is_not_one_is_refused_in_one_line(tmp_path, pg_url):
    data_dir = tmp_path / "d"
    data_dir.mkdir()
    (data_dir / "jobs.sqlite3").write_bytes(os.urandom(4096))
    code, out, err = await migrate(data_dir, pg_url)
    assert code == 2 and "Traceback" not in err and err.startswith("streamvox migrate-store:") and len(err.strip().splitlines()) == 1, err
    (data_dir / "jobs.sqlite3").unlink()
    (data_dir / "jobs.sqlite3").symlink_to("/etc/hostname")
    code, out, err = await migrate(data_dir, pg_url)
    assert code == 2 and "not a regular file" in err and "Traceback" not in err, err


async def _rows_the_server_did_not_write(insert) -> list[str]:
    """Queued jobs no server would store: params a list, a path in response_format, no input."""
    rows = [("[1, 2]",), (json.dumps({"input": "x", "response_format": "wav/../x"}),), (json.dumps({"input": 5}),)]
    return [await insert(uuid.uuid4().hex, params) for (params,) in rows]


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
async def test_the_dispatcher_survives_rows_it_cannot_parse(engine, tmp_path, kind, request):
    settings = {"jobs_db": request.getfixturevalue("pg_url")} if kind == "postgresql" else {}
    server = await start_server(engine, tmp_path / "data", job_workers=1, **settings)
    try:
        if kind == "sqlite":
            async def insert(job_id: str, params: str) -> str:
                db = sqlite3.connect(tmp_path / "data" / "jobs.sqlite3")
                db.execute("INSERT INTO jobs (id, status, params, created_at) VALUES (?, 'queued', ?, 0)",
                           (job_id, params))
                db.commit()
                db.close()
                return job_id
        else:
            async def insert(job_id: str, params: str) -> str:
                conn = await asyncpg.connect(settings["jobs_db"])
                try:
                    await conn.execute("INSERT INTO jobs (id, status, params, created_at) VALUES ($1, 'queued', $2, 0)",
                                       job_id, params)
                finally:
                    await conn.close()
                return job_id
        bad = await _rows_the_server_did_not_write(insert)
        async with StreamvoxClient(server.url) as client:
            job = await client.wait_job((await client.submit_job("New jobs still run.", seed=3))["id"])
            assert job["status"] == "succeeded", job
            listed = {job["id"]: job for job in await client.list_jobs()}  # never a 500
            for job_id in bad:
                assert listed[job_id]["status"] == "failed", listed[job_id]
                assert (await client.get_job(job_id))["status"] == "failed"
            stored = {job_id: await server.state.jobs.store.get(job_id) for job_id in bad}
            assert all(j.status == "failed" for j in stored.values()), stored  # marked failed in the store
            assert server.state.jobs._dispatcher is not None and not server.state.jobs._dispatcher.done()
    finally:
        await server.stop()
