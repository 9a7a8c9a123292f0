#!/usr/bin/env bash
# The README's "30-second tour", run as printed: every ```bash and ```python block of that
# section, in order, taken from README.md itself (so the README and this script cannot
# drift), in a scratch directory that sees the checkout's .venv as ./.venv, against the
# server of README command 1 on its default address, http://127.0.0.1:8000
# (scripts/readme-smoke.sh starts it and then runs this). A bash block runs under
# `set -euo pipefail`, so a failing command fails the tour.
#
# Then every file the tour names (hello.wav, speech.sse, ...) must exist and hold audio,
# read back with soundfile: 24 kHz mono, at least 0.1 s, finite, not silent; a .sse file
# (the events of `"stream": true`) must be well-formed events whose base64 audio decodes
# to such audio. A file the tour writes but does not name fails too (it would go unchecked).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
BASE=http://127.0.0.1:8000

command -v curl >/dev/null || { echo "readme-tour: curl is needed (the tour uses it)"; exit 1; }
if ! curl -fs -o /dev/null "$BASE/readyz"; then
  echo "readme-tour: no ready streamvox server at $BASE: start it as README command 1 does (or run scripts/readme-smoke.sh)"
  exit 1
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/blocks" "$work/tour"
ln -s "$repo/.venv" "$work/tour/.venv"

# The tour's blocks as files (NN.sh / NN.py) and the audio files it names, from README.md.
.venv/bin/python - "$repo/README.md" "$work" <<'PY'
import re
import sys
from pathlib import Path

readme, work = Path(sys.argv[1]).read_text(), Path(sys.argv[2])
match = re.search(r"^## 30-second tour\n(.*?)^## ", readme, re.S | re.M)
if not match:
    sys.exit("readme-tour: README.md has no '## 30-second tour' section")
tour = match.group(1)
blocks = re.findall(r"^```(bash|python)\n(.*?)^```", tour, re.S | re.M)
if not blocks:
    sys.exit("readme-tour: the tour section has no bash or python block")
for number, (language, code) in enumerate(blocks, 1):
    (work / "blocks" / f"{number:02d}.{'sh' if language == 'bash' else 'py'}").write_text(code)
names = sorted(set(re.findall(r"[\w-]+\.(?:wav|mp3|flac|ogg|opus|aac|pcm|sse)\b", "".join(c for _, c in blocks))))
(work / "names").write_text("\n".join(names) + "\n")
print(f"readme-tour: {len(blocks)} blocks; files to check: {' '.join(names)}")
PY

cd "$work/tour"
for block in "$work"/blocks/*; do
  start=$(date +%s%N)
  echo "readme-tour: block $(basename "$block") ----------------------------------------"
  case "$block" in
    *.sh) PS4='+ ' bash -euo pipefail -x "$block" ;;
    *.py) .venv/bin/python "$block" ;;
  esac || { echo "readme-tour: block $(basename "$block") failed (README.md, '30-second tour'):"; cat "$block"; exit 1; }
  echo "readme-tour: block $(basename "$block") ok in $(( ($(date +%s%N) - start) / 1000000 )) ms"
done

.venv/bin/python "$repo/scripts/lib/readme_audio.py" readme-tour "$work/names"
echo "readme-tour: every command ran and every file holds audio"
