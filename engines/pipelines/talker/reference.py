"""The Qwen3-TTS talker run plainly, one utterance at a time: the reference loop.

    bundle = TalkerBundle.from_checkpoint("/models/Qwen3-TTS-12Hz-0.6B-CustomVoice", device="cpu")
    codes = bundle.generate_codes("Hello.", "Vivian", language="Auto", greedy=True)   # LongTensor [T, G]

    base = TalkerBundle.from_checkpoint("/models/Qwen3-TTS-12Hz-0.6B-Base")          # voice cloning
    clone = base.clone_voice(wav_24k, ref_text="Transcript of the reference.")    # x_vector_only=True: no text
    codes = base.generate_codes("Hello.", None, clone=clone, greedy=True)         # generated frames only

:func:`generate_codes` is the reference loop, written the way the official
``Qwen3TTSForConditionalGeneration.generate`` + HF ``generate()`` run it: full codec
vocabulary, the official logits processors (repetition penalty over generated code-0
ids, min_new_tokens 2, suppression of [V-1024, V) except EOS), EOS ends the utterance
(and is not a frame), ``max_new_tokens = N`` gives at most N-1 frames. Every ``None``
argument means what the official package does for this checkpoint (generation_config.json,
then the package's hard defaults). The directory is read by engines/checkpoints/qwen3_tts.py
(:func:`~engines.checkpoints.qwen3_tts.load_talker`); the batched engine path is
``engines/pipelines/talker/source.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engines.checkpoints.qwen3_tts import TalkerGenerationConfig, load_talker
from engines.checkpoints.qwen3_voice import VoiceEncoders, load_voice_encoders
from engines.contract import VoiceClone
from engines.models.code_predictor import CodePredictor
from engines.models.sampling import FrameSampling, apply_talker_processors, sample_code0
from engines.models.talker import Talker
from engines.pipelines.talker.prompt import EMBEDDED, PromptBuilder, TalkerPrompt


@dataclass
class TalkerBundle:
    """What the talker pipeline runs: models, prompt builder, generation defaults.

    Built from the checkpoint loader's :class:`~engines.checkpoints.qwen3_tts.Qwen3TTSTalker`
    (or by hand in tests); it lives here, not in checkpoints/, because it holds the
    :class:`PromptBuilder` and runs the reference loop, both pipeline code."""

    talker: Talker
    predictor: CodePredictor
    prompt: PromptBuilder
    generation: TalkerGenerationConfig
    path: str
    device: torch.device
    dtype: torch.dtype
    voice_encoders: VoiceEncoders | None = None  # Base checkpoints: speaker + speech-tokenizer encoders

    @classmethod
    def from_checkpoint(cls, path: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32, predictor: CodePredictor | None = None) -> "TalkerBundle":
        """The talker of a Qwen3-TTS directory (sharing ``predictor`` when given)."""
        t = load_talker(path, device, dtype, predictor=predictor)
        prompt = PromptBuilder(t.prompt, t.tokenizer, frame_embedder(t.talker, t.predictor))
        return cls(t.talker, t.predictor, prompt, t.generation, t.path, t.device, t.dtype,
                   voice_encoders=load_voice_encoders(path, t.device, t.dtype))

    @property
    def task_type(self) -> str:
        return self.prompt.task_type

    def clone_voice(self, wav, ref_text: str | None = None, x_vector_only: bool = False) -> VoiceClone:
        """A reference voice (float32 mono at 24 kHz) -> its prompt features (Base checkpoints)."""
        if self.voice_encoders is None:
            raise ValueError(f"{self.path} is not a Base checkpoint: it has no speaker encoder")
        features = self.voice_encoders.features(wav)
        if x_vector_only:
            return VoiceClone(features.xvector)
        return VoiceClone(features.xvector, features.codes, ref_text)

    def voices(self) -> list[str]:
        return self.prompt.voices()

    def languages(self) -> list[str]:
        return self.prompt.languages()

    def generate_codes(self, text: str, voice: str | None, language: str = "Auto", greedy: bool = False,
                       max_new_tokens: int | None = None, non_streaming_mode: bool | None = None,
                       repetition_penalty: float | None = None, seed: int = 0,
                       instruct: str | None = None, clone: VoiceClone | None = None) -> torch.Tensor:
        return generate_codes(self.talker, self.predictor, self.prompt, text, voice, language=language,
                              greedy=greedy, max_new_tokens=max_new_tokens, non_streaming_mode=non_streaming_mode,
                              repetition_penalty=repetition_penalty, seed=seed, generation=self.generation,
                              instruct=instruct, clone=clone)


# --------------------------------------------------------------------------- reference loop


def prompt_tensors(talker: Talker, prompt: TalkerPrompt, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> prefill inputs [S, D], trailing text parts [T, D], tts_pad text part [D]."""
    (x,), (trailing,), pad = batch_prompt_tensors(talker, [prompt], device)
    return x, trailing, pad


