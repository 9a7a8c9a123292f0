"""The official codec decoder's waveforms for a set of code frames, in float32 and in bfloat16
(the precision the release is evaluated and served in): the yardstick benchmarks/codec_fidelity.py
holds our decoder's precisions to.

Runs with the official code (the oracle: .venv-oracle):

    .venv-oracle/bin/python benchmarks/official_codec.py CHECKPOINT_DIR CODES.json OUT.npz

``CODES.json``: benchmarks/official_codes.py's output (its cases' greedy frames), to which
``--random N`` utterances of ``--random-frames`` uniformly random frames are added (seeded).
``--calibrated DIR``: first write DIR, the checkpoint with its codec decoder rescaled as the
oracle fixtures' are (tests/oracle/make_fixtures.py ``calibrate_output_scale_``: activations O(1),
audio at RMS ~0.25; a random decoder with plain init saturates at +-1, where every precision
clips alike), and decode with that. ``OUT.npz`` holds, per case ``k``: ``codes_k`` [T, G], ``fp32_k`` and ``bf16_k`` [T * 1920].
The official ``Qwen3TTSModel.from_pretrained(..., dtype=torch.bfloat16)`` hands its dtype to the
speech tokenizer too, so a bf16 model decodes in bf16; here the tokenizer is loaded alone, once
per dtype, the same way.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "oracle"))

import official  # noqa: E402,F401  (stubs optional audio packages, pins transformers)
import numpy as np  # noqa: E402
import torch  # noqa: E402
from make_fixtures import calibrate_output_scale_  # noqa: E402
from qwen_tts.inference.qwen3_tts_tokenizer import Qwen3TTSTokenizer  # noqa: E402


def write_calibrated(checkpoint: Path, out: Path, groups: int) -> Path:
    """``out``: links to ``checkpoint``'s files, with a speech tokenizer whose decoder is calibrated."""
    out.mkdir(parents=True, exist_ok=True)
    for item in checkpoint.iterdir():
        if item.name != "speech_tokenizer" and not (out / item.name).exists():
            (out / item.name).symlink_to(item.resolve())
    tok = Qwen3TTSTokenizer.from_pretrained(str(checkpoint / "speech_tokenizer"), dtype=torch.float32,
                                            local_files_only=True)
    size = tok.model.config.decoder_config.codebook_size
    with torch.no_grad():
        calibrate_output_scale_(tok.model.decoder, SimpleNamespace(codebook_size=size, num_code_groups=groups),
                                torch.Generator().manual_seed(0))
    tok.model.save_pretrained(out / "speech_tokenizer", safe_serialization=True)
    shutil.copy(checkpoint / "speech_tokenizer" / "preprocessor_config.json", out / "speech_tokenizer")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("codes", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--random", type=int, default=2, help="utterances of random frames added (default 2)")
    ap.add_argument("--random-frames", type=int, default=60)
    ap.add_argument("--calibrated", type=Path, default=None, metavar="DIR",
                    help="write the checkpoint with a calibrated codec decoder here and decode with it")
    args = ap.parse_args()
    cases = [np.asarray(c["codes"], dtype=np.int64) for c in json.loads(args.codes.read_text())["cases"]]
    groups = cases[0].shape[1]
    checkpoint = args.checkpoint if args.calibrated is None else write_calibrated(args.checkpoint, args.calibrated, groups)
    tok_dir = checkpoint / "speech_tokenizer"
    size = json.loads((tok_dir / "config.json").read_text())["decoder_config"]["codebook_size"]
    rng = np.random.default_rng(0)
    cases += [rng.integers(0, size, (args.random_frames, groups)) for _ in range(args.random)]
    out: dict[str, np.ndarray] = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        tok = Qwen3TTSTokenizer.from_pretrained(str(tok_dir), dtype=dtype, local_files_only=True)
        assert next(tok.model.decoder.parameters()).dtype == dtype
        for k, codes in enumerate(cases):
            with torch.no_grad():
                wavs, _ = tok.decode([{"audio_codes": torch.from_numpy(codes)}])
            out[f"{name}_{k}"] = wavs[0].astype(np.float32)
            out[f"codes_{k}"] = codes
        print(f"official_codec: {len(cases)} cases decoded in {name}")
    np.savez(args.out, **out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
