"""The browser playground (GET /), driven in a real headless Chromium (Debian's package,
through Playwright) against a real server: it loads cleanly, streams and schedules audio,
shows time to first audio and the text being spoken (live text too), stops while buffered
audio still plays, fills the sampling fields with the model's defaults, and tells a missing
API key from a refused one. Screenshots go to test-artifacts/ (git-ignored), each taken in the
state the test asserts."""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp
import pytest
from conftest import REPO, start_server, wait_until

CHROMIUM = Path("/usr/bin/chromium")  # apt-get install chromium (scripts/dev-setup.sh); never `playwright install`
ARTIFACTS = REPO / "test-artifacts"  # git-ignored: the screenshot a person can look at
TWO_SENTENCES = "Hello from the playground. This is the second sentence."
LONG = " ".join(f"Sentence number {i} keeps the engine busy for a while." for i in range(40))
SIX_SENTENCES = " ".join(f"This is sentence number {i} of a short reading." for i in range(6))
CHROMIUM_ARGS = ["--no-sandbox", "--autoplay-policy=no-user-gesture-required", "--use-fake-ui-for-media-stream",
                 "--use-fake-device-for-media-stream"]


@pytest.fixture
async def browser():
    assert CHROMIUM.exists(), "Chromium is missing: apt-get install -y chromium chromium-driver (scripts/dev-setup.sh)"
    from playwright.async_api import async_playwright

    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        await browser.close()


async def open_page(browser, url: str):
    page = await browser.new_page(bypass_csp=True)  # lets the test evaluate its probes; the page itself needs no eval
    problems: list[str] = []
    page.on("console", lambda message: problems.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: problems.append(str(error)))
    await page.goto(url)
    return page, problems


async def test_both_paths_serve_the_same_self_contained_page(server):
    async with aiohttp.ClientSession() as http:
        pages = []
        for path in ("/", "/playground"):
            async with http.get(server.url + path) as response:
                assert response.status == 200
                assert response.content_type == "text/html"
                pages.append(await response.text())
    assert pages[0] == pages[1]
    # nothing fetched from elsewhere: no external script, style or font
    assert not re.search(r"""(src|href)=["']https?://""", pages[0])
    assert "AudioWorkletProcessor" in pages[0] and 'id="ttfa"' in pages[0] and 'id="rtf"' in pages[0]


async def test_speak_streams_plays_and_stops(server, browser):
    page, problems = await open_page(browser, server.url + "/")
    await page.wait_for_function("document.querySelectorAll('#voice option').length >= 1")
    assert await page.get_attribute("label[for=text]", "for") == "text"  # labelled controls

    await page.fill("#text", TWO_SENTENCES)
    await page.focus("#text")
    await page.keyboard.press("Control+Enter")  # the keyboard path to Speak
    await page.wait_for_function("window.playground.scheduledSamples >= 4800", timeout=120_000)
    await page.wait_for_function("document.querySelector('#status').textContent === 'Done.'", timeout=120_000)
    played = await page.evaluate("window.playground")
    assert played["receivedSamples"] == played["scheduledSamples"] > 4800  # every sample received went to the worklet
    # "Done." once everything was played, not when the last audio arrived; Stop is over then
    assert played["playedSamples"] == played["scheduledSamples"] and not played["playing"]
    assert not await page.is_enabled("#stop")
    ttfa = await page.text_content("#ttfa")
    assert re.fullmatch(r"\d+", ttfa) and 0 < int(ttfa) < 120_000, ttfa
    assert re.fullmatch(r"\d+\.\d\d", await page.text_content("#rtf"))  # wall s per audio s
    # beside it, the same measurement as a speed (which way it goes: the slow-server test below)
    speedup = await page.text_content("#speedup")
    assert re.fullmatch(r"\d+\.\d× (faster|slower) than real time", speedup), speedup
    assert await page.evaluate("""() => { const r = window.playground.rtf;
        return document.querySelector('#rtf').value === r.toFixed(2) && document.querySelector('#speedup').value
          === (r <= 1 ? (1 / r).toFixed(1) + '× faster' : r.toFixed(1) + '× slower') + ' than real time'; }""")
    assert await page.is_enabled("#download")
    async with page.expect_download() as download_info:
        await page.click("#download")
    download = await download_info.value
    assert download.suggested_filename == "streamvox.wav"

    ARTIFACTS.mkdir(exist_ok=True)
    await page.screenshot(path=str(ARTIFACTS / "playground.png"), full_page=True)

    # Stop: a long text, stopped once audio flows; the server's request is released
    await page.fill("#text", LONG)
    await page.click("#speak")
    await page.wait_for_function("window.playground.receivedSamples > 0", timeout=120_000)
    await page.click("#stop")
    assert await page.text_content("#status") == "Stopped."
    assert await page.is_enabled("#speak") and not await page.is_enabled("#stop")
    engine = server.state.engine

    async def released():
        return engine.stats().active_requests == 0

    await wait_until(released)
    scheduled = await page.evaluate("window.playground.scheduledSamples")
    await page.wait_for_timeout(300)
    assert await page.evaluate("window.playground.scheduledSamples") == scheduled  # nothing more is played
    assert problems == []


