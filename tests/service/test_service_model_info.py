"""What the server says about the loaded model, wherever audio comes out: /v1/models names
the model, its release and the fields it uses; random weights are named on every audio
response (X-Streamvox-Random-Weights) and in the WebSocket's session.created; on CPU the
start-up warm-up's real-time factor is logged and reported. Real servers, real clients."""

from __future__ import annotations

import asyncio
import io
import json

import time

import aiohttp
import numpy as np
import soundfile as sf
import websockets
from conftest import ServerProcess, wait_until
from engine_helpers import run_requests

from clients.client import StreamvoxClient
from engines.contract import SynthesisRequest
from engines.hardware.cpu_features import has_native_bf16
from engines.models.quantize import CPU_DEFAULT
from tests.oracle import talker_fixtures as fx

HEADER = "X-Streamvox-Random-Weights"


async def test_random_dit_is_named_on_every_audio_response(server):
    async with aiohttp.ClientSession() as http:
        async with http.get(server.url + "/v1/models") as response:
            model = (await response.json())["data"][0]
        assert model["release"] == "dit" and model["display_name"] == "streamvox DiT, preset tiny"
        assert model["random_weights"] and "dit" in model["random_components"]
        assert model["controls"] == {"voice": True, "instructions": False, "voice_cloning": False, "sampling": False,
                                     "language": False, "steps": True, "guidance_scale": True}
        # measured at start on CPU: wall seconds per audio second, and the same in words
        assert model["expected_rtf"] > 0 and "real time" in model["speed"]
        expected = ",".join(model["random_components"])

        body = {"input": "Whole file.", "response_format": "wav", "stream": False}
        async with http.post(server.url + "/v1/audio/speech", json=body) as response:
            assert response.status == 200 and response.headers[HEADER] == expected
            audio, rate = sf.read(io.BytesIO(await response.read()))
            assert rate == 24000 and audio.size > 0
        body = {"input": "Streamed.", "response_format": "pcm", "stream_format": "sse"}
        async with http.post(server.url + "/v1/audio/speech", json=body) as response:
            assert response.status == 200 and response.headers[HEADER] == expected
            await response.read()
        async with http.post(server.url + "/v1/audio/speech", json={"input": ""}) as response:
            assert response.status == 400 and HEADER not in response.headers  # errors carry no audio
    async with StreamvoxClient(server.url) as client:
        job = await client.wait_job((await client.submit_job("A job."))["id"])
        async with aiohttp.ClientSession() as http:
            async with http.get(server.url + job["audio_url"]) as response:
                assert response.status == 200 and response.headers[HEADER] == expected
    async with websockets.connect(server.ws_url) as ws:
        assert json.loads(await ws.recv())["random_components"] == expected.split(",")
        assert ws.response.headers[HEADER] == expected  # the handshake says it too
    async with websockets.connect(server.url.replace("http", "ws") + "/v1/audio/speech/stream") as ws:
        assert ws.response.headers[HEADER] == expected  # vllm-omni's dialect sends no session.created


