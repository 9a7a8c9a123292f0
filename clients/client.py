"""Async Python client for a streamvox server: WebSocket streaming and REST.

    async with StreamvoxClient("http://127.0.0.1:8000", api_key=None) as client:
        result = await client.say("Hello there. How are you?")      # WebSocket
        wav = await client.speech("Hello", response_format="wav")   # OpenAI-style REST
        job = await client.submit_job("A longer text ...")          # REST jobs
        job = await client.wait_job(job["id"]); audio = await client.fetch_audio(job["id"])

It reaches the service only over the network (no server imports).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterable, AsyncIterator, Callable, Iterator

import aiohttp
import numpy as np
import websockets

from .address import parse_address

SUBPROTOCOL = "streamvox"
JOB_FINISHED = ("succeeded", "failed", "cancelled")


def poll_delays(first_s: float = 0.25, most_s: float = 2.0, growth: float = 1.5) -> Iterator[float]:
    """The waits between polls of a job: short at first (a short job ends in a second), then
    longer by ``growth`` each time, up to ``most_s`` (a long job is asked every ``most_s``)."""
    delay = first_s
    while True:
        yield delay
        delay = min(most_s, delay * growth)


class StreamvoxError(Exception):
    """An error answer from the server: HTTP status (or 0 on WebSocket), code, message."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(f"{code}: {message}" + (f" (HTTP {status})" if status else ""))
        self.status = status
        self.code = code
        self.message = message


@dataclass
class Utterance:
    index: int
    text: str
    pcm: bytearray = field(default_factory=bytearray)
    samples: int | None = None  # as announced by audio.done
    cancelled: bool = False


@dataclass
class StreamResult:
    """Everything one round of a WebSocket session produced."""

    sample_rate: int
    utterances: list[Utterance]
    events: list[dict]
    time_to_first_audio_s: float | None
    wall_s: float

    @property
    def pcm(self) -> np.ndarray:
        """All utterances' audio as int16 samples, in order."""
        data = b"".join(bytes(u.pcm) for u in self.utterances)
        return np.frombuffer(data, dtype="<i2")

    @property
    def audio_seconds(self) -> float:
        return self.pcm.size / self.sample_rate

    @property
    def real_time_factor(self) -> float:
        """Wall seconds per audio second, as the speech literature means it: lower is better,
        below 1 keeps up with playback (``times_real_time`` is its inverse)."""
        return self.wall_s / self.audio_seconds if self.audio_seconds > 0 else float("inf")

    @property
    def times_real_time(self) -> float:
        """Audio seconds per wall second: how many times faster than real time."""
        return self.audio_seconds / self.wall_s if self.wall_s > 0 else float("inf")


class StreamSession:
    """One open WebSocket session; ``recv`` yields dicts (JSON messages) or bytes (PCM16)."""

    def __init__(self, connection):
        self.connection = connection
        self.created: dict = {}

    async def send(self, message: dict) -> None:
        await self.connection.send(json.dumps(message))

    async def configure(self, **fields: Any) -> None:
        await self.send({"type": "session.config", **fields})

    async def send_text(self, text: str) -> None:
        await self.send({"type": "input.text", "text": text})

    async def done(self) -> None:
        await self.send({"type": "input.done"})

    async def cancel(self) -> None:
        await self.send({"type": "response.cancel"})

    async def close(self) -> None:
        try:
            await self.send({"type": "session.close"})
        except websockets.ConnectionClosed:
            pass
        await self.connection.close()

    async def recv(self) -> dict | bytes:
        message = await self.connection.recv()
        return message if isinstance(message, bytes) else json.loads(message)

    async def __aiter__(self) -> AsyncIterator[dict | bytes]:
        try:
            while True:
                yield await self.recv()
        except websockets.ConnectionClosedOK:
            return

    async def collect_round(self, fatal_errors: bool = True) -> StreamResult:
        """Read until ``session.done``; a fatal ``error`` raises StreamvoxError."""
        started = time.monotonic()
        first_audio: float | None = None
        utterances: list[Utterance] = []
        events: list[dict] = []
        while True:
            message = await self.recv()
            if isinstance(message, bytes):
                if first_audio is None:
                    first_audio = time.monotonic() - started
                utterances[-1].pcm.extend(message)
                continue
            events.append(message)
            kind = message.get("type")
            if kind == "audio.start":
                utterances.append(Utterance(message["utterance"], message.get("text", "")))
            elif kind == "audio.done":
                utterances[-1].samples = message["samples"]
                utterances[-1].cancelled = bool(message.get("cancelled"))
            elif kind == "session.done":
                break
            elif kind == "error" and fatal_errors:
                raise StreamvoxError(0, message.get("code", "error"), message.get("message", ""))
        return StreamResult(self.created.get("sample_rate", 24000), utterances, events, first_audio,
                            time.monotonic() - started)