async def hold_playback(page) -> None:
    """Audio that is generated faster than it plays, made certain: the page's audio clock stands
    still (its AudioContext suspended, and kept so when the page resumes it at Speak) while
    generation goes on, so whatever arrives stays buffered until the test lets it play."""
    await page.evaluate("""async () => { const ctx = window.playground.ctx;
        ctx.resume = async () => {}; await ctx.suspend(); }""")


async def release_playback(page) -> None:
    await page.evaluate("async () => { const ctx = window.playground.ctx; delete ctx.resume; await ctx.resume(); }")


async def test_stop_works_until_the_buffered_audio_has_played(server, browser):
    """Generation ends while seconds of audio are still to play: Stop (and Escape) stays
    usable, the status says audio is still playing, and the text being spoken is shown."""
    page, problems = await open_page(browser, server.url + "/")
    await page.wait_for_function("window.playground.model !== null")
    await page.fill("#text", "Hello.")  # the first Speak makes the page's AudioContext
    await page.click("#speak")
    await page.wait_for_function("document.querySelector('#status').textContent === 'Done.'", timeout=120_000)
    await hold_playback(page)

    await page.fill("#text", SIX_SENTENCES)
    await page.click("#speak")
    await page.wait_for_function("document.querySelector('#status').textContent.startsWith('All audio received')",
                                 timeout=120_000)
    state = await page.evaluate("window.playground")
    assert not state["speaking"] and state["playing"] and state["scheduledSamples"] > state["playedSamples"]
    assert await page.is_enabled("#stop") and await page.is_enabled("#speak") and await page.is_enabled("#download")
    assert "Stop or Escape ends it" in await page.text_content("#status")
    assert await visible(page, "#spoken")
    first = await page.text_content("#spoken-text")
    assert first == "This is sentence number 0 of a short reading."  # what plays now: the first sentence
    ARTIFACTS.mkdir(exist_ok=True)
    await page.screenshot(path=str(ARTIFACTS / "playground-stop-during-playback.png"), full_page=True)

    await page.keyboard.press("Escape")
    assert await page.text_content("#status") == "Stopped."
    assert not await page.is_enabled("#stop") and not await visible(page, "#spoken")
    await release_playback(page)
    await page.wait_for_function("window.playground.ctx.state === 'running'")
    await page.wait_for_timeout(200)  # the worklet runs again: nothing of the stopped round is left to play
    assert await page.evaluate("window.playground.playedSamples") == 0
    assert await page.text_content("#status") == "Stopped."

    # the same with the Stop button, and after it a new round plays to its end
    await hold_playback(page)
    await page.click("#speak")
    await page.wait_for_function("document.querySelector('#status').textContent.startsWith('All audio received')",
                                 timeout=120_000)
    await page.click("#stop")
    assert await page.text_content("#status") == "Stopped." and not await page.is_enabled("#stop")
    await release_playback(page)
    await page.fill("#text", "Hello.")
    await page.click("#speak")
    await page.wait_for_function("document.querySelector('#status').textContent === 'Done.'", timeout=120_000)
    assert problems == []


async def test_a_missing_key_and_a_wrong_key_are_told_apart(engine, tmp_path, browser):
    live = await start_server(engine, tmp_path / "data", api_keys=("right-key",))
    try:
        page, _ = await open_page(browser, live.url + "/playground")
        await page.fill("#text", TWO_SENTENCES)
        await page.click("#speak")  # no key typed: the server needs one, none was refused
        await page.wait_for_function("!document.querySelector('#speak').disabled && window.playground.errors.length")
        messages = await page.evaluate("window.playground.errors")
        assert messages and all("needs an API key" in m and "refused" not in m for m in messages), messages

        await page.fill("#apikey", "wrong-key")
        await page.click("#speak")
        await page.wait_for_function("document.querySelector('#status').textContent.includes('refused')")
        assert "The API key was refused" in await page.text_content("#status")
        assert await page.evaluate("window.playground.receivedSamples") == 0

        await page.fill("#apikey", "right-key")
        await page.click("#speak")
        await page.wait_for_function("window.playground.scheduledSamples > 0", timeout=120_000)
    finally:
        await live.stop()


