"""How many frames one talker utterance may take, from its own text.

The released ``generation_config.json`` caps an utterance at ``max_new_tokens`` = 8192 (655 s of
audio) whatever it says. Checked as work that cap refuses every plain request; left unchecked it
lets an utterance that never samples EOS (about 0.2 % of 0.6B outputs) babble for minutes. So
each utterance gets a budget from its text instead:

    frames <= FRAMES_PER_TEXT_TOKEN * text_tokens + FRAMES_BASE        (12.5 frames per second)

capped by ``max_new_tokens - 1`` (the request's, else the checkpoint's: the official counting)
and by the stream's positions. ``text_tokens`` are the checkpoint's own BPE ids of the text
(``ids[3:-5]`` of the assistant-wrapped text, the ids the talker reads).

Where the numbers come from (a wide margin on the slowest plausible speech):

* Syllable rates of read speech (Pellegrino, Coupé & Marsico 2011, "A cross-language perspective
  on speech information rate", Language 87(3)): Japanese 7.84, Spanish 7.82, French 7.18,
  Italian 6.99, English 6.19, German 5.97, Mandarin 5.18 syllables/s. Qwen3-TTS's other
  languages (Korean, Portuguese, Russian) sit in the same 5-8 range in other studies.
* Deliberately slow speech (clear speech, a "speak slowly" instruction) runs at about half the
  conversational rate (Krause & Braida: ~100 against ~200 words per minute): Mandarin, the
  slowest above, then gives ~2.6 syllables/s.
* The Qwen2 BPE (151,643 merges) spends about 0.5 to 1 token per syllable (English ~1.3 tokens
  per ~1.5-syllable word; Chinese and Japanese often 2-3 characters per token): the fewest
  tokens per second of speech is then ~2.6 x 0.5 = 1.3, i.e. ~9.6 frames per token.
* A = 15 frames (1.2 s) per token is 1.5x that worst case and 3-6x normal speech; B = 50 frames
  (4 s) covers the leading and trailing silence and short texts whose few tokens say much
  ("1999", a long word that is one token).

A small test tokenizer splits text into more tokens than the released one: budgets there are
only larger. Long text is planned as utterances before it reaches the engine
(service/synthesis/plan.py), so every budget stays well under a stream's positions.
"""

from __future__ import annotations

from engines.contract import FrameBudget, SynthesisRequest
from engines.pipelines.talker.prompt import PromptBuilder

FRAMES_PER_SECOND = 12.5
FRAMES_PER_TEXT_TOKEN = 15
FRAMES_BASE = 50


def frame_budget(text_tokens: int) -> int:
    """The frames an utterance of ``text_tokens`` text ids may take at most (see the module docstring)."""
    return FRAMES_PER_TEXT_TOKEN * max(0, int(text_tokens)) + FRAMES_BASE


def frame_limit(max_new_tokens: int, positions_left: int, text_tokens: int | None) -> FrameBudget:
    """The most frames an utterance may take and which bound sets it: the budget of its text
    (None: its text is still arriving), ``max_new_tokens`` - 1 (the official counting:
    the last code 0 gets no frame) and the positions its stream has left."""
    text_frames = None if text_tokens is None else frame_budget(text_tokens)
    bounds = [(max_new_tokens - 1, "max_new_tokens"), (positions_left, "max_seq_len")]
    if text_frames is not None:
        bounds.insert(0, (text_frames, "budget"))
    frames, bound = min(bounds, key=lambda b: b[0])
    return FrameBudget(max(0, frames), bound, text_frames)


def plan_budget(request: SynthesisRequest, prompt: PromptBuilder, default_max_new_tokens: int,
                max_seq_len: int) -> FrameBudget:
    """The frame budget of ``request`` (its ``prompt_ids`` when it carries them), planned once
    before it is submitted: its text's budget, ``max_new_tokens`` - 1 (the request's, else the
    checkpoint's ``default_max_new_tokens``: the one place that default is read) and a stream's
    positions. A live utterance's text budget is known once its text is complete (source.py):
    only the other bounds hold it here."""
    max_new = default_max_new_tokens if request.max_new_tokens is None else int(request.max_new_tokens)
    tokens = None if request.text_feed is not None else prompt.text_tokens(request)
    return frame_limit(max_new, max_seq_len - 1, tokens)


__all__ = ["FRAMES_BASE", "FRAMES_PER_SECOND", "FRAMES_PER_TEXT_TOKEN", "frame_budget", "frame_limit", "plan_budget"]
