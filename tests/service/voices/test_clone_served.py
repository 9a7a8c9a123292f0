"""Voice cloning and voice design served: real servers on 127.0.0.1, real aiohttp clients,
audio read back as int16 and compared with the official qwen-tts output (oracle fixtures,
``bash scripts/oracle-clone-fixtures.sh``).

Greedy PCM must equal the official decode within int16 rounding (2 LSB: the official float
waveform and ours differ by ~2e-6 before rounding). In-context cloning: the official output is
decode(reference + generated codes) with the reference's share of the samples cut off,
int(T_ref / T_all * samples), which float rounding can put one sample early; our stream starts
exactly at T_ref * 1920, so the comparison aligns the ends.
"""

from __future__ import annotations

import base64
import io
import json

import aiohttp
import numpy as np
import pytest
import soundfile as sf
from aiohttp import web
from clone_helpers import LSB, assert_matches_official, voice_form, wav_bytes  # noqa: F401
from conftest import finished_job, same_pcm16, start_server

from engines.build import build_engine
from engines.config import EngineConfig
from tests.oracle import clone_fixtures as fx

QWEN_BASE = "Qwen/Qwen3-TTS-12Hz-0.6B-Base"


def data_url(samples: np.ndarray, rate: int = 24000) -> str:
    return "data:audio/wav;base64," + base64.b64encode(wav_bytes(samples, rate)).decode()


def pcm16(body: bytes) -> np.ndarray:
    return np.frombuffer(body, dtype="<i2").astype(np.float32) / 32768


@pytest.fixture(scope="module")
def design_engine():
    engine = build_engine(EngineConfig.for_tests(checkpoint=str(fx.checkpoint_dir("design")), max_slots=2))
    engine.start()
    yield engine
    engine.stop()


async def speak(http, url: str, body: dict) -> tuple[int, bytes]:
    # greedy (temperature 0): the official references are greedy; the talker samples by default
    async with http.post(url + "/v1/audio/speech", json={"response_format": "pcm", "temperature": 0, **body}) as r:
        return r.status, await r.read()


CLONE_CASES = ["icl_a_stream", "icl_a_nonstream", "icl_b_stream_long", "xvec_a_stream", "xvec_b_nonstream"]


async def test_served_cloning_equals_official_generate_voice_clone(base_engine, tmp_path):
    refs, cases = fx.references("base"), fx.info("base")["cases"]
    server = await start_server(base_engine, tmp_path / "data")
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(server.url + "/v1/models") as r:
                model = (await r.json())["data"][0]
            assert (model["task_types"], model["voice_cloning"], model["instructions"]) == (["Base"], True, False)
            for case in CLONE_CASES:
                c = cases[case]
                body = {"model": QWEN_BASE, "voice": "vivian", "input": c["text"], "language": c["language"],
                        "task_type": "Base", "ref_audio": data_url(refs[f"ref/{c['ref']}/wav"].numpy()),
                        "ref_text": c["ref_text"], "x_vector_only_mode": c["x_vector_only_mode"]}
                if c["non_streaming_mode"] is not None:
                    body["non_streaming_mode"] = c["non_streaming_mode"]
                status, audio = await speak(http, server.url, body)
                assert status == 200, audio[:300]
                assert_matches_official(pcm16(audio), refs[f"case/{case}/wav"].numpy())
    finally:
        await server.stop()


async def test_served_voice_design_equals_official(design_engine, tmp_path):
    refs, cases = fx.references("design"), fx.info("design")["cases"]
    server = await start_server(design_engine, tmp_path / "data")
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(server.url + "/v1/models") as r:
                model = (await r.json())["data"][0]
            assert (model["task_types"], model["voice_cloning"], model["instructions"]) == (["VoiceDesign"], False,
                                                                                           True)
            for case in ("design_en", "design_auto_stream"):
                c = cases[case]
                body = {"model": "Qwen/Qwen3-TTS-12Hz-1.7B-VoiceDesign", "input": c["text"],
                        "language": c["language"], "instructions": c["instruct"]}
                if c["non_streaming_mode"] is not None:
                    body["non_streaming_mode"] = c["non_streaming_mode"]
                status, audio = await speak(http, server.url, body)
                assert status == 200, audio[:300]
                assert_matches_official(pcm16(audio), refs[f"case/{case}/wav"].numpy())
            status, body = await speak(http, server.url, {"input": "Hi."})
            error = json.loads(body)["error"]
            assert (status, error["code"]) == (400, "invalid_field") and error["message"].startswith("instructions:")
    finally:
        await server.stop()