async def test_voice_upload_on_a_cloning_checkpoint_then_speak_with_it(tmp_path, browser):
    """On a Base (voice-clone) checkpoint the page offers a reference-clip upload: the clip goes
    to POST /v1/audio/voices, the saved voice is selected, and Speak plays it: the samples the
    page received equal the HTTP speech of that voice (greedy, within 2 LSB of the vocoder's
    batched float math)."""
    import io

    import numpy as np
    import soundfile as sf

    from engines.build import build_engine
    from engines.config import EngineConfig
    from tests.oracle import clone_fixtures as fx

    refs, c = fx.references("base"), fx.info("base")["cases"]["icl_a_stream"]
    clip = tmp_path / "reference.wav"
    sf.write(clip, refs["ref/a/wav"].numpy(), 24000)
    engine = build_engine(EngineConfig.for_tests(checkpoint=str(fx.checkpoint_dir("base")), max_slots=2))
    engine.start()
    live = await start_server(engine, tmp_path / "data")
    try:
        page, problems = await open_page(browser, live.url + "/")
        await page.wait_for_selector("#clone", state="visible")
        await page.fill("#clone-name", "erin")
        await page.set_input_files("#clone-audio", str(clip))
        await page.fill("#clone-text", c["ref_text"])
        await page.click("#clone-upload")
        await page.wait_for_function("document.querySelector('#status').textContent.startsWith('Voice erin saved')",
                                     timeout=60_000)
        assert await page.input_value("#voice") == "erin"
        text = "Hello in a saved voice."
        await page.fill("#text", text)
        await page.check("#greedy")  # the checkpoint samples by default (its generation_config.json)
        await page.click("#speak")
        await page.wait_for_function("document.querySelector('#status').textContent === 'Done.'", timeout=120_000)
        heard = np.array(await page.evaluate("window.playground.chunks.flatMap((c) => Array.from(c))"),
                         dtype=np.float32) / 32768
        async with aiohttp.ClientSession() as http:
            body = {"input": text, "voice": "erin", "greedy": True, "response_format": "wav", "stream": False}
            async with http.post(live.url + "/v1/audio/speech", json=body) as r:
                assert r.status == 200, await r.text()
                spoken, _ = sf.read(io.BytesIO(await r.read()), dtype="float32")
        assert len(heard) == len(spoken) > 0
        np.testing.assert_allclose(heard, spoken, atol=2 / 32768, rtol=0)
        assert problems == []
    finally:
        await live.stop()
        engine.stop()


async def visible(page, selector: str) -> bool:
    return await page.is_visible(selector)


async def test_random_weights_banner_and_the_dit_fields_on_the_default_model(server, browser):
    page, problems = await open_page(browser, server.url + "/")
    await page.wait_for_function("window.playground.model !== null")
    banner = await page.text_content("#random-banner")
    assert await visible(page, "#random-banner")
    assert "random weights: this is noise, not speech" in " ".join(banner.split()).lower()
    assert "--model Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice" in banner
    assert "dit" in await page.text_content("#random-components")
    assert await page.text_content("#model-name") == "streamvox DiT, preset tiny"
    assert "DiT preset" in await page.text_content("#model-release")
    # the DiT's own fields: steps and guidance; no sampling, instructions, language or cloning
    assert await visible(page, "#steps") and await visible(page, "#guidance")
    for hidden in ("#temperature", "#greedy", "#instructions", "#language", "#clone"):
        assert not await visible(page, hidden), hidden
    voices = await page.eval_on_selector_all("#voice option", "options => options.map((o) => o.value)")
    assert voices == list(server.state.engine.info.voices)
    assert problems == []


# a generation_config.json unlike the official defaults (0.9 / 50 / 1.0), so the page can only show it by reading it
GENERATION_CONFIG = {"do_sample": True, "top_k": 7, "top_p": 0.8, "temperature": 0.55, "repetition_penalty": 1.3,
                     "subtalker_dosample": True, "subtalker_top_k": 50, "subtalker_top_p": 1.0,
                     "subtalker_temperature": 0.9, "max_new_tokens": 28}