async def test_talker_checkpoint_on_cpu_logs_its_speed_and_reports_its_release(tmp_path):
    checkpoint = fx.checkpoint_dir("cv_proj")  # missing fixtures: fail under CI=true, else skip
    speakers = json.loads((checkpoint / "config.json").read_text())["talker_config"]["spk_id"]
    server = ServerProcess(tmp_path / "data", "--checkpoint", str(checkpoint))
    try:
        url = await asyncio.to_thread(server.wait_listening)
        speed_lines = [line for line in server.lines if "expected speed on this machine" in line]
        assert len(speed_lines) == 1 and "real-time factor" in speed_lines[0], server.log[-3000:]
        # the CPU default precision (docs/QUANTIZATION.md), named where the speed is
        assert f"quantize={CPU_DEFAULT}" in speed_lines[0]
        # and the codec decoder's: bf16 on a CPU with native bf16 (docs/QUANTIZATION.md, the codec)
        codec = "bfloat16" if has_native_bf16() else "float32"
        assert f"codec {codec}" in speed_lines[0]
        assert any("engine ready:" in line and f"quantize={CPU_DEFAULT} codec={codec}" in line for line in server.lines)
        async with aiohttp.ClientSession() as http:

            async def ready() -> bool:
                async with http.get(url + "/readyz") as response:
                    return response.status == 200

            await wait_until(ready, timeout_s=60)
            async with http.get(url + "/v1/models") as response:
                model = (await response.json())["data"][0]
            assert model["release"] == "CustomVoice" and model["display_name"] == "cv_proj"
            assert sorted(model["voices"]) == sorted(speakers)
            assert model["controls"]["sampling"] and model["controls"]["language"]
            assert not model["controls"]["steps"] and not model["controls"]["guidance_scale"]
            assert model["expected_rtf"] > 0 and f"{model['expected_rtf']:.2f}" in speed_lines[0]
            assert model["quantize"] == CPU_DEFAULT and model["codec_dtype"] == codec
            assert not model["random_weights"]
            body = {"input": "Hello.", "response_format": "pcm", "voice": sorted(speakers)[0]}
            async with http.post(url + "/v1/audio/speech", json=body) as response:
                assert response.status == 200 and HEADER not in response.headers  # a checkpoint's own weights
                pcm = np.frombuffer(await response.read(), dtype="<i2")
            assert pcm.size > 0 and np.abs(pcm).max() > 0  # audio, not silence
    finally:
        server.kill()


async def test_the_speed_line_leaves_the_cold_first_run_out(tmp_path):
    """The speed line (/v1/models ``expected_rtf`` and ``speed``) is measured on warm runs after the
    start's first, cold one. The first request is made 6 s slower here (a fault hook sleeping in
    it: a cold start exaggerated well past any load on this machine), so a line measured on it
    would say at least 1.5 (6 s over a 3.6 s sentence): the stated figure must not. How close the
    line comes to warm requests sent afterwards is a measurement, in benchmarks/RESULTS.md."""
    from conftest import start_server

    from engines.build import build_engine
    from engines.config import EngineConfig
    from engines.core.engine import Engine

    delayed: list[str] = []

    def cold_first(request_id: str, stage: str) -> None:
        if stage == "admit" and not delayed:
            delayed.append(request_id)
            time.sleep(6.0)

    engine = build_engine(EngineConfig.for_tests(), cold_first)
    engine.start()
    live = await start_server(engine, tmp_path / "data")
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(live.url + "/v1/models") as response:
                model = (await response.json())["data"][0]
            async with http.post(live.url + "/v1/audio/speech",
                                 json={"input": Engine.SPEED_TEXT, "response_format": "pcm"}) as response:
                audio_s = len(await response.read()) / 2 / 24000
    finally:
        await live.stop()
        engine.stop()
    assert delayed and delayed[0].startswith("warmup-"), "the hook slowed the start's first request"
    stated = model["expected_rtf"]
    assert 0 < stated < 6.0 / audio_s, (stated, audio_s)
    faster = f"{1 / stated:.1f}x faster" if stated < 1 else f"{stated:.1f}x slower"
    assert model["speed"] == f"real-time factor {stated:.2f} ({faster} than real time)"


def test_the_speed_line_waits_for_the_steady_state():
    """A run right after the warm-up that is still slow (here the first measured run, made 6 s
    slower by a fault hook: past any real time) is not the stated speed: the line measures until
    two runs in a row agree."""
    from engines.build import build_engine
    from engines.config import EngineConfig

    slowed: list[str] = []

    def slow_first_two(request_id: str, stage: str) -> None:
        if stage == "admit" and request_id not in slowed and len(slowed) < 2:
            slowed.append(request_id)
            time.sleep(6.0 if len(slowed) == 2 else 0.0)  # (a DiT request is admitted once per chunk)

    engine = build_engine(EngineConfig.for_tests(), slow_first_two)
    engine.start()
    try:
        collected = run_requests(engine, [SynthesisRequest(id="after", text=engine.SPEED_TEXT,
                                                           voice=engine.capabilities.voices[0])])[0]
    finally:
        engine.stop()
    assert [r.startswith("warmup-") for r in slowed] == [True, True]
    audio_s = collected.pcm.size / 24000
    assert 0 < engine.info.warmup_rtf < 6.0 / audio_s, (engine.info.warmup_rtf, audio_s)
