"""The Qwen3-TTS talker prompt, built exactly as the official package does.

    builder = PromptBuilder(prompt_config, tokenizer)   # both from engines/checkpoints/qwen3_text.py
    prompt = builder.build("Hello.", speaker="Vivian", language="Auto")   # -> TalkerPrompt (ids only)

Prompt (``Qwen3TTSForConditionalGeneration.generate``, custom-voice / voice-design):
every talker input position is a text part ``text_projection(text_embedding(id))`` plus,
except for the role (and instruct) positions, a codec part ``codec_embedding(id)``.
A :class:`TalkerPrompt` holds the ids; the talker turns them into embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass

from engines.checkpoints.qwen3_text import PromptConfig, QwenTextTokenizer


@dataclass(frozen=True)
class TalkerPrompt:
    """Ids of one utterance's talker input.

    Prefill position i = text part of ``text_ids[i]`` + codec part of ``codec_ids[i]``
    (``codec_ids[i] == -1``: no codec part). Decode step k adds the text part of
    ``trailing_text_ids[k]``, or of ``pad_text_id`` once they run out.
    """

    text_ids: tuple[int, ...]
    codec_ids: tuple[int, ...]
    trailing_text_ids: tuple[int, ...]
    pad_text_id: int

    def __len__(self) -> int:
        return len(self.text_ids)


NO_CODEC = -1


class PromptBuilder:
    def __init__(self, config: PromptConfig, tokenizer: QwenTextTokenizer):
        self.config = config
        self.tokenizer = tokenizer

    def voices(self) -> list[str]:
        return sorted(self.config.speakers)

    def languages(self) -> list[str]:
        return self.config.languages()

    def default_non_streaming_mode(self) -> bool:
        # generate_custom_voice / generate_voice_design default to True, generate_voice_clone to False.
        return self.config.tts_model_type != "base"

    def tokenize_assistant(self, text: str) -> list[int]:
        return self.tokenizer.encode(f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n")

    def language_id(self, speaker: str | None, language: str) -> int | None:
        c = self.config
        lang = (language or "").lower()
        if lang not in c.languages():
            raise ValueError(f"unsupported language {language!r}; supported: {sorted(c.languages())}")
        language_id = None if lang == "auto" else c.language_ids[lang]
        if lang in ("chinese", "auto") and speaker:
            dialect = c.speaker_dialects.get(speaker.lower(), False)
            if dialect is not False:
                language_id = c.language_ids[dialect]
        return language_id

    def build(self, text: str, speaker: str | None, language: str = "Auto", non_streaming_mode: bool | None = None,
              instruct: str | None = None) -> TalkerPrompt:
        return self.build_ids(self.tokenize_assistant(text), speaker, language, non_streaming_mode, instruct)

    def build_ids(self, ids: list[int], speaker: str | None, language: str = "Auto",
                  non_streaming_mode: bool | None = None, instruct: str | None = None) -> TalkerPrompt:
        """The prompt from the ids of the wrapped text (what ``tokenize_assistant`` returns;
        live utterances pass the text committed so far, engines/pipelines/talker/live_text.py)."""
        c = self.config
        if c.tts_model_type == "base":
            raise ValueError("this is a voice-clone (base) checkpoint: it needs a reference-audio speaker "
                             "embedding, which streamvox does not support; use a CustomVoice checkpoint")
        if non_streaming_mode is None:
            non_streaming_mode = self.default_non_streaming_mode()
        if c.tts_model_size in "0b6":  # the official wrapper's test: 0.6B models ignore instructions
            instruct = None
        if speaker and speaker.lower() not in c.speakers:
            raise ValueError(f"unsupported speaker {speaker!r}; supported: {self.voices()}")
        language_id = self.language_id(speaker, language)

        # Codec part: think/language tags, speaker, then [pad, bos].
        if language_id is None:
            codec = [c.codec_nothink_id, c.codec_think_bos_id, c.codec_think_eos_id]
        else:
            codec = [c.codec_think_id, c.codec_think_bos_id, language_id, c.codec_think_eos_id]
        if speaker:
            codec.append(c.speakers[speaker.lower()])
        codec += [c.codec_pad_id, c.codec_bos_id]

        text_ids: list[int] = []
        codec_ids: list[int] = []
        if instruct:  # "<|im_start|>user\n{instruct}<|im_end|>\n", text part only, before everything
            inst = self.tokenizer.encode(f"<|im_start|>user\n{instruct}<|im_end|>\n")
            text_ids += inst
            codec_ids += [NO_CODEC] * len(inst)
        text_ids += ids[:3]  # <|im_start|>assistant\n
        codec_ids += [NO_CODEC] * 3
        text_ids += [c.tts_pad_token_id] * (len(codec) - 2) + [c.tts_bos_token_id]
        codec_ids += codec[:-1]
        body = ids[3:-5]  # the text between the role and "<|im_end|>\n<|im_start|>assistant\n"
        if non_streaming_mode:
            text_ids += body + [c.tts_eos_token_id, c.tts_pad_token_id]
            codec_ids += [c.codec_pad_id] * (len(body) + 1) + [c.codec_bos_id]
            trailing: list[int] = []
        else:
            text_ids += ids[3:4]
            codec_ids += [c.codec_bos_id]
            trailing = ids[4:-5] + [c.tts_eos_token_id]
        return TalkerPrompt(tuple(text_ids), tuple(codec_ids), tuple(trailing), c.tts_pad_token_id)


__all__ = ["NO_CODEC", "PromptBuilder", "TalkerPrompt"]
