"""The Qwen3-TTS talker prompt, built exactly as the official package does.

    builder = PromptBuilder(prompt_config, tokenizer, frame_embeddings)   # configs: engines/checkpoints/qwen3_text.py
    prompt = builder.build("Hello.", speaker="Vivian", language="Auto")   # CustomVoice
    prompt = builder.build("Hello.", None, instruct="A calm, low voice.")  # VoiceDesign
    prompt = builder.build("Hello.", None, clone=VoiceClone(xvector, ref_codes, "ref text"))  # Base
    prompt = builder.for_request(request)                                  # the request's fields

Prompt (``Qwen3TTSForConditionalGeneration.generate``): every talker input position is a
text part ``text_projection(text_embedding(id))`` plus, except for the role (and instruct)
positions, a codec part: ``codec_embedding(id)``, or a vector given with the prompt
(:data:`EMBEDDED` positions, in order): the x-vector in the speaker's slot, then, for
in-context cloning, the sum of each reference frame's G code embeddings.

Modes (``generate`` + ``generate_icl_prompt`` of qwen-tts 0.1.1):
* CustomVoice: the speaker's codec id after the think/language tags; instructions
  (``<|im_start|>user\n{instruct}<|im_end|>\n``, text part only) first, dropped on 0.6B.
* VoiceDesign: no speaker; the instruction describes the voice.
* Base, x-vector only: the x-vector in the speaker's slot, then as CustomVoice.
* Base, in-context: the x-vector, then text part = [ref_text ids, text ids, tts_eos] and
  codec part = [codec_bos, reference frames]; non-streaming text mode puts all text first
  (with codec_pad), then the codec part (with tts_pad); streaming text mode pairs them
  position by position (the longer text's tail feeds the decode steps, a shorter text is
  padded with tts_pad). Unlike the other modes there is no "first text id + codec_bos".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from engines.checkpoints.qwen3_text import PromptConfig, QwenTextTokenizer
from engines.contract import SynthesisRequest, VoiceClone


@dataclass(frozen=True)
class TalkerPrompt:
    """Ids of one utterance's talker input.

    Prefill position i = text part of ``text_ids[i]`` + codec part of ``codec_ids[i]``
    (``codec_ids[i] == NO_CODEC``: no codec part; ``EMBEDDED``: the next row of
    ``codec_embeds``). Decode step k adds the text part of ``trailing_text_ids[k]``, or of
    ``pad_text_id`` once they run out. ``reference_frames``: in-context cloning's reference
    codes [T, G], which the decoder must run over before the generated frames.
    """

    text_ids: tuple[int, ...]
    codec_ids: tuple[int, ...]
    trailing_text_ids: tuple[int, ...]
    pad_text_id: int
    codec_embeds: torch.Tensor | None = None  # [number of EMBEDDED positions, D]
    reference_frames: torch.Tensor | None = None  # [T, G] int64 (in-context cloning)

    def __len__(self) -> int:
        return len(self.text_ids)

    def position_inputs(self) -> list[bytes]:
        """What defines each prefill position's input, as bytes (the prefix cache's key
        material): its text and codec ids, and for an EMBEDDED position the vector itself, or
        the reference frame's codes it is the embedding of."""
        embedded = [i for i, c in enumerate(self.codec_ids) if c == EMBEDDED]
        frames = 0 if self.reference_frames is None else self.reference_frames.shape[0]
        vectors = len(embedded) - frames  # the x-vector; the reference frames follow it
        detail: dict[int, bytes] = {}
        if vectors:
            rows = self.codec_embeds[:vectors].detach().to("cpu", torch.float32).contiguous()
            detail.update({i: b"v" + rows[n].numpy().tobytes() for n, i in enumerate(embedded[:vectors])})
        if frames:
            codes = self.reference_frames.to("cpu", torch.int64).contiguous()
            detail.update({i: b"f" + codes[n].numpy().tobytes() for n, i in enumerate(embedded[vectors:])})
        return [f"{t},{c}".encode() + detail.get(i, b"") for i, (t, c) in enumerate(zip(self.text_ids, self.codec_ids))]


