"""The official code's greedy codes for a few utterances of a Qwen3-TTS CustomVoice checkpoint
(the teacher sequences benchmarks/quantize_fidelity.py forces every precision through).

Runs with the official code (the oracle: .venv-oracle):

    .venv-oracle/bin/python benchmarks/official_codes.py CHECKPOINT_DIR OUT.json [--frames 24]

Greedy talker and code predictor (``do_sample=False, subtalker_dosample=False``), fp32, the
checkpoint's own generation_config otherwise; each case's codes [T, G] are written as lists.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "oracle"))

import official  # noqa: E402,F401  (stubs optional audio packages, pins transformers)
import torch  # noqa: E402
from qwen_tts.inference.qwen3_tts_model import Qwen3TTSModel  # noqa: E402

CASES = (  # text, speaker index in the checkpoint's list, language, non-streaming text
    ("Streaming speech on a laptop, one frame at a time.", 0, "English", True),
    ("The quick brown fox jumps over the lazy dog.", 1, "English", True),
    ("Real time on two cores, or not at all?", 2, "Auto", False),
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--frames", type=int, default=24, help="at most this many frames per utterance")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tts = Qwen3TTSModel.from_pretrained(str(args.checkpoint), dtype=torch.float32, local_files_only=True,
                                        attn_implementation="sdpa")
    tts.model.eval()
    speakers = sorted(tts.model.config.talker_config.spk_id)
    captured = []
    original = tts.model.generate

    def generate_and_keep(*a, **kw):  # keep what generate() returned: the codes before decoding
        result = original(*a, **kw)
        captured.append(result)
        return result

    tts.model.generate = generate_and_keep
    cases = []
    for text, speaker, language, non_streaming in CASES:
        t0 = time.time()
        captured.clear()
        with torch.no_grad():
            tts.generate_custom_voice(text, speaker=speakers[speaker % len(speakers)], language=language,
                                      non_streaming_mode=non_streaming, do_sample=False, subtalker_dosample=False,
                                      max_new_tokens=args.frames + 1)
        codes = captured[0][0][0].detach().long()  # talker_codes_list[0]: [T, G]
        cases.append({"text": text, "speaker": speakers[speaker % len(speakers)], "language": language,
                      "non_streaming_mode": non_streaming, "codes": codes.tolist()})
        print(f"official_codes: {len(codes)} frames in {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
    args.out.write_text(json.dumps({"checkpoint": str(args.checkpoint), "cases": cases}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
