"""Reading Hugging Face-style checkpoint directories with strict checking.

Generic pieces (no Qwen3-TTS knowledge here; see ``engines/checkpoints/qwen3_tts.py``):

* :func:`read_json` - a config file, with errors that name the file;
* :class:`SafetensorsFiles` - one ``model.safetensors`` or a sharded set listed in
  ``model.safetensors.index.json``; tensors are read lazily, by name;
* :func:`load_into` - fill an ``nn.Module`` from the tensors under a key prefix.

The rule is *strict inside, tolerant outside*: a real directory holds much more than
we load (the whole talker, a speaker encoder, the speech-tokenizer encoder), and that is
fine; but inside what we load, a missing tensor, an unexpected tensor, a wrong shape
or a non-float dtype is a :class:`CheckpointError` naming the file and the tensors,
never a silently half-initialised model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from safetensors import safe_open
from torch import nn

WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Floating dtypes accepted in a checkpoint; tensors are cast to the requested dtype."""

_SHOW = 8  # how many tensor names an error lists before "and N more"


class CheckpointError(ValueError):
    """A checkpoint directory is missing something, or holds something malformed."""


def _names(items: Iterable[str]) -> str:
    items = sorted(items)
    shown = ", ".join(items[:_SHOW])
    return shown + (f" (and {len(items) - _SHOW} more)" if len(items) > _SHOW else "")


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; CheckpointError if missing or malformed."""
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def require(config: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    """``config[key]`` checked against ``kind``; ``where`` names the file (and section)."""
    if key not in config:
        raise CheckpointError(f"{where}: missing key {key!r}")
    value = config[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # bool is an int in Python; a config saying `"hidden_size": true` is still wrong.
    if isinstance(value, bool) and bool not in kinds:
        raise CheckpointError(f"{where}: {key!r} must be {'/'.join(k.__name__ for k in kinds)}, got {value!r}")
    if not isinstance(value, kinds):
        raise CheckpointError(f"{where}: {key!r} must be {'/'.join(k.__name__ for k in kinds)}, got {value!r}")
    return value


class SafetensorsFiles:
    """The safetensors weights of one directory (single file or sharded), read lazily."""

    def __init__(self, directory: Path, stem: str = "model"):
        self.directory = directory
        single = directory / f"{stem}.safetensors"
        index = directory / f"{stem}.safetensors.index.json"
        self._where: dict[str, Path] = {}
        if single.is_file():
            self.files = [single]
        elif index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index}: missing or empty 'weight_map'")
            self.files = sorted({directory / str(name) for name in weight_map.values()})
            for path in self.files:
                if not path.is_file():
                    raise CheckpointError(f"{index}: lists shard {path.name}, which does not exist")
        else:
            raise CheckpointError(f"{directory}: no {single.name} (or {index.name})")
        self._handles = {}
        for path in self.files:
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None
            self._handles[path] = handle
            for key in handle.keys():
                self._where[key] = path

    @property
    def label(self) -> str:
        """How errors name these weights."""
        return str(self.files[0]) if len(self.files) == 1 else f"{self.directory}/{self.files[0].stem}-*.safetensors"

    def keys(self) -> list[str]:
        return list(self._where)

    def under(self, prefix: str) -> list[str]:
        return [k for k in self._where if k.startswith(prefix)]

    def get(self, key: str) -> torch.Tensor:
        return self._handles[self._where[key]].get_tensor(key)

    def __contains__(self, key: str) -> bool:
        return key in self._where


def load_into(module: nn.Module, files: SafetensorsFiles, prefix: str, *, device, dtype: torch.dtype,
              only: Iterable[str] | None = None) -> set[torch.dtype]:
    """Fill ``module`` from the tensors ``prefix + name`` for every state-dict name.

    Strict: every module tensor must be present with the same shape and a floating
    dtype in WEIGHT_DTYPES; every file tensor under ``prefix`` must belong to the
    module. ``only`` narrows the prefix to exact names, for a prefix such as
    ``talker.`` that also holds tensors we deliberately do not load.
    Returns the dtypes the tensors were stored in.
    """
    expected = module.state_dict()
    if only is not None:
        present = [prefix + name for name in only if prefix + name in files]
    else:
        present = files.under(prefix)
    found = {key[len(prefix):] for key in present}
    missing = set(expected) - found
    unexpected = found - set(expected)
    scope = f"under {prefix!r}" if only is None else f"among {_names(prefix + n for n in only)}"
    if missing:
        raise CheckpointError(f"{files.label}: missing tensors {scope}: {_names(prefix + n for n in missing)}")
    if unexpected:
        raise CheckpointError(f"{files.label}: unexpected tensors {scope} (wrong config or layout?): "
                              f"{_names(prefix + n for n in unexpected)}")
    state = {}
    bad_shape, bad_dtype = [], []
    stored: set[torch.dtype] = set()
    for name, param in expected.items():
        tensor = files.get(prefix + name)
        stored.add(tensor.dtype)
        if tensor.shape != param.shape:
            bad_shape.append(f"{prefix + name} {tuple(tensor.shape)} (expected {tuple(param.shape)})")
        elif tensor.dtype not in WEIGHT_DTYPES:
            bad_dtype.append(f"{prefix + name} {tensor.dtype}")
        else:
            state[name] = tensor.to(device=device, dtype=dtype)
    if bad_shape:
        raise CheckpointError(f"{files.label}: shape mismatch: {_names(bad_shape)}")
    if bad_dtype:
        raise CheckpointError(f"{files.label}: unsupported dtype (need float32/bfloat16/float16): "
                              f"{_names(bad_dtype)}")
    module.to(device=device, dtype=dtype)
    module.load_state_dict(state, strict=True)
    return stored