async def test_bad_reference_input_is_a_clear_4xx_and_nothing_breaks(base_engine, tmp_path):
    refs = fx.references("base")
    good = refs["ref/a/wav"].numpy()  # 1.7 s
    server = await start_server(base_engine, tmp_path / "data", max_ref_audio_seconds=1.65, max_ref_audio_mb=0.2)
    rng = np.random.default_rng(0)
    bad = {
        "not decodable": ("data:audio/wav;base64," + base64.b64encode(b"RIFF-not-really-a-wave" * 40).decode(),
                          400, "invalid_audio", "not decodable"),
        "empty": ("", 400, "invalid_audio", "empty"),
        "silent": (data_url(np.zeros(28800, dtype=np.float32)), 400, "invalid_audio", "silent"),
        "too short": (data_url(good[:12000]), 400, "invalid_audio", "at least 1 s"),
        "too long": (data_url(good), 400, "invalid_audio", "at most 1.65 s"),
        "too large": (base64.b64encode(rng.bytes(300_000)).decode(), 413, "ref_audio_too_large", "MiB"),
        "remote url": ("https://example.com/voice.wav", 400, "invalid_field", "not fetched"),
        "bad base64": ("data:audio/wav;base64,@@@@", 400, "invalid_field", "base64"),
    }
    try:
        async with aiohttp.ClientSession() as http:
            for what, (ref_audio, status, code, words) in bad.items():
                got, body = await speak(http, server.url, {"input": "Hi.", "ref_audio": ref_audio,
                                                           "ref_text": "Hello world, this is a test."})
                error = json.loads(body)["error"]
                assert (got, error["code"]) == (status, code), (what, body)
                assert error["message"].startswith(("ref_audio:", "audio_sample:")) and words in error["message"], what
            others = {
                "no reference": ({"input": "Hi."}, "ref_audio:"),
                "unknown saved voice": ({"input": "Hi.", "voice": "nobody"}, "voice:"),
                "no ref_text": ({"input": "Hi.", "ref_audio": data_url(good[:30000])}, "ref_text:"),
                "instructions on Base": ({"input": "Hi.", "ref_audio": data_url(good[:30000]), "x_vector_only_mode": True,
                                          "instructions": "Whisper."}, "instructions:"),
                "wrong task": ({"input": "Hi.", "task_type": "VoiceDesign", "instructions": "Calm."}, "task_type:"),
            }
            for what, (body, prefix) in others.items():
                got, raw = await speak(http, server.url, body)
                error = json.loads(raw)["error"]
                assert (got, error["code"]) == (400, "invalid_field"), (what, raw)
                assert error["message"].startswith(prefix), (what, error)
            # the server still clones (a 1.25 s reference, x-vector only: no transcript needed)
            got, audio = await speak(http, server.url, {"input": "Hi.", "ref_audio": data_url(good[:30000]),
                                                        "x_vector_only_mode": True})
            assert got == 200 and len(audio) > 0
    finally:
        await server.stop()


