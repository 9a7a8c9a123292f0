"""The codec decoder in a process of its own (CPU): the vocalizer's surface (``vocalize``,
``prime``, ``close``, ``open_streams``) over a :class:`Vocalizer` that runs in a child process.

Why a process: the decoder on a thread of the worker's process dispatches its ~500 torch ops a
chunk under the same GIL as the talker's ~740 ops a frame. Measured (benchmarks/
bench_codec_process.py, the kernel's per-thread accounting), that costs the talker's step 0.5-1.6
ms blocked per ~80 ms step, not the 1.2-1.4x slowdown seen beside the decoder thread on a loaded
machine: that was the talker waiting for a core; on a quiet machine the step beside the decoder, on
a thread or here, equals its time alone. What the process gives: nothing of the decoder's holds
the GIL the talker needs (nor the other way round, as the talker's step becomes fewer, longer
native calls), a crash or leak in the decoder stays in its process (the next call starts a new
one), and its heap is its own. The child holds the decoder's weights in shared memory
(``share_memory``: the parent's tensors, no second copy), its own torch threads and every
stream's decoder state; codes go in over a pipe (a chunk is a few hundred bytes) and the PCM
comes back as one buffer of float32 read straight into a tensor (4 frames: 30 KB); a 4-frame
piece's round trip costs ~1 ms more than decoding it in-process, on a quiet machine, against
~120 ms of decoding (the benchmark prints it).

Calls are made one at a time (a lock), in the order the caller makes them: the engine's
vocoder thread decodes pieces first in, first out, and the worker primes and closes streams only
with no piece in flight, so each stream's chunks decode in order as on one thread, and a
window-decoding vocalizer gives the same PCM to the bit as in the worker's process. A call that
fails in the child (a bad item) raises here and changes no stream, as the vocalizer does. If the
child dies, the call raises, the next call starts a new child, and the streams that were open
fail (their decoder state died with it) while new ones decode. If no child can start at all
(``start``: a /dev/shm smaller than the weights, 229 MB in bf16 at the released sizes, as Docker's
default 64 MB is; no ``spawn``), it says why and decodes in this process instead, on the caller's
thread: served as before, with the same PCM.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import numpy as np
import torch
import torch.multiprocessing as mp

from engines.models.codec_decoder import CodecDecoder
from engines.pipelines.vocoder import VocalizeItem, VocalizeResult, Vocalizer

log = logging.getLogger("streamvox.vocoder")

START_SECONDS = 120.0  # a child that has not said ready by then (importing torch on a busy machine) failed


class CodecProcessError(RuntimeError):
    """The codec process died or could not start."""


class VocoderProcess:
    """A vocalizer whose decoding runs in a child process (module docstring)."""

    graphed_decoder = None  # CPU only: the CUDA path keeps its graphed decoder on the device stream

    def __init__(self, vocalizer: Vocalizer, threads: int = 1):
        """``vocalizer``: the decoder, device (CPU), precision and windowing to run in the child;
        ``threads``: the child's torch intra-op threads."""
        if vocalizer.device.type != "cpu" or vocalizer.graphed_decoder is not None:
            raise ValueError("the codec process decodes on the CPU, without a graphed decoder")
        self.vocalizer = vocalizer
        self.decoder, self.device, self.dtype = vocalizer.decoder, vocalizer.device, vocalizer.dtype
        self.num_code_groups, self.codebook_size = vocalizer.num_code_groups, vocalizer.codebook_size
        self.samples_per_frame, self.windowed = vocalizer.samples_per_frame, vocalizer.windowed
        self.threads = threads
        self._lock = threading.Lock()
        self._process = None
        self._conn = None
        self._streams: set[str] = set()  # open in the current child
        self._lost: set[str] = set()  # open in a child that died: their state is gone
        self.starts = 0  # children started (a restart after a death counts)
        self.in_process = False  # no child could start: ``vocalizer`` decodes here
        # Seconds of ``vocalize`` calls: their wall time here, and the child's wall and CPU time
        # decoding them (the difference of the first two is the hand-over: pipe, pickling, wake-ups).
        self.call_seconds = self.child_seconds = self.child_cpu_seconds = 0.0
        self.calls = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the child now (engine start, before ready) unless it runs; if it cannot start,
        decode in this process from now on (the module docstring)."""
        with self._lock:
            try:
                self._ensure()
            except CodecProcessError as exc:
                log.warning("%s; the codec decoder runs in the server's process instead (a thread beside the "
                            "talker; STREAMVOX_CODEC_PROCESS=0 chooses that without trying)", exc)
                self.in_process = True

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None and self._process.is_alive() else None

    def shutdown(self) -> None:
        """Stop the child (its streams are forgotten)."""
        with self._lock:
            if self._conn is not None:
                try:
                    self._conn.send(("stop",))
                except OSError:
                    pass
            self._stop_child()
            self._streams.clear()
            self._lost.clear()

    def _ensure(self) -> None:
        if self._process is not None and self._process.is_alive():
            return
        if self._process is not None:  # it died: its streams' state went with it
            self._stop_child()
        self._lost |= self._streams
        self._streams = set()
        t0 = time.perf_counter()
        ctx = mp.get_context("spawn")  # fork would copy the parent's threads' locks mid-flight
        try:
            self.decoder.share_memory()  # the child maps these pages: no second copy of the weights
            parent, child = ctx.Pipe()
            process = ctx.Process(target=serve, args=(child, self.decoder, self.dtype, self.windowed, self.threads),
                                  name="streamvox-codec", daemon=True)
            process.start()
        except (OSError, RuntimeError) as exc:  # /dev/shm full, no spawn
            raise CodecProcessError(f"the codec process could not start: {exc}") from None
        child.close()
        if not parent.poll(START_SECONDS):
            process.kill()
            raise CodecProcessError(f"the codec process did not start within {START_SECONDS:.0f} s")
        try:
            ready = parent.recv()
        except (EOFError, OSError) as exc:
            raise CodecProcessError(f"the codec process died while starting ({exc or type(exc).__name__})") from None
        if ready[0] != "ready":
            process.kill()
            raise CodecProcessError(f"the codec process failed to start: {ready[-1]}")
        self._process, self._conn = process, parent
        self.starts += 1
        log.info("codec decoder process %d started in %.1f s (%s, %d thread%s%s)", process.pid,
                 time.perf_counter() - t0, str(self.dtype).removeprefix("torch."), self.threads,
                 "" if self.threads == 1 else "s", ", fixed windows" if self.windowed else "")

    def _stop_child(self) -> None:
        process, conn = self._process, self._conn
        self._process = self._conn = None
        if process is not None:
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join(5)
        if conn is not None:
            conn.close()

    def _call(self, message: tuple):
        """One request and its reply; the child's failure raised here, its death as CodecProcessError."""
        self._ensure()
        try:
            self._conn.send(message)
            reply = self._conn.recv()
            if reply[0] == "error":
                kind, text = reply[1], reply[2]
                raise (ValueError if kind == "ValueError" else RuntimeError)(text)
            if reply[0] == "pcm":
                buffer = bytearray(4 * sum(reply[1]))
                if buffer:
                    self._conn.recv_bytes_into(buffer)
                self.child_seconds += reply[2]
                self.child_cpu_seconds += reply[3]
                return reply[1], buffer
            return reply[1]
        except (EOFError, OSError) as exc:
            code = self._process.exitcode if self._process is not None else None
            self._stop_child()
            self._lost |= self._streams
            self._streams = set()
            raise CodecProcessError(f"the codec process died (exit code {code}): "
                                    f"{exc or type(exc).__name__}") from None

    # ------------------------------------------------------------------ the vocalizer's surface
    def capture_graphs(self) -> None:
        """(No CUDA graphs on a CPU.)"""

    def open_streams(self) -> int:
        return self.vocalizer.open_streams() if self.in_process else len(self._streams)

    def prime(self, stream_id: str, codes: torch.Tensor) -> None:
        """As :meth:`Vocalizer.prime`, in the child."""
        if self.in_process:
            return self.vocalizer.prime(stream_id, codes)
        if codes.shape[0] == 0:
            return
        with self._lock:
            self._lost.discard(stream_id)  # a new stream of that name
            self._call(("prime", stream_id, np.ascontiguousarray(codes.cpu().numpy())))
            self._streams.add(stream_id)

    def close(self, stream_id: str) -> None:
        """Forget a stream's decoder state; unknown ids are ignored."""
        if self.in_process:
            return self.vocalizer.close(stream_id)
        with self._lock:
            self._lost.discard(stream_id)
            if stream_id in self._streams:
                self._streams.discard(stream_id)
                if self._process is not None and self._process.is_alive():
                    self._call(("close", stream_id))

    def vocalize(self, items: list[VocalizeItem]) -> list[VocalizeResult]:
        """PCM for each item, in the same order, decoded in the child (:meth:`Vocalizer.vocalize`)."""
        if self.in_process:
            return self.vocalizer.vocalize(items)
        t0 = time.perf_counter()
        with self._lock:
            for it in items:
                if it.stream_id in self._lost:
                    raise CodecProcessError(f"stream {it.stream_id!r}: its decoder state died with the codec process")
            lengths, buffer = self._call(("vocalize", [(it.stream_id, np.ascontiguousarray(it.codes.cpu().numpy()),
                                                        it.frame_offset, it.is_last) for it in items]))
            for it in items:
                (self._streams.discard if it.is_last else self._streams.add)(it.stream_id)
            pcm = torch.frombuffer(buffer, dtype=torch.float32) if buffer else torch.empty(0)
            self.calls += 1
            self.call_seconds += time.perf_counter() - t0
        return [VocalizeResult(it.stream_id, it.codes, p) for it, p in zip(items, pcm.split(lengths))]


