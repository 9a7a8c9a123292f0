"""REST jobs on one shared PostgreSQL: 1 replica vs 2 replicas on this machine, side by side.

    python benchmarks/bench_jobs_replicas.py [--jobs 24] [--singles 10] [--preset tiny]

Variants, side by side: 1 replica with the default 2 job workers, 1 replica with 4 (as many
jobs in flight as two replicas: separates more jobs in flight from more replicas), 2 replicas
with 2 each. For each: a fresh database on a PostgreSQL started from the installed binaries
(testsupport/postgres.py), that many real ``streamvox serve`` processes with ``--jobs-db``, the
machine's cores split evenly between them (OMP threads), then

* **throughput**: ``--jobs`` jobs submitted at once, spread over the replicas; jobs/s from
  the first submission to the last job's end (the store's clock);
* **claim latency**: ``--singles`` jobs submitted one at a time to idle replicas; the time from
  ``created_at`` to ``started_at`` (both the database's clock): the NOTIFY wake-up plus the
  ``SKIP LOCKED`` claim.

Floors: throughput cannot beat the 1-replica figure times the replica count (linear scaling
on the same cores is the ceiling, not the expectation: the cores are shared); claim latency
cannot beat one database round trip (``SELECT 1`` from this process, printed).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import asyncpg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks, testsupport

from benchmarks.loadgen import Server  # noqa: E402
from testsupport.postgres import start_postgres  # noqa: E402

TEXT = "Job number {i} is read by whichever replica claims it first."


async def submit(http: aiohttp.ClientSession, url: str, i: int) -> str:
    async with http.post(url + "/v1/jobs", json={"input": TEXT.format(i=i), "seed": i}) as response:
        assert response.status == 202, await response.text()
        return (await response.json())["id"]


async def wait_all(http: aiohttp.ClientSession, url: str, ids: list[str]) -> list[dict]:
    pending, done = set(ids), {}
    while pending:
        for job_id in list(pending):
            async with http.get(f"{url}/v1/jobs/{job_id}") as response:
                job = await response.json()
            if job["status"] in ("succeeded", "failed", "cancelled"):
                assert job["status"] == "succeeded", job
                done[job_id] = job
                pending.discard(job_id)
        await asyncio.sleep(0.05)
    return [done[job_id] for job_id in ids]


async def round_trip_ms(url: str) -> float:
    conn = await asyncpg.connect(url)
    try:
        samples = []
        for _ in range(50):
            start = time.perf_counter()
            await conn.fetchval("SELECT 1")
            samples.append((time.perf_counter() - start) * 1000)
    finally:
        await conn.close()
    return statistics.median(samples)


async def measure(urls: list[str], jobs: int, singles: int) -> dict:
    async with aiohttp.ClientSession() as http:
        for url in urls:  # warm each replica (first synthesis pays one-off costs)
            await wait_all(http, url, [await submit(http, url, 10_000)])
        # throughput: everything at once, spread over the replicas
        ids = await asyncio.gather(*(submit(http, urls[i % len(urls)], i) for i in range(jobs)))
        finished = await wait_all(http, urls[0], list(ids))
        span = max(j["finished_at"] for j in finished) - min(j["created_at"] for j in finished)
        # claim latency: one job at a time, every replica idle
        latencies = []
        for i in range(singles):
            url = urls[i % len(urls)]
            [job] = await wait_all(http, url, [await submit(http, url, 1000 + i)])
            latencies.append((job["started_at"] - job["created_at"]) * 1000)
    latencies.sort()
    return {"throughput": jobs / span, "span": span, "claim_p50": statistics.median(latencies),
            "claim_p95": latencies[max(0, round(0.95 * len(latencies)) - 1)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=24)
    parser.add_argument("--singles", type=int, default=10)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--variants", nargs="+", default=["1x2", "1x4", "2x2"],
                        help="REPLICASxJOB_WORKERS each")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    postgres = start_postgres()
    results = {}
    try:
        rtt = asyncio.run(round_trip_ms(postgres.url()))
        for variant in args.variants:
            count, workers = (int(n) for n in variant.split("x"))
            db = postgres.create_database()
            threads = max(1, cores // count)
            os.environ.update(STREAMVOX_JOBS_DB=db, OMP_NUM_THREADS=str(threads))
            servers = []
            try:
                with tempfile.TemporaryDirectory() as tmp:
                    for r in range(count):
                        servers.append(Server.start(args.preset, "cpu", f"{tmp}/replica-{r}",
                                                    ["--job-workers", str(workers)]))
                    results[variant] = asyncio.run(measure([s.url for s in servers], args.jobs, args.singles))
                    results[variant].update(threads=threads, replicas=count, workers=workers)
            finally:
                for server in servers:
                    server.stop()
    finally:
        postgres.cleanup()
    base = results[args.variants[0]]["throughput"]
    print(f"device: CPU ({platform.processor() or platform.machine()}, {cores} cores), preset {args.preset}, "
          f"{args.jobs} jobs at once + {args.singles} single jobs, PostgreSQL on 127.0.0.1")
    print(f"floor: claim latency >= one database round trip ({rtt:.2f} ms); "
          f"throughput <= {base:.2f} jobs/s x replicas (the first row's)")
    print(f"{'replicas':>8} {'job workers':>11} {'threads each':>12} {'jobs/s':>8} {'vs first':>8} {'span s':>7} "
          f"{'claim p50 ms':>13} {'claim p95 ms':>13}")
    for r in results.values():
        print(f"{r['replicas']:>8} {r['workers']:>11} {r['threads']:>12} {r['throughput']:>8.2f} "
              f"{r['throughput'] / base:>7.2f}x {r['span']:>7.1f} {r['claim_p50']:>13.1f} {r['claim_p95']:>13.1f}")


if __name__ == "__main__":
    main()