async def test_saved_voice_upload_speech_restart_delete(base_engine, tmp_path):
    refs, c = fx.references("base"), fx.info("base")["cases"]["icl_a_stream"]
    ref = refs["ref/a/wav"].numpy()
    data_dir = tmp_path / "data"

    def form(name: str, audio: bytes, ref_text: str | None = c["ref_text"]) -> aiohttp.FormData:
        return voice_form(name, audio, ref_text, consent="I am the speaker and I agree.")

    server = await start_server(base_engine, data_dir)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(server.url + "/v1/audio/voices", data=form("alice", wav_bytes(ref))) as r:
                assert r.status == 201, await r.text()
                saved = (await r.json())["voice"]
            assert saved["name"] == "alice" and saved["in_context"] and saved["reference_frames"] == 22
            async with http.post(server.url + "/v1/audio/voices", data=form("alice", wav_bytes(ref))) as r:
                assert (r.status, (await r.json())["error"]["code"]) == (409, "voice_exists")
            async with http.post(server.url + "/v1/audio/voices", data=form("../x", wav_bytes(ref))) as r:
                assert r.status == 400
            async with http.post(server.url + "/v1/audio/voices", data=form("bob", b"nonsense" * 100)) as r:
                assert r.status == 400 and (await r.json())["error"]["message"].startswith("audio_sample:")
            async with http.get(server.url + "/v1/audio/voices") as r:
                listed = await r.json()
            assert [v["name"] for v in listed["uploaded_voices"]] == ["alice"] and listed["voices"] == []
            status, by_name = await speak(http, server.url, {"input": c["text"], "voice": "alice",
                                                             "language": c["language"]})
            assert status == 200, by_name[:300]
            assert_matches_official(pcm16(by_name), refs["case/icl_a_stream/wav"].numpy())
            async with http.get(server.url + "/v1/voices") as r:
                assert r.status == 200
        assert sorted(p.name for p in (data_dir / "voices").iterdir()) == ["alice.json", "alice.safetensors"]
    finally:
        await server.stop()

    server = await start_server(base_engine, data_dir)  # a restart: the voice is still there
    try:
        async with aiohttp.ClientSession() as http:
            status, again = await speak(http, server.url, {"input": c["text"], "voice": "alice",
                                                           "language": c["language"]})
            assert status == 200 and same_pcm16(again, by_name)
            async with http.delete(server.url + "/v1/audio/voices/alice") as r:
                assert r.status == 200
            async with http.delete(server.url + "/v1/audio/voices/alice") as r:
                assert (r.status, (await r.json())["error"]["code"]) == (404, "voice_not_found")
            status, raw = await speak(http, server.url, {"input": "Hi.", "voice": "alice"})
            assert status == 400 and json.loads(raw)["error"]["message"].startswith("voice:")
    finally:
        await server.stop()


async def test_speed_stretches_talker_audio_keeping_its_pitch(base_engine, tmp_path):
    """``speed`` on the talker: FFmpeg's atempo (PyAV) on the streamed audio. speed 2 -> half as
    long within 10 %, 0.5 -> twice as long; the dominant frequency stays (time-scale, not resampling)."""
    ref = fx.references("base")["ref/b/wav"].numpy()
    text = fx.info("base")["cases"]["icl_b_stream_long"]["text"]
    server = await start_server(base_engine, tmp_path / "data")

    def dominant_hz(x: np.ndarray) -> float:
        spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x))))
        return float(np.fft.rfftfreq(len(x), 1 / 24000)[spectrum.argmax()])

    try:
        async with aiohttp.ClientSession() as http:
            lengths, pitch = {}, {}
            for speed in (1.0, 2.0, 0.5):
                for stream_format in (None, "audio"):  # whole file and streamed
                    body = {"input": text, "ref_audio": data_url(ref), "x_vector_only_mode": True, "speed": speed}
                    if stream_format:
                        body["stream_format"] = stream_format
                    status, audio = await speak(http, server.url, body)
                    assert status == 200, audio[:200]
                    pcm = pcm16(audio)
                    lengths.setdefault(speed, len(pcm))
                    assert len(pcm) == lengths[speed]  # streamed == whole file
                    pitch[speed] = dominant_hz(pcm)
            assert abs(lengths[2.0] / lengths[1.0] - 0.5) < 0.05
            assert abs(lengths[0.5] / lengths[1.0] - 2.0) < 0.1
            assert abs(pitch[2.0] - pitch[1.0]) <= 0.1 * pitch[1.0] + 10
    finally:
        await server.stop()


