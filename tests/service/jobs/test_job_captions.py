"""``GET /v1/jobs/{id}/captions``: a finished job's word timestamps as JSON, SRT and WebVTT on a
live server with the random aligner fixture (tests/fixtures/aligner/tiny); owner-scoped like
the other job routes; 409 ``no_timestamps`` on a server without an aligner (no invented times);
the same captions from PostgreSQL after ``streamvox migrate-store`` (real command, real database)."""

from __future__ import annotations

import json
import re
import sqlite3

import aiohttp
import soundfile
from conftest import finished_job, start_server
from test_store_copy import migrate

from engines.pipelines.aligner.words import split_words

TEXT = "Hello there, my friend. How are you today? I am fine, thanks for asking."
ALICE, BOB = "alice-key-1", "bob-key-2"
SRT_CUE = re.compile(r"^(\d+)\n(\d\d):(\d\d):(\d\d),(\d\d\d) --> (\d\d):(\d\d):(\d\d),(\d\d\d)\n(.+)$")
VTT_CUE = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d\d\d) --> (\d\d):(\d\d):(\d\d)\.(\d\d\d)\n(.+)$")


async def succeeded_job_id(http, url: str, key: str) -> str:
    headers = {"Authorization": f"Bearer {key}"}
    async with http.post(url + "/v1/jobs", json={"input": TEXT, "response_format": "wav"}, headers=headers) as r:
        assert r.status == 202, await r.text()
        job_id = (await r.json())["id"]
    assert (await finished_job(http, f"{url}/v1/jobs/{job_id}", headers))["status"] == "succeeded"
    return job_id


def ms(h, m, s, milli) -> int:
    return ((int(h) * 60 + int(m)) * 60 + int(s)) * 1000 + int(milli)


async def test_captions_in_three_formats_owner_scoped(aligned_engine, tmp_path):
    server = await start_server(aligned_engine, tmp_path / "data", api_keys=(ALICE, BOB))
    try:
        async with aiohttp.ClientSession() as http:
            job_id = await succeeded_job_id(http, server.url, ALICE)
            alice = {"Authorization": f"Bearer {ALICE}"}
            async with http.get(f"{server.url}/v1/jobs/{job_id}/audio", headers=alice) as r:
                audio = await r.read()
            (tmp_path / "a.wav").write_bytes(audio)
            duration_ms = soundfile.info(str(tmp_path / "a.wav")).duration * 1000
            async with http.get(f"{server.url}/v1/jobs/{job_id}/captions", headers=alice) as r:
                assert r.status == 200
                words = (await r.json())["words"]
            assert [w["word"] for w in words] == split_words(TEXT, "english")
            last = 0.0
            for w in words:
                assert TEXT[w["char_start"]:w["char_end"]] == w["word"]
                assert last <= w["start_ms"] <= w["end_ms"] <= duration_ms + 0.5
                last = w["start_ms"]

            async with http.get(f"{server.url}/v1/jobs/{job_id}/captions?format=srt", headers=alice) as r:
                assert r.status == 200 and r.content_type == "application/x-subrip"
                srt = await r.text()
            cues = [SRT_CUE.match(block) for block in srt.strip().split("\n\n")]
            assert all(cues), srt
            assert [int(c.group(1)) for c in cues] == list(range(1, len(cues) + 1))
            assert " ".join(c.group(10) for c in cues).split() == [w["word"] for w in words]
            for c in cues:
                assert ms(*c.group(2, 3, 4, 5)) <= ms(*c.group(6, 7, 8, 9)) <= duration_ms + 1

            async with http.get(f"{server.url}/v1/jobs/{job_id}/captions?format=vtt", headers=alice) as r:
                assert r.status == 200 and r.content_type == "text/vtt"
                vtt = await r.text()
            header, *blocks = vtt.strip().split("\n\n")
            assert header == "WEBVTT"
            vcues = [VTT_CUE.match(block) for block in blocks]
            assert all(vcues) and len(vcues) == len(cues), vtt
            assert " ".join(c.group(9) for c in vcues).split() == [w["word"] for w in words]

            bob = {"Authorization": f"Bearer {BOB}"}
            for fmt in ("json", "srt", "vtt"):  # another key's job does not exist for it
                async with http.get(f"{server.url}/v1/jobs/{job_id}/captions?format={fmt}", headers=bob) as r:
                    assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"
            async with http.get(f"{server.url}/v1/jobs/{job_id}/captions?format=ass", headers=alice) as r:
                assert r.status == 400
    finally:
        await server.stop()


async def test_no_aligner_no_captions(server):
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + "/v1/jobs", json={"input": TEXT}) as r:
            job_id = (await r.json())["id"]
        assert (await finished_job(http, f"{server.url}/v1/jobs/{job_id}"))["status"] == "succeeded"
        async with http.get(f"{server.url}/v1/jobs/{job_id}/captions?format=srt") as r:
            assert r.status == 409 and (await r.json())["error"]["code"] == "no_timestamps"


async def captions(http, url: str, job_id: str, fmt: str) -> tuple[int, str]:
    async with http.get(f"{url}/v1/jobs/{job_id}/captions?format={fmt}",
                        headers={"Authorization": f"Bearer {ALICE}"}) as response:
        return response.status, await response.text()


async def test_captions_survive_migrate_store(aligned_engine, tmp_path, pg_url):
    """Word timestamps are copied with their job, checked like the rest of the row: stored
    words that are not a word list skip their job with the reason."""
    data_dir = tmp_path / "embedded"
    embedded = await start_server(aligned_engine, data_dir, api_keys=(ALICE,))
    try:
        async with aiohttp.ClientSession() as http:
            job_id = await succeeded_job_id(http, embedded.url, ALICE)
            crafted_id = await succeeded_job_id(http, embedded.url, ALICE)
            before = {fmt: await captions(http, embedded.url, job_id, fmt) for fmt in ("json", "srt", "vtt")}
    finally:
        await embedded.stop()
    assert all(status == 200 for status, _ in before.values()) and json.loads(before["json"][1])["words"]
    db = sqlite3.connect(data_dir / "jobs.sqlite3")  # a row whose words are not a word list
    db.execute("UPDATE jobs SET words = ? WHERE id = ?",
               (json.dumps([{"word": "x", "start_ms": 5, "end_ms": 1, "char_start": 0, "char_end": 1}]), crafted_id))
    db.commit()
    db.close()

    code, out, err = await migrate(data_dir, pg_url)
    assert code == 0 and "jobs: 1 copied" in out and f"skipped job '{crafted_id}': words" in out, (out, err)

    shared = await start_server(aligned_engine, tmp_path / "replica", jobs_db=pg_url, job_workers=0,
                                api_keys=(ALICE,))
    try:
        async with aiohttp.ClientSession() as http:
            after = {fmt: await captions(http, shared.url, job_id, fmt) for fmt in ("json", "srt", "vtt")}
    finally:
        await shared.stop()
    assert after == before