class StreamvoxClient:
    def __init__(self, url: str = "http://127.0.0.1:8000", api_key: str | None = None,
                 timeout_s: float = 300.0):
        """``url``: any form clients/address.py accepts (``http(s)://``, ``ws(s)://``,
        ``host:port``); a malformed one raises ``AddressError`` here, before any I/O."""
        self.address = parse_address(url)
        self.url = self.address.http
        self.api_key = api_key
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "StreamvoxClient":
        self._http = aiohttp.ClientSession(timeout=self._timeout)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def ws_url(self) -> str:
        return self.address.stream_url

    # -- REST ----------------------------------------------------------------------
    async def _request(self, method: str, path: str, **kwargs) -> aiohttp.ClientResponse:
        if self._http is None:
            raise RuntimeError("use `async with StreamvoxClient(...)`")
        response = await self._http.request(method, self.url + path, headers=self.headers, **kwargs)
        if response.status >= 400:
            try:
                error = (await response.json()).get("error", {})
            except (aiohttp.ContentTypeError, json.JSONDecodeError, AttributeError):
                error = {}
            response.release()
            raise StreamvoxError(response.status, error.get("code", "http_error"), error.get("message", response.reason))
        return response

    async def _json(self, method: str, path: str, **kwargs) -> Any:
        response = await self._request(method, path, **kwargs)
        async with response:
            return await response.json()

    async def ready(self) -> bool:
        try:
            await self._json("GET", "/readyz")
            return True
        except (StreamvoxError, aiohttp.ClientError):
            return False

    async def models(self) -> dict:
        return await self._json("GET", "/v1/models")

    async def voices(self) -> dict:
        return await self._json("GET", "/v1/voices")

    async def speech(self, input: str, response_format: str = "wav", **params: Any) -> bytes:
        """``POST /v1/audio/speech`` (not streamed): the whole file."""
        response = await self._request("POST", "/v1/audio/speech",
                                       json={"model": "streamvox", "input": input, "response_format": response_format,
                                             **params})
        async with response:
            return await response.read()

    async def submit_job(self, input: str, **params: Any) -> dict:
        return await self._json("POST", "/v1/jobs", json={"input": input, **params})

    async def get_job(self, job_id: str) -> dict:
        return await self._json("GET", f"/v1/jobs/{job_id}")

    async def list_jobs(self, status: str | None = None) -> list[dict]:
        return (await self._json("GET", "/v1/jobs", params={"status": status} if status else None))["data"]

    async def cancel_job(self, job_id: str) -> dict:
        return await self._json("DELETE", f"/v1/jobs/{job_id}")

    async def fetch_audio(self, job_id: str) -> bytes:
        response = await self._request("GET", f"/v1/jobs/{job_id}/audio")
        async with response:
            return await response.read()

    async def wait_job(self, job_id: str, on_progress: Callable[[dict], None] | None = None,
                       poll_s: float = 0.25, max_poll_s: float = 2.0) -> dict:
        """Poll until the job is finished (succeeded, failed or cancelled), backing off from
        ``poll_s`` to ``max_poll_s`` between polls (:func:`poll_delays`); ``on_progress(job)``
        sees each job object polled, the last one included."""
        for delay in poll_delays(poll_s, max_poll_s):
            job = await self.get_job(job_id)
            if on_progress is not None:
                on_progress(job)
            if job["status"] in JOB_FINISHED:
                return job
            await asyncio.sleep(delay)
        raise AssertionError("unreachable: poll_delays never ends")

    # -- WebSocket -----------------------------------------------------------------
    def connect(self) -> "_SessionContext":
        return _SessionContext(self)

    async def say(self, text: str, **config: Any) -> StreamResult:
        """Stream ``text`` over WebSocket and return the audio of the round."""
        async with self.connect() as session:
            if config:
                await session.configure(**config)
            await session.send_text(text)
            await session.done()
            return await session.collect_round()

    async def stream_speech(self, text: AsyncIterable[str], **config: Any) -> AsyncIterator[bytes]:
        """Text in as it comes, audio out as it is made: PCM16 (mono, ``sample_rate`` of the
        session) pieces while ``text`` is still being produced (an LLM's tokens, a pipe).
        On a talker server each piece of text reaches the engine at once (live text,
        docs/API.md); a fatal ``error`` raises StreamvoxError.

            async for pcm in client.stream_speech(llm_tokens(), voice="Vivian"):
                player.write(pcm)
        """
        async with self.connect() as session:
            if config:
                await session.configure(**config)

            async def send_all() -> None:
                try:
                    async for piece in text:
                        if piece:
                            await session.send_text(piece)
                except BaseException:
                    await session.cancel()  # the server answers with session.done: the reader ends
                    raise
                await session.done()

            sender = asyncio.create_task(send_all())
            try:
                while True:
                    message = await session.recv()
                    if isinstance(message, bytes):
                        yield message
                    elif message.get("type") == "session.done" and sender.done():
                        if sender.exception() is not None:
                            raise sender.exception()
                        return
                    elif message.get("type") == "error" and message.get("code") not in NON_FATAL_STREAM_ERRORS:
                        raise StreamvoxError(0, message.get("code", "error"), message.get("message", ""))
            finally:
                sender.cancel()


NON_FATAL_STREAM_ERRORS = ("input_idle",)  # the server ended an utterance for lack of text; audio follows


class _SessionContext:
    def __init__(self, client: StreamvoxClient):
        self.client = client
        self.session: StreamSession | None = None

    async def __aenter__(self) -> StreamSession:
        connection = await websockets.connect(self.client.ws_url, additional_headers=self.client.headers,
                                              subprotocols=[SUBPROTOCOL], max_size=None)
        self.session = StreamSession(connection)
        first = await self.session.recv()
        if isinstance(first, dict) and first.get("type") == "error":
            await connection.close()
            raise StreamvoxError(0, first.get("code", "error"), first.get("message", ""))
        self.session.created = first if isinstance(first, dict) else {}
        return self.session

    async def __aexit__(self, *exc) -> None:
        if self.session is not None:
            await self.session.connection.close()
