"""Hostile clients for the soak (``load.py --attacks``): the hardening reproductions run in
loops beside normal traffic, from a second loopback address (127.0.0.2) so they are a
client of their own. Every HTTP status they get is counted; a 5xx anywhere is a failure.

* ws_flood     - WebSocket handshake, then 20,000 ``response.cancel`` frames, never reading
* silent       - 60 sockets that send nothing, a never-ending head, or a never-ending body
* bad_bytes    - deep nesting, huge numbers, lone surrogates, odd charsets, non-UTF-8 headers
* heavy        - 8 concurrent long streamed requests (more than the per-key stream cap)
* over_work    - requests over the work limit (413 before any engine time)
* costly       - work counted in the units that cost: 4,096 emoji at speed 0.25 and steps 1, a
                 huge talker max_new_tokens (413 before any engine time), a ~100 s mp3 sentence
                 on the vllm-omni socket (encoded off the event loop) and 60,000 empty deltas
                 on a 4,000-character sentence buffer (read once, not re-split per message)
* ref_audio    - hostile reference audio through speech and voice upload: an SDP session, HLS,
                 DASH and ffconcat playlists naming a local port, FLAC decompression bombs (35 KB
                 decoding to an hour; 10 KB declaring 655,350 Hz x 8 channels), garbage behind
                 each allowed container's magic (all refused with a 400, never reaching the port)
* upload_flood - saved-voice uploads as fast as they are answered, each a new name (429 rate_limited /
                 too_many_voices once the key's rate or cap is reached; 400 on a server that cannot clone)
* contexts     - (from 127.0.0.4) Cartesia contexts whose ids share 32 characters (both must finish),
                 and barge-in turns: cancel a context 0-200 ms after its flush and reopen the same
                 id at once (every reply must finish); an error counts as a 500 (its code named),
                 a context that never ends as a 599
* crowd        - one socket speaking through 16 Cartesia contexts at once (held to one session's share
                 of engine requests; every context must finish)
* vendor_text  - a lone surrogate to the ElevenLabs HTTP routes (400, never a 500)
* log_forging  - request paths carrying %0a / %0d and a fake log line (load.py counts forged lines)
* vendor_answers - ElevenLabs' /with-timestamps at the largest answer the limits allow (~310 MiB of JSON,
                 once held 4-5 times over in memory), and 40-sentence requests whose client leaves first
* odd_numbers  - "²", other scripts' digits, 5,001 digits, signs, exponents in every numeric query
                 parameter, socket handshake and vendor JSON number (each a 4xx, never a 500)
* bad_encoding - Content-Encoding gzip / deflate on bodies that are not, on every route that reads one
* unknown_voices - socket handshakes naming a voice that does not exist (refused before the upgrade)
* cap_flood    - 300 connections at once from a third address (127.0.0.3), past the per-address
                 cap of 256: the refusals are 503s by design, counted apart (load.py checks the log
                 for tracebacks and its growth)
* job_listing  - 30 jobs of 198,000 characters (Chinese: stored as JSON, 6 bytes a character), each
                 cancelled at once, then ``GET /v1/jobs?limit=1000`` over them in a loop (a list reads
                 summaries, not inputs: it once cost +126-162 MB of RSS per call over 150 such jobs;
                 a server whose work limits refuse such a job answers 413 and lists fewer)
* breaks       - ``<break time=1s`` and 4,000 spaces that never reach ``>`` (a backtracking pattern
                 took tens of seconds over it) on every surface that takes text (400 / an error
                 message), and 255 x ``<break time=10s>`` (42 min of silence in 4 KB) as mp3 from the
                 ElevenLabs, Deepgram and OpenAI routes (200, read to the end)

All along, a process of its own polls ``/healthz`` from 127.0.0.1 on its own connection: the report's
longest wait for it is the longest stall of the event loop the attacks caused.

``load.py --attacks`` runs this file as a process of its own (so the attackers' work does not
slow the normal clients' event loop): ``python benchmarks/attacks.py URL SECONDS [NAME,...]`` prints
its report as one JSON line (NAME: only these attacks, ``load.py --only``). ``python benchmarks/attacks.py
URL --breaks [NAME]`` runs the break attacks (those whose name holds NAME) once each, one after the
other, and prints each one's longest ``/healthz`` wait (a table).

``python benchmarks/attacks.py list-jobs URL PID [JOBS]`` measures one attack alone: the server's
peak RSS during each ``GET /v1/jobs`` call (``/proc/PID``: VmHWM, reset before each call by
``clear_refs``, which needs the server's user or root) and the call's time, over JOBS (150)
cancelled jobs of 198,000 characters (on a server with ``--job-workers 0``, which runs none of
them meanwhile, and its work limits off, which would refuse such a job on the DiT).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import io
import itertools
import json
import math
import os
import socket
import struct
import sys
import time
import wave
from dataclasses import dataclass, field

import aiohttp

ATTACKER = "127.0.0.2"
CAP_ATTACKER = "127.0.0.3"  # its own address: the per-address connection cap counts it alone
TURNS_ATTACKER = "127.0.0.4"  # the barge-in turns: a client of their own, not queued behind the crowd's work
ANSWERS_ATTACKER = "127.0.0.5"  # vendor_answers: its own per-address stream cap, not the heavy streamer's
CAP_FLOOD_SOCKETS = 300  # past the default --max-connections-per-address (256)
FORGED_LINE = b"2026-01-01%2000:00:00,000%20ERROR%20streamvox.server:%20FORGED%20by%20a%20client"
FLOOD_FRAMES = 20_000
SILENT_SOCKETS = 60
HEAVY_STREAMS = 8
HEAVY_TEXT = " ".join(f"Heavy sentence number {i} keeps the device busy for a while." for i in range(4))

BAD_BODIES = [
    (b"[" * 100_000, "application/json"),
    (b'{"input": "Hi.", "seed": ' + b"9" * 5000 + b"}", "application/json"),
    (b'{"input": "Hi.", "speed": ' + b"9" * 400 + b"}", "application/json"),
    (b'{"input": "hi \\ud800"}', "application/json"),
    (b'{"input": "Hi."}', "application/json; charset=rot13"),
    (b'{"input": "\xff\xfe"}', "application/json"),
]
OVER_WORK = {"input": "A sentence of moderate length. " * 40, "speed": 0.25, "steps": 64}
# A job may plan far more than a request (--max-job-frame-steps, 8,000,000 DiT frame-steps): this one
# plans ~10 million at steps 64 (46,500 characters at speed 0.25), over the job's own limit.
OVER_WORK_JOB = {"input": "A sentence of moderate length. " * 1500, "speed": 0.25, "steps": 64}


@dataclass
class AttackReport:
    statuses: collections.Counter = field(default_factory=collections.Counter)  # (attack, HTTP status)
    flood_outcomes: collections.Counter = field(default_factory=collections.Counter)
    silent_closed: int = 0
    refused_connections: int = 0  # cap_flood: 503 too_many_connections, the cap doing its job
    health_longest_s: float = 0.0  # the longest /healthz wait while the attacks ran

    def count(self, attack: str, status: int) -> None:
        self.statuses[(attack, status)] += 1

    @property
    def server_errors(self) -> int:
        return sum(n for (_, status), n in self.statuses.items() if status >= 500)

    def rows(self) -> list[tuple[str, object]]:
        by_attack: dict[str, list[str]] = collections.defaultdict(list)
        for (attack, status), n in sorted(self.statuses.items()):
            by_attack[attack].append(f"{status} x{n}")
        rows = [(f"attack {name}", ", ".join(parts)) for name, parts in sorted(by_attack.items())]
        rows += [(f"attack ws_flood: {outcome}", n) for outcome, n in sorted(self.flood_outcomes.items())]
        rows += [("attack silent sockets closed by the server", self.silent_closed),
                 ("attack cap_flood connections refused (503 by design)", self.refused_connections),
                 ("longest /healthz wait under attack ms", f"{self.health_longest_s * 1000:.0f}")]
        return rows


def _frame(payload: bytes) -> bytes:
    mask = os.urandom(4)
    header = struct.pack("!BB", 0x81, 0x80 | len(payload))
    return header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    return host, int(port)


async def _open(url: str, receive_buffer: int | None = None, source: str = ATTACKER):
    host, port = _host_port(url)
    sock = socket.socket()
    if receive_buffer:  # a client that never reads: the server's replies back up at once
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.setblocking(False)
    try:
        sock.bind((source, 0))
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
    except OSError:
        sock.close()
        raise
    return await asyncio.open_connection(sock=sock)


async def _raw_request(url: str, head: bytes, attack: str, report: AttackReport) -> None:
    """Send ``head`` on a connection of its own and count the status of the reply."""
    try:
        reader, writer = await _open(url)
    except OSError:
        await asyncio.sleep(0.5)
        return
    writer.write(head)
    try:
        reply = await asyncio.wait_for(reader.read(4096), 10)
        report.count(attack, int(reply.split(b" ")[1]))
    except (OSError, asyncio.TimeoutError, IndexError, ValueError):
        pass
    finally:
        writer.close()


async def ws_flood(url: str, deadline: float, report: AttackReport) -> None:
    blob = _frame(b'{"type":"response.cancel"}') * FLOOD_FRAMES
    while time.monotonic() < deadline:
        try:
            reader, writer = await _open(url, receive_buffer=16 * 1024)
        except OSError:
            await asyncio.sleep(0.5)
            continue
        key = base64.b64encode(os.urandom(16)).decode()
        writer.write((f"GET /v1/stream HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                      f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            report.count("ws_flood", int(head.split(b" ")[1]))
            writer.write(blob)  # never read what comes back: the server must close us
            await asyncio.wait_for(writer.drain(), 10)
            await asyncio.sleep(1.0)  # still not reading: the replies back up, the bound must close us
            async with asyncio.timeout(5):
                while await reader.read(1 << 16):
                    pass
            report.flood_outcomes["closed by the server"] += 1
        except (ConnectionError, BrokenPipeError):
            report.flood_outcomes["closed by the server"] += 1
        except asyncio.TimeoutError:  # every round answered within the socket buffers: nothing to bound
            report.flood_outcomes["flood answered, session still open (we close)"] += 1
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
            report.flood_outcomes["handshake failed"] += 1
        finally:
            writer.close()


async def silent(url: str, deadline: float, report: AttackReport) -> None:
    partial = itertools.cycle([
        b"",
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ",
        b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 5000\r\n\r\n{\"input\": \"",
    ])

    async def one_socket() -> None:
        while time.monotonic() < deadline:
            try:
                reader, writer = await _open(url)
            except OSError:
                await asyncio.sleep(0.5)
                continue
            writer.write(next(partial))
            try:
                reply = await asyncio.wait_for(reader.read(), max(0.1, deadline - time.monotonic()))
                if reply.startswith(b"HTTP/1.1 "):
                    report.count("silent", int(reply.split(b" ")[1]))
                report.silent_closed += 1
            except (OSError, asyncio.TimeoutError):
                pass
            finally:
                writer.close()

    await asyncio.gather(*(one_socket() for _ in range(SILENT_SOCKETS)))


async def bad_bytes(http: aiohttp.ClientSession, url: str, deadline: float, report: AttackReport) -> None:
    for body, content_type in itertools.cycle(BAD_BODIES):
        if time.monotonic() >= deadline:
            return
        for path in ("/v1/audio/speech", "/v1/jobs"):
            try:
                async with http.post(url + path, data=body, headers={"Content-Type": content_type}) as r:
                    await r.read()
                    report.count("bad_bytes", r.status)
            except aiohttp.ClientError:
                pass
        # a header that is not UTF-8
        await _raw_request(url, b"GET /v1/voices HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n\r\n",
                           "bad_bytes", report)
        await asyncio.sleep(0.05)


async def heavy(http: aiohttp.ClientSession, url: str, deadline: float, report: AttackReport) -> None:
    async def one_stream(seed: int) -> None:
        while time.monotonic() < deadline:
            body = {"input": HEAVY_TEXT, "stream_format": "audio", "response_format": "pcm", "seed": seed}
            try:
                async with http.post(url + "/v1/audio/speech", json=body) as r:
                    await r.read()
                    report.count("heavy", r.status)
                    if r.status == 429:
                        await asyncio.sleep(float(r.headers.get("Retry-After", "1")))
            except aiohttp.ClientError:
                pass

    await asyncio.gather(*(one_stream(i) for i in range(HEAVY_STREAMS)))


async def over_work(http: aiohttp.ClientSession, url: str, deadline: float, report: AttackReport) -> None:
    while time.monotonic() < deadline:
        for path, body in (("/v1/audio/speech", OVER_WORK), ("/v1/jobs", OVER_WORK_JOB)):
            async with http.post(url + path, json=body) as r:
                await r.read()
                report.count("over_work", r.status)
        await asyncio.sleep(0.1)


SESSION_REFUSALS = ("too_many_sessions", "rate_limited")  # a socket closed at the door: a 429 in effect


class Refused(Exception):
    """A WebSocket session refused with one of SESSION_REFUSALS after its upgrade."""


EMOJI_WORK = {"input": "\U0001F600" * 4096, "speed": 0.25, "steps": 1}  # ~59,000 frames, 1 step each
# the job's limit is --max-job-audio-frames (1,000,000): 80,000 emoji at speed 0.25 plan ~1,150,000
EMOJI_JOB = {"input": "\U0001F600" * 80_000, "speed": 0.25, "steps": 1}
HUGE_TOKENS = {"input": "Hello there.", "max_new_tokens": 16384}
LONG_OMNI_SENTENCE = "word " * 280  # one sentence of ~100 s of audio at steps 1 (DiT)
EMPTY_DELTAS = 60_000


async def costly(http: aiohttp.ClientSession, url: str, deadline: float, report: AttackReport) -> None:
    """The work-limit and event-loop reproductions in turn. WebSocket sessions count their
    handshake status; an answer that never comes or an utterance that fails counts as a 5xx."""
    ws_base = url.replace("http://", "ws://", 1).replace("https://", "wss://", 1)

    async def post(name: str, path: str, body: dict) -> None:
        async with http.post(url + path, json=body) as r:
            await r.read()
            report.count(name, r.status)

    async def until(ws, kind: str, timeout: float) -> list[dict]:
        events: list[dict] = []
        async with asyncio.timeout(timeout):
            async for message in ws:
                if message.type == aiohttp.WSMsgType.TEXT:
                    events.append(json.loads(message.data))
                    if events[-1]["type"] == kind:
                        return events
                    if events[-1]["type"] == "error" and events[-1].get("code") in SESSION_REFUSALS:
                        raise Refused(events[-1]["code"])
                elif message.type != aiohttp.WSMsgType.BINARY:
                    break
        raise ConnectionError(f"the socket ended before {kind}")

    async def long_omni_sentence() -> None:
        async with http.ws_connect(ws_base + "/v1/audio/speech/stream", max_msg_size=0) as ws:
            report.count("costly long_omni", 101)
            await ws.send_json({"type": "session.config", "response_format": "mp3", "steps": 1})
            await ws.send_json({"type": "input.text", "text": LONG_OMNI_SENTENCE})
            await ws.send_json({"type": "input.done"})
            events = await until(ws, "session.done", 300)
            failed = [e for e in events if e["type"] == "audio.done" and e.get("error")]
            report.count("costly long_omni", 500 if failed else 200)

    async def empty_deltas() -> None:
        async with http.ws_connect(ws_base + "/v1/stream") as ws:
            report.count("costly empty_deltas", 101)
            await ws.send_json({"type": "session.config", "voice": "default", "text_streaming": False})
            await ws.send_json({"type": "input.text", "text": "word " * 800})  # no sentence end
            for _ in range(EMPTY_DELTAS):
                await ws.send_str('{"type":"input.text","text":""}')
            await ws.send_json({"type": "response.cancel"})
            events = await until(ws, "session.done", 60)
            server_side = [e for e in events if e["type"] == "error" and e.get("code") != "invalid_field"]
            report.count("costly empty_deltas", 500 if server_side else 200)

    while time.monotonic() < deadline:
        await post("costly emoji", "/v1/audio/speech", {**EMOJI_WORK, "stream": False})
        await post("costly emoji", "/v1/jobs", EMOJI_JOB)
        await post("costly max_new_tokens", "/v1/audio/speech", {**HUGE_TOKENS, "stream": False})
        for attack in (long_omni_sentence, empty_deltas):
            if time.monotonic() >= deadline:
                return
            try:
                await attack()
            except Refused:  # the key's session cap (or rate) closed the socket first: a refusal, by design
                report.count(f"costly {attack.__name__}", 429)
            except (aiohttp.ClientError, ConnectionError, asyncio.TimeoutError):
                report.count(f"costly {attack.__name__}", 599)  # no answer: counted as a server failure
        await asyncio.sleep(0.1)
def _flac_bomb(size: int = 35_000, rate: int = 48000) -> bytes:
    """One FLAC frame of a constant (65,535 samples in a dozen bytes) repeated, after a
    STREAMINFO declaring no length: an hour of audio from 35 KB."""
    import io

    import av
    import numpy as np

    block = 65535
    encoded = io.BytesIO()
    with av.open(encoded, mode="w", format="flac") as box:
        stream = box.add_stream("flac", rate=rate, layout="mono")
        stream.codec_context.options = {"frame_size": str(block)}
        frame = av.AudioFrame.from_ndarray(np.full((1, block), 0.25, dtype=np.float32), format="fltp", layout="mono")
        frame.sample_rate, frame.pts = rate, 0
        one = bytes(next(iter(stream.encode(frame))))
    header = b"fLaC" + _streaminfo(rate, 1, 0, block)
    return header + one * ((size - len(header)) // len(one))


def _streaminfo(rate: int, channels: int, total_samples: int, block: int = 4096) -> bytes:
    packed = (rate << 44) | ((channels - 1) << 41) | (15 << 36) | total_samples
    body = struct.pack(">HH", block, block) + b"\x00" * 6 + packed.to_bytes(8, "big") + b"\x00" * 16
    return bytes([0x80, 0, 0, len(body)]) + body


def hostile_references(port: int) -> dict[str, bytes]:
    url = f"http://127.0.0.1:{port}/a.wav"
    return {
        "sdp": (f"v=0\r\no=- 0 0 IN IP4 127.0.0.1\r\ns=x\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
                f"m=audio {port} RTP/AVP 0\r\n").encode(),
        "hls": f"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10.0,\n{url}\n#EXT-X-ENDLIST\n".encode(),
        "ffconcat": f"ffconcat version 1.0\nfile '{url}'\n".encode(),
        "dash": (f'<?xml version="1.0"?><MPD xmlns="urn:mpeg:dash:schema:mpd:2011"><Period><AdaptationSet>'
                 f'<Representation id="a" bandwidth="1"><BaseURL>{url}</BaseURL></Representation>'
                 f'</AdaptationSet></Period></MPD>').encode(),
        "flac bomb": _flac_bomb(),
        "flac header bomb": b"fLaC" + _streaminfo(655350, 8, 30 * 655350) + b"\xff\xf8" + b"\x00" * 10_000,
        "wav garbage": b"RIFF\xff\xff\xff\xffWAVEfmt " + os.urandom(4000),
        "ogg garbage": b"OggS\x00\x02" + os.urandom(4000),
        "mp4 garbage": b"\x00\x00\x00\x18ftypM4A " + os.urandom(4000),
    }


async def ref_audio(http: aiohttp.ClientSession, url: str, deadline: float, report: AttackReport) -> None:
    """Hostile references against speech and voice upload; a local port that accepts and never
    answers is named in the playlists, and must never be connected to."""
    reached = 0

    async def never_answer(reader, writer) -> None:
        nonlocal reached
        reached += 1
        await asyncio.sleep(3600)

    trap = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = trap.sockets[0].getsockname()[1]
    references = itertools.cycle(hostile_references(port).items())
    try:
        while time.monotonic() < deadline:
            _, data = next(references)
            body = {"input": "Hi.", "ref_audio": base64.b64encode(data).decode(), "x_vector_only_mode": True}
            form = aiohttp.FormData()
            form.add_field("name", f"attack{os.getpid()}")
            form.add_field("audio_sample", data, filename="ref", content_type="application/octet-stream")
            for path, kwargs in (("/v1/audio/speech", {"json": body}), ("/v1/audio/voices", {"data": form})):
                try:
                    async with http.post(url + path, **kwargs) as r:
                        await r.read()
                        report.count("ref_audio", r.status)
                except aiohttp.ClientError:
                    pass
            await asyncio.sleep(0.05)
    finally:
        trap.close()
        if reached:
            report.count("ref_audio reached the network", 599)  # counted as a failure, like a 5xx
def _reference_wav(seconds: float = 1.5, rate: int = 24000) -> bytes:
    """A voiced-sounding reference (a 180 Hz tone with harmonics), 16-bit mono WAV, from the stdlib."""
    frames = bytearray()
    for i in range(int(seconds * rate)):
        t = i / rate
        value = 0.3 * math.sin(2 * math.pi * 180 * t) + 0.1 * math.sin(2 * math.pi * 360 * t)
        frames += struct.pack("<h", int(value * 32767))
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(bytes(frames))
    return buf.getvalue()


async def upload_flood(http: aiohttp.ClientSession, url: str, deadline: float, report: AttackReport) -> None:
    """One client saving voice after voice (each name new), 8 at a time, never waiting for Retry-After."""
    audio = _reference_wav()
    names = itertools.count()

    async def uploader() -> None:
        while time.monotonic() < deadline:
            form = aiohttp.FormData()
            form.add_field("name", f"flood-{os.getpid()}-{next(names)}")
            form.add_field("audio_sample", audio, filename="ref.wav", content_type="audio/wav")
            try:
                async with http.post(url + "/v1/audio/voices", data=form) as r:
                    await r.read()
                    report.count("upload_flood", r.status)
            except aiohttp.ClientError:
                pass

    await asyncio.gather(*(uploader() for _ in range(8)))


CARTESIA = "/tts/websocket?cartesia_version=2025-04-16"
CONTEXT_PREFIX = "voice-agent-turn-0123456789abcde"  # 32 characters
TURN_TEXT = "This sentence keeps going for a while, so that it is cut off mid way. "
CROWD_TEXT = "One context of sixteen speaks this sentence. And then this one."


def _cartesia(context_id: str, transcript: str, more: bool, **extra) -> dict:
    return {"context_id": context_id, "transcript": transcript, "continue": more, "model_id": "sonic-2",
            "voice": {"mode": "id", "id": "default"},
            "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}, **extra}


async def _until_done(ws, contexts: set[str], timeout: float) -> str:
    """Read until every context in ``contexts`` sent ``done``: "ok", "error <code>" or "hang"."""
    waiting = set(contexts)
    try:
        async with asyncio.timeout(timeout):
            while waiting:
                message = await ws.receive()
                if message.type != aiohttp.WSMsgType.TEXT:
                    return "hang"  # the socket ended first
                event = json.loads(message.data)
                if event.get("type") == "error":
                    return f"error {event.get('error_code')}"
                if event.get("type") == "done":
                    waiting.discard(event.get("context_id"))
    except asyncio.TimeoutError:
        return "hang"
    return "ok"


def _count_outcome(report: AttackReport, attack: str, outcome: str) -> None:
    """ok: 200; an error message: 500 (its code named); no end in time: 599."""
    if outcome.startswith("error"):
        report.count(f"{attack} ({outcome})", 500)
    else:
        report.count(attack, 200 if outcome == "ok" else 599)


async def contexts(http: aiohttp.ClientSession, url: str, deadline: float, report: AttackReport) -> None:
    ws_url = url.replace("http://", "ws://", 1) + CARTESIA
    turn = 0
    while time.monotonic() < deadline:
        try:
            async with http.ws_connect(ws_url) as ws:
                report.count("contexts", 101)
                pair = {CONTEXT_PREFIX + "-a", CONTEXT_PREFIX + "-b"}
                for context_id in pair:
                    await ws.send_json(_cartesia(context_id, "Both of us finish.", False))
                _count_outcome(report, "contexts shared prefix", await _until_done(ws, pair, 30))
                for _ in range(10):
                    await ws.send_json(_cartesia("r1", TURN_TEXT, True, flush=True))
                    await asyncio.sleep((turn % 11) * 0.02)  # the barge-in's moment: 0-200 ms
                    turn += 1
                    await ws.send_json({"context_id": "r1", "cancel": True})
                    await ws.send_json(_cartesia("r1", "Okay.", False))
                    _count_outcome(report, "contexts reopened", await _until_done(ws, {"r1"}, 30))
        except aiohttp.WSServerHandshakeError as exc:  # refused before the upgrade (the address's session cap: 429)
            report.count("contexts", exc.status)
        except (aiohttp.ClientError, ConnectionError):
            report.count("contexts", 599)


async def crowd(http: aiohttp.ClientSession, url: str, deadline: float, report: AttackReport) -> None:
    ws_url = url.replace("http://", "ws://", 1) + CARTESIA
    while time.monotonic() < deadline:
        try:
            async with http.ws_connect(ws_url) as ws:
                report.count("crowd", 101)
                names = {f"crowd-{i}" for i in range(16)}
                for name in names:
                    await ws.send_json(_cartesia(name, CROWD_TEXT, False))
                _count_outcome(report, "crowd", await _until_done(ws, names, 120))
        except aiohttp.WSServerHandshakeError as exc:  # refused before the upgrade (the address's session cap: 429)
            report.count("crowd", exc.status)
        except (aiohttp.ClientError, ConnectionError):
            report.count("crowd", 599)


async def vendor_text(http: aiohttp.ClientSession, url: str, deadline: float, report: AttackReport) -> None:
    while time.monotonic() < deadline:
        for path in ("/v1/text-to-speech/default/stream", "/v1/text-to-speech/default/stream/with-timestamps"):
            async with http.post(url + path, json={"text": "\ud800x"}) as r:
                await r.read()
                report.count("vendor_text", r.status)
        await asyncio.sleep(0.1)


WITH_TIMESTAMPS = "/v1/text-to-speech/default/with-timestamps"
LARGEST_ANSWER = "Hi. " + "<break time=10s>" * 255  # 2,550 s: the most audio 4,096 characters can ask for
LEAVING_TEXT = " ".join(f"Sentence {i} is spoken only while the client is still there." for i in range(40))
ODD_NUMBERS = ["\u00b2", "\u0662\u0664\u0660\u0660\u0660", "\uff12\uff14\uff10\uff10\uff10", "9" * 5001, " 24000",
               "+24000", "2.4e4", "nan", "24000.5", "", "24_000"]
NUMBER_QUERIES = ["/v1/speak?encoding=linear16&sample_rate={}", "/v1/speak?encoding=mp3&bit_rate={}", "/v1/speak?speed={}",
                  WITH_TIMESTAMPS + "?output_format=pcm_{}", "/v1/jobs?limit={}", "/v1/audio/voices?limit={}"]
NUMBER_HANDSHAKES = ["/v1/speak?sample_rate={}", "/v1/speak?speed={}",
                     "/v1/text-to-speech/default/stream-input?inactivity_timeout={}",
                     "/v1/text-to-speech/default/multi-stream-input?output_format=pcm_{}"]
BODY_ROUTES = ["/v1/audio/speech", "/v1/jobs", "/v1/speak", "/tts/bytes", "/tts/sse", "/v1/text-to-speech/default",
               "/v1/text-to-speech/default/stream", WITH_TIMESTAMPS, "/v1/text-to-speech/default/stream/with-timestamps",
               "/v1/audio/voices"]
UNKNOWN_VOICES = ["/v1/text-to-speech/nobody-here/stream-input", "/v1/text-to-speech/nobody-here/multi-stream-input",
                  "/v1/speak?model=aura-2-nobody-here-en", "/v1/speak?model=nobody-here"]


def _upgrade(target: bytes) -> bytes:
    key = base64.b64encode(os.urandom(16))
    return (b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: " + key + b"\r\n\r\n")


async def vendor_answers(url: str, deadline: float, report: AttackReport) -> None:
    """ElevenLabs' convert_with_timestamps at the largest answer the limits allow (pcm_48000, ~310 MiB
    of JSON; it used to be held 4-5 times over: +1.4 GB), read and dropped; then 40 sentences whose
    client leaves after 1 s, before any answer (their synthesis must stop: the soak's RSS and the
    engine's idleness after it show it did). A client that left counts as 499. From an address of
    its own (the heavy streamer holds 127.0.0.2's stream cap)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(ANSWERS_ATTACKER, 0))) as http:
        await _vendor_answers(http, url, deadline, report)


async def _vendor_answers(http: aiohttp.ClientSession, url: str, deadline: float, report: AttackReport) -> None:
    while time.monotonic() < deadline:
        try:
            async with http.post(url + WITH_TIMESTAMPS + "?output_format=pcm_48000",
                                 json={"text": LARGEST_ANSWER}) as r:
                async for _ in r.content.iter_chunked(1 << 20):
                    pass
                report.count("vendor_answers largest", r.status)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        try:
            async with asyncio.timeout(1.0):
                async with http.post(url + WITH_TIMESTAMPS, json={"text": LEAVING_TEXT}) as r:
                    await r.read()
                    report.count("vendor_answers leaving (answered first)", r.status)
        except asyncio.TimeoutError:
            report.count("vendor_answers left", 499)
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.5)


async def odd_numbers(http: aiohttp.ClientSession, url: str, deadline: float, report: AttackReport) -> None:
    """Numbers that are not: superscripts, other scripts' digits, 5,001 digits, signs, exponents, in every
    numeric query parameter, socket handshake (raw bytes) and vendor JSON field; and whole floats."""
    from urllib.parse import quote

    for value in itertools.cycle(ODD_NUMBERS):
        if time.monotonic() >= deadline:
            return
        quoted = quote(value, safe="")
        for query in NUMBER_QUERIES:
            method = http.get if "limit=" in query else http.post
            try:
                async with method(url + query.format(quoted), json={"text": "Hi."}) as r:
                    await r.read()
                    report.count("odd_numbers query", r.status)
            except aiohttp.ClientError:
                pass
        for handshake in NUMBER_HANDSHAKES:
            for raw in (quoted.encode(), value.encode()):
                if not any(c in raw for c in b" \r\n"):
                    await _raw_request(url, _upgrade(handshake.format("").encode() + raw), "odd_numbers handshake",
                                       report)
        for fmt in ({"container": "mp3", "sample_rate": 8000.0, "bit_rate": 64000},
                    {"container": "raw", "encoding": "pcm_s16le", "sample_rate": value}):
            body = {"transcript": "Hi.", "voice": "default", "output_format": fmt}
            try:
                async with http.post(url + "/tts/bytes", json=body) as r:
                    await r.read()
                    report.count("odd_numbers json", r.status)
            except aiohttp.ClientError:
                pass
        await asyncio.sleep(0.1)


async def bad_encoding(http: aiohttp.ClientSession, url: str, deadline: float, report: AttackReport) -> None:
    """``Content-Encoding: gzip`` / ``deflate`` on bodies that are not, on every route that reads one."""
    bodies = itertools.cycle([b'{"input": "Hi.", "text": "Hi."}', b"\x1f\x8b\x08\x00not really gzip",
                              b"x\x9cnot really deflate"])
    for encoding in itertools.cycle(["gzip", "deflate"]):
        if time.monotonic() >= deadline:
            return
        for path in BODY_ROUTES:
            kind = "multipart/form-data; boundary=x" if path == "/v1/audio/voices" else "application/json"
            try:
                async with http.post(url + path, data=next(bodies), headers={
                        "Content-Type": kind, "Content-Encoding": encoding}) as r:
                    await r.read()
                    report.count("bad_encoding", r.status)
            except aiohttp.ClientError:
                pass
        await asyncio.sleep(0.1)


async def unknown_voices(url: str, deadline: float, report: AttackReport) -> None:
    """Socket handshakes naming a voice that does not exist: refused before the upgrade (a 101 counts
    as a failure)."""
    for path in itertools.cycle(UNKNOWN_VOICES):
        if time.monotonic() >= deadline:
            return
        before = report.statuses[("unknown_voices", 101)]
        await _raw_request(url, _upgrade(path.encode()), "unknown_voices", report)
        if report.statuses[("unknown_voices", 101)] > before:
            report.count("unknown_voices upgraded for a voice that does not exist", 599)
        await asyncio.sleep(0.05)


def edge_attacks(http: aiohttp.ClientSession, url: str, deadline: float, report: AttackReport) -> list:
    """The HTTP/WebSocket edges' reproductions: vendor answers and clients that leave, odd numbers, bad
    content encodings, unknown voices."""
    return [vendor_answers(url, deadline, report), odd_numbers(http, url, deadline, report),
            bad_encoding(http, url, deadline, report), unknown_voices(url, deadline, report)]


async def log_forging(url: str, deadline: float, report: AttackReport) -> None:
    paths = [b"/nothing%0a" + FORGED_LINE, b"/nothing%0d%0a" + FORGED_LINE, b"/v1/models%0a" + FORGED_LINE]
    for path in itertools.cycle(paths):
        if time.monotonic() >= deadline:
            return
        await _raw_request(url, b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                           "log_forging", report)
        await asyncio.sleep(0.2)


async def cap_flood(url: str, deadline: float, report: AttackReport) -> None:
    async def one() -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        try:
            return await _open(url, source=CAP_ATTACKER)
        except OSError:
            return None

    while time.monotonic() < deadline:
        held = [c for c in await asyncio.gather(*(one() for _ in range(CAP_FLOOD_SOCKETS))) if c is not None]
        replies = await asyncio.gather(*(asyncio.wait_for(reader.read(256), 2) for reader, _ in held),
                                       return_exceptions=True)
        for reply in replies:
            if isinstance(reply, bytes) and reply.startswith(b"HTTP/1.1 503"):
                report.refused_connections += 1
            elif isinstance(reply, bytes) and reply.startswith(b"HTTP/1.1 "):
                report.count("cap_flood", int(reply.split(b" ")[1]))
        for _, writer in held:
            writer.close()
        await asyncio.sleep(2.0)


LISTED_JOB_CHARS = 198_000  # under the default --max-job-chars (200,000)
LIST_CALLS = 5


async def cancelled_long_jobs(http: aiohttp.ClientSession, url: str, count: int, report: AttackReport) -> None:
    """``count`` jobs of LISTED_JOB_CHARS characters, each cancelled as soon as it is made (so the
    caps on unfinished jobs never refuse the next)."""
    text = ("这是一本很长的书里的一章，没有人会去听它。" * (LISTED_JOB_CHARS // 20 + 1))[:LISTED_JOB_CHARS]
    for i in range(count):
        async with http.post(url + "/v1/jobs", json={"input": text, "seed": i}) as r:
            report.count("job_listing", r.status)
            job = await r.json() if r.status == 202 else None
        if job is not None:
            async with http.delete(f"{url}/v1/jobs/{job['id']}") as r:
                await r.read()
                report.count("job_listing", r.status)


async def job_listing(http: aiohttp.ClientSession, url: str, deadline: float, report: AttackReport) -> None:
    await cancelled_long_jobs(http, url, 30, report)
    while time.monotonic() < deadline:
        async with http.get(url + "/v1/jobs", params={"limit": "1000"}) as r:
            await r.read()
            report.count("job_listing", r.status)
        await asyncio.sleep(0.5)


def _status_mb(pid: int, field: str) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def _reset_peak_rss(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as handle:
        handle.write("5")  # VmHWM := VmRSS (Linux >= 4.0)


async def measure_job_listing(url: str, pid: int, jobs: int = 150) -> list[tuple[str, str]]:
    """The server's RSS and the time of LIST_CALLS list calls over ``jobs`` long cancelled jobs."""
    report = AttackReport()
    async with aiohttp.ClientSession() as http:
        await cancelled_long_jobs(http, url, jobs, report)
        assert report.server_errors == 0 and report.statuses[("job_listing", 202)] == jobs, report.statuses
        before = _status_mb(pid, "VmRSS")
        peaks, after, seconds = [], [], []
        for _ in range(LIST_CALLS):
            _reset_peak_rss(pid)
            start = time.perf_counter()
            async with http.get(url + "/v1/jobs", params={"limit": "1000"}) as r:
                listed = (await r.json())["data"]
            seconds.append(time.perf_counter() - start)
            peaks.append(_status_mb(pid, "VmHWM"))
            after.append(_status_mb(pid, "VmRSS"))
    assert len(listed) >= jobs
    return [("jobs listed (cancelled, 198,000 characters each)", f"{len(listed)}"),
            ("server RSS before the first list MiB", f"{before:.0f}"),
            (f"server peak RSS during each of {LIST_CALLS} lists MiB", ", ".join(f"{x:.0f}" for x in peaks)),
            ("server RSS after each list MiB", ", ".join(f"{x:.0f}" for x in after)),
            ("list call seconds (each)", ", ".join(f"{x:.3f}" for x in seconds))]


def _poll_health(host: str, port: int, every_s: float, longest, stop) -> None:
    """HealthProbe's process: GET /healthz in a loop, the longest wait into ``longest``."""
    import http.client

    connection = None
    while not stop.is_set():
        start = time.monotonic()
        try:
            connection = connection or http.client.HTTPConnection(host, port, timeout=600)
            connection.request("GET", "/healthz")
            connection.getresponse().read()
        except (OSError, http.client.HTTPException):
            connection = None  # (a refused connection is no stall: the next poll reconnects)
            continue
        finally:
            longest.value = max(longest.value, time.monotonic() - start)
        stop.wait(every_s)


class HealthProbe:
    """``GET /healthz`` in a loop in a process of its own, from 127.0.0.1: the longest wait for an
    answer while it runs (``longest_s``). A process, not a thread: the attackers' own event loop
    and payload building hold this process's GIL for up to hundreds of ms, which a thread here
    would count as the server's stall."""

    def __init__(self, url: str, every_s: float = 0.01):
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self._longest = context.Value("d", 0.0)
        self._stop = context.Event()
        self._process = context.Process(target=_poll_health, args=(*_host_port(url), every_s, self._longest,
                                                                   self._stop), daemon=True)

    @property
    def longest_s(self) -> float:
        return self._longest.value

    def __enter__(self) -> "HealthProbe":
        self._process.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._process.join(600)


REDOS_BREAK = "Hello. <break time=1s" + " " * 4000 + "and on."  # never reaches ">" (and is no sentence's end)
LONG_PAUSES = "<break time=10s>" * 255  # 2,550 s of silence in 4,080 characters
_VOICE = {"mode": "id", "id": "default"}
_RAW = {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}


def break_attacks(url: str) -> list[tuple[str, object]]:
    """(name, coroutine function of an aiohttp session -> HTTP status) per break attack: an answer
    of 400 (a socket's error message) for the ReDoS text, 200 read to the end for the pauses."""
    ws = url.replace("http://", "ws://", 1).replace("https://", "wss://", 1)

    def post(path: str, body: dict):
        async def attack(http: aiohttp.ClientSession) -> int:
            async with http.post(url + path, json=body) as r:
                async for _ in r.content.iter_chunked(1 << 16):  # 40 MB of mp3: read, not kept
                    pass
                return r.status
        return attack

    def socket(path: str, messages: list[dict], is_error):
        async def attack(http: aiohttp.ClientSession) -> int:
            async with http.ws_connect(ws + path, max_msg_size=0) as sock:
                for message in messages:
                    await sock.send_json(message)
                async with asyncio.timeout(600):
                    async for frame in sock:
                        if frame.type != aiohttp.WSMsgType.TEXT:
                            continue
                        event = json.loads(frame.data)
                        if is_error(event):  # a session refused at the door (the key's cap) is a 429 in effect
                            code = str(event.get("code") or event.get("error_code") or event.get("error")
                                       or event.get("err_code") or "").lower()
                            return 429 if code in SESSION_REFUSALS else 400
                        if event.get("type") in ("session.done", "done", "Flushed") or event.get("isFinal"):
                            return 200
            return 599  # the socket ended without an answer
        return attack

    cartesia = {"context_id": "b", "transcript": REDOS_BREAK, "continue": False, "voice": _VOICE,
                "model_id": "sonic-2", "output_format": _RAW}
    return [
        ("redos speech", post("/v1/audio/speech", {"input": REDOS_BREAK})),
        ("redos jobs", post("/v1/jobs", {"input": REDOS_BREAK})),
        ("redos elevenlabs http", post("/v1/text-to-speech/default/stream", {"text": REDOS_BREAK})),
        ("redos cartesia http", post("/tts/bytes", {**cartesia, "output_format": {**_RAW, "container": "wav"}})),
        ("redos deepgram http", post("/v1/speak?model=default", {"text": REDOS_BREAK})),
        ("redos /v1/stream", socket("/v1/stream", [{"type": "input.text", "text": REDOS_BREAK},
                                                   {"type": "input.done"}], lambda e: e.get("type") == "error")),
        ("redos omni socket", socket("/v1/audio/speech/stream", [
            {"type": "session.config"}, {"type": "input.text", "text": REDOS_BREAK}, {"type": "input.done"}],
            lambda e: e.get("type") == "error")),
        ("redos elevenlabs socket", socket("/v1/text-to-speech/default/stream-input", [
            {"text": " "}, {"text": REDOS_BREAK}, {"text": ""}], lambda e: "error" in e)),
        ("redos cartesia socket", socket(CARTESIA, [cartesia], lambda e: e.get("type") == "error")),
        ("redos deepgram socket", socket("/v1/speak?model=default", [{"type": "Speak", "text": REDOS_BREAK},
                                                                     {"type": "Flush"}],
                                         lambda e: e.get("type") == "Error")),
        ("pauses elevenlabs mp3_44100_128", post("/v1/text-to-speech/default/stream", {"text": LONG_PAUSES})),
        ("pauses deepgram mp3", post("/v1/speak?model=default&encoding=mp3", {"text": LONG_PAUSES})),
        ("pauses openai mp3", post("/v1/audio/speech", {"input": LONG_PAUSES, "response_format": "mp3"})),
    ]


async def breaks(http: aiohttp.ClientSession, url: str, deadline: float, report: AttackReport) -> None:
    for name, attack in itertools.cycle(break_attacks(url)):
        if time.monotonic() >= deadline:
            return
        try:
            report.count(f"breaks {name}", await attack(http))
        except aiohttp.WSServerHandshakeError as exc:  # a dialect's socket refused before the upgrade (429: the cap)
            report.count(f"breaks {name}", exc.status)
        except (aiohttp.ClientError, ConnectionError, asyncio.TimeoutError):
            report.count(f"breaks {name}", 599)  # no answer: counted as a server failure
        await asyncio.sleep(0.1)


async def breaks_once(url: str, only: str = "") -> list[tuple[str, int, float, float]]:
    """Each break attack (whose name holds ``only``) once, alone: (name, status, the longest
    /healthz wait while it ran, the seconds it took)."""
    rows = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as http:
        for name, attack in break_attacks(url):
            if only not in name:
                continue
            with HealthProbe(url) as probe:
                start = time.monotonic()
                status = await attack(http)
                took = time.monotonic() - start
            rows.append((name, status, probe.longest_s, took))
    return rows


async def run_attacks(url: str, deadline: float, only: set[str] | None = None) -> AttackReport:
    """Every attack (``only``: those of these names) until ``deadline``; then whatever is still in
    flight is dropped (a hostile client simply goes away)."""
    report = AttackReport()
    connector = aiohttp.TCPConnector(local_addr=(ATTACKER, 0), limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        turns = aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(TURNS_ATTACKER, 0), limit=0))
        attacks = (
            ws_flood(url, deadline, report), silent(url, deadline, report), bad_bytes(http, url, deadline, report),
            heavy(http, url, deadline, report), over_work(http, url, deadline, report),
            costly(http, url, deadline, report), ref_audio(http, url, deadline, report),
            upload_flood(http, url, deadline, report), contexts(turns, url, deadline, report),
            crowd(http, url, deadline, report), vendor_text(http, url, deadline, report),
            log_forging(url, deadline, report), cap_flood(url, deadline, report), breaks(http, url, deadline, report),
            job_listing(http, url, deadline, report), *edge_attacks(http, url, deadline, report))
        for attack in attacks:
            if only is not None and attack.__name__ not in only:
                attack.close()  # (a coroutine never started)
        tasks = [asyncio.create_task(attack) for attack in attacks if only is None or attack.__name__ in only]
        with HealthProbe(url) as probe:
            done, _ = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
        report.health_longest_s = probe.longest_s
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await turns.close()
        for result in results:
            if isinstance(result, Exception):  # a bug in an attack must show, not pass as "no 5xx"
                raise result
    return report


def report_to_json(report: AttackReport) -> str:
    return json.dumps({"statuses": [[a, s, n] for (a, s), n in report.statuses.items()],
                       "flood_outcomes": dict(report.flood_outcomes), "silent_closed": report.silent_closed,
                       "refused_connections": report.refused_connections,
                       "health_longest_s": report.health_longest_s})


def report_from_json(line: str) -> AttackReport:
    data = json.loads(line)
    report = AttackReport(flood_outcomes=collections.Counter(data["flood_outcomes"]),
                          silent_closed=data["silent_closed"], refused_connections=data["refused_connections"],
                          health_longest_s=data.get("health_longest_s", 0.0))
    for attack, status, n in data["statuses"]:
        report.statuses[(attack, status)] = n
    return report


if __name__ == "__main__":
    if sys.argv[1] == "list-jobs":
        rows = asyncio.run(measure_job_listing(sys.argv[2], int(sys.argv[3]), *map(int, sys.argv[4:5])))
        for name, value in rows:
            print(f"{name:<56}{value}")
    elif sys.argv[2:3] == ["--breaks"]:  # [a part of the attacks' names]
        print(f"{'break attack':<34} {'status':>6} {'longest /healthz wait ms':>24} {'took s':>7}")
        for name, status, longest, took in asyncio.run(breaks_once(sys.argv[1], "".join(sys.argv[3:4]))):
            print(f"{name:<34} {status:>6} {longest * 1000:>24.1f} {took:>7.2f}")
    else:
        url, seconds = sys.argv[1], float(sys.argv[2])
        only = set(sys.argv[3].split(",")) if len(sys.argv) > 3 else None  # attack names (load.py --only)
        print(report_to_json(asyncio.run(run_attacks(url, time.monotonic() + seconds, only))))
