"""``--jobs-disk-quota-mb``: a quota over everything the jobs keep (their audio, their kept
segments, their records: :meth:`JobStore.stored_bytes`), enforced as each piece is stored, not only
when a job is created.

    quota = DiskQuota(store, quota_mb)
    stored = await quota.admit(len(data), lambda: store.put_audio(job_id, token, offset, data))

Each write that grows what is kept is checked against what the store holds now and made under one
lock, so this replica's jobs never overshoot together; several replicas on one database may
overshoot by at most a piece each. A write that would pass the quota raises
:class:`QuotaExceeded`: the job that made it fails (``storage_full``), its audio and segments
dropped and their space given back (the stores' ``finish``), the others go on.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, TypeVar

from service.jobs.store.base import JobStore

T = TypeVar("T")


class QuotaExceeded(Exception):
    """Storing the next piece would take what the jobs keep past ``--jobs-disk-quota-mb``."""


class DiskQuota:
    def __init__(self, store: JobStore, quota_mb: float):
        self.store = store
        self.quota_mb = quota_mb
        self.limit = int(quota_mb * 1024 * 1024)
        self._lock = asyncio.Lock()

    async def admit(self, nbytes: int, write: Callable[[], Awaitable[T]]) -> T:
        """``write()``, which stores ``nbytes`` more (0: it grows nothing, e.g. a rewrite of a stored
        chunk), unless that would pass the quota: QuotaExceeded, nothing written."""
        if not self.limit or nbytes <= 0:
            return await write()
        async with self._lock:
            used = await self.store.stored_bytes()
            if used + nbytes > self.limit:
                raise QuotaExceeded(f"storage_full: what the jobs keep (audio, kept segments, records) would exceed "
                                    f"its quota ({self.quota_mb:g} MB, --jobs-disk-quota-mb; {used} bytes stored); "
                                    "this job's audio was dropped")
            return await write()


__all__ = ["DiskQuota", "QuotaExceeded"]
