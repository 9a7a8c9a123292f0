"""Long jobs: a job's text is spoken as utterances (service/synthesis/plan.py), each kept in the
store as it finishes (service/jobs/segments.py). ``GET /v1/jobs/{id}`` shows progress over the
whole plan from the first answer (frames and utterances planned at submit) and it moves while the
job runs; a job interrupted by a restart resumes at the next utterance, on SQLite and on
PostgreSQL, with its progress, first start and attempt number, and its audio equals an
uninterrupted greedy run's; its captions span the whole text; its kept segments count against
--jobs-disk-quota-mb. A job's input may be up to ``--max-job-chars``, over ``--max-input-chars``.

Real servers on 127.0.0.1 (the second one on the first one's store), real HTTP clients, real
PostgreSQL; the tiny talker oracle fixture with the random forced aligner. (A 100,000-character
job: benchmarks/bench_long_job.py.)"""

from __future__ import annotations

import io

import aiohttp
import numpy as np
import pytest
import soundfile as sf
from conftest import start_server, wait_until
from testsupport.long_text import Recorded, long_text


TEXT = long_text(1500)
UNINTERRUPTED: dict = {}  # the uninterrupted run, made once for both stores
JOB = {"input": TEXT, "response_format": "wav", "temperature": 0}


async def get_job(http, url: str, job_id: str) -> dict:
    async with http.get(f"{url}/v1/jobs/{job_id}") as r:
        return await r.json()


async def finished(http, url: str, job_id: str) -> tuple[dict, np.ndarray, list[dict]]:
    async def done():
        return (await get_job(http, url, job_id))["status"] in ("succeeded", "failed", "cancelled")

    await wait_until(done, timeout_s=300, every_s=0.1)
    job = await get_job(http, url, job_id)
    assert job["status"] == "succeeded", job
    async with http.get(f"{url}/v1/jobs/{job_id}/audio") as r:
        audio, rate = sf.read(io.BytesIO(await r.read()), dtype="float32")
    async with http.get(f"{url}/v1/jobs/{job_id}/captions") as r:
        assert r.status == 200, await r.text()
        words = (await r.json())["words"]
    assert rate == 24000
    return job, audio, words


async def uninterrupted(http, engine, data_dir) -> dict:
    """The job run once without interruption (made once for every test here): its job object,
    audio, words and the texts of its utterances."""
    if not UNINTERRUPTED:
        plain = await start_server(engine, data_dir, job_workers=1)
        try:
            with Recorded(engine) as whole:
                async with http.post(plain.url + "/v1/jobs", json=JOB) as r:
                    assert r.status == 202, await r.text()
                    job_id = (await r.json())["id"]
                UNINTERRUPTED.update(zip(("job", "audio", "words"), await finished(http, plain.url, job_id)))
            UNINTERRUPTED["texts"] = [r.text for r in whole.requests]
        finally:
            await plain.stop()
    return UNINTERRUPTED


