#!/usr/bin/env bash
# The README's voice-cloning block ("Backends and the real talker"), run as printed: taken from
# README.md itself (the ```bash block that clones from ref.wav), in a scratch directory that sees
# the checkout's .venv as ./.venv, against a server on the README's address serving the Base
# release the block names. That release is a random Base checkpoint in the official layout
# (tests/fixtures/oracle/clone/base, written by scripts/oracle-clone-fixtures.sh), served under
# its Hugging Face id by a hub on 127.0.0.1 (testsupport/hub.py), so `--model ORG/NAME` is
# fetched as a reader's would be. ref.wav, the reader's own recording, is a made-up 2 s voice.
# Then every file the block names must hold audio (scripts/lib/readme_audio.py). Run by
# scripts/readme-smoke.sh after the tour; needs 127.0.0.1:8000 free.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
source scripts/lib/wait_ready.sh
url=http://127.0.0.1:8000
fixture=tests/fixtures/oracle/clone/base
if [ ! -f "$fixture/config.json" ]; then
  echo "readme-clone: no random Base checkpoint at $fixture: run bash scripts/oracle-clone-fixtures.sh"
  exit 1
fi
# (SO_REUSEADDR: the connections of a server that just stopped, in TIME_WAIT, do not count; a listener does)
if ! python3 -c "import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('127.0.0.1', 8000)); s.close()" 2>/dev/null; then
  echo "readme-clone: 127.0.0.1:8000, the README's address, is in use: stop what listens there and run again"
  exit 1
fi

work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM -- -"$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
mkdir "$work/clone"
ln -s "$repo/.venv" "$work/clone/.venv"

# The block, the model id it names and the files it names, from README.md.
.venv/bin/python - "$repo/README.md" "$work" <<'PY'
import re
import sys
import textwrap
from pathlib import Path

readme, work = Path(sys.argv[1]).read_text(), Path(sys.argv[2])
blocks = [textwrap.dedent(body) for _, body in re.findall(r"^( *)```bash\n(.*?)^\1```", readme, re.S | re.M)]
clone = [b for b in blocks if "--ref-audio ref.wav" in b]
if len(clone) != 1:
    sys.exit(f"readme-clone: README.md has {len(clone)} bash blocks cloning from ref.wav (expected one)")
block = clone[0]
model = re.search(r"--model (\S+)", block)
if not model:
    sys.exit("readme-clone: the cloning block names no --model")
(work / "block.sh").write_text(block)
(work / "model").write_text(model.group(1))
names = sorted(set(re.findall(r"[\w-]+\.(?:wav|mp3|flac)\b", block)))
(work / "names").write_text("\n".join(names) + "\n")
print(f"readme-clone: the block names {model.group(1)}; files to check: {' '.join(names)}")
PY
model=$(cat "$work/model")

# The hub on 127.0.0.1, serving the random Base release under that id.
setsid .venv/bin/python scripts/lib/loopback_hub.py "${model%@*}=$fixture" >"$work/hub.url" 2>"$work/hub.log" &
pids+=($!)
for _ in $(seq 100); do [ -s "$work/hub.url" ] && break; sleep 0.1; done
[ -s "$work/hub.url" ] || { echo "readme-clone: the loopback hub did not start"; cat "$work/hub.log"; exit 1; }
unset HF_HUB_OFFLINE HF_TOKEN HF_HUB_CACHE
export HF_ENDPOINT=$(cat "$work/hub.url") HF_HOME="$work/hf"

# The server the block talks to: the same release, on the README's address.
log="$work/serve.log"
STREAMVOX_DATA_DIR="$work/data" setsid .venv/bin/streamvox serve --model "$model" >"$log" 2>&1 &
pids+=($!)
start=$(date +%s)
wait_ready readme-clone "$url" "${pids[1]}" "$log" "streamvox serve --model $model"
echo "readme-clone: serving $model from the loopback hub after $(( $(date +%s) - start ))s"

# ref.wav: a reader's 2 s recording.
.venv/bin/python scripts/lib/reference_voice.py "$work/clone/ref.wav"

cd "$work/clone"
bash -euo pipefail -v "$work/block.sh" || {  # -v: each command as printed, not as expanded (a base64 page)
  echo "readme-clone: the cloning block failed (README.md, 'Backends and the real talker'):"
  cat "$work/block.sh"; tail -n 20 "$log"; exit 1
}
.venv/bin/python "$repo/scripts/lib/readme_audio.py" readme-clone "$work/names"
echo "readme-clone: the cloning block ran as printed and every file holds audio"
