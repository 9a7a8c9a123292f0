"""The codec decoder on a thread of its own beside the talker's next tick (CPU; the thread hands the
pieces to the decoder's own process by default): the same PCM as decoding after each tick, each
request's chunks in order, failures and cancels still one request's, a dead decoder process only
the streams it held."""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest
import torch
from engine_helpers import Collected, run_requests

from engines.build import build_engine
from engines.config import RuntimeSwitches
from engines.contract import SynthesisRequest
from engines.core.executor import split_cpu_threads
from tests.oracle import talker_fixtures

TEXTS = ["Hello there, this is a test.", "Short one.", "The quick brown fox jumps over the lazy dog, twice.",
         "Streaming speech while it is being generated."]


def talker(vocoder_thread: bool, threads: int, **kw):
    """The talker fixture engine built (and its worker started) with ``threads`` torch threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        engine = build_engine(preset="tiny", device="cpu", checkpoint=str(talker_fixtures.checkpoint_dir("cv_proj")),
                              warmup=False, switches=RuntimeSwitches(vocoder_thread=vocoder_thread), **kw)
        steady_steps(engine.worker.scheduler)
        engine.start()
    finally:
        torch.set_num_threads(before)
    return engine


def steady_steps(scheduler, period: float = 0.01) -> None:
    """The scheduler sees one step every ``period`` seconds whatever the machine's load, on a clock
    that moves only with the steps: chunk sizes follow the step period and each stream's lead, and
    the comparisons below need the same chunks both ways (a busy CI machine would otherwise give the
    two engines different ones)."""
    observe, clock = scheduler.observe, [0.0]

    def at_steady_pace(frames_produced: int, now: float | None = None) -> None:
        clock[0] += period
        observe(frames_produced, clock[0])

    scheduler.observe = at_steady_pace
    scheduler.no_step = lambda: None  # (idle turns are no gap on this clock)
    scheduler.clock = lambda: clock[0]


def pcm_of(result) -> np.ndarray:
    return np.frombuffer(result[0], dtype=np.float32)


def requests(engine) -> list[SynthesisRequest]:
    voice = engine.capabilities.voices[0]
    return [SynthesisRequest(id=f"r{i}", text=t, voice=voice, seed=10 + i) for i, t in enumerate(TEXTS)]


@pytest.fixture(scope="module")
def sequential():
    """Every request's PCM bytes and chunk sizes, decoded after each tick on the worker thread, at one
    torch thread: the count the decoder and the talker each get beside each other on two cores
    (fp32 results may differ in their last bits from one thread count to another)."""
    engine = talker(False, threads=1)
    try:
        assert not engine.worker.executor.overlapped
        return [(c.pcm.tobytes(), [k.pcm.size for k in c.chunks]) for c in run_requests(engine, requests(engine))]
    finally:
        engine.stop()


def test_the_talker_and_the_decoder_share_the_cores_out():
    assert split_cpu_threads(2) == (1, 1)
    assert split_cpu_threads(3) == (2, 1)
    assert split_cpu_threads(8) == (4, 4)


def test_same_requests_give_the_same_pcm_bytes_with_the_decoder_on_its_own_thread(sequential):
    """A decoder slower than the talker (a piece decodes once the next one is queued behind it):
    pieces queue on the vocoder thread, and each stream's audio still comes out as decoded in order."""
    engine = talker(True, threads=2)
    executor = engine.worker.executor
    seen: dict[str, set] = {"tick": set(), "vocalize": set()}
    queued = threading.Condition()
    in_flight = [0]
    tick, vocalize, submit = engine.pipeline.tick, engine.vocalizer.vocalize, executor.submit_vocode

    def ticking(*args, **kwargs):
        seen["tick"].add((threading.current_thread().name, torch.get_num_threads()))
        return tick(*args, **kwargs)

    def submitting(items, payload):
        with queued:
            submit(items, payload)
            in_flight[0] = max(in_flight[0], executor.vocoding)
            queued.notify_all()

    def vocalizing(items):
        seen["vocalize"].add((threading.current_thread().name, torch.get_num_threads()))
        with queued:  # (bounded: no piece follows the last ones)
            queued.wait_for(lambda: executor.vocoding >= 2, timeout=0.2)
        return vocalize(items)

    engine.pipeline.tick, engine.vocalizer.vocalize, executor.submit_vocode = ticking, vocalizing, submitting
    try:
        assert engine.worker.executor.overlapped
        got = run_requests(engine, requests(engine))
        stats = engine.stage_seconds()
    finally:
        engine.stop()
    for (pcm, sizes), collected in zip(sequential, got):
        assert collected.error is None
        assert [c.index for c in collected.chunks] == list(range(len(collected.chunks)))
        assert [c.pcm.size for c in collected.chunks] == sizes
        assert collected.pcm.tobytes() == pcm
    # the talker on the worker thread and the decoder beside it, one core each
    assert {name for name, _ in seen["tick"]} == {"streamvox-worker"}
    assert {name.split("_")[0] for name, _ in seen["vocalize"]} == {"streamvox-vocoder"}
    assert {n for _, n in seen["tick"] | seen["vocalize"]} == {1}
    assert in_flight[0] == 2  # queued pieces, at most two
    assert stats["decode"] > 0


