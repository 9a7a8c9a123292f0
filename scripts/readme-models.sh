#!/usr/bin/env bash
# The README's Models block, run as printed: taken from README.md itself (the ```bash block with
# `streamvox download`), in a scratch directory that sees the checkout's .venv as ./.venv, against
# a hub on 127.0.0.1 (HF_ENDPOINT) serving random checkpoints in the official layout under the ids
# the block names (scripts/lib/loopback_hub.py): a Base id gets the Base fixture, a CustomVoice id
# the CustomVoice fixture; both carry the released generation_config.json (max_new_tokens 8192).
# Each `serve` line must reach /readyz on the README's address, list the model it was given in
# /v1/models, speak a plain request (read back and checked) and exit 0 on SIGTERM; `download` must
# print a directory holding the checkpoint; the HF_HUB_OFFLINE=1 line runs with the hub stopped.
# Run by scripts/readme-smoke.sh; needs 127.0.0.1:8000 free and the oracle fixtures
# (scripts/oracle-talker-fixtures.sh, scripts/oracle-clone-fixtures.sh).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
source scripts/lib/wait_ready.sh
url=http://127.0.0.1:8000
fixtures=tests/fixtures/oracle
for f in clone/base talker/cv_proj; do
  [ -f "$fixtures/$f/config.json" ] || { echo "readme-models: no random checkpoint at $fixtures/$f: run scripts/dev-setup.sh"; exit 1; }
done
if ! python3 -c "import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('127.0.0.1', 8000)); s.close()" 2>/dev/null; then
  echo "readme-models: 127.0.0.1:8000, the README's address, is in use: stop what listens there and run again"
  exit 1
fi

