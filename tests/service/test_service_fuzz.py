"""Property-based fuzzing (hypothesis) of REST bodies and WebSocket message sequences
against a real `streamvox serve` process: valid requests must produce correct audio,
hostile ones a documented 4xx / WS error; never a 5xx, never a hung session."""

from __future__ import annotations

import io
import json
import urllib.error
import urllib.request

import pytest
import soundfile as sf
from conftest import serving
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from websockets.sync.client import connect

RECOVERABLE = {"invalid_json", "unknown_type", "invalid_field", "binary_not_supported", "text_too_long",
               "too_much_work"}
MAX_CHARS = 60
SESSION_TIMEOUT_S = 120


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def live_url(request, tmp_path_factory):
    """The server under fuzz, on each job store (a hostile job must not break either).
    No job workers: accepted jobs are stored, never run (the fuzz is about what gets in)."""
    env = {"STREAMVOX_JOBS_DB": request.getfixturevalue("postgres").create_database()} \
        if request.param == "postgresql" else {}
    with serving(tmp_path_factory.mktemp("fuzz"), "--max-input-chars", str(MAX_CHARS), "--job-workers", "0",
                 env=env) as server:
        yield server.url


short_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30)
sentences = st.lists(st.sampled_from(["Hello there.", "How are you?", "Dr. Who is 3.5 m tall.", "Fine!", "Ok",
                                      "雨です。", "Wait..."]), min_size=1, max_size=2).map(" ".join)
any_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | short_text,
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(short_text, inner, max_size=3),
                        max_leaves=6)
field_values = {
    "input": st.one_of(sentences, short_text, st.text(min_size=MAX_CHARS + 1, max_size=MAX_CHARS + 5), any_json),
    "voice": st.one_of(st.sampled_from(["default", "alloy", "nova", "ALLOY", "nobody", ""]), any_json),
    "response_format": st.one_of(st.sampled_from(["pcm", "wav", "flac", "ulaw", "aac", "WAV"]), any_json),
    "stream_format": st.one_of(st.sampled_from(["audio", "sse", "video"]), any_json),
    "speed": st.one_of(st.floats(allow_nan=True), st.sampled_from([0.25, 1.0, 4.0, 4.01]), any_json),
    "seed": st.one_of(st.integers(min_value=-5, max_value=2**64), any_json),
    "steps": st.one_of(st.integers(min_value=-1, max_value=70), any_json),
    "guidance_scale": st.one_of(st.floats(), any_json),
    "model": st.one_of(st.just("streamvox"), short_text),
}
speech_bodies = st.fixed_dictionaries({"input": field_values["input"]},
                                      optional={k: v for k, v in field_values.items() if k != "input"})
raw_bodies = st.one_of(st.binary(max_size=64), any_json.map(lambda v: json.dumps(v).encode()))


def post(url: str, body: bytes) -> tuple[int, bytes, dict]:
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=SESSION_TIMEOUT_S) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, error.read(), dict(error.headers)


def check_http_answer(status: int, payload: bytes, headers: dict, body: dict | None) -> None:
    assert status < 500, payload[:300]
    assert headers.get("X-Request-Id")
    if status >= 400:
        error = json.loads(payload)["error"]
        assert error["code"] and error["message"]
        return
    assert payload, "an accepted request returned no audio"
    fmt = (body or {}).get("response_format", "mp3")
    if fmt in ("wav", "flac") and not body.get("stream_format"):
        audio, rate = sf.read(io.BytesIO(payload))
        assert rate == 24000 and audio.size > 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=speech_bodies)
def test_fuzz_speech_bodies(live_url, body):
    try:
        raw = json.dumps(body, allow_nan=True).encode()
    except (TypeError, ValueError):
        return
    status, payload, headers = post(live_url + "/v1/audio/speech", raw)
    event(f"HTTP {status}")  # shown by --hypothesis-show-statistics
    check_http_answer(status, payload, headers, body)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=speech_bodies)
def test_fuzz_job_bodies(live_url, body):
    """Speech-shaped bodies as jobs: stored (202, readable back as the same job) or a 4xx."""
    try:
        raw = json.dumps(body, allow_nan=True).encode()
    except (TypeError, ValueError):
        return
    status, payload, headers = post(live_url + "/v1/jobs", raw)
    event(f"HTTP {status}")
    assert status < 500, payload[:300]
    answer = json.loads(payload)
    if status >= 400:
        assert answer["error"]["code"] and answer["error"]["message"]
        return
    assert status == 202
    with urllib.request.urlopen(f"{live_url}/v1/jobs/{answer['id']}", timeout=30) as response:
        assert json.loads(response.read())["id"] == answer["id"]


@settings(max_examples=30, deadline=None)
@given(raw=raw_bodies, path=st.sampled_from(["/v1/audio/speech", "/v1/jobs"]))
def test_fuzz_raw_bodies(live_url, raw, path):
    status, payload, headers = post(live_url + path, raw)
    assert status < 500, payload[:300]
    if status >= 400:
        assert json.loads(payload)["error"]["code"]


# bytes that once made a 5xx — lone surrogates, huge integers, deep nesting,
# odd charsets, header bytes that are not UTF-8
surrogates = st.text(alphabet=st.characters(categories=["Cs"]), min_size=1, max_size=3)
huge_ints = st.integers(min_value=300, max_value=6000).map(lambda n: "9" * n)
hostile_fields = st.sampled_from(["input", "voice", "speed", "seed", "steps", "guidance_scale", "top_k"])