async def test_a_job_clones_a_saved_voice(base_engine, tmp_path):
    """REST jobs name a saved voice (the features stored at upload; nothing to re-send): the
    job's WAV equals the official generate_voice_clone within int16 rounding. A Base job naming
    no saved voice is a 400 at submission, not a failed job later."""
    refs, c = fx.references("base"), fx.info("base")["cases"]["icl_a_stream"]
    server = await start_server(base_engine, tmp_path / "data")
    try:
        async with aiohttp.ClientSession() as http:
            form = voice_form("dora", wav_bytes(refs["ref/a/wav"].numpy()), c["ref_text"])
            async with http.post(server.url + "/v1/audio/voices", data=form) as r:
                assert r.status == 201, await r.text()
            async with http.post(server.url + "/v1/jobs", json={"input": "Hi.", "voice": "nobody"}) as r:
                assert r.status == 400 and (await r.json())["error"]["message"].startswith("voice:")
            body = {"input": c["text"], "voice": "dora", "language": c["language"], "temperature": 0,
                    "response_format": "wav"}
            async with http.post(server.url + "/v1/jobs", json=body) as r:
                assert r.status == 202, await r.text()
                job = await r.json()
            job = await finished_job(http, server.url + f"/v1/jobs/{job['id']}")
            assert job["status"] == "succeeded", job
            async with http.get(server.url + job["audio_url"]) as r:
                audio, rate = sf.read(io.BytesIO(await r.read()), dtype="float32")
        assert rate == 24000
        assert_matches_official(audio, refs["case/icl_a_stream/wav"].numpy())
    finally:
        await server.stop()


async def test_a_voice_saved_through_one_replica_clones_on_another_with_postgres(base_engine, tmp_path, pg_url):
    """With --jobs-db saved voices live in the shared database: uploaded through
    replica A (its own data dir), spoken through replica B identically to the official
    clone, listed by both, deleted through B and gone for A. Nothing lands in either data dir."""
    refs, c = fx.references("base"), fx.info("base")["cases"]["icl_a_stream"]
    form = voice_form("shared-alice", wav_bytes(refs["ref/a/wav"].numpy()), c["ref_text"])
    a = await start_server(base_engine, tmp_path / "a", jobs_db=pg_url)
    b = await start_server(base_engine, tmp_path / "b", jobs_db=pg_url)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(a.url + "/v1/audio/voices", data=form) as r:
                assert r.status == 201, await r.text()
            for replica in (a, b):
                async with http.get(replica.url + "/v1/audio/voices") as r:
                    assert [v["name"] for v in (await r.json())["uploaded_voices"]] == ["shared-alice"]
            status, on_b = await speak(http, b.url, {"input": c["text"], "voice": "shared-alice",
                                                     "language": c["language"]})
            assert status == 200, on_b[:300]
            assert_matches_official(pcm16(on_b), refs["case/icl_a_stream/wav"].numpy())
            async with http.delete(b.url + "/v1/audio/voices/shared-alice") as r:
                assert r.status == 200
            status, raw = await speak(http, a.url, {"input": "Hi.", "voice": "shared-alice"})
            assert status == 400 and json.loads(raw)["error"]["message"].startswith("voice:")
        assert not (tmp_path / "a" / "voices").exists() and not (tmp_path / "b" / "voices").exists()
    finally:
        await a.stop()
        await b.stop()


async def ws_speak(url: str, path: str, configs: list[dict], text: str) -> tuple[list[dict], bytes]:
    """``session.config`` messages, then one utterance over a WebSocket dialect: the JSON
    events and the PCM16 bytes."""
    events, pcm = [], bytearray()
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(url + path, max_msg_size=0) as ws:
            if path == "/v1/stream":
                assert (await ws.receive_json(timeout=30))["type"] == "session.created"
            for config in configs:
                await ws.send_json({"type": "session.config", **config})
            await ws.send_json({"type": "input.text", "text": text})
            await ws.send_json({"type": "input.done"})
            while not events or events[-1]["type"] != "session.done":  # errors here are not fatal
                message = await ws.receive(timeout=120)
                if message.type == aiohttp.WSMsgType.BINARY:
                    pcm += message.data
                else:
                    assert message.type == aiohttp.WSMsgType.TEXT, message
                    events.append(json.loads(message.data))
    return events, bytes(pcm)