work=$(mktemp -d)
hub_pid=""
serve_pid=""
cleanup() {
  for pid in $serve_pid $hub_pid; do kill -TERM -- -"$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
mkdir "$work/run" "$work/heard"
ln -s "$repo/.venv" "$work/run/.venv"

# The block's command lines, and the hub's repos: each id the block names, with its fixture.
.venv/bin/python - "$repo/README.md" "$work" "$repo/$fixtures" <<'PY'
import re
import sys
import textwrap
from pathlib import Path

readme, work, fixtures = Path(sys.argv[1]).read_text(), Path(sys.argv[2]), Path(sys.argv[3])
blocks = [textwrap.dedent(body) for _, body in re.findall(r"^( *)```bash\n(.*?)^\1```", readme, re.S | re.M)]
models = [b for b in blocks if "streamvox download" in b]
if len(models) != 1:
    sys.exit(f"readme-models: README.md has {len(models)} bash blocks with `streamvox download` (expected one)")
lines = [line for line in models[0].splitlines() if line.strip() and not line.lstrip().startswith("#")]
repos = []
for repo_id in sorted(set(re.findall(r"\bQwen/Qwen3-TTS-[\w.-]+", models[0]))):
    kind = "clone/base" if repo_id.endswith("-Base") else "talker/cv_proj" if "CustomVoice" in repo_id else None
    if kind is None:
        sys.exit(f"readme-models: no random checkpoint stands in for {repo_id}")
    repos.append(f"{repo_id}={fixtures / kind}")
(work / "lines").write_text("\n".join(lines) + "\n")
(work / "repos").write_text("\n".join(repos) + "\n")
print(f"readme-models: {len(lines)} commands; the hub serves {', '.join(r.split('=')[0] for r in repos)}")
PY

# A Base request's reference: a reader's 2 s recording.
.venv/bin/python scripts/lib/reference_voice.py "$work/ref.wav"
.venv/bin/python - "$work/ref.wav" "$work/base-request.json" <<'PY'
import base64
import json
import sys
from pathlib import Path

ref_audio = "data:audio/wav;base64," + base64.b64encode(Path(sys.argv[1]).read_bytes()).decode()
request = {"input": "Hello from the models block.", "response_format": "wav", "ref_audio": ref_audio,
           "ref_text": "What the reference says."}
Path(sys.argv[2]).write_text(json.dumps(request))
PY

mapfile -t repos <"$work/repos"
setsid .venv/bin/python scripts/lib/loopback_hub.py "${repos[@]}" >"$work/hub.url" 2>"$work/hub.log" &
hub_pid=$!
for _ in $(seq 100); do [ -s "$work/hub.url" ] && break; sleep 0.1; done
[ -s "$work/hub.url" ] || { echo "readme-models: the loopback hub did not start"; cat "$work/hub.log"; exit 1; }
unset HF_HUB_OFFLINE HF_TOKEN HF_HUB_CACHE
export HF_ENDPOINT=$(cat "$work/hub.url") HF_HOME="$work/hf" STREAMVOX_DATA_DIR="$work/data"

# A serve line: ready on the README's address, the model it names listed, a plain request heard.
check_serve() {  # check_serve N LINE
  local n=$1 line=$2 log="$work/serve-$1.log" start
  (cd "$work/run" && exec setsid bash -c "$line") >"$log" 2>&1 &
  serve_pid=$!
  start=$(date +%s)
  wait_ready readme-models "$url" "$serve_pid" "$log" "$line"
  local model
  model=$(grep -o -- '--model [^ ]*' <<<"$line" | cut -d' ' -f2)
  curl -fsS "$url/v1/models" | grep -q "\"${model%@*}" \
    || { echo "readme-models: /v1/models does not list ${model%@*}: $line"; curl -sS "$url/v1/models"; exit 1; }
  # A Base release speaks in a voice cloned from reference audio, so its request carries one.
  local body='{"input": "Hello from the models block.", "response_format": "wav"}'
  [[ ${model%@*} == *-Base ]] && body=$(cat "$work/base-request.json")
  local code
  code=$(curl -sS "$url/v1/audio/speech" -H 'Content-Type: application/json' -d "$body" \
    -o "$work/heard/models-$n.wav" -w "%{http_code}") || code=000
  [ "$code" = 200 ] || {
    echo "readme-models: a plain request got HTTP $code: $line"; head -c 600 "$work/heard/models-$n.wav"; echo
    tail -n 20 "$log"; exit 1
  }
  echo "models-$n.wav" >>"$work/heard.names"
  kill -TERM -- -"$serve_pid"
  local status=0
  wait "$serve_pid" || status=$?
  serve_pid=""
  [ "$status" -eq 0 ] || { echo "readme-models: serve exited $status after SIGTERM: $line"; tail -n 20 "$log"; exit 1; }
  echo "readme-models: served and heard after $(( $(date +%s) - start ))s: $line"
}

n=0
while IFS= read -r line; do
  n=$((n + 1))
  if [[ $line == *HF_HUB_OFFLINE=1* ]] && [ -n "$hub_pid" ]; then
    kill -TERM -- -"$hub_pid"; wait "$hub_pid" 2>/dev/null || true; hub_pid=""  # offline means no hub
  fi
  if [[ $line == *" serve "* ]]; then
    check_serve "$n" "$line"
  else
    out=$(cd "$work/run" && bash -euo pipefail -c "$line" 2>"$work/line-$n.log") || { echo "readme-models: failed: $line"; tail -n 20 "$work/line-$n.log"; exit 1; }
    if [[ $line == *" download "* ]]; then
      dir=$(tail -n 1 <<<"$out")
      [ -f "$dir/config.json" ] || { echo "readme-models: download printed '$dir', which holds no checkpoint"; exit 1; }
    fi
    echo "readme-models: ran: $line"
  fi
done <"$work/lines"
(cd "$work/heard" && "$repo/.venv/bin/python" "$repo/scripts/lib/readme_audio.py" readme-models ../heard.names)
echo "readme-models: the Models block ran as printed and every server spoke"