def batch_prompt_tensors(talker: Talker, prompts: list[TalkerPrompt],
                         device) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Several prompts' inputs in one pass: -> prefill inputs [S_i, D] and trailing text parts
    [T_i, D] per prompt (views of one tensor each), the tts_pad text part [D]. The ids of all
    prompts go up in one copy and through the embeddings once, so admitting n requests launches
    the kernels of one (the work is launch bound on a GPU). Every op is per position, so a
    prompt's values do not depend on the others' beyond the GEMM's blocking (one prompt: exactly
    :func:`prompt_tensors`)."""
    def upload(ids) -> torch.Tensor:  # non_blocking: no stream sync at admission
        return torch.tensor(ids, dtype=torch.long).to(device, non_blocking=True)

    text = upload([i for p in prompts for i in p.text_ids])
    codec = upload([c for p in prompts for c in p.codec_ids])
    xs = list(talker.prompt_embeds(text, codec).split([len(p.text_ids) for p in prompts]))
    trailing = talker.text_part(upload([i for p in prompts for i in p.trailing_text_ids]))
    trailings = list(trailing.split([len(p.trailing_text_ids) for p in prompts]))
    pad = talker.text_part(upload([prompts[0].pad_text_id]))[0]
    for k, prompt in enumerate(prompts):
        if prompt.codec_embeds is not None:  # x-vector / reference frames: codec parts given as vectors
            where = upload([i for i, c in enumerate(prompt.codec_ids) if c == EMBEDDED])
            xs[k] = xs[k].index_add(0, where, prompt.codec_embeds.to(device=xs[k].device, dtype=xs[k].dtype))
    return xs, trailings, pad


def frame_embedder(talker: Talker, predictor: CodePredictor):
    """codes [T, G] -> [T, D] frame embeddings on the talker's device (in-context cloning's reference)."""
    def embed(codes: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return frame_embedding(talker, predictor, codes.to(talker.codec_head.weight.device))
    return embed


def frame_embedding(talker: Talker, predictor: CodePredictor, codes: torch.Tensor) -> torch.Tensor:
    """codes [B, G] -> sum of the frame's G code embeddings [B, D] (code 0 via the talker's
    table, code g via the predictor's table g-1), summed in the official order."""
    parts = [talker.codec_part(codes[:, 0])]
    parts += [predictor.model.codec_embedding[g - 1](codes[:, g]) for g in range(1, codes.shape[1])]
    return torch.stack(parts, dim=1).sum(1)


@torch.no_grad()
def generate_codes(talker: Talker, predictor: CodePredictor, prompt_builder: PromptBuilder, text: str,
                   voice: str | None, language: str = "Auto", greedy: bool = False, max_new_tokens: int | None = None,
                   non_streaming_mode: bool | None = None, repetition_penalty: float | None = None, seed: int = 0,
                   generation: TalkerGenerationConfig | None = None, instruct: str | None = None,
                   clone: VoiceClone | None = None) -> torch.Tensor:
    """One utterance -> LongTensor [T, G] (see the module docstring; in-context cloning: the
    generated frames, without the reference frames the prompt holds)."""
    gen = generation or TalkerGenerationConfig.from_dict({})
    n_max = gen.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
    penalty = gen.repetition_penalty if repetition_penalty is None else float(repetition_penalty)
    prompt = prompt_builder.build(text, voice, language, non_streaming_mode, instruct=instruct, clone=clone)
    device = talker.codec_head.weight.device
    dtype = talker.codec_head.weight.dtype
    cfg = talker.cfg
    g = cfg.num_code_groups
    eos = cfg.codec_eos_token_id
    x, trailing, pad = prompt_tensors(talker, prompt, device)
    s = x.shape[0]
    cache = talker.new_cache(1, s + max(n_max, 1), device, dtype)

    talker_greedy = greedy or not gen.do_sample
    code0_sampling = FrameSampling.for_stream(1, seed, 0, device, greedy=talker_greedy,
                                              temperature=gen.temperature, top_k=gen.top_k, top_p=gen.top_p)
    suppressed = torch.ones(cfg.vocab_size, dtype=torch.bool, device=device)
    suppressed[talker.valid_ids] = False
    ids = torch.arange(cfg.vocab_size, device=device)

    h = talker(x[None], torch.arange(s, device=device)[None], cache, attend_len=s)  # [1, D]
    generated: list[int] = []
    frames: list[torch.Tensor] = []
    for step in range(n_max):
        scores = talker.logits(h).float()  # [1, V], full vocabulary as HF sees it
        seen = torch.zeros_like(scores, dtype=torch.bool)
        if generated:
            seen[0, torch.tensor(generated, device=device)] = True
        blocked = torch.tensor([step < gen.min_new_tokens], device=device)
        scores = apply_talker_processors(scores, seen, penalty, eos, blocked)
        scores = scores.masked_fill(suppressed, float("-inf"))
        sampling = FrameSampling(code0_sampling.seed_lo, code0_sampling.seed_hi,
                                 torch.tensor([step], device=device), code0_sampling.greedy,
                                 code0_sampling.temperature, code0_sampling.top_k, code0_sampling.top_p,
                                 code0_sampling.all_greedy, code0_sampling.any_top_p)
        code0 = ids[sample_code0(scores, ids, sampling)]  # [1]
        token = int(code0)
        generated.append(token)
        if token == eos or step == n_max - 1:  # the last sampled code 0 never gets its residual codes
            break
        sub = FrameSampling.for_stream(1, seed, step, device, greedy=greedy or not gen.subtalker_dosample,
                                       temperature=gen.subtalker_temperature, top_k=gen.subtalker_top_k,
                                       top_p=gen.subtalker_top_p)
        rest = predictor.predict(h, talker.codec_part(code0), sub)  # [1, G-1]
        frame = torch.cat([code0[:, None], rest], dim=1)  # [1, G]
        frames.append(frame[0])
        text_part = trailing[step] if step < trailing.shape[0] else pad
        nxt = frame_embedding(talker, predictor, frame) + text_part  # [1, D]
        h = talker(nxt[:, None], torch.tensor([[s + step]], device=device), cache, attend_len=s + step + 1)
    if not frames:
        return torch.zeros(0, g, dtype=torch.long, device=device)
    return torch.stack(frames)


__all__ = ["TalkerBundle", "batch_prompt_tensors", "frame_embedder", "frame_embedding", "generate_codes",
           "prompt_tensors"]
