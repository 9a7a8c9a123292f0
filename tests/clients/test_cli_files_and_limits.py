"""The CLI's file paths, limits and usage, as a user meets them (real subprocesses): an
``--out`` in a folder that does not exist yet is made, one that cannot be is one line and an
exit code (never a traceback, never "cannot reach the server"); the text limit says what the
server says; a bad flag of ``serve`` is one line naming ``serve``; the real-time factor is worded
right on both sides of 1."""

from __future__ import annotations

import soundfile as sf
from conftest import start_server
from test_cli_say import assert_one_line_error, run_cli

from service.speed import real_time_words


def test_the_real_time_factor_is_worded_right_on_both_sides_of_one():
    assert real_time_words(4.0) == "real-time factor 4.00 (4.0x slower than real time)"
    assert real_time_words(0.25) == "real-time factor 0.25 (4.0x faster than real time)"
    assert real_time_words(1.0) == "real-time factor 1.00 (as fast as real time)"


async def test_say_and_fetch_make_a_missing_folder_and_refuse_an_impossible_one(server, tmp_path):
    out = tmp_path / "new" / "folder" / "hello.wav"
    rc, stdout, stderr = await run_cli("say", "Hello there.", "--out", str(out), "--url", server.url)
    assert rc == 0, stderr
    assert sf.info(out).frames > 0
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    for command in (["say", "Hello."], ["say", "--stdin"]):
        rc, _, stderr = await run_cli(*command, "--out", str(blocker / "x.wav"), "--url", server.url,
                                      stdin=b"Hello.")
        line = assert_one_line_error(rc, stderr, f"streamvox say: --out {blocker / 'x.wav'}: cannot create", 2)
        assert "reach" not in line
    rc, stdout, stderr = await run_cli("submit", "A job.", "--wait", "--quiet", "--url", server.url)
    job = stdout.strip()
    assert rc == 0, stderr
    rc, _, stderr = await run_cli("fetch", job, "--out", str(tmp_path / "jobs" / "job.wav"), "--url", server.url)
    assert rc == 0 and sf.info(tmp_path / "jobs" / "job.wav").frames > 0, stderr
    rc, _, stderr = await run_cli("fetch", job, "--out", str(blocker / "job.wav"), "--url", server.url)
    line = assert_one_line_error(rc, stderr, "streamvox fetch: --out", 2)
    assert "reach" not in line and "cannot create the folder" in line


async def test_the_text_limit_says_the_same_on_every_surface(engine, tmp_path):
    """HTTP speech, the WebSocket (``say``), a vendor dialect and ``synthesize``: one message."""
    import aiohttp

    live = await start_server(engine, tmp_path / "data", max_input_chars=50)
    text = "word " * 20  # 100 characters
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(live.url + "/v1/audio/speech", json={"input": text}) as response:
                http_message = (await response.json())["error"]["message"]
            async with http.post(live.url + "/v1/speak?model=default", json={"text": text}) as response:
                vendor_message = (await response.json())["err_msg"]
        rc, _, stderr = await run_cli("say", text, "--out", str(tmp_path / "x.wav"), "--url", live.url)
    finally:
        await live.stop()
    assert http_message == "input: 100 characters, the limit is 50"
    assert vendor_message == "text: 100 characters, the limit is 50"
    assert rc == 1 and stderr.splitlines()[-1] == "streamvox say: text_too_long: text: 100 characters, the limit is 50"
    rc, _, stderr = await run_cli("synthesize", "--preset", "tiny", "--device", "cpu", "--text", "x" * 4097,
                                  "--out", str(tmp_path / "long.wav"))
    assert_one_line_error(rc, stderr, "streamvox synthesize: text: 4097 characters, the limit is 4096", 2)
    assert not (tmp_path / "long.wav").exists()


async def test_synthesize_checks_its_paths_before_loading_a_model(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    rc, _, stderr = await run_cli("synthesize", "--preset", "tiny", "--device", "cpu", "--text", "Hi.",
                                  "--out", str(blocker / "o.wav"))
    assert_one_line_error(rc, stderr, f"streamvox synthesize: --out {blocker / 'o.wav'}: cannot create the folder", 2)
    rc, _, stderr = await run_cli("synthesize", "--preset", "tiny", "--device", "cpu", "--text", "Hi.",
                                  "--out", str(tmp_path / "o.wav"), "--ref-audio", str(tmp_path / "missing.wav"))
    assert_one_line_error(rc, stderr, "streamvox synthesize: --ref-audio", 2)
    rc, _, stderr = await run_cli("synthesize", "--preset", "tiny", "--device", "cpu", "--text", "Hi.",
                                  "--out", str(tmp_path / "made" / "o.wav"), "--quiet")
    assert rc == 0 and sf.info(tmp_path / "made" / "o.wav").frames > 0, stderr


async def test_a_bad_serve_flag_is_one_line_naming_serve(tmp_path):
    rc, _, stderr = await run_cli("serve", "--no-such-flag")
    assert_one_line_error(rc, stderr, "streamvox serve: unrecognized arguments: --no-such-flag", 2)
    assert "`streamvox serve --help`" in stderr
