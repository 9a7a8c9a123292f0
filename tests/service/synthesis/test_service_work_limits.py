"""Work limits in the units that cost: the vocoder's frames (after ``speed``; ``steps`` do not
change a frame's vocoder cost), the DiT's frames x steps and the talker's decode steps
(each utterance's frame budget from its text) are counted by the engine and refused with 413 ``too_much_work`` (a
WebSocket ``error``) before any engine time, on every entry point: speech, jobs, ``/v1/stream``
and the vllm-omni socket.

Real servers on 127.0.0.1, real HTTP and WebSocket clients; ``engine.submit`` is wrapped only
to record what reached the engine.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
import websockets
from conftest import start_server

from engines.pipelines.talker.budget import FRAMES_BASE
from service.settings import from_args

EMOJI_ATTACK = {"input": "\U0001F600" * 4096, "speed": 0.25, "steps": 1}  # 58,982 frames at 1 step each
OMNI = "/v1/audio/speech/stream"


class Submissions:
    """Records the texts the engine was asked to synthesize (the real submit still runs)."""

    def __init__(self, engine):
        self.engine, self.texts, self.real = engine, [], engine.submit

    def __enter__(self):
        def recording_submit(request, deliver):
            self.texts.append(request.text)
            return self.real(request, deliver)

        self.engine.submit = recording_submit
        return self

    def __exit__(self, *exc):
        self.engine.submit = self.real


async def next_json(ws, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        message = await asyncio.wait_for(ws.recv(), max(0.01, deadline - time.monotonic()))
        if isinstance(message, str):
            return json.loads(message)


async def http_refusals(url: str, body: dict, job: bool = True) -> list[tuple[int, dict]]:
    """(status, error) of the body as streamed speech (fast to answer 200 if it were accepted),
    whole-file speech and (``job``) a job."""
    out = []
    async with aiohttp.ClientSession() as http:
        for path, extra in (("/v1/audio/speech", {"response_format": "pcm", "stream_format": "audio"}),
                            ("/v1/audio/speech", {"response_format": "wav"}), ("/v1/jobs", {}))[:3 if job else 2]:
            async with http.post(url + path, json={**body, **extra}) as response:
                out.append((response.status, (await response.json(content_type=None) or {}).get("error")
                            if response.status != 200 else None))
    return out


async def ws_refusal(url: str, config: dict, text: str, omni: bool = False) -> list[dict]:
    """The events of one round with this config and text, up to session.done."""
    async with websockets.connect(url, max_size=None) as ws:
        if not omni:
            assert (await next_json(ws))["type"] == "session.created"
        await ws.send(json.dumps({"type": "session.config", **config}))
        await ws.send(json.dumps({"type": "input.text", "text": text}))
        await ws.send(json.dumps({"type": "input.done"}))
        events = []
        while not events or events[-1]["type"] != "session.done":
            events.append(await next_json(ws))
        return events


def assert_refused(results, name: str, flag: str) -> None:
    for status, error in results:
        assert status == 413, (status, error)
        assert error["code"] == "too_much_work" and name in error["message"] and flag in error["message"], error


def assert_ws_refused(events: list[dict], flag: str) -> None:
    errors = [e for e in events if e["type"] == "error"]
    assert len(errors) == 1 and errors[0]["code"] == "too_much_work" and flag in errors[0]["message"], events
    assert not [e for e in events if e["type"] == "audio.start"], events


async def test_emoji_at_quarter_speed_and_one_step_is_refused_everywhere_before_any_engine_time(engine, tmp_path):
    """4,096 emoji are 16,384 UTF-8 bytes: ~14,700 planned frames at speed 1, ~59,000 at 0.25.
    One denoising step keeps the frame-steps under their limit, but the vocoder still decodes
    every frame: the frame limit refuses it, on the three speech entry points. (A job may plan
    more: --max-job-audio-frames, test_jobs_have_their_own_limit_over_the_whole_job.)"""
    live = await start_server(engine, tmp_path / "data", job_workers=0)
    try:
        with Submissions(engine) as submitted:
            assert_refused(await http_refusals(live.url, EMOJI_ATTACK, job=False), "audio frames",
                           "--max-work-audio-frames")
            config = {"speed": 0.25, "steps": 1}
            assert_ws_refused(await ws_refusal(live.ws_url, config, EMOJI_ATTACK["input"][:4000]),
                              "--max-work-audio-frames")
            omni_events = await ws_refusal(live.url.replace("http", "ws") + OMNI, config,
                                           EMOJI_ATTACK["input"][:4000], omni=True)
            assert_ws_refused(omni_events, "--max-work-audio-frames")
            assert submitted.texts == []
            # The same text at speed 1 plans ~14,700 frames: under the default limit (a job, queued only);
            # at 0.25 a job takes it, as utterances that each fit one request.
            async with aiohttp.ClientSession() as http:
                for job in ({"input": EMOJI_ATTACK["input"], "steps": 1}, EMOJI_ATTACK):
                    async with http.post(live.url + "/v1/jobs", json=job) as r:
                        assert r.status == 202, await r.text()
    finally:
        await live.stop()


async def test_the_frame_and_frame_step_limits_are_separate_and_configurable(engine, tmp_path):
    live = await start_server(engine, tmp_path / "data", job_workers=0, max_work_audio_frames=100,
                              max_work_frame_steps=400)
    text = "x" * 100  # 90 planned frames at speed 1
    try:
        async with aiohttp.ClientSession() as http:
            for extra, expected, flag in (({"steps": 4}, 200, None), ({"steps": 5}, 413, "--max-work-frame-steps"),
                                          ({"speed": 0.5, "steps": 1}, 413, "--max-work-audio-frames"),
                                          ({"speed": 2.0, "steps": 8}, 200, None)):
                async with http.post(live.url + "/v1/audio/speech",
                                     json={"input": text, "response_format": "pcm", **extra}) as response:
                    body = await response.json() if response.status != 200 else await response.read()
                assert response.status == expected, (extra, body)
                if flag:
                    assert body["error"]["code"] == "too_much_work" and flag in body["error"]["message"]
    finally:
        await live.stop()


def test_the_work_limits_have_flags_and_environment_variables():
    import argparse

    from service.settings import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--max-work-audio-frames", "500", "--max-work-talker-steps", "0"])
    settings = from_args(args, env={"STREAMVOX_MAX_WORK_FRAME_STEPS": "1234"})
    assert (settings.max_work_audio_frames, settings.max_work_frame_steps, settings.max_work_talker_steps) == \
        (500, 1234, 0)
    with pytest.raises(ValueError, match="--max-work-audio-frames"):
        from_args(parser.parse_args(["--max-work-audio-frames", "-1"]), env={})


async def test_the_talker_limit_checks_the_texts_budget_not_max_new_tokens(unwarmed_talker_engine, tmp_path):
    """Each utterance is charged its text's frame budget (engines/pipelines/talker/budget.py),
    capped by max_new_tokens: a huge max_new_tokens on a short text is served, and a limit under
    the budget is refused on every entry point before any engine time (a live utterance is
    charged the text it has when it opens: at least FRAMES_BASE)."""
    assert FRAMES_BASE > 40
    text = "Hello there."
    huge = {"input": text, "max_new_tokens": 16384}
    live = await start_server(unwarmed_talker_engine, tmp_path / "data", job_workers=0, max_work_talker_steps=40)
    try:
        with Submissions(unwarmed_talker_engine) as submitted:
            # (long text is cut into utterances that fit; no piece of any text fits under FRAMES_BASE)
            assert_refused(await http_refusals(live.url, huge), "talker steps", "--max-work-talker-steps")
            for url, omni in ((live.ws_url, False), (live.url.replace("http", "ws") + OMNI, True)):
                for streaming in (True, False):  # a live utterance is checked as a sentence is
                    config = {"max_new_tokens": 16384, **({} if omni else {"text_streaming": streaming})}
                    assert_ws_refused(await ws_refusal(url, config, text, omni=omni), "--max-work-talker-steps")
                    if omni:
                        break
            assert submitted.texts == []
            async with aiohttp.ClientSession() as http:  # max_new_tokens under the limit caps the budget: served
                async with http.post(live.url + "/v1/audio/speech",
                                     json={"input": text, "response_format": "pcm", "max_new_tokens": 41}) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
            assert len(submitted.texts) == 1
    finally:
        await live.stop()
    live = await start_server(unwarmed_talker_engine, tmp_path / "data2", job_workers=0)  # the default limit
    try:
        with Submissions(unwarmed_talker_engine) as submitted:
            async with aiohttp.ClientSession() as http:
                for extra in ({}, {"max_new_tokens": 16384}):
                    async with http.post(live.url + "/v1/audio/speech",
                                         json={"input": text, "response_format": "pcm", **extra}) as response:
                        assert response.status == 200, await response.text()
                        await response.read()
            assert len(submitted.texts) == 2
    finally:
        await live.stop()
