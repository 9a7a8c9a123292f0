"""Logs nobody can forge or flood: what a client sends (a path, a header, a name) is written
with its control characters escaped, so it can never start a line of its own; and an error
that repeats (the same message, numbers aside) is written a few times, then counted, not
written, until its window passes.

``escape_controls`` is for a log call that writes a client's value; :class:`SafeFormatter`
applies it to every message the server logs (whatever a future call forgets),
:class:`ClientErrorFilter` writes a request aiohttp could not parse (the client's fault, answered
400) as one line, not the parser's traceback, and :class:`RepeatFilter` bounds repeated warnings
and errors. ``configure`` installs them on a handler; :func:`queued_writer` is the process's log
handler (service/server.py): a line is filtered and formatted where it is logged and written to
the stream by a thread of its own, so a slow reader of the log (a full pipe) never holds the
event loop."""

from __future__ import annotations

import atexit
import collections
import logging
import re
import threading
import time
from logging.handlers import QueueHandler
from typing import TextIO

from aiohttp.http_exceptions import BadHttpMessage

# C0 controls, DEL, C1 controls, the Unicode line and paragraph separators (a log viewer may
# break lines there), and lone surrogates (a stream encoding UTF-8 would fail on them).
_ESCAPES = {cp: f"\\x{cp:02x}" for cp in (*range(0x20), 0x7F, *range(0x80, 0xA0))}
_ESCAPES.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t", 0x2028: "\\u2028", 0x2029: "\\u2029"})
_ESCAPES.update({cp: f"\\u{cp:04x}" for cp in range(0xD800, 0xE000)})
_NEEDS_ESCAPE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")

REPEAT_WINDOW_S = 60.0  # a repeated message is counted per window...
REPEAT_BURST = 5  # ...and written this many times in one
LOG_QUEUE_LINES = 10_000  # lines waiting for the writer at most; past that they are counted, not kept
LOG_WRITE_EVERY_S = 0.05  # the writer's period: lines reach the log at most this much later
_VARYING = re.compile(r"0x[0-9a-fA-F]+|\d+")  # task names, addresses, counts: the same error all the same


def escape_controls(text: str) -> str:
    """``text`` with every character that could end or forge a log line escaped (``\\n``, ``\\x1b``...)."""
    return text.translate(_ESCAPES) if _NEEDS_ESCAPE.search(text) else text


class SafeFormatter(logging.Formatter):
    """A formatter whose message part is always one line: control characters escaped. The
    traceback of an exception stays as Python wrote it (its lines are the server's own)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape_controls(record.message)
        return super().formatMessage(record)


class ClientErrorFilter(logging.Filter):
    """aiohttp logs a request it could not parse (bytes that are not allowed in a request line, a
    malformed header: it answers 400) at ERROR with the parser's traceback. That is the client's
    doing, not the server's: one INFO line saying what was wrong, as a client that goes away is."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if record.name == "aiohttp.server" and isinstance(error, BadHttpMessage):
            record.msg = f"{record.getMessage()}: a malformed request, answered {error.code}: {' '.join(str(error.message).split())}"
            record.args = ()
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        return True


class RepeatFilter(logging.Filter):
    """Warnings and errors that repeat are written at most ``burst`` times per ``window_s``;
    the first one written after a quiet spell says how many were left out. Two records repeat
    when logger, level, message template (numbers aside) and exception type match."""

    def __init__(self, window_s: float = REPEAT_WINDOW_S, burst: int = REPEAT_BURST, max_keys: int = 1024):
        super().__init__()
        self.window_s = window_s
        self.burst = burst
        self.max_keys = max_keys
        self._seen: dict[tuple, list] = {}  # key -> [window start, written in it, left out since last written]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        exc_type = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else ""
        key = (record.name, record.levelno, _VARYING.sub("#", str(record.msg)[:200]), exc_type)
        now = time.monotonic()
        entry = self._seen.get(key)
        if entry is None or now - entry[0] >= self.window_s:
            if entry is None and len(self._seen) >= self.max_keys:
                self._seen = {k: e for k, e in self._seen.items() if now - e[0] < self.window_s}
            left_out = entry[2] if entry is not None else 0
            entry = self._seen[key] = [now, 0, left_out]
        if entry[1] >= self.burst:
            entry[2] += 1
            return False
        entry[1] += 1
        if entry[2]:
            record.msg = f"{record.msg} [{entry[2]} more like this left out of the log]"
            entry[2] = 0
        return True


def configure(handler: logging.Handler, fmt: str) -> None:
    handler.setFormatter(SafeFormatter(fmt))
    handler.addFilter(ClientErrorFilter())  # (first: what it makes INFO is no repeated error)
    handler.addFilter(RepeatFilter())


class _LineBuffer(QueueHandler):
    """Filters and formats a record where it is logged (its traceback, its values as they are
    then) and appends the finished line to a deque: no lock taken, no thread woken (a queue's
    put woke the writer at every line, ~8 % of the event loop's time under a request flood).
    A full buffer counts what it could not keep, and the next line kept says how many."""

    def __init__(self):
        super().__init__(collections.deque())  # type: ignore[arg-type]  (append and popleft are atomic)
        self.left_out = 0

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        record = super().prepare(record)
        record.stack_info = None  # in the line already
        return record

    def enqueue(self, record: logging.LogRecord) -> None:
        if len(self.queue) >= LOG_QUEUE_LINES:
            self.left_out += 1
            return
        if self.left_out:
            record.msg = f"{record.msg} [{self.left_out} lines before it left out: the log could not keep up]"
            self.left_out = 0
        self.queue.append(record)


class _LineWriter(threading.Thread):
    """Writes what the buffer holds every LOG_WRITE_EVERY_S, and all of it when stopped."""

    def __init__(self, lines: collections.deque, stream: TextIO):
        super().__init__(name="log-writer", daemon=True)
        self.lines, self.stream, self.stopping = lines, stream, threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(LOG_WRITE_EVERY_S):
            self.write_out()
        self.write_out()

    def write_out(self) -> None:
        if not self.lines:
            return
        try:
            while self.lines:
                self.stream.write(self.lines.popleft().msg + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # the stream is gone (its reader exited): nothing can be written
            self.lines.clear()

    def stop(self) -> None:
        self.stopping.set()
        self.join()


def queued_writer(stream: TextIO, fmt: str) -> logging.Handler:
    """The handler to log through: lines safe as :func:`configure` makes them, written to
    ``stream`` by a thread (started here; stopped, everything written, at exit)."""
    handler = _LineBuffer()
    configure(handler, fmt)
    writer = _LineWriter(handler.queue, stream)  # type: ignore[arg-type]
    writer.start()
    atexit.register(writer.stop)
    return handler


__all__ = ["ClientErrorFilter", "RepeatFilter", "SafeFormatter", "configure", "escape_controls", "queued_writer"]
