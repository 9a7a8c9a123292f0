"""The text side of one live utterance: text that is still arriving.

    live = LiveText(request.text_feed, prompt_builder)   # on the worker thread
    live.pull()                       # drain new deltas -> committed text ids (stable_tokens.py)
    live.ready                        # the prompt can be prefilled (first text id known, or text complete)
    prompt = live.prompt(request)     # streaming-text prompt of the request's voice, no tts_eos yet
    ids = live.trailing_ids()         # text ids decode steps 0, 1, ... add (+ tts_eos once complete)

Streaming-text mode (``non_streaming_mode=False``, REFERENCES "Qwen3-TTS talker prompt"):
the prefill ends with ``text_0 + codec_bos``; decode step k adds text id k+1, then
``tts_eos``, then ``tts_pad``. So a row can start once text id 0 is committed, and decode
step k can run once text id k+1 is committed (or the text is complete: ``tts_eos``/pad).
A row whose next text id is not there yet sits the step out (source.py's live-text hook).
The committed ids equal the whole text's ids for any split (stable_tokens.py), so the codes
equal the official ``generate()`` in streaming-text mode on the whole text.
"""

from __future__ import annotations

import dataclasses

from engines.contract import SynthesisRequest, TextFeed
from engines.pipelines.talker.prompt import PromptBuilder, TalkerPrompt
from engines.pipelines.talker.stable_tokens import TAIL, StableTokenizer


class LiveText:
    def __init__(self, feed: TextFeed, prompt: PromptBuilder):
        self.feed = feed
        self.builder = prompt
        self.stream = StableTokenizer(prompt.tokenizer)
        self._tail_ids = prompt.tokenizer.encode(TAIL)
        self.done = False
        self._read = 0  # deltas of the feed read so far

    @property
    def ids(self) -> list[int]:
        """Committed body ids (text id 0, 1, ...)."""
        return self.stream.committed

    def pull(self) -> bool:
        """Drain the feed; -> whether new ids were committed or the text completed."""
        if self.done:
            return False
        text, self._read, finished = self.feed.read(self._read)
        new = self.stream.feed(text) if text else []
        if finished:
            new += self.stream.finish()
            self.done = True
        return bool(new) or finished

    @property
    def ready(self) -> bool:
        return self.done or len(self.ids) > 0

    def prompt(self, request: SynthesisRequest, instruct: str | None = None) -> TalkerPrompt:
        """The streaming-text prompt of the text so far (the request's task, voice or x-vector
        clone, language, instructions); its trailing ids hold no ``tts_eos`` until the text is
        complete (they come from :meth:`trailing_ids` as they commit)."""
        if request.clone is not None and request.clone.in_context:
            # generate_icl_prompt interleaves the reference text with the whole target text
            raise ValueError("in-context cloning needs the whole text: use text_streaming false")
        speaker = request.voice if self.builder.task_type == "CustomVoice" else None
        wrapped = self.stream.role_ids + self.ids[:1] + self._tail_ids
        prompt = self.builder.build_ids(wrapped, speaker, request.language, non_streaming_mode=False,
                                        instruct=request.instructions if instruct is None else instruct,
                                        clone=request.clone)
        return dataclasses.replace(prompt, trailing_text_ids=())

    def trailing_ids(self) -> list[int]:
        """Text ids of decode steps 0, 1, ...: ids[1:], then ``tts_eos`` once the text is complete."""
        ids = self.ids[1:]
        return ids + [self.builder.config.tts_eos_token_id] if self.done else ids


__all__ = ["LiveText"]
