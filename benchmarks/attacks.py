"""Hostile clients for the soak (``load.py --attacks``): the issue-20 reproductions run in
loops beside normal traffic, from a second loopback address (127.0.0.2) so they are a
client of their own. Every HTTP status they get is counted; a 5xx anywhere is a failure.

* ws_flood     - WebSocket handshake, then 20,000 ``response.cancel`` frames, never reading
* silent       - 60 sockets that send nothing, a never-ending head, or a never-ending body
* bad_bytes    - deep nesting, huge numbers, lone surrogates, odd charsets, non-UTF-8 headers
* heavy        - 8 concurrent long streamed requests (more than the per-key stream cap)
* over_work    - requests over the work limit (413 before any engine time)
* upload_flood - saved-voice uploads as fast as they are answered, each a new name (429 rate_limited /
                 too_many_voices once the key's rate or cap is reached; 400 on a server that cannot clone)

``load.py --attacks`` runs this file as a process of its own (so the attackers' work does not
slow the normal clients' event loop): ``python benchmarks/attacks.py URL SECONDS`` prints its
report as one JSON line.
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


@dataclass
class AttackReport:
    statuses: collections.Counter = field(default_factory=collections.Counter)  # (attack, HTTP status)
    flood_outcomes: collections.Counter = field(default_factory=collections.Counter)
    silent_closed: int = 0

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
        rows += [("attack silent sockets closed by the server", self.silent_closed)]
        return rows


def _frame(payload: bytes) -> bytes:
    mask = os.urandom(4)
    header = struct.pack("!BB", 0x81, 0x80 | len(payload))
    return header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    return host, int(port)


async def _open(url: str, receive_buffer: int | None = None):
    host, port = _host_port(url)
    sock = socket.socket()
    if receive_buffer:  # a client that never reads: the server's replies back up at once
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.setblocking(False)
    try:
        sock.bind((ATTACKER, 0))
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
    except OSError:
        sock.close()
        raise
    return await asyncio.open_connection(sock=sock)


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
        reader, writer = await _open(url)  # a header that is not UTF-8
        writer.write(b"GET /v1/voices HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n\r\n")
        try:
            reply = await asyncio.wait_for(reader.read(4096), 10)
            report.count("bad_bytes", int(reply.split(b" ")[1]))
        except (OSError, asyncio.TimeoutError, IndexError, ValueError):
            pass
        finally:
            writer.close()
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
        for path in ("/v1/audio/speech", "/v1/jobs"):
            async with http.post(url + path, json=OVER_WORK) as r:
                await r.read()
                report.count("over_work", r.status)
        await asyncio.sleep(0.1)


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


async def run_attacks(url: str, deadline: float) -> AttackReport:
    """Every attack until ``deadline``; then whatever is still in flight is dropped (a
    hostile client simply goes away)."""
    report = AttackReport()
    connector = aiohttp.TCPConnector(local_addr=(ATTACKER, 0), limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        tasks = [asyncio.create_task(attack) for attack in (
            ws_flood(url, deadline, report), silent(url, deadline, report), bad_bytes(http, url, deadline, report),
            heavy(http, url, deadline, report), over_work(http, url, deadline, report),
            upload_flood(http, url, deadline, report))]
        done, _ = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, Exception):  # a bug in an attack must show, not pass as "no 5xx"
                raise result
    return report


def report_to_json(report: AttackReport) -> str:
    return json.dumps({"statuses": [[a, s, n] for (a, s), n in report.statuses.items()],
                       "flood_outcomes": dict(report.flood_outcomes), "silent_closed": report.silent_closed})


def report_from_json(line: str) -> AttackReport:
    data = json.loads(line)
    report = AttackReport(flood_outcomes=collections.Counter(data["flood_outcomes"]),
                          silent_closed=data["silent_closed"])
    for attack, status, n in data["statuses"]:
        report.statuses[(attack, status)] = n
    return report


if __name__ == "__main__":
    url, seconds = sys.argv[1], float(sys.argv[2])
    print(report_to_json(asyncio.run(run_attacks(url, time.monotonic() + seconds))))
