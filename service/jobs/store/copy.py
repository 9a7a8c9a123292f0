"""Moving from the embedded store to PostgreSQL: copy a ``--data-dir``'s saved voices and REST
jobs (records and audio) into a ``--jobs-db`` database (``streamvox migrate-store``).

Idempotent: a voice or job already in the database (same name or id) is left alone and
counted as such, so a copy that was interrupted can simply run again. Jobs keep their ids
(client URLs stay valid), owners, times and status; one that was running goes back to the
queue. Run it with the old server stopped, so that nothing changes under the copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from service.jobs.store.postgres import PostgresJobStore
from service.jobs.store.sqlite import SqliteJobStore
from service.voices.store import FileVoiceStore, VoiceExists

ALL_JOBS = 1 << 62  # no limit on a listing


@dataclass
class CopyReport:
    voices_copied: int = 0
    voices_present: int = 0
    jobs_copied: int = 0
    jobs_present: int = 0
    audio_bytes: int = 0

    def summary(self) -> str:
        return (f"voices: {self.voices_copied} copied, {self.voices_present} already there; "
                f"jobs: {self.jobs_copied} copied, {self.jobs_present} already there; "
                f"{self.audio_bytes / (1 << 20):.1f} MiB of job audio")


async def _counted(blocks, report: CopyReport):
    """The audio blocks of one job, counted as they pass."""
    async for block in blocks:
        report.audio_bytes += len(block)
        yield block


async def copy_embedded_store(data_dir: Path, url: str, password: str | None = None) -> CopyReport:
    """Copy what ``data_dir`` holds into the database at ``url`` (schema created if needed)."""
    source = SqliteJobStore(data_dir)
    target = PostgresJobStore(url, pool_size=2, password=password)
    report = CopyReport()
    await source.open()
    try:
        await target.open()
        try:
            voices = target.voice_store(data_dir)
            for voice in await FileVoiceStore(Path(data_dir) / "voices").list():
                try:
                    await voices.add(voice)
                    report.voices_copied += 1
                except VoiceExists:
                    report.voices_present += 1
            for job in reversed(await source.list(limit=ALL_JOBS)):  # oldest first
                # read_audio yields nothing for a job that did not succeed
                if await target.import_job(job, _counted(source.read_audio(job), report)):
                    report.jobs_copied += 1
                else:
                    report.jobs_present += 1
        finally:
            await target.close()
    finally:
        await source.close()
    return report