@pytest.mark.parametrize("path", ["/v1/stream", "/v1/audio/speech/stream"])
async def test_websocket_session_config_clones_inline_ref_audio_like_the_official_code(base_engine, tmp_path, path):
    """Both WebSocket dialects take vllm-omni's ref_audio / ref_text / x_vector_only_mode in
    session.config (the reference is decoded and encoded once per config) and speak as the
    official clone: in-context (sentence mode) and x-vector-only (live text on /v1/stream).
    The official references are float WAV, larger than the default 128 KiB message: the
    server here allows 1 MiB messages."""
    refs, cases = fx.references("base"), fx.info("base")["cases"]
    server = await start_server(base_engine, tmp_path / "data", max_ws_message_bytes=1 << 20)
    try:
        url = server.url.replace("http", "ws")
        for case in ("icl_a_stream", "xvec_a_stream"):
            c = cases[case]
            config = {"ref_audio": data_url(refs[f"ref/{c['ref']}/wav"].numpy()), "ref_text": c["ref_text"],
                      "x_vector_only_mode": c["x_vector_only_mode"], "language": c["language"], "temperature": 0}
            if path != "/v1/stream":
                config["stream_audio"] = True  # vllm-omni: raw PCM as generated
            events, pcm = await ws_speak(url, path, [config], c["text"])
            assert not [e for e in events if e["type"] == "error"], events
            assert_matches_official(pcm16(pcm), refs[f"case/{case}/wav"].numpy())
        # a bad reference is a non-fatal error naming the field; the session goes on with the next config
        silent = {"ref_audio": data_url(np.zeros(48000, dtype=np.float32)), "x_vector_only_mode": True}
        events, pcm = await ws_speak(url, path, [silent, config], c["text"])
        assert events[0]["type"] == "error" and events[0]["message"].startswith("ref_audio:"), events
        assert [e for e in events if e["type"] == "error"] == events[:1]
        assert_matches_official(pcm16(pcm), refs[f"case/{case}/wav"].numpy())
    finally:
        await server.stop()