async def test_a_long_job_interrupted_by_a_restart_resumes_at_the_next_utterance(aligned_talker, tmp_path,
                                                                                  store_settings):
    async with aiohttp.ClientSession() as http:
        whole = await uninterrupted(http, aligned_talker, tmp_path / "plain")
        job, expected, texts = whole["job"], whole["audio"], whole["texts"]
        total = job["progress"]["utterances_total"]
        assert total == len(texts) >= 8 and " ".join(texts) == TEXT
        assert job["progress"]["utterances_done"] == total
        assert job["progress"]["audio_seconds"] == pytest.approx(expected.size / 24000, abs=1e-3)

        frames = job["progress"]["frames_done"]
        assert job["progress"]["frames_total"] == frames > 0 and job["progress"]["percent"] == 100.0

        # the same job, stopped halfway, then resumed by a new server on the same store
        first = await start_server(aligned_talker, tmp_path / "data", job_workers=1, **store_settings)
        polls: list[dict] = []
        try:
            async with http.post(first.url + "/v1/jobs", json=JOB) as r:
                posted = await r.json()
                job_id = posted["id"]
            # planned at submit: the first answer says how much there is (a talker's budget: at least the frames)
            assert posted["progress"]["utterances_total"] == total and posted["progress"]["frames_total"] >= frames

            async def halfway():
                polls.append(await get_job(http, first.url, job_id))
                return polls[-1]["progress"]["utterances_done"] >= 3

            await wait_until(halfway, timeout_s=120, every_s=0.02)
        finally:
            await first.stop()  # a restart: the running job goes back to the queue
        # progress moved between polls of the running job, over the whole job, never back
        running = [poll for poll in polls if poll["status"] == "running"]
        done = [poll["progress"]["frames_done"] for poll in running]
        assert done == sorted(done) and len(set(done) - {0}) >= 3, done
        assert all(0 <= p["progress"]["frames_done"] <= p["progress"]["frames_total"] for p in running)
        assert all(p["progress"]["utterances_total"] == total for p in polls)
        assert any(p["progress"]["seconds_left"] is not None for p in running)
        percents = [p["progress"]["percent"] for p in running]  # an estimate: it may step back as the rest is re-estimated
        assert len(set(percents) - {0}) >= 2 and 0 < percents[-1] < 100
        started_at = running[-1]["started_at"]
        progress = (await get_job_from_store(first, job_id))
        done_before = progress["utterances_done"]
        assert 3 <= done_before < total and progress["audio_seconds"] > 0
        assert 0 < progress["frames_done"] < frames  # what the kept utterances hold
        second = await start_server(aligned_talker, tmp_path / "data", job_workers=1, **store_settings)
        try:
            with Recorded(aligned_talker) as resumed:
                job, audio, words = await finished(http, second.url, job_id)
        finally:
            await second.stop()
        # it went on from the next utterance: nothing before it was spoken again
        assert [r.text for r in resumed.requests] == texts[done_before:]
        assert job["progress"]["utterances_done"] == total
        # its progress is the whole job's, across both attempts: the frames of the uninterrupted run
        assert (job["progress"]["frames_done"], job["progress"]["frames_total"]) == (frames, frames)
        assert (job["attempt"], job["started_at"]) == (2, started_at)
        # and its audio is the uninterrupted run's (<= 1 LSB: the decoder's windows do not follow the attempt)
        assert audio.shape == expected.shape
        assert np.abs(audio - expected).max() <= 1 / 32768
        # captions across the whole job: in order, within the audio, to its last words
        starts = [w["start_ms"] for w in words]
        assert starts == sorted(starts) and words[-1]["end_ms"] <= audio.size / 24 + 1
        assert words[-1]["char_end"] >= len(TEXT) - len("and so on.")
        assert all(TEXT[w["char_start"]:w["char_end"]] == w["word"] for w in words)


async def test_a_long_job_over_the_quota_leaves_the_data_dir_within_it(aligned_talker, tmp_path, store_settings):
    """A long job's utterances are kept as they finish (to resume after them): they count against
    --jobs-disk-quota-mb with its audio and the database. A job that cannot fit fails, and what it
    kept is given back: the data dir (SQLite: database, WAL and audio) ends within the quota.
    (Before: segments were float32 and uncounted, and SQLite never gave their pages back; with a
    10 MB quota the data dir kept +33 MB after the job failed.)"""
    async with aiohttp.ClientSession() as http:
        whole = await uninterrupted(http, aligned_talker, tmp_path / "plain")
        wav_bytes = 44 + 2 * whole["audio"].size
        limit = int(0.75 * wav_bytes)  # not even its audio fits
        live = await start_server(aligned_talker, tmp_path / "data", job_workers=1,
                                  jobs_disk_quota_mb=limit / 2**20, **store_settings)
        try:
            async with http.post(live.url + "/v1/jobs", json=JOB) as r:
                job_id = (await r.json())["id"]

            async def ended():
                return (await get_job(http, live.url, job_id))["status"] in ("succeeded", "failed", "cancelled")

            await wait_until(ended, timeout_s=300, every_s=0.1)
            job = await get_job(http, live.url, job_id)
            assert job["status"] == "failed" and job["error"].startswith("storage_full"), job
            assert job["progress"]["utterances_done"] >= 1  # it had kept some
            assert await live.state.jobs.store.stored_bytes() <= limit
            on_disk = sum(path.stat().st_size for path in (tmp_path / "data").rglob("*") if path.is_file())
            assert on_disk <= limit
        finally:
            await live.stop()