def _hostile_body(kind: str, field: str, surrogate: str, digits: str, depth: int) -> bytes:
    if kind == "surrogate":
        return json.dumps({"input": "Hi.", field: "a" + surrogate}).encode()  # ensure_ascii: "\udXXX"
    if kind == "huge_int":
        return ('{"input": "Hi.", "%s": %s%s}' % (field, "-" if depth % 2 else "", digits)).encode()
    if kind == "huge_float":
        return ('{"input": "Hi.", "%s": %s.5e%d}' % (field, digits[:400], depth)).encode()
    return b'{"input": ' * (depth % 3) + b"[" * depth  # deep nesting


hostile_bodies = st.builds(_hostile_body, st.sampled_from(["surrogate", "huge_int", "huge_float", "deep"]),
                           hostile_fields, surrogates, huge_ints, st.integers(min_value=1, max_value=200_000))
charsets = st.sampled_from(["", "; charset=utf-8", "; charset=latin-1", "; charset=utf-16", "; charset=foo",
                            "; charset=rot13", "; charset=zlib", "; charset=base64", "; charset=idna",
                            '; charset="utf-8"', "; charset="])
header_bytes = st.none() | st.binary(min_size=1, max_size=12).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=hostile_bodies, charset=charsets, header=header_bytes,
       path=st.sampled_from(["/v1/audio/speech", "/v1/jobs"]))
def test_fuzz_hostile_bytes(live_url, raw, charset, header, path):
    request = urllib.request.Request(live_url + path, data=raw, method="POST",
                                     headers={"Content-Type": "application/json" + charset})
    if header is not None:
        request.add_header("X-fuzz", b"v" + header)  # bytes go out as they are
    try:
        with urllib.request.urlopen(request, timeout=SESSION_TIMEOUT_S) as response:
            status, payload, kind = response.status, response.read(), response.headers.get_content_type()
    except urllib.error.HTTPError as error:
        status, payload, kind = error.code, error.read(), error.headers.get_content_type()
    event(f"HTTP {status}")
    assert 400 <= status < 500, (status, payload[:300])
    if kind == "application/json":  # aiohttp's HTTP parser answers control bytes in headers in plain text
        assert json.loads(payload)["error"]["code"]


def _hostile_ws_message(kind: str, field: str, surrogate: str, digits: str, depth: int) -> str:
    """Those values as WebSocket text: each must be a non-fatal error on a live socket."""
    kind_of = {"input": "input.text"}.get(field, "session.config")
    key = "text" if field == "input" else field
    if kind == "surrogate":
        return json.dumps({"type": kind_of, key: "a" + surrogate})
    if kind == "huge_int":
        return '{"type": "%s", "%s": %s%s}' % (kind_of, key, "-" if depth % 2 else "", digits)
    if kind == "huge_float":
        return '{"type": "%s", "%s": %s.5e%d}' % (kind_of, key, digits[:400], depth)
    return '{"type": "input.text", "text": ' * (depth % 3) + "[" * min(depth, 100_000)  # deep nesting


hostile_ws = st.builds(_hostile_ws_message, st.sampled_from(["surrogate", "huge_int", "huge_float", "deep"]),
                       hostile_fields, surrogates, huge_ints, st.integers(min_value=1, max_value=100_000))

ws_messages = st.one_of(
    hostile_ws,
    st.builds(lambda t: {"type": "input.text", "text": t}, st.one_of(sentences, short_text, any_json)),
    st.just({"type": "input.done"}),
    st.just({"type": "response.cancel"}),
    st.builds(lambda f: {"type": "session.config", **f},
              st.fixed_dictionaries({}, optional={k: field_values[k] for k in ("voice", "speed", "seed", "steps")})),
    st.builds(lambda t: {"type": t}, short_text),
    any_json,
    st.binary(min_size=1, max_size=16),
    short_text.map(lambda s: "{" + s),
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sequence=st.lists(ws_messages, max_size=6))
def test_fuzz_ws_sequences(live_url, sequence):
    with connect(live_url.replace("http", "ws") + "/v1/stream", open_timeout=30, max_size=None) as ws:
        assert json.loads(ws.recv(timeout=30))["type"] == "session.created"
        rounds = 1  # the final input.done below
        for message in sequence:
            if isinstance(message, bytes):
                ws.send(message)
                continue
            try:
                text = message if isinstance(message, str) else json.dumps(message, allow_nan=True)
            except (TypeError, ValueError):
                continue
            ws.send(text)
            if isinstance(message, dict) and message.get("type") in ("input.done", "response.cancel"):
                rounds += 1
        ws.send(json.dumps({"type": "input.done"}))
        current, received = None, 0
        while rounds:
            frame = ws.recv(timeout=SESSION_TIMEOUT_S)  # a hung session fails here
            if isinstance(frame, bytes):
                assert current is not None, "audio outside an utterance"
                received += len(frame)
                continue
            reply = json.loads(frame)
            if reply["type"] == "error":
                assert reply["code"] in RECOVERABLE, reply
            elif reply["type"] == "audio.start":
                assert current is None, "utterances interleave"
                current, received = reply["utterance"], 0
            elif reply["type"] == "audio.done":
                event("utterance spoken")
                assert reply["utterance"] == current and received == 2 * reply["samples"]
                current = None
            elif reply["type"] == "session.done":
                rounds -= 1
    status, _, _ = post(live_url + "/v1/audio/speech", json.dumps({"input": "Still ready.", "response_format": "pcm"}).encode())
    assert status == 200
