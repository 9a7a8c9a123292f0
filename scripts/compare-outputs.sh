#!/usr/bin/env bash
# Same audio before and after a change: synthesize a fixed set of requests with this checkout and
# with BASE_REV (a temporary git worktree), on every model the tests have (DiT tiny on random
# weights, the talker CustomVoice / Base clone / VoiceDesign oracle checkpoints; greedy and
# sampled), fp32 on the CPU, and compare the decoded samples bit for bit.
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
import sys, numpy as np, soundfile as sf
name, a, b = sys.argv[1:]
x, rx = sf.read(a, dtype="float32")
y, ry = sf.read(b, dtype="float32")
same = rx == ry and x.shape == y.shape and np.array_equal(x, y)
print(f"{name:28s} {'identical' if same else 'DIFFERENT'}  ({len(x)} vs {len(y)} samples)")
sys.exit(0 if same else 1)
EOF2
}

compare dit-tiny-random --preset tiny --model random --source dit --seed 3
compare talker-customvoice-greedy --preset tiny --model "$FX/talker/cv_proj" --voice ryan --temperature 0
compare talker-customvoice-sampled --preset tiny --model "$FX/talker/cv_proj" --voice vivian --seed 7
compare talker-base-xvector --preset tiny --model "$FX/clone/base" --ref-audio "$REF" --x-vector-only --temperature 0
compare talker-base-in-context --preset tiny --model "$FX/clone/base" --ref-audio "$REF" --ref-text "Hello." --temperature 0
compare talker-voicedesign --preset tiny --model "$FX/clone/design" --instructions "A calm, low voice." --temperature 0
exit $status
