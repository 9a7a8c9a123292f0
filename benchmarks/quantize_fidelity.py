"""Fidelity of ``--quantize int8`` (engines/models/quantize.py) against fp32 on the oracle
checkpoints: greedy codes and the audio they decode to.

    python benchmarks/quantize_fidelity.py [--markdown]

For every case of the talker oracle fixtures (random CustomVoice checkpoints in the official
layout; fp32 greedy codes there equal the official ``generate()``'s), one utterance at a
time through the reference loop (engines/pipelines/talker/reference.py), fp32 and int8:
* frames equal: frames until the first frame whose 16 codes differ / fp32 frames;
* codes equal: equal codes over the common length (all groups) / codes there;
* length: int8 frames - fp32 frames;
* log-mel distance: mean |log-mel(int8 audio) - log-mel(fp32 audio)| over the common frames
  (engines/models/mel.py, natural log), beside the same distance between the fp32 audio of
  two different cases of equal length class (``different utterances``) for scale.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from engines.checkpoints.qwen3_tts import load_checkpoint  # noqa: E402
from engines.models.mel import LogMel  # noqa: E402
from engines.models.quantize import quantize_talker  # noqa: E402
from engines.pipelines.talker.reference import TalkerBundle  # noqa: E402
from tests.oracle import talker_fixtures as fx  # noqa: E402


def logmel_distance(mel: LogMel, a: torch.Tensor, b: torch.Tensor) -> float:
    n = min(a.shape[-1], b.shape[-1])
    if n < 1024:
        return float("nan")
    ma, mb = mel(a[..., :n].reshape(1, -1)), mel(b[..., :n].reshape(1, -1))
    return (ma - mb).abs().mean().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.parse_args()
    torch.set_num_threads(1)
    mel = LogMel()
    rows = []
    for name in fx.CHECKPOINTS:
        fp32 = TalkerBundle.from_checkpoint(fx.checkpoint_dir(name))
        int8 = TalkerBundle.from_checkpoint(fx.checkpoint_dir(name))
        converted = quantize_talker(int8.talker, int8.predictor, "int8")
        parts = load_checkpoint(fx.checkpoint_dir(name))
        wavs = {}
        for case, c in fx.cases(name).items():
            kw = dict(greedy=True, max_new_tokens=c["max_new_tokens"], non_streaming_mode=c["non_streaming_mode"],
                      instruct=c["instruct"])
            a = fp32.generate_codes(c["prompt"], c["speaker"], c["language"], **kw)
            b = int8.generate_codes(c["prompt"], c["speaker"], c["language"], **kw)
            assert torch.equal(a, fx.references(name)[f"case/{case}/codes"]), case  # fp32 = official
            n = min(a.shape[0], b.shape[0])
            differs = (a[:n] != b[:n]).any(dim=1).nonzero()
            first = int(differs[0, 0]) if differs.numel() else n
            with torch.no_grad():
                wa, wb = parts.decode(a.T[None])[0], parts.decode(b.T[None])[0] if b.shape[0] else torch.zeros(0)
            wavs[case] = wa
            rows.append(dict(ckpt=name, case=case, frames=a.shape[0], prefix=first / max(a.shape[0], 1),
                             codes=(a[:n] == b[:n]).float().mean().item() if n else 0.0, length=b.shape[0] - a.shape[0],
                             mel=logmel_distance(mel, wa, wb), converted=converted))
        cases = list(wavs)
        scale = [logmel_distance(mel, wavs[x], wavs[y]) for x, y in zip(cases, cases[1:])]
        rows.append(dict(ckpt=name, case="(different utterances, fp32)", mel=statistics.median(
            s for s in scale if s == s)))
    print("| checkpoint | case | fp32 frames | frames equal until first difference | codes equal | "
          "length int8 - fp32 | log-mel distance |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "frames" not in r:
            print(f"| {r['ckpt']} | {r['case']} | | | | | {r['mel']:.3f} |")
            continue
        print(f"| {r['ckpt']} | {r['case']} | {r['frames']} | {r['prefix']:.0%} | {r['codes']:.0%} | "
              f"{r['length']:+d} | {r['mel']:.3f} |")
    real = [r for r in rows if "frames" in r]
    print(f"\nall cases: frames equal until the first difference {statistics.mean(r['prefix'] for r in real):.0%} "
          f"(mean), codes equal {statistics.mean(r['codes'] for r in real):.0%} (mean), identical utterances "
          f"{sum(r['prefix'] == 1 and r['length'] == 0 for r in real)}/{len(real)}; linear layers converted per "
          f"checkpoint: {real[0]['converted']}")


if __name__ == "__main__":
    main()
