"""Word timestamps point into the text the client sent, on every surface that gives character
offsets: ``text[char_start:char_end]`` is the word, for text with blank lines, tabs, runs of
spaces and ``<break>`` tags, spoken as several utterances (a job's text cut where one request
could not take it, the parts around a break). Speech SSE and jobs' captions index the request's
text; a ``/v1/stream`` ``alignment`` message (and an ElevenLabs socket's characters) the
utterance's text as it was sent, a slice of the session's.

Real servers on 127.0.0.1 with the tiny DiT and the random forced aligner fixture (real word
times, degenerate values: the checks are the offsets), real clients; ``Recorded`` only records
the engine requests.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import websockets
from conftest import finished_job, start_server

from engines.pipelines.aligner.words import split_words
from testsupport.long_text import Recorded

TEXT = ("Hello   there, my friend.\n\nHow are\tyou today?  The weather is mild,\n  and the trains   run on time. "
        'Fine,\n  thanks <break time="200ms"/>  a lot.\n')
SPOKEN = TEXT.replace('<break time="200ms"/>', " ")


def check_offsets(words: list[dict], text: str) -> None:
    assert words, "no words were timed"
    for w in words:
        assert text[w["char_start"]:w["char_end"]] == w["word"], (w, text[w["char_start"]:w["char_end"]])
    starts = [w["char_start"] for w in words]
    assert starts == sorted(starts)


async def test_speech_sse_words_index_the_request_text(aligned_engine, tmp_path):
    live = await start_server(aligned_engine, tmp_path / "data")
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(live.url + "/v1/audio/speech", json={
                    "input": TEXT, "response_format": "pcm", "stream_format": "sse", "timestamps": True}) as r:
                assert r.status == 200, await r.text()
                body = await r.text()
        events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: ")]
        (alignment,) = [e for e in events if e["type"] == "speech.audio.alignment"]
        assert alignment["text"] == TEXT
        assert [w["word"] for w in alignment["words"]] == split_words(SPOKEN, "english")
        check_offsets(alignment["words"], TEXT)
    finally:
        await live.stop()


async def test_a_jobs_captions_index_its_text_across_utterances(aligned_engine, tmp_path):
    """A DiT job longer than one request may be (a low --max-work-audio-frames here) is spoken as
    utterances, each within the limit; its captions locate every word in the submitted text."""
    live = await start_server(aligned_engine, tmp_path / "data", job_workers=1, max_work_audio_frames=60)
    try:
        async with aiohttp.ClientSession() as http:
            with Recorded(aligned_engine) as submitted:
                async with http.post(live.url + "/v1/jobs", json={"input": TEXT, "steps": 1}) as r:
                    assert r.status == 202, await r.text()
                    job_id = (await r.json())["id"]
                job = await finished_job(http, f"{live.url}/v1/jobs/{job_id}", timeout_s=240)
            assert job["status"] == "succeeded", job
            assert len(submitted.requests) >= 3
            assert all(aligned_engine.planned_work(r).audio_frames <= 60 for r in submitted.requests)
            async with http.get(f"{live.url}/v1/jobs/{job_id}/captions") as r:
                assert r.status == 200, await r.text()
                words = (await r.json())["words"]
        assert [w["word"] for w in words] == split_words(SPOKEN, "english")
        check_offsets(words, TEXT)
    finally:
        await live.stop()


async def test_stream_and_elevenlabs_alignments_index_the_text_as_sent(aligned_engine, tmp_path):
    """Each utterance's alignment is over its text as sent (a slice of what the session sent,
    breaks and whitespace kept), its words located in it."""
    live = await start_server(aligned_engine, tmp_path / "data")
    ws_url = live.url.replace("http://", "ws://")
    try:
        async with websockets.connect(ws_url + "/v1/stream", max_size=None) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "session.config", "timestamps": True}))
            await ws.send(json.dumps({"type": "input.text", "text": TEXT}))
            await ws.send(json.dumps({"type": "input.done"}))
            alignments = []
            while True:
                message = await asyncio.wait_for(ws.recv(), 120)
                if isinstance(message, bytes):
                    continue
                message = json.loads(message)
                if message["type"] == "alignment":
                    alignments.append(message)
                if message["type"] == "session.done":
                    break
        assert len(alignments) >= 3
        for m in alignments:
            assert m["text"] in TEXT, m["text"]
            check_offsets(m["words"], m["text"])
        assert [w["word"] for m in alignments for w in m["words"]] == split_words(SPOKEN, "english")

        url = ws_url + "/v1/text-to-speech/default/stream-input?output_format=pcm_24000"
        async with websockets.connect(url, max_size=None) as ws:
            await ws.send(json.dumps({"text": " "}))
            await ws.send(json.dumps({"text": TEXT}))
            await ws.send(json.dumps({"text": ""}))
            texts = []
            while not (message := json.loads(await asyncio.wait_for(ws.recv(), 120))).get("isFinal"):
                if message.get("alignment"):
                    texts.append("".join(message["alignment"]["chars"])[:-1])  # (and the space between utterances)
        assert len(texts) >= 3 and all(text in TEXT for text in texts), texts
    finally:
        await live.stop()
