"""Reference audio decoded away from the server: in worker processes, with a time budget.

FFmpeg's demuxers and decoders are C parsing hostile bytes; a crash or a hang in one must not
take the server down or freeze its event loop. So :func:`decode_reference` first refuses
anything that is not an allowed container (magic bytes, on the loop, microseconds), then hands
the bytes to one of a few long-lived worker processes (``python -m service.voices.decode_worker``,
a fresh interpreter that imports only the decoder, never a fork of the server with its model
and threads) and waits for the answer in a thread. A worker that runs past the time budget is
killed and replaced, as is one that dies; the client gets a 400 naming the field either way.
A warm worker costs a pipe round trip per call (1-3 ms more than decoding in the server);
a fresh process per call would add a Python start-up and the av/numpy/soxr imports every
time (about 0.6 s on a busy two-core machine).
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import select
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from engines.contract import SAMPLE_RATE
from service.errors import ApiError
from service.voices import decode
from service.voices.decode_worker import ANSWER, REQUEST

log = logging.getLogger("streamvox.voices")

WORKERS = 2
DECODE_BUDGET_S = 10.0  # a 30 s reference decodes in tens of milliseconds; this is only a backstop
MAX_WAITING = 16  # decodes waiting for a worker beyond this are refused (503) rather than piled up
_REPO = str(Path(__file__).resolve().parents[2])


def _bad(field: str, message: str) -> ApiError:
    return ApiError(400, "invalid_audio", f"{field}: {message}")


class _WorkerGone(Exception):
    pass


class _Worker:
    def __init__(self):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_REPO, os.environ.get("PYTHONPATH")])),
               "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen([sys.executable, "-m", "service.voices.decode_worker"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=env, cwd=_REPO)
        self._out = self.process.stdout.fileno()

    def ask(self, data: bytes, max_seconds: float, out_rate: int, budget_s: float) -> tuple[bytes, bytes]:
        deadline = time.monotonic() + budget_s
        try:
            self.process.stdin.write(REQUEST.pack(max_seconds, out_rate, len(data)) + data)
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            raise _WorkerGone from None
        status, size = ANSWER.unpack(self._read(ANSWER.size, deadline))
        return status, self._read(size, deadline)

    def _read(self, size: int, deadline: float) -> bytes:
        chunks, got = [], 0
        while got < size:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._out], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(self._out, min(size - got, 1 << 20))
            if not chunk:
                raise _WorkerGone
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(5)
        self.process.stdin.close()
        self.process.stdout.close()


class DecoderPool:
    """``workers`` decoder processes, started on first use and replaced when one is killed."""

    def __init__(self, workers: int = WORKERS, budget_s: float = DECODE_BUDGET_S):
        self.budget_s = budget_s
        self._size = workers
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._threads = ThreadPoolExecutor(workers, thread_name_prefix="ref-audio")
        self._started = False
        self._lock = threading.Lock()
        self._waiting = 0

    def _start(self) -> None:
        with self._lock:
            if not self._started:
                for _ in range(self._size):
                    self._idle.put(_Worker())
                self._started = True

    def decode_blocking(self, data: bytes, max_seconds: float, out_rate: int) -> tuple[str, object]:
        """One decode in a worker (run in one of the pool's threads): ("ok", samples),
        ("refused", why) or ("busy", why)."""
        try:
            self._start()
            worker = self._idle.get(timeout=self.budget_s)  # empty only while workers are being replaced
        except (OSError, queue.Empty):
            return "busy", "no reference-audio decoder is free; retry shortly"
        healthy = False
        try:
            status, payload = worker.ask(data, max_seconds, out_rate, self.budget_s)
            healthy = True
        except TimeoutError:
            log.warning("a reference-audio decode ran past %g s; its worker is replaced", self.budget_s)
            return "refused", f"decoding took longer than {self.budget_s:g} s"
        except (_WorkerGone, OSError, ValueError):
            log.warning("a reference-audio worker died (exit code %s); replacing it", worker.process.poll())
            return "refused", "not decodable audio (the decoder failed on it)"
        finally:
            if healthy:
                self._idle.put(worker)
            else:
                worker.kill()
                threading.Thread(target=self._replace, daemon=True).start()  # the answer need not wait for it
        if status == b"o":
            return "ok", np.frombuffer(payload, dtype="<f4").copy()
        return "refused", payload.decode("utf-8", "replace")

    def _replace(self) -> None:
        try:
            self._idle.put(_Worker())
        except OSError:
            log.exception("could not start a reference-audio worker; the pool is one short")

    async def decode(self, data: bytes, max_seconds: float, field: str) -> np.ndarray:
        if self._waiting >= MAX_WAITING:
            raise ApiError(503, "busy", f"{field}: too many reference files wait to be decoded; retry shortly",
                           headers={"Retry-After": "1"})
        self._waiting += 1
        try:
            loop = asyncio.get_running_loop()
            outcome, value = await loop.run_in_executor(self._threads, self.decode_blocking, data, max_seconds,
                                                        SAMPLE_RATE)
        finally:
            self._waiting -= 1
        if outcome == "ok":
            return value
        if outcome == "busy":
            raise ApiError(503, "busy", f"{field}: {value}", headers={"Retry-After": "1"})
        raise _bad(field, value)

    def close(self) -> None:
        while not self._idle.empty():
            self._idle.get_nowait().kill()
        self._threads.shutdown(wait=False)


_pool: DecoderPool | None = None


def _shared_pool() -> DecoderPool:
    global _pool
    if _pool is None:
        _pool = DecoderPool()
    return _pool


async def decode_reference(data: bytes, max_seconds: float, field: str = "ref_audio") -> np.ndarray:
    """Reference audio file bytes -> float32 mono at 24 kHz for voice cloning, decoded in a worker
    process within a time budget; a 400 naming ``field`` when it is refused. Anything that is not
    an allowed container is refused here at once, without a worker."""
    if not data:
        raise _bad(field, "empty")
    if decode.sniff_container(data) is None:
        raise _bad(field, decode.NOT_ALLOWED)
    return await _shared_pool().decode(data, max_seconds, field)


def reference_audio(data: bytes, max_seconds: float, field: str = "ref_audio") -> np.ndarray:
    """The same decoding in this process (the command line's own files, no server around)."""
    try:
        return decode.decode_reference(data, max_seconds, SAMPLE_RATE)
    except decode.Refused as exc:
        raise _bad(field, str(exc)) from None