def serve(conn, decoder: CodecDecoder, dtype: torch.dtype, windowed: bool, threads: int) -> None:
    """The child: a vocalizer over the shared decoder, answering the parent's calls until told to
    stop or the parent goes away."""
    try:
        torch.set_num_threads(threads)
        vocalizer = Vocalizer(decoder, "cpu", dtype, windowed=windowed)
    except Exception as exc:  # reported, not raised: the parent names it
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", os.getpid()))
    with torch.no_grad():
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return  # the parent is gone
            kind = message[0]
            if kind == "stop":
                return
            try:
                if kind == "vocalize":
                    t0, c0 = time.perf_counter(), time.thread_time()
                    results = vocalizer.vocalize([VocalizeItem(s, torch.from_numpy(c), offset, last)
                                                  for s, c, offset, last in message[1]])
                    lengths = [r.pcm.numel() for r in results]
                    conn.send(("pcm", lengths, time.perf_counter() - t0, time.thread_time() - c0))
                    if sum(lengths):
                        conn.send_bytes(torch.cat([r.pcm for r in results]).numpy())
                elif kind == "prime":
                    vocalizer.prime(message[1], torch.from_numpy(message[2]))
                    conn.send(("ok", None))
                elif kind == "close":
                    vocalizer.close(message[1])
                    conn.send(("ok", None))
                else:
                    conn.send(("error", "ValueError", f"unknown call {kind!r}"))
            except Exception as exc:
                conn.send(("error", type(exc).__name__, str(exc)))
