"""`--out`'s extension picks the file format, in `say`, `synthesize` and `fetch` (real CLI
subprocesses against a real server): .wav, .flac, .mp3, .ogg / .opus (Ogg Opus), .aac and .pcm
hold that format, read back with soundfile; a name with no audio extension, or a place no file
can be made (/proc), is one line and exit 2 before any work: `say` never reaches the server,
`synthesize` never loads a model."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf
from test_cli_say import assert_one_line_error, run_cli

TEXT = "Hello there."
# extension -> soundfile's (format, subtype) of the file written
CONTAINERS = {".wav": ("WAV", "PCM_16"), ".flac": ("FLAC", "PCM_16"), ".mp3": ("MP3", "MPEG_LAYER_III"),
              ".ogg": ("OGG", "OPUS"), ".opus": ("OGG", "OPUS")}


def closed_port() -> int:
    import socket

    with socket.socket() as probe:  # nothing listens there: reaching for it would fail differently
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def assert_holds(path, container: tuple[str, str], reference: np.ndarray) -> None:
    """``path`` is a 24 kHz mono file of that format whose audio is ``reference``'s: the same
    samples when lossless, the same length give or take the encoder's padding when not."""
    info = sf.info(str(path))
    assert (info.format, info.subtype, info.samplerate, info.channels) == (*container, 24000, 1), (path, info)
    audio, _ = sf.read(str(path), dtype="int16")
    if container[1] == "PCM_16":
        np.testing.assert_array_equal(audio, reference)
    else:
        assert abs(len(audio) - len(reference)) <= 2400, (path, len(audio), len(reference))
        assert np.sqrt(np.mean(audio.astype(np.float64) ** 2)) > 10, path  # not silence


async def test_say_writes_the_format_its_extension_names(server, tmp_path):
    outputs = {ext: tmp_path / f"say{ext}" for ext in (*CONTAINERS, ".pcm")}
    for ext, out in outputs.items():
        rc, stdout, stderr = await run_cli("say", TEXT, "--seed", "3", "--out", str(out), "--url", server.url)
        assert rc == 0 and "Traceback" not in stderr, (ext, stderr)
        assert stdout.startswith(f"wrote {out}:"), stdout
    reference, _ = sf.read(str(outputs[".wav"]), dtype="int16")
    assert len(reference) > 0
    for ext, container in CONTAINERS.items():
        assert_holds(outputs[ext], container, reference)
    raw = np.frombuffer(outputs[".pcm"].read_bytes(), dtype="<i2")  # raw 16-bit little-endian, 24 kHz mono
    np.testing.assert_array_equal(raw, reference)


async def test_synthesize_and_fetch_write_the_format_their_extension_names(server, tmp_path):
    out = tmp_path / "offline.mp3"
    rc, _, stderr = await run_cli("synthesize", "--preset", "tiny", "--device", "cpu", "--text", TEXT, "--quiet",
                                  "--out", str(out))
    assert rc == 0, stderr
    assert (sf.info(str(out)).format, sf.info(str(out)).samplerate) == ("MP3", 24000)

    rc, stdout, stderr = await run_cli("submit", "A job.", "--wait", "--quiet", "--url", server.url)
    assert rc == 0, stderr
    job = stdout.strip()
    fetched = {ext: tmp_path / f"job{ext}" for ext in (".wav", ".flac", ".mp3", ".ogg", ".pcm")}
    for ext, path in fetched.items():
        rc, _, stderr = await run_cli("fetch", job, "--out", str(path), "--url", server.url)
        assert rc == 0 and "Traceback" not in stderr, (ext, stderr)
    reference, _ = sf.read(str(fetched[".wav"]), dtype="int16")
    for ext in (".wav", ".flac", ".mp3", ".ogg"):
        assert_holds(fetched[ext], CONTAINERS[ext], reference)
    np.testing.assert_array_equal(np.frombuffer(fetched[".pcm"].read_bytes(), dtype="<i2"), reference)


@pytest.mark.parametrize("name, reason", [
    ("notes.txt", ".txt is not an audio format"),
    ("audio", "no extension to tell the format"),
])
async def test_an_unknown_extension_is_one_line_before_any_work(name, reason, server, tmp_path):
    out = tmp_path / name
    nowhere = f"127.0.0.1:{closed_port()}"
    for command in (["say", TEXT, "--url", nowhere], ["say", "--stdin", "--url", nowhere],
                    ["synthesize", "--preset", "tiny", "--device", "cpu", "--text", TEXT]):
        rc, stdout, stderr = await run_cli(*command, "--out", str(out), stdin=TEXT.encode())
        line = assert_one_line_error(rc, stderr, f"streamvox {command[0]}: --out {out}: {reason}", 2)
        assert ".wav" in line and ".mp3" in line and stdout == "" and not out.exists(), command
    rc, stdout, stderr = await run_cli("submit", "A job.", "--wait", "--quiet", "--url", server.url)
    assert rc == 0, stderr
    rc, _, stderr = await run_cli("fetch", stdout.strip(), "--out", str(out), "--url", server.url)
    assert_one_line_error(rc, stderr, f"streamvox fetch: --out {out}: {reason}", 2)
    assert not out.exists()


async def test_a_place_no_file_can_be_made_is_one_line_before_any_work(tmp_path):
    """/proc takes no new file, even from root (for whom os.access says every folder is writable)."""
    nowhere = f"127.0.0.1:{closed_port()}"
    for command in (["say", TEXT, "--url", nowhere], ["synthesize", "--preset", "tiny", "--device", "cpu",
                                                       "--text", TEXT]):
        rc, _, stderr = await run_cli(*command, "--out", "/proc/streamvox-test.wav")
        line = assert_one_line_error(rc, stderr, f"streamvox {command[0]}: --out /proc/streamvox-test.wav: ", 2)
        assert "cannot write the file" in line, line
        assert "RANDOM" not in stderr  # synthesize: refused before a model loaded


async def test_synthesize_refuses_a_format_its_name_contradicts(tmp_path):
    out = tmp_path / "x.wav"
    rc, _, stderr = await run_cli("synthesize", "--preset", "tiny", "--device", "cpu", "--text", TEXT,
                                  "--format", "flac", "--out", str(out))
    assert_one_line_error(rc, stderr, f"streamvox synthesize: --out {out}: a .wav name, but the format asked is flac", 2)
    assert not out.exists()
