"""Property-based fuzzing (hypothesis) of reference audio against a real `streamvox serve`
process: random bytes, random bytes behind each allowed container's magic, and real files of
every allowed container mutated (bytes flipped, cut, spliced, headers overwritten), sent as
speech ``ref_audio`` and as voice uploads. Every answer is a 4xx JSON error naming the field
(or, where the bytes still decode, the DiT's own "cannot clone"); never a 5xx, never a hang,
and the server outlives them all."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
import uuid

import pytest
import ref_audio_samples as samples
from conftest import serving
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

TIMEOUT_S = 60
MAGICS = [b"RIFF\x00\x00\x00\x00WAVEfmt ", b"fLaC", b"OggS\x00\x02", b"\x1a\x45\xdf\xa3", b"\x00\x00\x00\x18ftypM4A ",
          b"ID3\x04\x00\x00\x00\x00\x00\x00\xff\xfb", b"\xff\xf1", b"\xff\xfb\x90"]
REAL = samples.all_containers()


@pytest.fixture(scope="module")
def live_url(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("fuzz-ref"), "--job-workers", "0", "--max-ref-audio-seconds", "5") as server:
        yield server.url


@st.composite
def mutated(draw) -> bytes:
    name = draw(st.sampled_from(sorted(REAL)))
    data = bytearray(REAL[name])
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["flip", "cut", "splice", "header", "repeat"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if kind == "flip":
            data[at] ^= draw(st.integers(1, 255))
        elif kind == "cut":
            del data[at:at + draw(st.integers(1, 4096))]
        elif kind == "splice":
            data[at:at] = draw(st.binary(min_size=1, max_size=64))
        elif kind == "header":  # the first 64 bytes hold the lengths, rates and counts a parser trusts
            spot = draw(st.integers(0, 63))
            data[spot:spot + 4] = draw(st.binary(min_size=4, max_size=4))
        else:
            piece = data[at:at + draw(st.integers(1, 512))]
            data[at:at] = piece * draw(st.integers(1, 50))
        if not data:
            break
    return bytes(data)


references = st.one_of(
    st.tuples(st.just("random bytes"), st.binary(max_size=2048)),
    st.tuples(st.just("magic + random"), st.builds(bytes.__add__, st.sampled_from(MAGICS), st.binary(max_size=4096))),
    st.tuples(st.just("mutated file"), mutated()),
)


def post(url: str, body: bytes, content_type: str) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def multipart(data: bytes) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"name\"\r\n\r\nfuzzed\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"audio_sample\"; filename=\"a\"\r\n"
            f"Content-Type: application/octet-stream\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()
    return body, f"multipart/form-data; boundary={boundary}"


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(reference=references, upload=st.booleans())
def test_fuzz_reference_audio(live_url, reference, upload):
    kind, data = reference
    event(kind)
    if upload:
        body, content_type = multipart(data)
        status, payload = post(live_url + "/v1/audio/voices", body, content_type)
        field = "audio_sample:"
    else:
        body = json.dumps({"input": "Hi.", "ref_audio": base64.b64encode(data).decode(), "x_vector_only_mode": True})
        status, payload = post(live_url + "/v1/audio/speech", body.encode(), "application/json")
        field = "ref_audio:"
    assert status < 500, payload[:300]
    assert 400 <= status < 500, "the DiT cannot clone: no reference can be accepted"
    error = json.loads(payload)["error"]
    if "a Base checkpoint" in error["message"]:  # decoded; the DiT's own refusal (it names ref_audio either way)
        event("decoded (the DiT then refuses to clone)")
        return
    assert error["message"].startswith(field), error
    event(error["code"])
