"""A reference-audio decoder process: ``python -m service.voices.decode_worker``, started and
fed by service/voices/decoder_pool.py.

The wire format is plain bytes both ways (no pickle: a decoder compromised by hostile input
must not be able to run code in the server by what it answers). Request: ``<d I Q`` (the
longest allowed seconds, the output rate, the length of the file) then the file. Answer: one
status byte and a ``Q`` length, then float32 samples (``o``) or a UTF-8 reason (``r``).
"""

from __future__ import annotations

import resource
import signal
import struct
import sys

from service.voices.decode import Refused, decode_reference

REQUEST = struct.Struct("<dIQ")
ANSWER = struct.Struct("<cQ")
MEMORY_BYTES = 2 << 30  # this process's address space: a runaway decoder fails here, not the host


def _read_exact(stream, size: int) -> bytes | None:
    data = stream.read(size)
    return data if data is not None and len(data) == size else None


def answer(data: bytes, max_seconds: float, out_rate: int) -> tuple[bytes, bytes]:
    try:
        return b"o", decode_reference(data, max_seconds, out_rate).astype("<f4").tobytes()
    except Refused as exc:
        return b"r", str(exc).encode()
    except MemoryError:
        return b"r", b"decoding it needs more memory than a reference voice may"
    except Exception as exc:  # a decoder fault on hostile bytes: the client's problem, said plainly
        return b"r", f"not decodable audio ({type(exc).__name__})".encode()


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the server's to handle; we end at EOF
    try:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    except (ValueError, OSError):
        pass
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    while (head := _read_exact(requests, REQUEST.size)) is not None:
        max_seconds, out_rate, size = REQUEST.unpack(head)
        data = _read_exact(requests, size)
        if data is None:
            return
        status, payload = answer(data, max_seconds, out_rate)
        replies.write(ANSWER.pack(status, len(payload)) + payload)
        replies.flush()


if __name__ == "__main__":
    main()
