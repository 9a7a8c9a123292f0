"""REST jobs: ``/v1/jobs``. The runner (service/jobs/runner.py) runs them; the store
(service/jobs/store/base.py: SQLite under --data-dir, or PostgreSQL shared by every replica) keeps them.

With a shared store any replica lists, polls, downloads and cancels any job. Every status
change is a conditional update in the store, so cancel is atomic with completion: a job
DELETE has cancelled never turns ``succeeded``. With API keys on, a job belongs to the key
that made it: other keys get 404, admin keys (``admin.``) see all. With auth off everyone sees
every job, and a job is recorded as the client address's (for the per-key cap on unfinished
jobs). While the store is unreachable every job endpoint answers 503 ``database_unavailable``
with Retry-After (service/http/middleware.py); streaming does not depend on it.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from service.access.auth import job_owner
from service.access.limits import client_identity
from service.errors import ApiError, StoreUnavailable, invalid_field
from service.http.body import read_work_request
from service.http.middleware import log_at_debug
from service.jobs.progress import planned_frames
from service.jobs.runner import JobRunner
from service.jobs.store.base import (
    FINISHED,
    JOB_ID_RE,
    STATUSES,
    Job,
    JobStore,
)
from service.state import REQUEST_ID, STATE_KEY
from service.synthesis.audio import CONTENT_TYPES
from service.synthesis.numbers import whole_number
from service.synthesis.params import JobBody, check_params, parse_body
from service.synthesis.plan import check_work, off_loop
from service.synthesis.submit import check_plan
from service.voices.clones import job_voice_scope, scoped_clone, voice_for

log = logging.getLogger("streamvox.jobs")

HEALTH_TIMEOUT_S = 1.0  # /readyz waits this long for the job store (probes time out at 3 s)
QUEUE_FULL_RETRY_SECONDS = 5  # Retry-After when the job queue (total or this key's) is full


# -- routes ---------------------------------------------------------------------------

def _runner(request: web.Request) -> JobRunner:
    return request.app[STATE_KEY].jobs


def _owner(request: web.Request) -> tuple[str | None, bool]:
    return job_owner(request, request.app[STATE_KEY].api_keys)


def _store(request: web.Request) -> JobStore:
    return _runner(request).store


async def _job_or_404(request: web.Request) -> Job:
    job_id = request.match_info["job_id"]
    if not JOB_ID_RE.fullmatch(job_id):
        raise invalid_field("id", "a job id is 32 lowercase hex characters")
    job = await _store(request).get(job_id)
    owner, sees_all = _owner(request)
    if job is None or not (sees_all or job.owner == owner):  # another key's job does not exist for this one
        raise ApiError(404, "not_found", f"no job with id {job_id}")
    return job


def job_body_bytes(settings) -> int:
    """The largest job body: ``--max-job-chars`` characters as JSON may write them (an emoji
    escaped is 12 bytes), with room for the other fields; never under ``max_body_bytes``."""
    return max(settings.max_body_bytes, 12 * settings.max_job_chars + 64 * 1024)


async def create_job(request: web.Request) -> web.Response:
    settings = request.app[STATE_KEY].settings
    state, _, raw = await read_work_request(request.clone(client_max_size=job_body_bytes(settings)))
    body = parse_body(JobBody, raw, settings.max_job_chars)
    body = body.model_copy(update={"voice": check_params(state.engine, body.params).voice})
    store = _store(request)
    quota_mb = state.settings.jobs_disk_quota_mb
    if quota_mb and await store.stored_bytes() >= quota_mb * 1024 * 1024:
        raise ApiError(507, "storage_full", f"what the jobs keep uses its whole quota ({quota_mb:g} MB, "
                                            "--jobs-disk-quota-mb); download and delete old jobs or wait for retention")
    clone = (await voice_for(request, body.voice)).clone  # the one voice resolver: a saved voice, or None
    if clone is None and state.engine.capabilities.task_type == "Base":
        raise ApiError(400, "invalid_field", "voice: jobs on a voice-clone (Base) checkpoint need a saved voice "
                                             "(POST /v1/audio/voices), named by voice")
    # Planned and checked now as it will run (the runner here reuses the plan: its ids and budgets).
    plan = await off_loop(body.input, check_work, state.engine, body.input, body.params, settings, clone=clone,
                          job_format=body.response_format)
    await off_loop(body.input, check_plan, state.engine, plan)
    owner, _ = _owner(request)
    if owner is None:  # auth off: the job is counted (and scheduled fairly) by the client's address
        owner = client_identity(request, request.app[STATE_KEY].api_keys)
    await _check_queue(state, store, owner)
    planned = planned_frames(plan)  # progress from the first poll
    job = await store.create(body.model_dump(exclude_none=True), owner=owner, frames_total=sum(planned),
                             utterances_total=len(plan.parts))
    if plan.as_sent:  # one utterance: its run here reuses its plan (and ids)
        _runner(request).remember(job.id, plan)
    _runner(request).wake()
    log.info("job %s queued (request %s, %d chars)", job.id, request[REQUEST_ID], len(body.input))
    return web.json_response(job.to_json(), status=202, headers={"Location": f"/v1/jobs/{job.id}"})


async def _check_queue(state, store: JobStore, owner: str | None) -> None:
    """429 ``too_many_jobs`` with Retry-After when unfinished jobs are at the cap, in total
    or for this key (this address with auth off)."""
    per_key, total = state.settings.max_queued_jobs_per_key, state.settings.max_queued_jobs
    retry = {"Retry-After": str(QUEUE_FULL_RETRY_SECONDS)}
    if per_key and await store.unfinished(owner, any_owner=False) >= per_key:
        raise ApiError(429, "too_many_jobs", f"this key already has {per_key} unfinished jobs (the limit); "
                                             "wait for some to finish or cancel them", headers=retry)
    if total and await store.unfinished() >= total:
        raise ApiError(429, "too_many_jobs", f"the job queue is full ({total} unfinished jobs); retry later",
                       headers=retry)


async def list_jobs(request: web.Request) -> web.Response:
    status = request.query.get("status") or None
    if status is not None and status not in STATUSES:
        raise invalid_field("status", f"choose one of {', '.join(STATUSES)}")
    limit = whole_number(request.query.get("limit", "100"))
    if limit is None:
        raise invalid_field("limit", "must be an integer")
    if not 1 <= limit <= 1000:
        raise invalid_field("limit", "must be between 1 and 1000")
    owner, sees_all = _owner(request)
    log_at_debug(request)  # a client polling its jobs is not news
    jobs = await _store(request).list(status, limit, owner=owner, any_owner=sees_all)  # summaries: no inputs read
    return web.json_response({"object": "list", "data": [job.to_json() for job in jobs]})


async def get_job(request: web.Request) -> web.Response:
    log_at_debug(request)
    return web.json_response((await _job_or_404(request)).to_json())


async def get_job_audio(request: web.Request) -> web.StreamResponse:
    job = await _job_or_404(request)
    if job.status != "succeeded" or job.corrupt:
        raise ApiError(409, "job_not_ready", f"job {job.id} is {job.status}; audio exists once it has succeeded")
    blocks = _store(request).read_audio(job).__aiter__()
    try:  # the first block before the headers: a store that fails now is still a 503, not a cut file
        first = await blocks.__anext__()
    except StopAsyncIteration:
        raise ApiError(410, "audio_gone", f"the audio of job {job.id} is no longer stored") from None
    name = f"{job.id}.{job.response_format}"
    # the random-weights header names this replica's model (the one that runs its jobs)
    response = web.StreamResponse(headers={"Content-Type": CONTENT_TYPES[job.response_format],
                                           "Content-Disposition": f'attachment; filename="{name}"',
                                           **request.app[STATE_KEY].audio_headers()})
    if job.audio_size is not None:
        response.content_length = job.audio_size
    await response.prepare(request)
    await response.write(first)
    async for block in blocks:  # a store failing mid-file cuts the connection (short of Content-Length)
        await response.write(block)
    await response.write_eof()
    return response


async def delete_job(request: web.Request) -> web.Response:
    job = await _job_or_404(request)
    store = _store(request)
    if job.status in FINISHED or not await _runner(request).cancel(job):
        job = await store.get(job.id)
        raise ApiError(409, "job_finished", f"job {job.id} has already finished ({job.status})")
    return web.json_response((await store.get(job.id)).to_json())


async def store_health(state) -> dict:
    """For /readyz: the job store's kind and whether it answers now."""
    runner = state.jobs
    if runner is None:
        return {"kind": None, "reachable": False, "error": "not started"}
    try:  # bounded: a database that does not answer (not even a refusal) must not stall the probe
        await asyncio.wait_for(runner.store.ping(), HEALTH_TIMEOUT_S)
    except StoreUnavailable as exc:
        return {"kind": runner.store.kind, "reachable": False, "error": str(exc)}
    except asyncio.TimeoutError:
        return {"kind": runner.store.kind, "reachable": False, "error": f"no answer within {HEALTH_TIMEOUT_S:g} s"}
    return {"kind": runner.store.kind, "reachable": True, "leader": runner.store.leader}


