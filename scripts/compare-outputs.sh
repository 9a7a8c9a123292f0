#!/usr/bin/env bash
# Same audio before and after a change: synthesize a fixed set of requests with this checkout and
# with BASE_REV (a temporary git worktree), on every model the tests have (DiT tiny on random
# weights, the talker CustomVoice / Base clone / VoiceDesign oracle checkpoints; greedy and
# sampled), fp32 on the CPU, and compare the decoded samples bit for bit (COMPARE_LSB=N: a change
# whose stated tolerance moves 16-bit samples by up to N steps passes; every differing case says by
# how much). Sampled speech's chunk sizes follow the machine's load, and the codec decoder's float
# sums may differ by 1 LSB at a chunk boundary, so run it on a quiet machine.
#   bash scripts/compare-outputs.sh 73aa0c9
# Needs .venv and the oracle fixtures (scripts/dev-setup.sh). Prints one line per case and
# exits 1 when any case differs.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE_REV=${1:?usage: compare-outputs.sh BASE_REV}
ROOT=$(pwd)
WORK=$(mktemp -d)
trap 'git worktree remove --force "$WORK/base" >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT
git worktree add -q --detach "$WORK/base" "$BASE_REV"
ln -s "$ROOT/.venv" "$WORK/base/.venv"
FX=$ROOT/tests/fixtures/oracle
REF=$WORK/ref.wav
.venv/bin/python - "$REF" <<'EOF'
import sys, numpy as np, soundfile as sf
t = np.arange(24000 * 2) / 24000
sf.write(sys.argv[1], (0.3 * np.sin(2 * np.pi * 180 * t) + 0.05 * np.sin(2 * np.pi * 360 * t)).astype(np.float32), 24000)
EOF
TEXT="Hello there. This sentence checks that nothing changed, word for word."
status=0

compare() {  # compare NAME SYNTHESIZE-FLAGS...: both trees, then the samples
  local name=$1; shift
  for tree in base head; do
    local dir=$ROOT
    [ "$tree" = base ] && dir=$WORK/base
    (cd "$dir" && OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python -m clients.cli synthesize --device cpu \
       --text "$TEXT" --out "$WORK/$name.$tree.wav" --quiet "$@" >/dev/null 2>"$WORK/$name.$tree.err") \
      || { echo "$name: the $tree tree failed: $(tail -1 "$WORK/$name.$tree.err")"; status=1; return; }
  done
  .venv/bin/python - "$name" "$WORK/$name.base.wav" "$WORK/$name.head.wav" <<'EOF2' || status=1
import os, sys, numpy as np, soundfile as sf
name, a, b = sys.argv[1:]
x, rx = sf.read(a, dtype="int16")
y, ry = sf.read(b, dtype="int16")
if rx != ry or x.shape != y.shape:
    print(f"{name:28s} DIFFERENT  ({len(x)} vs {len(y)} samples at {rx} / {ry} Hz)")
    sys.exit(1)
steps = np.abs(x.astype(np.int32) - y.astype(np.int32))
worst, allowed = int(steps.max(initial=0)), int(os.environ.get("COMPARE_LSB", "0"))
verdict = "identical" if worst == 0 else f"within {allowed} LSB" if worst <= allowed else "DIFFERENT"
detail = "" if worst == 0 else f"; {int((steps > 0).sum())} samples differ, by at most {worst} LSB"
print(f"{name:28s} {verdict}  ({len(x)} vs {len(y)} samples{detail})")
sys.exit(0 if worst <= allowed else 1)
EOF2
}

compare dit-tiny-random --preset tiny --model random --source dit --seed 3
compare talker-customvoice-greedy --preset tiny --model "$FX/talker/cv_proj" --voice ryan --temperature 0
compare talker-customvoice-sampled --preset tiny --model "$FX/talker/cv_proj" --voice vivian --seed 7
compare talker-base-xvector --preset tiny --model "$FX/clone/base" --ref-audio "$REF" --x-vector-only --temperature 0
compare talker-base-in-context --preset tiny --model "$FX/clone/base" --ref-audio "$REF" --ref-text "Hello." --temperature 0
compare talker-voicedesign --preset tiny --model "$FX/clone/design" --instructions "A calm, low voice." --temperature 0
exit $status
