"""The virtual device: the cost table's lookup rules, the device timeline's overlap of host and
device work, and a served run at tiny levels (real server, real WebSocket clients) whose audio,
waits and graph captures come from a small cost table - so the virtual device cannot rot."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import aiohttp
import pytest
import websockets
from conftest import start_server
from ws_helpers import read_until_session_done

from engines.build import build_engine
from engines.config import EngineConfig, VirtualDeviceConfig
from engines.contract import SAMPLES_PER_FRAME, SynthesisRequest
from engines.virtual.clock import DeviceClock
from engines.virtual.costs import CostTable

REPO = Path(__file__).resolve().parents[3]
PROMPT_SIDE = REPO / "benchmarks" / "costs" / "prompt-0.6b"  # the benchmark checkpoint's configs and tokenizer
LONG = "A long one, read slowly: with many small words in it, so that its budget is well past three hundred frames."
DECODE_MS = [[2.0, 3.0], [3.0, 4.0]]  # rows 1 / 4 x KV blocks 1 / 8
TABLE = {
    "schema": 1, "device": "test GPU", "torch": "0", "date": "2026-11-27", "commit": "test", "size": "0.6b",
    "dtype": "bfloat16", "command": "by hand",
    "decode_step": {"rows": [1, 4], "kv_blocks": [1, 8], "ms": DECODE_MS},
    "prefill": {"prompts": [1, 4], "width": [8, 64], "ms": [[4.0, 5.0], [6.0, 8.0]]},
    "codec_decode": {"rows": [1, 4], "frames": [1, 25], "ms": [[1.0, 3.0], [2.0, 5.0]]},
    "capture_ms": {"decode_step": 20.0, "codec_decode": 10.0}, "start_s": 1.0, "notes": "tiny, for tests",
}


@pytest.fixture(scope="module")
def table_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("costs") / "test-0.6b.json"
    path.write_text(json.dumps(TABLE))
    return path


def test_lookups_round_buckets_up_interpolate_widths_and_extrapolate_past_the_last_point(table_path):
    t = CostTable.load(table_path)
    assert t.decode_step_ms(3, 5) == 4.0  # rows 3 -> bucket 4, 5 blocks -> bucket 8
    assert t.decode_step_ms(1, 1) == 2.0
    assert t.decode_step_ms(7, 8) == pytest.approx(3.0 + (7 - 1) / (4 - 1) * (4.0 - 3.0))  # past rows 4: linear
    assert t.prefill_ms(2, 36) == pytest.approx(6.0 + (36 - 8) / (64 - 8) * (8.0 - 6.0))  # prompts up, width linear
    assert t.prefill_ms(1, 4) == 4.0  # below the first width: its cost
    assert t.codec_decode_ms(1, 13) == pytest.approx(1.0 + (13 - 1) / 24 * 2.0)
    assert t.codec_decode_ms(3, 50) == pytest.approx(2.0 + (50 - 1) / 24 * 3.0)
    assert t.admit_ms(16) is None, "a table measured before admission was has no admit costs"
    measured = CostTable.model_validate({**TABLE, "admit": {"rows": [1, 64], "ms": [1.5, 2.0]}})
    assert measured.admit_ms(1) == 1.5 and measured.admit_ms(64) == 2.0
    assert measured.admit_ms(22) == pytest.approx(1.5 + (22 - 1) / 63 * 0.5)  # rows started together: linear


def faked_parts(text: str) -> list[str]:
    """What a module does to fake a device by patching the real path: a class deriving from one of
    engines.pipelines (a host rule overridden), or a private name imported from another module."""
    import ast

    tree = ast.parse(text)
    from_pipelines = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                      and (node.module or "").startswith("engines.pipelines") for alias in node.names}
    found = [f"{node.lineno}: class {node.name}({ast.unparse(base)})" for node in ast.walk(tree)
             if isinstance(node, ast.ClassDef) for base in node.bases if ast.unparse(base).split(".")[0] in from_pipelines]
    found += [f"{node.lineno}: from {node.module} import {alias.name}" for node in ast.walk(tree)
              if isinstance(node, ast.ImportFrom) for alias in node.names if alias.name.startswith("_")]
    return found


def test_the_virtual_device_is_runners_not_patches_of_the_real_path():
    """The virtual device implements the runner interfaces the real device implements (the talker
    batch's TalkerRunner, the vocalizer's graphed decoder): it subclasses nothing of the pipelines and
    imports nothing private, so no host rule of the real path can be skipped or overridden on it.
    The checker is shown to catch both on a snippet."""
    for path in sorted((REPO / "engines" / "virtual").glob("*.py")):
        assert not faked_parts(path.read_text()), (path.name, faked_parts(path.read_text()))
    patched = ("from engines.pipelines.talker.batch import UtteranceBatch\n"
               "from engines.pipelines.vocoder import Vocalizer, _Stream\n"
               "class Fake(UtteranceBatch): pass\n")
    assert len(faked_parts(patched)) == 2


def test_every_committed_table_loads_and_a_malformed_one_is_refused_by_name(tmp_path):
    tables = sorted((REPO / "benchmarks" / "costs").glob("*.json"))
    assert tables, "benchmarks/costs holds no cost table"
    for path in tables:
        CostTable.load(path)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**TABLE, "decode_step": {"rows": [1, 4], "kv_blocks": [1, 8], "ms": [[1.0]]}}))
    with pytest.raises(ValueError, match="bad.json"):
        CostTable.load(bad)


def test_graphed_ops_queue_behind_the_stream_and_eager_ones_hold_the_host():
    now = [0.0]
    clock = DeviceClock(now=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    first = clock.graphed(10.0)
    second = clock.graphed(5.0)  # queued behind the first: the host does not wait
    assert (now[0], first.at, second.at) == (0.0, 0.010, pytest.approx(0.015))
    assert not second.query()
    clock.eager(8.0)  # launch bound: the host is busy 8 ms, the stream's backlog drains meanwhile
    assert now[0] == pytest.approx(0.008) and clock.free_at == pytest.approx(0.015)
    second.synchronize()  # a host read waits for the op's end
    assert now[0] == pytest.approx(0.015) and second.query()
    clock.blocking(20.0)  # a capture: after the stream drained, host and device together
    assert now[0] == pytest.approx(0.035) and clock.busy_s == pytest.approx(0.035)


@pytest.fixture(scope="module")
def virtual_engine(table_path):
    engine = build_engine(EngineConfig().updated(checkpoint=str(PROMPT_SIDE), max_slots=4,
                                                 virtual=VirtualDeviceConfig(str(table_path))))
    engine.start()
    yield engine
    engine.stop()


async def speak(url: str, text: str, config: dict) -> tuple[bytes, list[dict]]:
    async with websockets.connect(url) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        await ws.send(json.dumps({"type": "session.config", **config}))
        await ws.send(json.dumps({"type": "input.text", "text": text}))
        await ws.send(json.dumps({"type": "input.done"}))
        read = await read_until_session_done(ws, timeout_s=30)
    return read.audio, read.events


async def test_a_served_run_streams_each_utterance_to_its_frame_budget_at_the_tables_pace(virtual_engine, tmp_path):
    live = await start_server(virtual_engine, tmp_path / "data")
    try:
        async with aiohttp.ClientSession() as http, http.get(live.url + "/v1/models") as response:
            assert "virtual test GPU" in (await response.json())["data"][0]["device"]
        captures = virtual_engine.virtual.stats()["talker_step_captures_after_start"]
        t0 = time.monotonic()
        results = await asyncio.gather(
            speak(live.ws_url, "Hello there.", {}), speak(live.ws_url, "A second stream.", {}),
            # 299 frames (its text's budget is larger) + its prompt: over 20 KV blocks, a bucket (32)
            # that neither the start nor the warm-up captured
            speak(live.ws_url, LONG, {"max_new_tokens": 300}))
        wall = time.monotonic() - t0
    finally:
        await live.stop()
    frames = [len(audio) // (2 * SAMPLES_PER_FRAME) for audio, _ in results]
    assert frames == [75, 75, 299]  # EOS never wins: max_new_tokens - 1 frames (the checkpoint's 76, then 300)
    assert all(len(audio) % (2 * SAMPLES_PER_FRAME) == 0 for audio, _ in results)
    assert all(e["type"] != "error" for _, events in results for e in events)
    assert wall >= 299 * min(min(row) for row in DECODE_MS) / 1e3  # every decode step waited its cost
    assert virtual_engine.virtual.stats()["talker_step_captures_after_start"] > captures


async def test_the_real_paths_row_ending_rules_hold_on_the_virtual_device(virtual_engine, tmp_path):
    """The virtual device is a runner under the real talker batch, so the host rules it once
    skipped hold on it: a live utterance (a /v1/stream session's text is live) ends at its text's
    frame budget once its text is complete (it ran to max_new_tokens - 1 before), and a greedy row,
    whose code 0 repeats one id on this device (fixed logits), is ended by the runaway guard after
    LOOP_WINDOW frames instead of babbling to its limit."""
    from engines.pipelines.talker.budget import frame_budget
    from engines.pipelines.talker.guard import LOOP_WINDOW

    prompt = virtual_engine.pipeline.source.prompt
    short, looping = "Hello there.", "This sentence is long enough for the guard to see it loop."
    budget = frame_budget(prompt.text_tokens(SynthesisRequest(id="t", text=short)))
    assert budget < 299 and frame_budget(prompt.text_tokens(SynthesisRequest(id="t", text=looping))) > 299
    live = await start_server(virtual_engine, tmp_path / "data")
    try:
        (short_audio, short_events), (loop_audio, loop_events), (sampled_audio, _) = await asyncio.gather(
            speak(live.ws_url, short, {"max_new_tokens": 300}),
            speak(live.ws_url, looping, {"max_new_tokens": 300, "temperature": 0}),
            speak(live.ws_url, looping, {"max_new_tokens": 300, "seed": 7}))
    finally:
        await live.stop()

    def done(events):
        return next(e for e in events if e["type"] == "audio.done")

    assert len(short_audio) // (2 * SAMPLES_PER_FRAME) == budget
    assert done(short_events).get("truncated") == "budget"
    assert len(loop_audio) // (2 * SAMPLES_PER_FRAME) == LOOP_WINDOW
    assert done(loop_events).get("truncated") == "loop"
    assert len(sampled_audio) // (2 * SAMPLES_PER_FRAME) == 299, "sampled codes never loop: to max_new_tokens - 1"


def test_with_an_eos_length_every_utterance_ends_there(table_path):
    engine = build_engine(EngineConfig().updated(checkpoint=str(PROMPT_SIDE), max_slots=2, warmup=False,
                                                 virtual=VirtualDeviceConfig(str(table_path), eos_frames=10)))
    engine.start()
    try:
        done, samples = threading.Event(), []

        def deliver(chunk):
            samples.append(chunk.pcm.size)
            if chunk.is_final:
                assert chunk.error is None
                done.set()

        engine.submit(SynthesisRequest(id="eos", text="Hello there.", voice="vivian"), deliver)
        assert done.wait(30)
    finally:
        engine.stop()
    assert sum(samples) == 10 * SAMPLES_PER_FRAME


@pytest.mark.parametrize("graph_positions", [0, 1024])
def test_a_graphed_prefill_is_queued_on_the_stream_an_eager_one_holds_the_host(graph_positions):
    """Where the table measured the prefill through CUDA graphs (run 7's H100), a prefill call that
    fits a graphed bucket is a replay queued on the stream behind the work in flight, and the host
    is free meanwhile; an eager call (past the buckets, or a table without them) is launch bound: the
    host is busy launching it, overlapping the stream's backlog. Either way the new row is
    prefilled and its first frame made in the same tick."""
    from engines.pipelines.base import StepPlan
    from engines.virtual.device import VirtualDevice
    from engines.virtual.talker import ADMIT_MS

    now = [0.0]
    clock = DeviceClock(now=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    table = CostTable.model_validate({**TABLE, "prefill_graph_positions": graph_positions})
    device = VirtualDevice(table, clock)
    source = device.talker_source(device.talker_bundle(PROMPT_SIDE), max_slots=2)
    source.runner.graphs.capture_all()  # as the engine does at start
    source.admit(SynthesisRequest(id="a", text="Hello there.", voice="vivian"))
    width = source.capacity().prefill_waiting[0]
    prefill_ms, backlog_ms = table.prefill_ms(1, width), 50.0
    clock.graphed(backlog_ms)  # another stream's step still running
    frames = source.tick(StepPlan(prefill=(width,)))  # the prefill, then the first decode step
    assert [f.request_id for f in frames] == ["a"]
    prefill_end = backlog_ms + prefill_ms if graph_positions else max(backlog_ms, ADMIT_MS + prefill_ms)
    assert now[0] == pytest.approx(prefill_end / 1e3)  # the host read the prefill's ids when it ended
    step_ms = table.decode_step_ms(1, source.cache.row_blocks(0))
    assert clock.free_at == pytest.approx((prefill_end + step_ms) / 1e3)  # the first frame's step behind it