def test_a_request_failing_in_the_decoder_thread_fails_alone(sequential):
    engine = talker(True, threads=2)
    vocalize = engine.vocalizer.vocalize

    def failing_for_r2(items):
        if any(it.stream_id == "r2" for it in items):
            raise RuntimeError("injected decoder failure")
        return vocalize(items)

    engine.vocalizer.vocalize = failing_for_r2
    try:
        got = run_requests(engine, requests(engine))
        assert engine.stats().alive
        [after] = run_requests(engine, requests(engine)[:1])  # the engine serves on
    finally:
        engine.stop()
    assert "injected decoder failure" in got[2].error
    for i in (0, 1, 3):  # decoded in other batches than before (the culprit's piece re-runs item by item)
        assert got[i].error is None
        np.testing.assert_allclose(got[i].pcm, pcm_of(sequential[i]), atol=1e-5, rtol=0)
    assert after.error is None
    np.testing.assert_allclose(after.pcm, pcm_of(sequential[0]), atol=1e-5, rtol=0)


def test_a_cancel_with_its_audio_on_the_decoder_thread_ends_only_that_request(sequential):
    engine = talker(True, threads=2)
    reqs = requests(engine)
    out = [Collected() for _ in reqs]
    try:
        handles = [engine.submit(r, c.deliver) for r, c in zip(reqs, out)]
        assert out[2].first_audio.wait(60)
        handles[2].cancel()
        for c in out:
            assert c.done.wait(60)
        assert engine.worker.vocalizer.open_streams() == 0  # the cancelled stream's decoder state is gone
    finally:
        engine.stop()
    assert out[2].error == "cancelled"
    cut = out[2].pcm.size  # what it got is the start of its audio
    assert 0 < cut < pcm_of(sequential[2]).size
    np.testing.assert_allclose(out[2].pcm, pcm_of(sequential[2])[:cut], atol=1e-5, rtol=0)
    for i in (0, 1, 3):  # decoded in other batches after the cancel
        assert out[i].error is None
        np.testing.assert_allclose(out[i].pcm, pcm_of(sequential[i]), atol=1e-5, rtol=0)


def test_a_dead_codec_process_fails_the_streams_it_held_and_the_engine_serves_on(sequential):
    """The decoder in its process (the CPU default): killed while streams decode, those streams end
    with an error, the engine lives, and the next requests decode in a new process."""
    engine = talker(True, threads=2)
    reqs = requests(engine)
    out = [Collected() for _ in reqs]
    try:
        assert engine.codec_process is not None and engine.codec_process.pid is not None
        for r, c in zip(reqs, out):
            engine.submit(r, c.deliver)
        assert out[0].first_audio.wait(60)
        os.kill(engine.codec_process.pid, signal.SIGKILL)
        for c in out:
            assert c.done.wait(60)
        assert engine.stats().alive
        after = run_requests(engine, reqs[:2])
    finally:
        engine.stop()
    failed = [c.error for c in out if c.error]
    assert failed and all("codec process" in e for e in failed), failed
    assert engine.codec_process.starts == 2
    for i, c in enumerate(after):  # (fp32: batched with other neighbours than before, as rounding allows)
        assert c.error is None
        np.testing.assert_allclose(c.pcm, pcm_of(sequential[i]), atol=1e-5, rtol=0)