NO_CODEC = -1
EMBEDDED = -2

TASK_TYPES = {"base": "Base", "custom_voice": "CustomVoice", "voice_design": "VoiceDesign"}
FrameEmbeddings = Callable[[torch.Tensor], torch.Tensor]  # codes [T, G] -> [T, D] (talker + predictor tables)


class PromptBuilder:
    def __init__(self, config: PromptConfig, tokenizer: QwenTextTokenizer,
                 frame_embeddings: FrameEmbeddings | None = None):
        self.config = config
        self.tokenizer = tokenizer
        self.frame_embeddings = frame_embeddings  # needed for in-context cloning only

    @property
    def task_type(self) -> str:
        """The release's task: "Base" (cloning), "CustomVoice" or "VoiceDesign"."""
        return TASK_TYPES.get(self.config.tts_model_type, "CustomVoice")

    @property
    def instructions_apply(self) -> bool:
        """False on 0.6B CustomVoice releases, whose official wrapper drops instructions; Base never takes them."""
        if self.task_type == "Base":
            return False
        return not (self.task_type == "CustomVoice" and self.config.tts_model_size in "0b6")

    def voices(self) -> list[str]:
        return sorted(self.config.speakers)

    def languages(self) -> list[str]:
        return self.config.languages()

    def default_non_streaming_mode(self) -> bool:
        # generate_custom_voice / generate_voice_design default to True, generate_voice_clone to False.
        return self.config.tts_model_type != "base"

    def tokenize_assistant(self, text: str) -> list[int]:
        return self.tokenizer.encode(f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n")

    def text_tokens(self, request: SynthesisRequest) -> int:
        """How many ids the request's text is (its ``prompt_ids`` when it carries them): the ids
        the talker reads, between the role and the closing tags (as :meth:`build_ids` cuts them)."""
        ids = request.prompt_ids if request.prompt_ids is not None else self.tokenize_assistant(request.text)
        return len(ids[3:-5])

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

    def for_request(self, request: SynthesisRequest, non_streaming_mode: bool | None = None,
                    instruct: str | None = None) -> TalkerPrompt:
        """The prompt of a request: its text (its ``prompt_ids`` when it carries them), voice,
        language, instructions, clone and text mode (explicit arguments win over the request's fields)."""
        if non_streaming_mode is None:
            non_streaming_mode = request.non_streaming_mode
        if instruct is None:
            instruct = request.instructions
        speaker = request.voice if self.task_type == "CustomVoice" else None
        ids = list(request.prompt_ids) if request.prompt_ids is not None else self.tokenize_assistant(request.text)
        return self.build_ids(ids, speaker, request.language, non_streaming_mode, instruct, clone=request.clone)

    def build(self, text: str, speaker: str | None, language: str = "Auto", non_streaming_mode: bool | None = None,
              instruct: str | None = None, clone: VoiceClone | None = None) -> TalkerPrompt:
        return self.build_ids(self.tokenize_assistant(text), speaker, language, non_streaming_mode, instruct, clone)

    def build_ids(self, ids: list[int], speaker: str | None, language: str = "Auto",
                  non_streaming_mode: bool | None = None, instruct: str | None = None,
                  clone: VoiceClone | None = None) -> TalkerPrompt:
        """The prompt from the ids of the wrapped text (what ``tokenize_assistant`` returns;
        live utterances pass the text committed so far, engines/pipelines/talker/live_text.py)."""
        c = self.config
        task = self.task_type
        if task == "Base":
            if clone is None:
                raise ValueError("this is a voice-clone (Base) checkpoint: a request needs reference audio "
                                 "(ref_audio, or a saved voice)")
            speaker = instruct = None  # generate_voice_clone takes neither
        elif clone is not None:
            raise ValueError(f"voice cloning needs a Base checkpoint; this one is {task}")
        elif task == "VoiceDesign":
            if not instruct:
                raise ValueError("a VoiceDesign checkpoint needs instructions that describe the voice")
            speaker = None
        if non_streaming_mode is None:
            non_streaming_mode = self.default_non_streaming_mode()
        if not self.instructions_apply:  # the official wrapper's test: 0.6B models ignore instructions
            instruct = None
        if speaker and speaker.lower() not in c.speakers:
            raise ValueError(f"unsupported speaker {speaker!r}; supported: {self.voices()}")
        language_id = self.language_id(speaker, language)

        # Codec part: think/language tags, speaker (or the x-vector), then [pad, bos].
        if language_id is None:
            codec = [c.codec_nothink_id, c.codec_think_bos_id, c.codec_think_eos_id]
        else:
            codec = [c.codec_think_id, c.codec_think_bos_id, language_id, c.codec_think_eos_id]
        embeds: list[torch.Tensor] = []
        if clone is not None:
            codec.append(EMBEDDED)
            embeds.append(torch.from_numpy(np.asarray(clone.xvector, dtype=np.float32)).reshape(1, -1))
        elif speaker:
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
        reference = None
        if clone is not None and clone.in_context:
            reference, frame_embeds, trailing = self._in_context(clone, body, non_streaming_mode, text_ids,
                                                                 codec_ids)
            embeds.append(frame_embeds)
        elif non_streaming_mode:
            text_ids += body + [c.tts_eos_token_id, c.tts_pad_token_id]
            codec_ids += [c.codec_pad_id] * (len(body) + 1) + [c.codec_bos_id]
            trailing: list[int] = []
        else:
            text_ids += ids[3:4]
            codec_ids += [c.codec_bos_id]
            trailing = ids[4:-5] + [c.tts_eos_token_id]
        codec_embeds = torch.cat([e.to(embeds[-1]) for e in embeds]) if embeds else None
        return TalkerPrompt(tuple(text_ids), tuple(codec_ids), tuple(trailing), c.tts_pad_token_id,
                            codec_embeds=codec_embeds, reference_frames=reference)

    def _in_context(self, clone: VoiceClone, body: list[int], non_streaming_mode: bool, text_ids: list[int],
                    codec_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Append generate_icl_prompt's positions; -> reference codes, their frame embeddings, trailing text ids."""
        c = self.config
        if not clone.ref_text:
            raise ValueError("in-context cloning needs ref_text, the transcript of the reference audio "
                             "(or x_vector_only_mode)")
        if self.frame_embeddings is None:
            raise ValueError("this prompt builder has no frame embeddings (in-context cloning needs the talker's "
                             "and code predictor's codec tables)")
        ref_ids = self.tokenizer.encode(f"<|im_start|>assistant\n{clone.ref_text}<|im_end|>\n")[3:-2]
        codes = torch.from_numpy(np.asarray(clone.ref_codes, dtype=np.int64))
        frame_embeds = self.frame_embeddings(codes)  # [T, D]
        text = ref_ids + body + [c.tts_eos_token_id]
        codec = [c.codec_bos_id] + [EMBEDDED] * codes.shape[0]
        trailing: list[int] = []
        if non_streaming_mode:
            text_ids += text + [c.tts_pad_token_id] * len(codec)
            codec_ids += [c.codec_pad_id] * len(text) + codec
        elif len(text) > len(codec):
            text_ids += text[: len(codec)]
            codec_ids += codec
            trailing = text[len(codec):]
        else:
            text_ids += text + [c.tts_pad_token_id] * (len(codec) - len(text))
            codec_ids += codec
        return codes, frame_embeds, trailing


__all__ = ["EMBEDDED", "NO_CODEC", "TASK_TYPES", "PromptBuilder", "TalkerPrompt"]