async def test_a_talker_checkpoint_shows_its_speakers_its_sampling_and_the_live_text_spoken(tmp_path, browser):
    import json
    import shutil

    from engines.build import build_engine
    from engines.config import EngineConfig
    from tests.oracle import talker_fixtures as fx

    checkpoint = tmp_path / "cv_proj"  # missing fixtures: fail under CI=true, else skip
    shutil.copytree(fx.checkpoint_dir("cv_proj"), checkpoint)
    (checkpoint / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    speakers = json.loads((checkpoint / "config.json").read_text())["talker_config"]["spk_id"]
    engine = build_engine(EngineConfig.for_tests(checkpoint=str(checkpoint), max_slots=2))
    engine.start()
    live = await start_server(engine, tmp_path / "data", checkpoint=str(checkpoint))
    try:
        page, problems = await open_page(browser, live.url + "/")
        await page.wait_for_function("window.playground.model !== null")
        await page.wait_for_function(f"document.querySelectorAll('#voice option').length === {len(speakers)}")
        voices = await page.eval_on_selector_all("#voice option", "options => options.map((o) => o.value)")
        assert sorted(voices) == sorted(speakers)  # the checkpoint's speakers, not the DiT's voice table
        assert not set(voices) & {"aria", "blaze", "cedar"}
        assert await page.text_content("#model-name") == "cv_proj"
        assert "CustomVoice" in await page.text_content("#model-release")
        assert not await visible(page, "#random-banner")
        assert await visible(page, "#temperature") and await visible(page, "#greedy") and await visible(page, "#language")
        assert not await visible(page, "#steps") and not await visible(page, "#clone")
        instructions = engine.capabilities.instructions
        assert await visible(page, "#instructions") == instructions
        # the sampling fields hold the checkpoint's generation_config.json, as /v1/models serves it
        model = await page.evaluate("window.playground.model")
        assert model["sampling_defaults"] == {"greedy": False, "temperature": 0.55, "top_k": 7, "top_p": 0.8,
                                              "repetition_penalty": 1.3}
        assert not await page.is_checked("#greedy")
        assert [await page.input_value(f"#{name}") for name in ("temperature", "top_k", "top_p")] == ["0.55", "7", "0.8"]

        text = "Hello from a checkpoint speaker."
        await page.select_option("#voice", sorted(speakers)[-1])
        await page.fill("#text", text)
        await page.click("#speak")
        await page.wait_for_function("document.querySelector('#status').textContent === 'Done.'", timeout=120_000)
        assert await page.evaluate("window.playground.receivedSamples") > 0
        assert re.fullmatch(r"\d+\.\d\d", await page.text_content("#rtf"))
        assert await page.evaluate("window.playground.utterances[0].live")  # live text: audio.start had no text

        # the text being spoken is shown in live mode too (its audio.start carries none)
        await hold_playback(page)
        await page.click("#speak")
        await page.wait_for_function("document.querySelector('#status').textContent.startsWith('All audio received')",
                                     timeout=120_000)
        assert await visible(page, "#spoken") and await page.text_content("#spoken-text") == text
        ARTIFACTS.mkdir(exist_ok=True)
        await page.screenshot(path=str(ARTIFACTS / "playground-live-text-spoken.png"), full_page=True)
        await page.keyboard.press("Escape")
        assert await page.text_content("#status") == "Stopped." and not await visible(page, "#spoken")
        assert problems == []
    finally:
        await live.stop()
        engine.stop()


async def test_a_server_slower_than_real_time_says_so_and_suggests_whole_files(tmp_path, browser):
    """The engine's fault hook sleeps 1.2 s before each vocoder piece (at most 0.96 s of audio
    after the first), of every request but the cold first one of the warm-up (the speed is
    measured after it): slower than real time by construction."""
    import time

    from engines.build import build_engine
    from engines.config import EngineConfig

    requests: list[str] = []

    def slow_vocoder(request_id: str, stage: str) -> None:
        if request_id not in requests:
            requests.append(request_id)
        if stage == "vocalize" and request_id != requests[0]:
            time.sleep(1.2)

    engine = build_engine(EngineConfig.for_tests(), slow_vocoder)
    engine.start()
    live = await start_server(engine, tmp_path / "data")
    try:
        page, problems = await open_page(browser, live.url + "/")
        await page.wait_for_function("window.playground.model !== null")
        assert await visible(page, "#speed-hint")
        hint = " ".join((await page.text_content("#speed-hint")).split())
        assert "slower than real time" in hint and '"stream": false' in hint and "/v1/jobs" in hint
        assert float(await page.text_content("#speed-slower")) > 1

        await page.fill("#text", "Hello there, this stream is slower than real time.")
        await page.click("#speak")
        await page.wait_for_function("document.querySelector('#status').textContent === 'Done.'", timeout=120_000)
        assert await visible(page, "#behind-note")
        assert "slower than real time" in await page.text_content("#behind-note")
        assert "slower than real time" in await page.text_content("#speedup")
        assert problems == []
    finally:
        await live.stop()
        engine.stop()

