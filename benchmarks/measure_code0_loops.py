"""How long a normal utterance's code 0 repeats itself: the measurement behind the runaway
guard's window (engines/pipelines/talker/guard.py LOOP_WINDOW).

    python benchmarks/measure_code0_loops.py            # needs the talker oracle fixtures

For the official code's greedy outputs stored with the talker oracle fixtures, and for this
engine's reference loop (greedy and sampled, several seeds) on the fixture checkpoints and on
the in-process test talker (testsupport/talker.py), it prints, per source, how many utterances
ended by EOS and the longest periodic run (period <= LOOP_MAX_PERIOD) among them and among the
others (cut by max_new_tokens: random weights that never found EOS).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # engines, testsupport, tests.oracle

from engines.pipelines.talker.guard import LOOP_MAX_PERIOD, LOOP_WINDOW, longest_periodic_run  # noqa: E402
from engines.pipelines.talker.reference import TalkerBundle  # noqa: E402

TEXTS = ["Hello world, this is a small test of streaming speech.", "Hello there.", "the quick brown fox",
         "Numbers 2026 and 42.", "你好，世界。", "A longer sentence that goes on for a while, with a clause or two, "
         "and then ends.", "Yes.", "assistant user the lazy dog jumps", "数字 2026 and 42 and the fox.",
         "How are you today? Fine, thanks.", "small test of speech", "Hello world."]
SEEDS = (1, 2, 3, 4)  # sampled runs per text and voice (and one greedy run)
MAX_NEW_TOKENS = 200


def measure(bundle: TalkerBundle, greedy: bool) -> tuple[list[int], list[int]]:
    """Longest periodic runs of (utterances ended by EOS, utterances cut at MAX_NEW_TOKENS)."""
    eos, cut = [], []
    for text in TEXTS:
        for voice in bundle.voices():
            for seed in (0,) if greedy else SEEDS:
                codes = bundle.generate_codes(text, voice, greedy=greedy, seed=seed, max_new_tokens=MAX_NEW_TOKENS)
                run = longest_periodic_run(codes[:, 0].tolist())
                (cut if codes.shape[0] >= MAX_NEW_TOKENS - 1 else eos).append(run)
    return eos, cut


def report(name: str, eos: list[int], cut: list[int]) -> None:
    print(f"{name:36s} EOS-ended {len(eos):4d}: longest run {max(eos, default=0):3d} | "
          f"cut {len(cut):4d}: longest run {max(cut, default=0):3d}")


def main() -> None:
    from testsupport.talker import make_bundle
    from tests.oracle import talker_fixtures as fx

    print(f"periods <= {LOOP_MAX_PERIOD} frames (the pattern seen twice at least); the guard's window is "
          f"{LOOP_WINDOW} frames")
    everything: list[int] = []
    bundles = [(name, TalkerBundle.from_checkpoint(fx.checkpoint_dir(name), "cpu", torch.float32))
               for name in fx.CHECKPOINTS] + [("in-process", make_bundle(max_new_tokens=MAX_NEW_TOKENS))]
    for name in fx.CHECKPOINTS:
        refs = fx.references(name)
        runs = [longest_periodic_run(v[:, 0].tolist()) for k, v in refs.items() if k.endswith("/codes")]
        report(f"official greedy cases, {name}", runs, [])
        everything += runs
    for greedy in (False, True):
        for name, bundle in bundles:
            eos, cut = measure(bundle, greedy)
            report(f"engine {'greedy' if greedy else 'sampled'}, {name}", eos, cut)
            everything += eos
    print(f"all {len(everything)} EOS-ended utterances: longest periodic run {max(everything)} frames")


if __name__ == "__main__":
    main()
