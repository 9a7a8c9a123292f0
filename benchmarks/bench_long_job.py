"""A 100,000-character REST job on the tiny talker, end to end on a real server: how long its
POST takes (validation and planning the text as utterances), how fast it is spoken, and that its
audio and captions reach the end of the text. Too slow for CI (tests/service/jobs/test_long_jobs.py
runs 1,500 characters, interrupted and resumed).

    python benchmarks/bench_long_job.py [--chars 100000] [--checkpoint DIR] [--interrupt]

Needs the talker oracle fixture (the default checkpoint) and the random aligner fixture (captions).
``--interrupt``: the server is stopped halfway and a new one on the same store finishes the job.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import soundfile as sf
from aiohttp import web

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # engines, service, testsupport

from engines.build import build_engine  # noqa: E402
from engines.config import EngineConfig  # noqa: E402
from service.app import create_app  # noqa: E402
from service.settings import Settings  # noqa: E402
from testsupport.long_text import long_text  # noqa: E402


async def serve(engine, data_dir: Path):
    settings = Settings(host="127.0.0.1", port=0, preset="tiny", device="cpu", data_dir=data_dir, job_workers=1)
    runner = web.AppRunner(create_app(settings, engine), access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


async def wait_job(http, url: str, job_id: str, until) -> dict:
    while True:
        async with http.get(f"{url}/v1/jobs/{job_id}") as r:
            job = await r.json()
        if until(job):
            return job
        await asyncio.sleep(0.5)


async def main(args) -> None:
    engine = build_engine(EngineConfig.for_tests(checkpoint=args.checkpoint, warmup=False,
                                                 aligner=args.aligner if Path(args.aligner).exists() else None))
    engine.start()
    text = long_text(args.chars)
    data = Path(tempfile.mkdtemp(prefix="bench-long-job-"))
    runner, url = await serve(engine, data)
    try:
        async with aiohttp.ClientSession() as http:
            posted = time.perf_counter()
            async with http.post(url + "/v1/jobs", json={"input": text, "response_format": "wav",
                                                         "temperature": 0}) as r:
                assert r.status == 202, await r.text()
                job_id = (await r.json())["id"]
            print(f"{len(text)} characters: POST answered in {time.perf_counter() - posted:.2f} s")
            started = time.perf_counter()
            if args.interrupt:
                job = await wait_job(http, url, job_id, lambda j: j["progress"]["utterances_done"] * 2 >=
                                     max(2, j["progress"]["utterances_total"]))
                await runner.cleanup()
                print(f"stopped at {job['progress']['utterances_done']} of {job['progress']['utterances_total']} "
                      f"utterances ({job['progress']['audio_seconds']} s of audio)")
                runner, url = await serve(engine, data)
            job = await wait_job(http, url, job_id, lambda j: j["status"] in ("succeeded", "failed", "cancelled"))
            wall = time.perf_counter() - started
            assert job["status"] == "succeeded", job
            async with http.get(f"{url}/v1/jobs/{job_id}/audio") as r:
                audio, rate = sf.read(io.BytesIO(await r.read()), dtype="float32")
            seconds = audio.size / rate
            progress = job["progress"]
            print(f"{progress['utterances_total']} utterances, {seconds:.1f} s of audio in {wall:.1f} s "
                  f"({seconds / wall:.1f} audio s per wall s)")
            async with http.get(f"{url}/v1/jobs/{job_id}/captions") as r:
                if r.status == 200:
                    words = (await r.json())["words"]
                    print(f"captions: {len(words)} words, the last ends at {words[-1]['end_ms'] / 1000:.1f} s, "
                          f"characters {words[-1]['char_end']} of {len(text)}")
    finally:
        await runner.cleanup()
        engine.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chars", type=int, default=100_000)
    parser.add_argument("--checkpoint", default=str(REPO / "tests/fixtures/oracle/talker/cv_proj"))
    parser.add_argument("--aligner", default=str(REPO / "tests/fixtures/aligner/tiny"))
    parser.add_argument("--interrupt", action="store_true")
    asyncio.run(main(parser.parse_args()))
