"""Import the OFFICIAL qwen-tts 0.1.1 model code inside .venv-oracle.

Runs only in the oracle virtualenv (scripts/oracle-env.sh), never in streamvox's own.

The package ``__init__`` (and the modules the model file pulls in through
``qwen_tts.inference``) import librosa, soundfile, sox, onnxruntime, torchaudio and
einops. Those serve audio I/O, the speaker-encoder mel front end and the 25 Hz
tokenizer, none of which the code predictor, codec head or 12 Hz decoder touch. We do
not install them (torchaudio alone pins its own, possibly CUDA, torch); instead each
missing one is replaced by a stub module whose every attribute raises when *called*,
so an accidental use fails loudly instead of computing something wrong.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import sys
import types

_OPTIONAL = {
    "librosa": ["librosa.filters"],
    "soundfile": [],
    "sox": [],
    "onnxruntime": [],
    "torchaudio": ["torchaudio.compliance", "torchaudio.compliance.kaldi"],
    "einops": [],
}


class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def _unavailable(*args, **kwargs):
            raise RuntimeError(f"{self.__name__}.{name} is a stub in the oracle venv (not installed)")

        return _unavailable


def _install_stub(name: str) -> None:
    module = _Stub(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__path__ = []
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)


STUBBED: list[str] = []
for _name, _subs in _OPTIONAL.items():
    try:
        importlib.import_module(_name)
        for _sub in _subs:
            importlib.import_module(_sub)
    except ImportError:
        for _key in [k for k in sys.modules if k == _name or k.startswith(_name + ".")]:
            del sys.modules[_key]
        for _stub_name in [_name, *_subs]:
            _install_stub(_stub_name)
        STUBBED.append(_name)

import transformers  # noqa: E402

if transformers.__version__ != "4.57.3":
    raise RuntimeError(f"the oracle needs transformers 4.57.3 (qwen-tts pins it), found {transformers.__version__}")

# The package prints a flash-attn banner on import: keep stdout clean for callers
# that parse it (tests/oracle/bench_generate.py prints JSON lines).
with contextlib.redirect_stdout(sys.stderr):
    from qwen_tts.core.models.configuration_qwen3_tts import (  # noqa: E402
        Qwen3TTSConfig,
        Qwen3TTSTalkerCodePredictorConfig,
        Qwen3TTSTalkerConfig,
    )
    from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSForConditionalGeneration  # noqa: E402
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import (  # noqa: E402
        Qwen3TTSTokenizerV2Config,
    )
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import (  # noqa: E402
        Qwen3TTSTokenizerV2Model,
    )


__all__ = [
    "STUBBED",
    "Qwen3TTSConfig",
    "Qwen3TTSTalkerConfig",
    "Qwen3TTSTalkerCodePredictorConfig",
    "Qwen3TTSForConditionalGeneration",
    "Qwen3TTSTokenizerV2Config",
    "Qwen3TTSTokenizerV2Model",
]
