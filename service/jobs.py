"""REST jobs: ``/v1/jobs``. A runner feeds queued jobs to the engine at batch priority.

Jobs use the capacity real-time streams leave (the engine serves ``Priority.REALTIME``
first); at most ``settings.job_workers`` jobs run at once. On shutdown running jobs go
back to ``queued``; on start-up any job still marked ``running`` is re-queued.

Every status change is a conditional update in the store, so cancel is atomic with
completion: a job DELETE has cancelled never turns ``succeeded`` (the audio it was writing
is deleted). With API keys on, a job belongs to the key that made it: other keys get 404,
admin keys (``admin.``) see all. With auth off everyone sees every job, and a job is
recorded as the client address's (for the per-key cap on unfinished jobs).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Callable

from aiohttp import web

from engines.contract import (
    EngineOverloaded,
    EngineUnavailable,
    InvalidRequest,
    Priority,
    VoiceClone,
)

from .audio import CONTENT_TYPES
from .auth import job_owner
from .chunks import ChunkStream
from .errors import ApiError, invalid_field
from .job_store import FINISHED, JOB_ID_RE, STATUSES, Job, JobStore
from .limits import client_identity
from .params import JobBody, SynthesisParams, build_request
from .schema import FieldError
from .speech import read_work_request
from .spool import AudioSpool
from .state import REQUEST_ID, STATE_KEY, AppState
from .voices import saved_clone

log = logging.getLogger("streamvox.jobs")

RETRY_SECONDS = 0.5  # how long the runner waits when the engine queue is full
RETENTION_EVERY_SECONDS = 60.0
QUEUE_FULL_RETRY_SECONDS = 5  # Retry-After when the job queue (total or this key's) is full


class JobRunner:
    def __init__(self, state: AppState, store: JobStore,
                 voice_clone: Callable[[str], VoiceClone | None] | None = None):
        self.state = state
        self.store = store
        self.voice_clone = voice_clone  # a saved voice's name -> its clone (service/voices.py), else None
        self.running: dict[str, ChunkStream] = {}
        self.cancelled: set[str] = set()
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._dispatcher: asyncio.Task | None = None
        self._stopping = False
        self._last_retention = float("-inf")

    def start(self) -> None:
        requeued = self.store.requeue_interrupted()
        if requeued:
            log.info("re-queued %d interrupted job(s)", requeued)
        self._dispatcher = asyncio.create_task(self._dispatch())

    def wake(self) -> None:
        self._wake.set()

    async def stop(self) -> None:
        """Stop taking jobs; running ones are cancelled in the engine and left ``queued``."""
        self._stopping = True
        if self._dispatcher:
            self._dispatcher.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, *(t for t in [self._dispatcher] if t), return_exceptions=True)

    def _apply_retention(self) -> None:
        ttl_hours = self.state.settings.job_ttl_hours
        now = time.monotonic()
        every = min(RETENTION_EVERY_SECONDS, ttl_hours * 3600)  # a short TTL is checked more often
        if ttl_hours <= 0 or now - self._last_retention < every:
            return
        self._last_retention = now
        removed = self.store.delete_finished_before(time.time() - ttl_hours * 3600)
        if removed:
            log.info("retention: deleted %d finished job(s) older than %g h", removed, ttl_hours)

    async def _dispatch(self) -> None:
        while not self._stopping:
            self._apply_retention()
            free = self.state.settings.job_workers - len(self.running)
            started = 0
            if free > 0 and not self.state.draining:
                for job in self.store.oldest_queued(free):
                    if not await self._start(job):
                        break
                    started += 1
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=RETRY_SECONDS if not started else None)
            except asyncio.TimeoutError:
                pass

    async def _start(self, job: Job) -> bool:
        try:
            # Stored when the job was created, after validation; a job stored by an older
            # version lacks the newer fields, which take their defaults.
            params = SynthesisParams().update(job.params)
            # One engine request id per attempt: a job re-run after a restart (or on a shared
            # engine) must not collide with its cancelled predecessor still draining.
            attempt = f"job-{job.id}-{uuid.uuid4().hex[:8]}"
            clone = self.voice_clone(params.voice) if self.voice_clone is not None else None
            synthesis = build_request(attempt, job.params["input"], params, Priority.BATCH, clone=clone,
                                      tenant=job.owner or "jobs")
            stream = ChunkStream(self.state.engine, synthesis, self.state.metrics, high_water=1 << 30)
            stream.start()
        except (EngineOverloaded, EngineUnavailable):
            return False  # stays queued; the dispatcher retries shortly
        except (InvalidRequest, FieldError) as exc:
            self.store.finish(job.id, "failed", error=str(exc), from_statuses=("queued",))
            return True
        if not self.store.mark_running(job.id):  # cancelled since it was read as queued
            stream.cancel()
            return True
        self.running[job.id] = stream
        task = asyncio.create_task(self._run(job, stream))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _run(self, job: Job, stream: ChunkStream) -> None:
        # Encoded as it arrives (service/spool.py): the float32 signal is never held whole.
        spool = AudioSpool(job.response_format, self.state.settings.whole_file_memory_bytes)
        try:
            while True:
                chunk = await stream.next_chunk()
                if chunk.pcm.size:
                    await asyncio.to_thread(spool.write, chunk.pcm)
                self.store.set_progress(job.id, chunk.frames_done, chunk.frames_total)
                if chunk.is_final:
                    break
            if job.id in self.cancelled:
                return  # DELETE already recorded the cancellation
            if chunk.error:
                self.store.finish(job.id, "failed", error=f"synthesis failed: {chunk.error}")
                return
            fmt = job.response_format
            try:
                await asyncio.to_thread(spool.finish)
                data = await asyncio.to_thread(spool.read, -1)
                name = await asyncio.to_thread(self.store.write_audio, job.id, fmt, data)
            except OSError as exc:  # disk full, permissions: this job fails, with the reason
                self.store.finish(job.id, "failed", error=f"could not write audio: {exc.strerror or exc}")
                return
            if not self.store.finish(job.id, "succeeded", audio_file=name):
                # DELETE won the race while the audio was encoded or written: it stays
                # cancelled and its audio goes.
                self.store.discard_audio(name)
                log.info("job %s was cancelled as it finished; audio discarded", job.id)
                return
            log.info("job %s succeeded (%.2f s audio)", job.id, spool.samples / chunk.sample_rate)
        except asyncio.CancelledError:
            stream.cancel()
            if job.id not in self.cancelled:
                self.store.requeue(job.id)  # shutdown: run it again after the restart
            raise
        except Exception:  # a bug here must fail this job only, visibly
            log.exception("job %s failed", job.id)
            self.store.finish(job.id, "failed", error="internal error while finishing the job")
        finally:
            self.running.pop(job.id, None)
            self.cancelled.discard(job.id)
            self.wake()
            spool.close()  # quick: frees memory or unlinks a temp file

    def cancel(self, job: Job) -> bool:
        """queued/running -> cancelled, atomically; False when the job had already ended."""
        if not self.store.cancel(job.id):
            return False
        if job.id in self.running:
            self.cancelled.add(job.id)
            self.running[job.id].cancel()
        return True


# -- routes ---------------------------------------------------------------------------

def _runner(request: web.Request) -> JobRunner:
    return request.app[STATE_KEY].jobs


def _owner(request: web.Request) -> tuple[str | None, bool]:
    return job_owner(request, request.app[STATE_KEY].api_keys)


def _job_or_404(request: web.Request) -> Job:
    job_id = request.match_info["job_id"]
    if not JOB_ID_RE.fullmatch(job_id):
        raise invalid_field("id", "a job id is 32 lowercase hex characters")
    job = _runner(request).store.get(job_id)
    owner, sees_all = _owner(request)
    if job is None or not (sees_all or job.owner == owner):  # another key's job does not exist for this one
        raise ApiError(404, "not_found", f"no job with id {job_id}")
    return job


async def create_job(request: web.Request) -> web.Response:
    state, body = await read_work_request(request, JobBody)
    quota_mb = state.settings.jobs_disk_quota_mb
    if quota_mb and _runner(request).store.audio_bytes() >= quota_mb * 1024 * 1024:
        raise ApiError(507, "storage_full", f"job audio uses its whole quota ({quota_mb:g} MB); "
                                            "download and delete old jobs or wait for retention")
    if getattr(state.engine, "task_type", None) == "Base" and saved_clone(request.app, body.voice) is None:
        raise ApiError(400, "invalid_field", "voice: jobs on a voice-clone (Base) checkpoint need a saved voice "
                                             "(POST /v1/audio/voices), named by voice")
    owner, _ = _owner(request)
    if owner is None:  # auth off: the job is counted (and scheduled fairly) by the client's address
        owner = client_identity(request)
    _check_queue(state, _runner(request).store, owner)
    job = _runner(request).store.create(body.model_dump(exclude_none=True), owner=owner)
    _runner(request).wake()
    log.info("job %s queued (request %s, %d chars)", job.id, request[REQUEST_ID], len(body.input))
    return web.json_response(job.to_json(), status=202, headers={"Location": f"/v1/jobs/{job.id}"})


def _check_queue(state, store: JobStore, owner: str | None) -> None:
    """429 ``too_many_jobs`` with Retry-After when unfinished jobs are at the cap, in total
    or for this key (this address with auth off)."""
    per_key, total = state.settings.max_queued_jobs_per_key, state.settings.max_queued_jobs
    retry = {"Retry-After": str(QUEUE_FULL_RETRY_SECONDS)}
    if per_key and store.unfinished(owner, any_owner=False) >= per_key:
        raise ApiError(429, "too_many_jobs", f"this key already has {per_key} unfinished jobs (the limit); "
                                             "wait for some to finish or cancel them", headers=retry)
    if total and store.unfinished() >= total:
        raise ApiError(429, "too_many_jobs", f"the job queue is full ({total} unfinished jobs); retry later",
                       headers=retry)


async def list_jobs(request: web.Request) -> web.Response:
    status = request.query.get("status") or None
    if status is not None and status not in STATUSES:
        raise invalid_field("status", f"choose one of {', '.join(STATUSES)}")
    try:
        limit = int(request.query.get("limit", "100"))
    except ValueError:
        raise invalid_field("limit", "must be an integer") from None
    if not 1 <= limit <= 1000:
        raise invalid_field("limit", "must be between 1 and 1000")
    owner, sees_all = _owner(request)
    jobs = _runner(request).store.list(status, limit, owner=owner, any_owner=sees_all)
    return web.json_response({"object": "list", "data": [job.to_json() for job in jobs]})


async def get_job(request: web.Request) -> web.Response:
    return web.json_response(_job_or_404(request).to_json())


async def get_job_audio(request: web.Request) -> web.StreamResponse:
    job = _job_or_404(request)
    if job.status != "succeeded":
        raise ApiError(409, "job_not_ready", f"job {job.id} is {job.status}; audio exists once it has succeeded")
    path = _runner(request).store.audio_path(job)
    if path is None or not path.exists():
        raise ApiError(410, "audio_gone", f"the audio of job {job.id} is no longer stored")
    return web.FileResponse(path, headers={"Content-Type": CONTENT_TYPES[job.response_format],
                                           "Content-Disposition": f'attachment; filename="{path.name}"'})


async def delete_job(request: web.Request) -> web.Response:
    job = _job_or_404(request)
    if job.status in FINISHED or not _runner(request).cancel(job):
        job = _runner(request).store.get(job.id)
        raise ApiError(409, "job_finished", f"job {job.id} has already finished ({job.status})")
    return web.json_response(_runner(request).store.get(job.id).to_json())


async def _start_runner(app: web.Application) -> None:
    state = app[STATE_KEY]
    state.jobs = JobRunner(state, JobStore(state.settings.data_dir), voice_clone=lambda voice: saved_clone(app, voice))
    state.jobs.start()


async def _stop_runner(app: web.Application) -> None:
    runner = app[STATE_KEY].jobs
    if runner is not None:
        await runner.stop()
        runner.store.close()


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/jobs", create_job)
    app.router.add_get("/v1/jobs", list_jobs)
    app.router.add_get("/v1/jobs/{job_id}", get_job)
    app.router.add_get("/v1/jobs/{job_id}/audio", get_job_audio)
    app.router.add_delete("/v1/jobs/{job_id}", delete_job)
    app.on_startup.append(_start_runner)
    app.on_shutdown.append(_stop_runner)
