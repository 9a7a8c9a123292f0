"""The text side of a Qwen3-TTS directory: the text tokenizer files and the prompt ids of ``config.json``.

    tok = QwenTextTokenizer.from_dir(checkpoint_dir)          # vocab.json + merges.txt + tokenizer_config.json
    ids = PromptConfig.from_config(read_json(checkpoint_dir / "config.json"))

Tokenizer: the releases ship a Qwen2 byte-level BPE without ``tokenizer.json``;
transformers builds the fast tokenizer from the two files (``Qwen2Converter``): NFC
normaliser, the Qwen2 split regex + ByteLevel pre-tokeniser, BPE without unk, added
tokens (``tokenizer_config.json`` ``added_tokens_decoder``) matched before splitting.
The official processor is loaded with ``fix_mistral_regex=True``; transformers 4.57.3
then swaps the split regex (a camelCase-aware one) when the base vocabulary exceeds
100 000 ids and the directory's ``config.json`` does not exempt it (see
:func:`_swaps_split_regex`). We reproduce that decision with the ``tokenizers`` package.

The prompt itself is built from these in engines/pipelines/talker/prompt.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from engines.checkpoints.files import CheckpointError, read_json, require

QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
# What transformers 4.57.3 installs under fix_mistral_regex=True.
FIXED_SPLIT = (r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"""
               r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"""
               r""" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
_MISTRAL_TYPES = ("mistral", "mistral3", "voxtral", "ministral", "pixtral")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def _swaps_split_regex(vocab_size: int, model_config: Mapping[str, Any] | None) -> bool:
    """transformers 4.57.3 ``_patch_mistral_regex`` for a local directory, called with
    ``fix_mistral_regex=True``: swap unless the vocabulary is small, there is no config.json,
    the config was written by transformers <= 4.57.2 for a non-Mistral model, or by >= 5."""
    if vocab_size <= 100_000 or model_config is None:
        return False
    written = model_config.get("transformers_version")
    if written:
        v = _version(str(written))
        if v <= (4, 57, 2):
            model_type = model_config.get("model_type")
            if model_type is not None and model_type not in _MISTRAL_TYPES:
                return False
        elif v >= (5, 0, 0):
            return False
    return True


class QwenTextTokenizer:
    """Byte-level BPE of a Qwen3-TTS checkpoint, via the ``tokenizers`` package."""

    def __init__(self, tokenizer, split_regex: str):
        self._tok = tokenizer
        self.split_regex = split_regex

    @classmethod
    def from_dir(cls, directory: str | Path) -> "QwenTextTokenizer":
        from tokenizers import (
            AddedToken,
            Regex,
            Tokenizer,
            decoders,
            models,
            normalizers,
            pre_tokenizers,
        )

        root = Path(directory)
        config_file = root / "tokenizer_config.json"
        config = read_json(config_file) if config_file.is_file() else {}
        if (root / "tokenizer.json").is_file():  # transformers prefers it when present
            tok = Tokenizer.from_file(str(root / "tokenizer.json"))
        else:
            vocab, merges = root / "vocab.json", root / "merges.txt"
            for f in (vocab, merges):
                if not f.is_file():
                    raise CheckpointError(f"{f}: file not found (the text tokenizer needs vocab.json + merges.txt)")
            # transformers' Qwen2Converter, field by field.
            tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges), dropout=None, unk_token=None,
                                                 continuing_subword_prefix="", end_of_word_suffix="",
                                                 fuse_unk=False, byte_fallback=False))
            tok.normalizer = normalizers.NFC()
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
            tok.decoder = decoders.ByteLevel()
            added = config.get("added_tokens_decoder", {})
            for key in sorted(added, key=int):  # in id order, so each lands on its id
                spec = added[key]
                token = AddedToken(spec["content"], single_word=spec.get("single_word", False),
                                   lstrip=spec.get("lstrip", False), rstrip=spec.get("rstrip", False),
                                   normalized=spec.get("normalized", not spec.get("special", False)),
                                   special=spec.get("special", False))
                if token.content not in tok.get_vocab(with_added_tokens=True):
                    if spec.get("special", False):
                        tok.add_special_tokens([token])
                    else:
                        tok.add_tokens([token])
                got = tok.token_to_id(spec["content"])
                if got != int(key):
                    raise CheckpointError(f"{config_file}: added token {spec['content']!r} has id {key} but "
                                          f"lands on {got} (ids must follow the vocabulary)")
        model_config_file = root / "config.json"
        model_config = read_json(model_config_file) if model_config_file.is_file() else None
        regex = QWEN2_SPLIT
        if _swaps_split_regex(tok.get_vocab_size(with_added_tokens=False), model_config):
            regex = FIXED_SPLIT
            pre = tok.pre_tokenizer
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(FIXED_SPLIT), behavior="isolated"), pre[1]])
        return cls(tok, regex)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)


@dataclass(frozen=True)
class PromptConfig:
    """The ids the prompt needs, from ``config.json`` (top level + ``talker_config``)."""

    tts_model_type: str
    tts_pad_token_id: int
    tts_bos_token_id: int
    tts_eos_token_id: int
    codec_pad_id: int
    codec_bos_id: int
    codec_think_id: int
    codec_nothink_id: int
    codec_think_bos_id: int
    codec_think_eos_id: int
    speakers: Mapping[str, int]  # lower-case name -> codec id
    speaker_dialects: Mapping[str, str | bool]  # lower-case name -> dialect language key or False
    language_ids: Mapping[str, int]  # lower-case name -> codec id (dialects included)
    tts_model_size: str = ""

    @classmethod
    def from_config(cls, config: Mapping[str, Any], where: str = "config.json") -> "PromptConfig":
        talker = require(config, "talker_config", dict, where)
        tw = f"{where} [talker_config]"
        ids = {k: require(config, k, int, where) for k in ("tts_pad_token_id", "tts_bos_token_id", "tts_eos_token_id")}
        ids |= {k: require(talker, k, int, tw) for k in (
            "codec_pad_id", "codec_bos_id", "codec_think_id", "codec_nothink_id", "codec_think_bos_id",
            "codec_think_eos_id")}
        # (a one-element list is what torch.tensor(spk_id) embeds to a single row as well)
        speakers = {str(k).lower(): int(v[0] if isinstance(v, list) else v)
                    for k, v in (talker.get("spk_id") or {}).items()}
        dialects = {str(k).lower(): v for k, v in (talker.get("spk_is_dialect") or {}).items()}
        languages = {str(k).lower(): int(v) for k, v in (talker.get("codec_language_id") or {}).items()}
        for name, dialect in dialects.items():
            if dialect is not False and dialect not in languages:
                raise CheckpointError(f"{tw}: speaker {name!r} has dialect {dialect!r} missing from codec_language_id")
        return cls(tts_model_type=str(config.get("tts_model_type") or ""), speakers=speakers,
                   speaker_dialects=dialects, language_ids=languages,
                   tts_model_size=str(config.get("tts_model_size") or ""), **ids)

    def languages(self) -> list[str]:
        """What the official wrapper accepts: "auto" plus every non-dialect language."""
        return ["auto"] + [name for name in self.language_ids if "dialect" not in name]


__all__ = ["PromptConfig", "QwenTextTokenizer"]
