"""Time to first audio of a cloned voice: a saved voice vs inline ``ref_audio``.

    python benchmarks/bench_clone_ttfa.py [--checkpoint tests/fixtures/oracle/clone/base] [--runs 5]
        [--seconds 5] [--device cpu]

A real server on 127.0.0.1 serving a Base checkpoint (default: the random official-layout
Base fixture, ``bash scripts/oracle-clone-fixtures.sh``), an aiohttp client streaming
``POST /v1/audio/speech`` (pcm, ``stream_format: audio``), one request at a time. Variants:

* inline, new audio  - ``ref_audio`` the server has not seen: decode + speaker encoder +
                        speech-tokenizer encoder run before the prompt (the cache misses)
* inline, same audio - the same ``ref_audio`` again: features come from the content-keyed cache
                        (the body is still uploaded and decoded, and hashed)
* saved voice        - ``voice: NAME`` after ``POST /v1/audio/voices``: features read from disk

The floor is the saved voice: nothing about the reference runs per request. Prints the
device, a table (median / min ms) and ratios to the floor.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
import soundfile as sf

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # engines, service, testsupport

TEXT = "The talker predicts one frame at a time."
REF_TEXT = "Hello world, this is a test."


def reference(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 24000)) / 24000
    wav = sum(0.2 / k * np.sin(2 * np.pi * k * (140 + 30 * seed) * t) for k in range(1, 5))
    return (wav + 0.02 * rng.standard_normal(t.size)).astype(np.float32)


def wav_bytes(samples: np.ndarray) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, 24000, format="WAV", subtype="PCM_16")
    return buf.getvalue()


async def ttfa(http: aiohttp.ClientSession, url: str, body: dict) -> float:
    start = time.perf_counter()
    async with http.post(url + "/v1/audio/speech", json={"input": TEXT, "response_format": "pcm",
                                                         "stream_format": "audio", **body}) as r:
        if r.status != 200:
            raise RuntimeError(await r.text())
        async for piece in r.content.iter_any():
            if piece:
                first = time.perf_counter() - start
                break
        await r.read()
    return first


async def main(args: argparse.Namespace) -> None:
    import torch

    from engines.build import build_engine
    from engines.config import EngineConfig
    from testsupport.server import start_server

    torch.set_num_threads(max(1, torch.get_num_threads()))
    engine = build_engine(EngineConfig.for_tests(device=args.device, checkpoint=args.checkpoint, max_slots=2))
    engine.start()
    print(f"device: {engine.info.device} ({torch.get_num_threads()} threads), torch {torch.__version__}, "
          f"checkpoint {args.checkpoint}, reference {args.seconds:g} s, {args.runs} runs per variant")
    with tempfile.TemporaryDirectory() as data:
        server = await start_server(engine, Path(data))
        try:
            async with aiohttp.ClientSession() as http:
                same = "data:audio/wav;base64," + base64.b64encode(wav_bytes(reference(args.seconds, 0))).decode()
                form = aiohttp.FormData()
                form.add_field("name", "bench")
                form.add_field("ref_text", REF_TEXT)
                form.add_field("audio_sample", wav_bytes(reference(args.seconds, 0)), filename="ref.wav")
                async with http.post(server.url + "/v1/audio/voices", data=form) as r:
                    assert r.status == 201, await r.text()
                await ttfa(http, server.url, {"voice": "bench"})  # warm
                times: dict[str, list[float]] = {"inline, new audio": [], "inline, same audio": [],
                                                 "saved voice": []}
                for i in range(args.runs):
                    fresh = wav_bytes(reference(args.seconds, 100 + i))
                    times["inline, new audio"].append(await ttfa(http, server.url, {
                        "ref_audio": "data:audio/wav;base64," + base64.b64encode(fresh).decode(),
                        "ref_text": REF_TEXT}))
                    times["inline, same audio"].append(await ttfa(http, server.url, {"ref_audio": same,
                                                                                    "ref_text": REF_TEXT}))
                    times["saved voice"].append(await ttfa(http, server.url, {"voice": "bench"}))
        finally:
            await server.stop()
            engine.stop()
    floor = statistics.median(times["saved voice"])
    print("\n| variant | TTFA median ms | min ms | / saved voice |")
    print("|---|---|---|---|")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"| {name} | {med * 1000:.1f} | {min(values) * 1000:.1f} | {med / floor:.2f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default=str(REPO / "tests/fixtures/oracle/clone/base"))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--device", default="cpu")
    asyncio.run(main(parser.parse_args()))
