"""A small random Qwen3-TTS talker bundle built in-process (no oracle needed).

Fan-in scaled weights (N(0, 1/sqrt(fan_in)), embeddings N(0, 1), norms ~ 1) so the codes
depend on the text, voice and language; a byte-level BPE trained on a few sentences with
the special tokens the prompt needs.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engines.checkpoints.qwen3_text import QWEN2_SPLIT, PromptConfig, QwenTextTokenizer
from engines.checkpoints.qwen3_tts import TalkerGenerationConfig
from engines.models.code_predictor import CodePredictor
from engines.models.configs import CodePredictorConfig
from engines.models.talker import Talker, TalkerConfig
from engines.pipelines.talker.prompt import PromptBuilder
from engines.pipelines.talker.reference import TalkerBundle

CORPUS = ["assistant assistant assistant user user the quick brown fox jumps over the lazy dog",
          "Hello world, this is a small test of streaming speech.", "你好，世界。数字 2026 and 42."] * 4
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>"]


def make_tokenizer(extra_corpus: tuple[str, ...] = ()) -> QwenTextTokenizer:
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS + list(extra_corpus), trainers.BpeTrainer(vocab_size=400, show_progress=False, special_tokens=[],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in SPECIALS])
    return QwenTextTokenizer(tok, QWEN2_SPLIT)


@torch.no_grad()
def randomize(module: nn.Module, g: torch.Generator) -> None:
    for m in module.modules():
        for name, p in m.named_parameters(recurse=False):
            if isinstance(m, nn.Linear) and name == "weight":
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
            elif isinstance(m, nn.Linear):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif isinstance(m, nn.Embedding):
                p.copy_(torch.randn(p.shape, generator=g))
            else:  # norms
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))


@torch.no_grad()
def make_bundle(seed: int = 0, groups: int = 4, codebook: int = 32, hidden: int = 32, max_new_tokens: int = 24,
                eos_gain: float = 1.5, layers: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                predictor_hidden: int = 32, predictor_layers: int = 2, text_hidden: int = 24,
                intermediate: int | None = None, predictor_intermediate: int | None = None,
                predictor_heads: int = 4, predictor_kv_heads: int = 2, predictor_head_dim: int | None = None,
                device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> TalkerBundle:
    tok = make_tokenizer()
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    cb = codebook
    q = head_dim // 2  # rotary pairs, split 3 ways like [24, 20, 20] of 64
    section = (q - 2 * (q * 5 // 16), q * 5 // 16, q * 5 // 16)
    tcfg = TalkerConfig(hidden_size=hidden, intermediate_size=intermediate or 2 * hidden, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                        mrope_section=section, vocab_size=cb + 1024, text_vocab_size=tok.vocab_size + 2,
                        text_hidden_size=text_hidden, num_code_groups=groups, codec_eos_token_id=cb + 102)
    pcfg = CodePredictorConfig(vocab_size=cb, hidden_size=predictor_hidden,
                               intermediate_size=predictor_intermediate or 2 * predictor_hidden,
                               num_hidden_layers=predictor_layers, num_attention_heads=predictor_heads,
                               num_key_value_heads=predictor_kv_heads, head_dim=predictor_head_dim or predictor_hidden // predictor_heads,
                               num_code_groups=groups, talker_hidden_size=hidden)
    prompt_cfg = PromptConfig(
        tts_model_type="custom_voice", tts_pad_token_id=ids["<tts_pad>"], tts_bos_token_id=ids["<tts_text_bos>"],
        tts_eos_token_id=ids["<tts_text_eod>"], codec_pad_id=cb + 100, codec_bos_id=cb + 101,
        codec_think_id=cb + 106, codec_nothink_id=cb + 107, codec_think_bos_id=cb + 108, codec_think_eos_id=cb + 109,
        speakers={"vivian": cb + 200, "ryan": cb + 201, "dylan": cb + 202},
        speaker_dialects={"vivian": False, "ryan": False, "dylan": "beijing_dialect"},
        language_ids={"chinese": cb + 50, "english": cb + 51, "beijing_dialect": cb + 60})
    g = torch.Generator().manual_seed(seed)
    talker, predictor = Talker(tcfg), CodePredictor(pcfg)
    randomize(talker, g)
    randomize(predictor, g)
    talker.codec_head.weight[tcfg.codec_eos_token_id] *= eos_gain  # EOS within a few dozen steps
    generation = TalkerGenerationConfig.from_dict({"max_new_tokens": max_new_tokens})
    device = torch.device(device)
    return TalkerBundle(talker.to(device, dtype).eval(), predictor.to(device, dtype).eval(),
                        PromptBuilder(prompt_cfg, tok), generation, "<random>", device, dtype)


def step(source, scheduler=None):
    """One tick of a TalkerSource driven directly (no engine), under the core scheduler's plan:
    the admission and prefill decisions, the prefill token budget included, are the scheduler's
    (engines/core/scheduler.py; ``None``: one with the default budget)."""
    from engines.core.scheduler import Scheduler

    scheduler = scheduler or Scheduler(max_slots=source.max_slots)
    return source.tick(scheduler.step_plan(source.capacity()))


def admissible(source, scheduler=None) -> int:
    """Rows the core scheduler would fill now from what the source reports (and the prompts waiting
    in ``scheduler``'s queue, if given)."""
    from engines.core.scheduler import Scheduler

    scheduler = scheduler or Scheduler(max_slots=source.max_slots)
    return scheduler.free_slots(source.capacity())


def waiting_prompt(scheduler, positions: int, request_id: str = "waiting"):
    """``scheduler`` with a request WAITING in its queue whose prompt takes ``positions`` positions
    (the scheduler keeps KV blocks for it); -> the scheduler."""
    from engines.contract import RequestHandle, SynthesisRequest
    from engines.core.scheduler import RequestState
    from engines.pipelines.base import Prepared

    state = RequestState(handle=RequestHandle(SynthesisRequest(id=request_id, text="x")), deliver=print)
    scheduler.add(state, Prepared(frames=1, prompt_positions=positions))
    return scheduler
