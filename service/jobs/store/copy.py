"""Moving from the embedded store to PostgreSQL: copy a ``--data-dir``'s saved voices and REST
jobs (records and audio) into a ``--jobs-db`` database (``streamvox migrate-store``).

The directory is read as hostile input (service/jobs/store/untrusted.py): read-only, no links
followed, every record schema-checked; what cannot be used is skipped and listed in the
report with the reason, never imported. Idempotent: a voice or job already in the database
(same owner and name, or id) is left alone and counted as such, so a copy that was interrupted
can simply run again. Jobs keep their ids (client URLs stay valid), owners, times, status and
word timestamps (captions; checked like the rest of the row); one that was running goes back to
the queue. Run it with the old server stopped, so that
nothing changes under the copy.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

from service.jobs.store.postgres import PostgresJobStore
from service.jobs.store.untrusted import Skipped, read_job_audio, read_jobs, read_voices, reason
from service.voices.store import VoiceExists


@dataclass
class CopyReport:
    voices_copied: int = 0
    voices_present: int = 0
    jobs_copied: int = 0
    jobs_present: int = 0
    audio_bytes: int = 0
    skipped: list[Skipped] = field(default_factory=list)

    def summary(self) -> str:
        return (f"voices: {self.voices_copied} copied, {self.voices_present} already there; "
                f"jobs: {self.jobs_copied} copied, {self.jobs_present} already there; "
                f"{self.audio_bytes / (1 << 20):.1f} MiB of job audio; {len(self.skipped)} skipped")

    def skipped_lines(self) -> list[str]:
        return [f"skipped {item.kind} {item.name!r}: {item.reason}" for item in self.skipped]


async def _audio(data_dir: Path, job, report: CopyReport) -> list[bytes]:
    """A succeeded job's audio, read whole before the job is inserted (a file that turns out
    unreadable skips the job instead of leaving half of it); nothing for other jobs."""
    if job.status != "succeeded":
        return []
    blocks = await asyncio.to_thread(lambda: list(read_job_audio(data_dir, job)))
    report.audio_bytes += sum(len(block) for block in blocks)
    return blocks


async def _blocks(blocks: list[bytes]):
    for block in blocks:
        yield block


async def copy_embedded_store(data_dir: Path, url: str, password: str | None = None) -> CopyReport:
    """Copy what ``data_dir`` holds into the database at ``url`` (schema created if needed).
    Raises UnreadableStore when the job database cannot be read at all, StoreUnavailable while
    the target cannot be reached."""
    data_dir = Path(data_dir)
    report = CopyReport()
    target = PostgresJobStore(url, pool_size=2, password=password)
    jobs = await asyncio.to_thread(lambda: list(read_jobs(data_dir)))  # before connecting: fail fast
    await target.open()
    try:
        voices = target.voice_store(data_dir)
        for voice, skipped in await asyncio.to_thread(lambda: list(read_voices(data_dir))):
            if skipped is not None:
                report.skipped.append(skipped)
                continue
            try:
                await voices.add(voice)
                report.voices_copied += 1
            except VoiceExists:
                report.voices_present += 1
        for job, skipped in jobs:
            if skipped is not None:
                report.skipped.append(skipped)
                continue
            try:
                audio = await _audio(data_dir, job, report)
            except (OSError, ValueError) as exc:
                report.skipped.append(Skipped("job", job.id, f"audio: {reason(exc)}"))
                continue
            if await target.import_job(job, _blocks(audio), words=job.words):
                report.jobs_copied += 1
            else:
                report.jobs_present += 1
    finally:
        await target.close()
    return report