async def get_job_from_store(server, job_id: str) -> dict:
    """A stopped server's job, read from its store (the API is gone with it)."""
    from service.jobs.store import make_job_store

    store = make_job_store(server.state.settings)
    await store.open()
    try:
        return (await store.get(job_id)).to_json()["progress"]
    finally:
        await store.close()


async def test_a_job_may_be_longer_than_a_speech_request(aligned_talker, tmp_path):
    live = await start_server(aligned_talker, tmp_path / "data", job_workers=0, max_input_chars=1000, max_job_chars=3000,
                              max_body_bytes=10_000)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(live.url + "/v1/audio/speech", json={"input": TEXT}) as r:
                assert r.status == 400 and (await r.json())["error"]["code"] == "text_too_long"
            async with http.post(live.url + "/v1/jobs", json={"input": TEXT}) as r:
                assert r.status == 202, await r.text()
            async with http.post(live.url + "/v1/jobs", json={"input": long_text(3100)}) as r:
                assert r.status == 400 and (await r.json())["error"]["code"] == "text_too_long"
            # its body may be bigger than other requests' (3,000 CJK characters, escaped: ~18 KB)
            cjk = {"input": "你好世界。" * 600}
            async with http.post(live.url + "/v1/audio/speech", json=cjk) as r:
                assert r.status == 413, await r.text()
            async with http.post(live.url + "/v1/jobs", json=cjk) as r:
                assert r.status == 202, await r.text()
    finally:
        await live.stop()


async def test_a_job_resumed_right_after_a_pause_sounds_as_if_never_stopped(aligned_talker, tmp_path):
    """Killed with its first utterance and the pause after it kept, the job resumes at the next
    utterance, which starts from the pause's silence as it did in the uninterrupted run (no fade-in)."""
    job = {"input": 'Hello there. <break time="300ms"/> ' + long_text(600), "response_format": "wav",
           "temperature": 0}
    async with aiohttp.ClientSession() as http:
        plain = await start_server(aligned_talker, tmp_path / "plain", job_workers=1)
        try:
            async with http.post(plain.url + "/v1/jobs", json=job) as r:
                assert r.status == 202, await r.text()
                _, expected, _ = await finished(http, plain.url, (await r.json())["id"])
        finally:
            await plain.stop()

        first = await start_server(aligned_talker, tmp_path / "data", job_workers=1)
        try:
            async with http.post(first.url + "/v1/jobs", json=job) as r:
                job_id = (await r.json())["id"]

            async def paused():  # "Hello there." and the pause are kept; the long utterance is being spoken
                return (await get_job(http, first.url, job_id))["progress"]["utterances_done"] >= 2

            await wait_until(paused, timeout_s=120, every_s=0.02)
        finally:
            await first.stop()
        progress = await get_job_from_store(first, job_id)
        assert progress["utterances_done"] == 2 < progress["utterances_total"], progress
        second = await start_server(aligned_talker, tmp_path / "data", job_workers=1)
        try:
            _, audio, _ = await finished(http, second.url, job_id)
        finally:
            await second.stop()
    assert audio.shape == expected.shape
    assert np.abs(audio - expected).max() <= 1 / 32768  # within 1 LSB, the seam included