JOB_STORE_KEY: web.AppKey[JobStore] = web.AppKey("job_store", JobStore)


async def _start_runner(app: web.Application) -> None:
    state = app[STATE_KEY]
    store = app[JOB_STORE_KEY]
    try:
        await store.open()
    except StoreUnavailable as exc:  # the runner keeps trying; job endpoints answer 503 until then
        log.warning("%s", exc)
    state.jobs = JobRunner(state, store,
                           voice_clone=lambda voice, owner: scoped_clone(app, voice, job_voice_scope(app, owner)))
    await state.jobs.start()


async def _stop_runner(app: web.Application) -> None:
    runner = app[STATE_KEY].jobs
    if runner is not None:
        await runner.stop()
        await runner.store.close()


def add_routes(app: web.Application, store: JobStore) -> None:
    """The job routes over ``store`` (opened at start-up: service.jobs.store.make_job_store)."""
    app[JOB_STORE_KEY] = store
    app.router.add_post("/v1/jobs", create_job)
    app.router.add_get("/v1/jobs", list_jobs)
    app.router.add_get("/v1/jobs/{job_id}", get_job)
    app.router.add_get("/v1/jobs/{job_id}/audio", get_job_audio)
    app.router.add_delete("/v1/jobs/{job_id}", delete_job)
    app.on_startup.append(_start_runner)
    app.on_shutdown.append(_stop_runner)