async def test_ref_audio_urls_are_fetched_only_under_the_allowed_prefixes(base_engine, tmp_path):
    """vllm-omni's URL references: http(s):// and file:// under --ref-audio-url-prefixes give
    the same voice as the same audio inline; everything else is a 4xx naming ref_audio, and
    nothing outside the prefixes is ever requested."""
    refs, c = fx.references("base"), fx.info("base")["cases"]["icl_a_stream"]
    ref_wav = wav_bytes(refs["ref/a/wav"].numpy())
    requested: list[str] = []

    async def serve(request: web.Request) -> web.StreamResponse:
        requested.append(request.path)
        name = request.match_info["name"]
        if name == "a.wav":
            return web.Response(body=ref_wav, content_type="audio/wav")
        if name == "big.wav":
            return web.Response(body=b"\0" * (2 << 20), content_type="audio/wav")
        if name == "moved.wav":
            raise web.HTTPFound("/voices/a.wav")
        raise web.HTTPNotFound()

    files = web.Application()
    files.router.add_get("/{folder}/{name}", serve)
    runner = web.AppRunner(files)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    origin = f"http://127.0.0.1:{runner.addresses[0][1]}"
    refs_dir = tmp_path / "refs"
    refs_dir.mkdir()
    (refs_dir / "a.wav").write_bytes(ref_wav)
    (refs_dir / "escape.wav").symlink_to("/etc/hostname")
    server = await start_server(base_engine, tmp_path / "data", max_ref_audio_mb=1.0,
                                ref_audio_url_prefixes=(f"{origin}/voices/", f"file://{refs_dir}/"))
    try:
        async with aiohttp.ClientSession() as http:
            base = {"input": c["text"], "language": c["language"], "ref_text": c["ref_text"]}
            status, inline = await speak(http, server.url, {**base, "ref_audio": data_url(refs["ref/a/wav"].numpy())})
            assert status == 200
            for url in (f"{origin}/voices/a.wav", f"file://{refs_dir}/a.wav"):
                status, fetched = await speak(http, server.url, {**base, "ref_audio": url})
                assert status == 200, fetched[:300]
                assert same_pcm16(fetched, inline)  # the same reference, the same (greedy) audio
            assert_matches_official(pcm16(inline), refs["case/icl_a_stream/wav"].numpy())
            requested.clear()
            for url, code, words in ((f"{origin}/secret/a.wav", 400, "outside the allowed prefixes"),
                                     (f"{origin}/voices/../secret/a.wav", 400, "outside the allowed prefixes"),
                                     (f"{origin.replace('127.0.0.1', 'user:pw@127.0.0.1')}/voices/a.wav", 400,
                                      "credentials"),
                                     (f"{origin}/voices/moved.wav", 400, "redirect"),
                                     (f"{origin}/voices/missing.wav", 400, "HTTP 404"),
                                     (f"{origin}/voices/big.wav", 413, "MiB"),
                                     ("file:///etc/passwd", 400, "outside the allowed prefixes"),
                                     (f"file://{refs_dir}/escape.wav", 400, "outside the allowed directories"),
                                     ("ftp://127.0.0.1/voices/a.wav", 400, "outside the allowed prefixes"),
                                     # hostile shapes: malformed, out of range, NUL, huge
                                     ("http://[", 400, "not a valid URL"),
                                     ("http://127.0.0.1:99999/voices/a.wav", 400, "not a valid URL"),
                                     (f"file://{refs_dir}/a%00.wav", 400, "not a usable file path"),
                                     (f"{origin}/voices/%00", 400, "HTTP 404"),
                                     (f"{origin}/voices/" + "x" * 200_000, 400, "")):
                status, raw = await speak(http, server.url, {**base, "ref_audio": url})
                error = json.loads(raw)["error"]
                assert status == code and error["message"].startswith("ref_audio:") and words in error["message"], \
                    (url, status, error)
            assert "/secret/a.wav" not in requested and "/voices/a.wav" not in requested  # refused before any request
            assert sorted(requested) == ["/voices/\x00", "/voices/big.wav", "/voices/missing.wav", "/voices/moved.wav"]
    finally:
        await server.stop()
        await runner.cleanup()


async def test_a_stored_voice_that_does_not_fit_the_model_is_a_400_not_a_failed_step(base_engine, tmp_path):
    """A saved voice's features come from the store (a hand-made or migrated data dir, another
    model's voice): an x-vector or reference codes of the wrong shape or range is refused when
    the request is checked, naming the voice, and the server keeps serving."""
    from service.voices.store import FileVoiceStore, SavedVoice

    data_dir = tmp_path / "data"
    store = FileVoiceStore(data_dir / "voices")
    width = base_engine.models.config.latent_dim
    groups = base_engine.models.config.num_code_groups
    await store.add(SavedVoice("wide", np.zeros(width + 3, np.float32), np.zeros((0, groups), np.int64)))
    await store.add(SavedVoice("outofrange", np.zeros(width, np.float32), np.full((4, groups), 10**6, np.int64),
                               ref_text="Hello."))
    server = await start_server(base_engine, data_dir)
    try:
        async with aiohttp.ClientSession() as http:
            for name in ("wide", "outofrange"):
                status, body = await speak(http, server.url, {"input": "Hello there.", "voice": name})
                assert status == 400, (name, status, body[:200])
                error = json.loads(body)["error"]
                assert error["code"] == "invalid_field" and "voice" in error["message"], error
            async with http.get(server.url + "/healthz") as r:
                assert r.status == 200
    finally:
        await server.stop()
