"""The job runner: claims queued jobs from the store and feeds them to the engine at batch
priority, under a lease it renews while they run.

Jobs use the capacity real-time streams leave (the engine serves ``Priority.REALTIME``
first); at most ``settings.job_workers`` jobs run at once on a replica. The runner wakes on
the store's events (a new or released job; a cancel, from any replica) and otherwise polls
every few seconds, for the leases of replicas that died. While a job runs:

* its audio is encoded into a spool (service/synthesis/spool.py) and copied into the store in chunks as
  it grows (:class:`AudioUpload`), so any replica can serve the download once it succeeds;
  ``--jobs-disk-quota-mb`` holds while it does (service/jobs/quota.py): a job whose next chunk
  or kept segment would take what the jobs keep past the quota fails (``storage_full``), its
  audio and segments dropped;
* a claimed job whose stored record does not parse (``Job.corrupt``) is failed, not run; nothing
  a job holds stops the dispatcher;
* its progress over the whole plan (service/jobs/progress.py) is recorded with each segment it
  keeps and every ``PROGRESS_SECONDS`` with a renewal of its lease (at least every third of
  ``--job-lease-seconds``). A renewal that finds the job cancelled (DELETE on any replica) or its
  lease gone stops the engine work;
* its completion is fenced by the lease token: it is recorded once, by the attempt that holds
  the lease, whatever happened to other attempts.

The store may be unreachable for a while (a database restart): the runner keeps the audio it
has and retries; when the store is back, the job carries on under the same lease unless
another replica took it over meanwhile. On shutdown running jobs go back to ``queued``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import socket
import time
import uuid
from collections import OrderedDict
from typing import Awaitable, Callable

from engines.contract import SAMPLE_RATE, Priority, VoiceClone
from service.errors import RETRY_LATER, ApiError, StoreUnavailable, is_capacity_error
from service.jobs.progress import ProgressMeter, planned_frames
from service.jobs.quota import DiskQuota, QuotaExceeded
from service.jobs.segments import SegmentLog, plan_key
from service.jobs.store.base import CANCELLED, LOST, Job, JobStore
from service.state import AppState
from service.synthesis.params import SynthesisParams
from service.synthesis.plan import RequestPlan, check_work, off_loop
from service.synthesis.schema import FieldError
from service.synthesis.sequence import UtteranceSequence
from service.synthesis.spool import AudioSpool
from service.synthesis.submit import open_sequence

log = logging.getLogger("streamvox.jobs")

RETRY_SECONDS = 0.5  # how long the runner waits when the engine queue is full
STORE_RETRY_SECONDS = 1.0  # between tries while the store is unreachable
MAX_POLL_SECONDS = 5.0  # the dispatcher looks for expired leases at least this often
RETENTION_EVERY_SECONDS = 60.0
UPLOAD_CHUNK_BYTES = 256 * 1024  # audio copied into the store in pieces of about this size
PLANS_KEPT = 256  # one-utterance jobs planned here whose plans wait for their run (remember)
PROGRESS_SECONDS = 1.0  # a running job's progress is recorded this often (and as each segment ends)


# A job that ran out of KV cache is queued again this many times (claims) before it fails: the
# cache may be full of other work now, but a job that never fits must not loop forever.
CAPACITY_ATTEMPTS = 5

class LeaseLost(Exception):
    """This attempt no longer holds its job (cancelled, or taken over by another replica)."""


class AudioUpload:
    """Copies a growing :class:`AudioSpool` into the store, chunk by chunk, at fixed offsets.

    Encoders rewrite a file's start when it ends (WAV sizes, FLAC's STREAMINFO), so ``flush``
    at the end re-reads every chunk already stored and stores again those whose bytes changed.
    """

    def __init__(self, store: JobStore, job_id: str, token: str, spool: AudioSpool, quota: DiskQuota | None = None):
        self.store, self.job_id, self.token, self.spool = store, job_id, token, spool
        self.quota = quota or DiskQuota(store, 0)
        self.stored = 0  # bytes of the spool already in the store
        self._chunks: list[tuple[int, int, bytes]] = []  # (offset, length, digest) as stored

    def pending(self) -> int:
        return self.spool.file.tell() - self.stored if not self.spool.file.closed else 0

    def _read(self, offset: int, length: int) -> bytes:
        """Blocking: bytes of the spool, leaving its position where it was (the encoder's)."""
        handle = self.spool.file
        here = handle.tell()
        try:
            handle.seek(offset)
            return handle.read(length)
        finally:
            handle.seek(here)

    async def flush(self, final: bool = False) -> None:
        """Store what the spool has gained (all of it when ``final``; whole chunks otherwise).
        Raises LeaseLost, or StoreUnavailable with nothing lost (the next flush resumes)."""
        if final:
            for offset, length, digest in list(self._chunks):
                data = await asyncio.to_thread(self._read, offset, length)
                if hashlib.blake2b(data, digest_size=16).digest() != digest:
                    await self._put(offset, data, replace=True)
        end = self.spool.size if final else self.spool.file.tell()
        while end - self.stored >= (1 if final else UPLOAD_CHUNK_BYTES):
            length = min(UPLOAD_CHUNK_BYTES, end - self.stored)
            await self._put(self.stored, await asyncio.to_thread(self._read, self.stored, length))

    async def _put(self, offset: int, data: bytes, replace: bool = False) -> None:
        # a rewrite of a stored chunk (a header at the end) grows nothing
        if not await self.quota.admit(0 if replace else len(data),
                                      lambda: self.store.put_audio(self.job_id, self.token, offset, data)):
            raise LeaseLost(self.job_id)
        digest = hashlib.blake2b(data, digest_size=16).digest()
        if replace:
            self._chunks = [(o, n, digest if o == offset else d) for o, n, d in self._chunks]
        else:
            self._chunks.append((offset, len(data), digest))
            self.stored = offset + len(data)


class JobRunner:
    def __init__(self, state: AppState, store: JobStore,
                 voice_clone: Callable[[str, str | None], Awaitable[VoiceClone | None]] | None = None):
        self.state = state
        self.store = store
        # (a saved voice's name, the job's owner) -> its clone as that owner sees it (service/voices/clones.py), else None
        self.voice_clone = voice_clone
        self.worker = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"  # this replica, in leases
        self.lease_seconds = state.settings.job_lease_seconds
        self.poll_seconds = min(MAX_POLL_SECONDS, self.lease_seconds / 2)
        self.progress_seconds = min(PROGRESS_SECONDS, self.lease_seconds / 3)
        self.running: dict[str, UtteranceSequence | None] = {}  # None: its segments were all kept already
        self._plans: OrderedDict[str, RequestPlan] = OrderedDict()  # job id -> its plan (remember)
        self.stopped: dict[str, str] = {}  # job id -> why its engine work was stopped (cancelled | lost)
        self.store_error: str | None = None  # set while the store is unreachable
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._dispatcher: asyncio.Task | None = None
        self._stopping = False
        self._last_retention = float("-inf")
        self._claim_after = 0.0  # monotonic time before which the engine is not offered jobs
        self.quota = DiskQuota(store, state.settings.jobs_disk_quota_mb)
        store.set_listener(self._on_store_event)

    async def start(self) -> None:
        try:
            requeued = await self.store.requeue_interrupted()
            if requeued:
                log.info("re-queued %d interrupted job(s)", requeued)
        except StoreUnavailable as exc:
            self._store_down(exc)
        self._dispatcher = asyncio.create_task(self._dispatch())

    def wake(self) -> None:
        self._wake.set()

    async def stop(self) -> None:
        """Stop taking jobs; running ones are cancelled in the engine and given back (``queued``)."""
        self._stopping = True
        if self._dispatcher:
            self._dispatcher.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, *(t for t in [self._dispatcher] if t), return_exceptions=True)

    # -- events and the store's health ---------------------------------------------------
    def _on_store_event(self, event: str, job_id: str | None) -> None:
        if event == "cancelled" and job_id in self.running:
            self._stop_work(job_id, CANCELLED)
        self.wake()

    def _stop_work(self, job_id: str, why: str) -> None:
        self.stopped.setdefault(job_id, why)
        self._cancel(self.running[job_id])

    @staticmethod
    def _cancel(stream: UtteranceSequence | None) -> None:
        if stream is not None:  # None: nothing of the job was left to speak
            stream.cancel()

    def _store_down(self, exc: Exception) -> None:
        self.state.metrics.job_store_up.set(0)
        if self.store_error is None:
            log.warning("job store unreachable (%s); job endpoints answer 503, queued jobs wait", exc)
        self.store_error = str(exc)

    def _store_up(self) -> None:
        self.state.metrics.job_store_up.set(1)
        if self.store_error is not None:
            log.info("job store reachable again")
        self.store_error = None

    async def _until_stored(self, call: Callable[[], Awaitable]):
        """Run a store call, retrying while the store is unreachable (a running job keeps its
        audio meanwhile; the runner's shutdown cancels the wait)."""
        while True:
            try:
                return await call()
            except StoreUnavailable as exc:
                self._store_down(exc)
                await asyncio.sleep(STORE_RETRY_SECONDS)

    # -- the dispatcher ---------------------------------------------------------------------
    async def _apply_retention(self) -> None:
        ttl_hours = self.state.settings.job_ttl_hours
        now = time.monotonic()
        every = min(RETENTION_EVERY_SECONDS, ttl_hours * 3600)  # a short TTL is checked more often
        if ttl_hours <= 0 or now - self._last_retention < every:
            return
        self._last_retention = now
        removed = await self.store.delete_finished_before(time.time() - ttl_hours * 3600)
        if removed:
            log.info("retention: deleted %d finished job(s) older than %g h", removed, ttl_hours)

    async def _dispatch(self) -> None:
        while not self._stopping:
            self._wake.clear()
            timeout = self.poll_seconds
            try:
                await self.store.maintain()
                await self._apply_retention()
                # The leader exports the shared queue (service/metrics.py, docs/DEPLOY.md).
                self.state.metrics.job_backlog = await self.store.queued() if self.store.leader else 0
                free = self.state.settings.job_workers - len(self.running)
                # After the engine refused a job, no claim for RETRY_SECONDS: the release's own
                # NOTIFY wakes this loop at once, which would otherwise claim and release in a spin.
                if free > 0 and not self.state.draining and time.monotonic() >= self._claim_after:
                    for job in await self.store.claim(self.worker, free, self.lease_seconds):
                        self.state.metrics.job_claims.labels("takeover" if job.taken_over else "first").inc()
                        if not await self._start(job):
                            self._claim_after = time.monotonic() + RETRY_SECONDS
                            timeout = RETRY_SECONDS  # the engine is full: try again soon
                self._store_up()
            except StoreUnavailable as exc:
                self._store_down(exc)
                timeout = STORE_RETRY_SECONDS
            except Exception:  # a bug must not end the dispatcher: new jobs would wait forever
                log.exception("job dispatcher: unexpected error; carrying on")
                timeout = STORE_RETRY_SECONDS
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=timeout)
            except asyncio.TimeoutError:
                pass

    async def _start(self, job: Job) -> bool:
        """Start a claimed job in the engine; False (the job given back) when the engine is full."""
        token = job.lease_token
        if job.corrupt:  # not a request this server made: fail it, visibly, and go on
            log.warning("job %s: corrupt record (%s); marked failed", job.id, job.corrupt)
            await self._until_stored(lambda: self.store.finish(job.id, token, "failed",
                                                               error=f"corrupt job record: {job.corrupt}"))
            return True
        try:
            # Stored when the job was created, after validation; a job stored by an older
            # version lacks the newer fields, which take their defaults.
            params = SynthesisParams().update(job.params)
            # One engine request id per attempt: a job re-run after a restart (or on a shared
            # engine) must not collide with its cancelled predecessor still draining.
            attempt = f"job-{job.id}-{uuid.uuid4().hex[:8]}"
            clone = await self.voice_clone(params.voice, job.owner) if self.voice_clone is not None else None
            text = job.params["input"]
            plan = self._plans.pop(job.id, None) or await off_loop(  # (posted here as one utterance: planned then)
                text, check_work, self.state.engine, text, params, self.state.settings, job_format=job.response_format,
                clone=clone)
            parts = plan.parts
            planned = planned_frames(plan)
            # the segments an earlier attempt finished of this same plan: it resumes after them
            kept = await self._until_stored(lambda: self.store.start_plan(job.id, token, plan_key(parts),
                                                                          len(parts)))
            stream = None
            if len(kept) < len(parts):
                stream = open_sequence(self.state, plan.after(len(kept)), attempt, Priority.BATCH,
                                       tenant=job.owner or "jobs", high_water=1 << 30,
                                       timestamps=True,  # word times for captions, where an aligner is loaded
                                       after=parts[len(kept) - 1] if kept else None)
        except ApiError as exc:
            if exc.status in RETRY_LATER:  # the engine is full (or not running): the job waits
                await self._until_stored(lambda: self.store.release(job.id, token))
                return False
            error = exc.message
            await self._until_stored(lambda: self.store.finish(job.id, token, "failed", error=error))
            return True
        except FieldError as exc:
            error = str(exc)
            await self._until_stored(lambda: self.store.finish(job.id, token, "failed", error=error))
            return True
        except StoreUnavailable:
            raise
        except Exception as exc:  # stored params this version cannot use (e.g. not the shape it wrote)
            log.warning("job %s: cannot start (%s: %s); marked failed", job.id, type(exc).__name__, exc)
            error = f"the stored job cannot be run: {type(exc).__name__}"
            await self._until_stored(lambda: self.store.finish(job.id, token, "failed", error=error))
            return True
        self.running[job.id] = stream
        task = asyncio.create_task(self._run(job, stream, parts, kept, ProgressMeter(planned, kept)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    def remember(self, job_id: str, plan: RequestPlan) -> None:
        """The plan of a one-utterance job checked here (POST): its run here reuses it (and its
        ids) instead of planning its text again. A job run elsewhere (another replica, after a
        restart) is planned there; the oldest plans beyond ``PLANS_KEPT`` are dropped."""
        self._plans[job_id] = plan
        while len(self._plans) > PLANS_KEPT:
            self._plans.popitem(last=False)

    # -- one running job ------------------------------------------------------------------
    async def _keep_lease(self, job: Job, meter: ProgressMeter) -> None:
        """Renew the lease with the job's progress every ``progress_seconds`` (a segment that ends
        records it too, with the segment)."""
        while True:
            await asyncio.sleep(self.progress_seconds)
            try:
                outcome = await self.store.renew(job.id, job.lease_token, self.lease_seconds, meter.progress())
            except StoreUnavailable as exc:
                self._store_down(exc)
                continue
            if outcome in (CANCELLED, LOST):
                if outcome == LOST:
                    self.state.metrics.job_leases_lost.inc()
                    log.warning("job %s: lease lost (another replica has it); stopping here", job.id)
                self._stop_work(job.id, outcome)
                return

    async def _run(self, job: Job, stream: UtteranceSequence | None, parts: list, kept: list,
                   meter: ProgressMeter) -> None:
        token = job.lease_token
        # Encoded as it arrives (service/synthesis/spool.py): the float32 signal is never held whole.
        spool = AudioSpool(job.response_format, self.state.settings.whole_file_memory_bytes)
        upload = AudioUpload(self.store, job.id, token, spool, self.quota)
        segments = SegmentLog(self.store, job.id, token, parts, kept, self.quota, job.response_format)
        keeper = asyncio.create_task(self._keep_lease(job, meter))

        async def write(pcm) -> None:  # into the spool, copied into the store as it grows
            await asyncio.to_thread(spool.write, pcm)
            meter.audio_samples = spool.samples
            if upload.pending() >= UPLOAD_CHUNK_BYTES:
                try:
                    await upload.flush()
                except StoreUnavailable as exc:  # kept in the spool; the next flush resumes
                    self._store_down(exc)

        try:
            await self._until_stored(lambda: segments.replay(write))  # what an earlier attempt finished
            chunk = None
            while stream is not None:
                chunk = await stream.next_chunk()
                if chunk.pcm.size:
                    await write(chunk.pcm)
                    segments.add(chunk.pcm)
                meter.update(chunk.frames_done, spool.samples)
                if len(kept) + stream.parts_done > segments.done:  # a segment ended: kept for a resume
                    frames = meter.part_ended()
                    progress = meter.progress()
                    if not await self._until_stored(lambda: segments.end_segment(stream.ended_part_alignment,
                                                                                 frames, progress)):
                        raise LeaseLost(job.id)
                if chunk.is_final:
                    break
            if job.id in self.stopped:
                return  # cancelled (recorded by whoever cancelled) or taken over elsewhere
            error = chunk.error if chunk is not None else None
            if error and is_capacity_error(error) and job.attempts < CAPACITY_ATTEMPTS:
                # no room in the KV cache now, not a fault of the job: it waits for another turn
                log.info("job %s: %s; queued again (attempt %d)", job.id, error, job.attempts)
                await self._until_stored(lambda: self.store.release(job.id, token))
                return
            if error:
                await self._until_stored(lambda: self.store.finish(job.id, token, "failed",
                                                                   error=f"synthesis failed: {error}"))
                return
            size = await asyncio.to_thread(spool.finish)
            await self._until_stored(lambda: upload.flush(final=True))
            captions = segments.captions()
            if captions is not None:  # GET /v1/jobs/{id}/captions (service/jobs/captions.py), the whole job's
                words = json.dumps(captions)
                await self._until_stored(lambda: self.store.put_words(job.id, token, words))
            self.state.metrics.job_audio_stored.inc()
            await self._until_stored(lambda: self.store.renew(job.id, token, self.lease_seconds, meter.progress()))
            if not await self._until_stored(lambda: self.store.finish(job.id, token, "succeeded", audio_size=size)):
                # DELETE (or a takeover) won the race while the audio was stored
                log.info("job %s was cancelled as it finished; audio discarded", job.id)
                return
            self.state.metrics.jobs_succeeded.inc()
            log.info("job %s succeeded (%.2f s audio, %d bytes, attempt %d, %d of %d segments kept from before)",
                     job.id, spool.samples / SAMPLE_RATE, size, job.attempts, len(kept), len(parts))
        except OSError as exc:  # disk full, permissions (spool, audio files): this job fails, with the reason
            self._cancel(stream)
            error = f"could not write audio: {exc.strerror or exc}"
            await self._until_stored(lambda: self.store.finish(job.id, token, "failed", error=error))
        except QuotaExceeded as exc:  # this job only: the others go on, within what is left
            self._cancel(stream)
            log.warning("job %s: %s", job.id, exc)
            error = str(exc)
            await self._until_stored(lambda: self.store.finish(job.id, token, "failed", error=error))
        except LeaseLost:
            self.state.metrics.job_leases_lost.inc()
            self._cancel(stream)
            log.info("job %s: no longer this replica's (cancelled or taken over)", job.id)
        except asyncio.CancelledError:
            self._cancel(stream)
            if job.id not in self.stopped:  # shutdown: run it again after the restart (or elsewhere)
                try:
                    await asyncio.wait_for(self.store.release(job.id, token), STORE_RETRY_SECONDS * 5)
                except (StoreUnavailable, asyncio.TimeoutError):
                    pass  # its lease expires instead (or the next start re-queues it)
            raise
        except Exception:  # a bug here must fail this job only, visibly
            log.exception("job %s failed", job.id)
            try:
                await self.store.finish(job.id, token, "failed", error="internal error while finishing the job")
            except StoreUnavailable:
                pass
        finally:
            keeper.cancel()
            self.running.pop(job.id, None)
            self.stopped.pop(job.id, None)
            self.wake()
            spool.close()  # quick: frees memory or unlinks a temp file

    async def cancel(self, job: Job) -> bool:
        """queued/running -> cancelled, atomically, wherever it runs; False when it had ended."""
        if not await self.store.cancel(job.id):
            return False
        if job.id in self.running:  # the store's event does it too; here at once
            self._stop_work(job.id, CANCELLED)
        return True
