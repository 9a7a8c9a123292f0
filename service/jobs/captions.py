"""``GET /v1/jobs/{id}/captions?format=json|srt|vtt``: a finished job's word timestamps.

The runner stores them when the job's audio is done (an aligner loaded, ``--aligner``);
a job that has none (no aligner, or nothing could be timed) answers 409 ``no_timestamps``:
never invented times. Owner-scoped like every job route (another key's job is 404).
"""

from __future__ import annotations

from aiohttp import web

from service.errors import ApiError, invalid_field
from service.jobs.routes import _job_or_404, _store
from service.synthesis.timestamps import CAPTION_FORMATS, parse_words, srt, vtt

CONTENT_TYPES = {"json": "application/json", "srt": "application/x-subrip; charset=utf-8",
                 "vtt": "text/vtt; charset=utf-8"}


async def get_captions(request: web.Request) -> web.Response:
    fmt = request.query.get("format", "json")
    if fmt not in CAPTION_FORMATS:
        raise invalid_field("format", f"choose one of {', '.join(CAPTION_FORMATS)}")
    job = await _job_or_404(request)
    if job.status != "succeeded" or job.corrupt:
        raise ApiError(409, "job_not_ready", f"job {job.id} is {job.status}; captions exist once it has succeeded")
    stored = await _store(request).get_words(job.id)
    if stored is None:
        raise ApiError(409, "no_timestamps", f"job {job.id} has no word timestamps (the server had no aligner, "
                                             "--aligner, or the text could not be timed)")
    try:
        words = parse_words(stored)  # a store row is checked on read, as every other
    except ValueError:
        raise ApiError(409, "no_timestamps", f"job {job.id} has word timestamps that cannot be read") from None
    if fmt == "json":
        return web.json_response({"id": job.id, "words": words})
    body = srt(words) if fmt == "srt" else vtt(words)
    return web.Response(text=body, headers={"Content-Type": CONTENT_TYPES[fmt]})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/jobs/{job_id}/captions", get_captions)
