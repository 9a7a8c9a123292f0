#!/usr/bin/env bash
# The newcomer's path, exactly as the README prints it: run README command 1 (install +
# `streamvox serve` on the embedded default (random weights offline), on its default address 127.0.0.1:8000), wait
# for /readyz (within a minute of the command starting), run the README's tour against it
# (scripts/readme-tour.sh: every command as printed, every file it writes checked), and
# SIGTERM must stop the server with exit code 0. Then the README's cloning block, as printed,
# against a server of the Base release it names (scripts/readme-clone.sh), and the Models block's
# serve / download / offline serve against a loopback hub (scripts/readme-models.sh). Used by .ci/run.
#
#   bash scripts/readme-smoke.sh [--serve-only]
#
# --serve-only runs only command 1's last step (`.venv/bin/streamvox serve`) for a .venv that
# is installed already, with this checkout's code first on PYTHONPATH: the full command
# re-installs the project into .venv (`pip install -e .`), which would re-point a venv that
# another checkout (a git worktree) shares.
set -euo pipefail
cd "$(dirname "$0")/.."
serve_only=0
case "${1:-}" in
  "") ;;
  --serve-only) serve_only=1 ;;
  *) echo "usage: bash scripts/readme-smoke.sh [--serve-only]"; exit 2 ;;
esac
cmd=$(awk '/^```bash/{f=1; next} f && /^```/{exit} f' README.md | grep -v '^[[:space:]]*#' | grep -v '^[[:space:]]*$' | head -n 1)
[ -n "$cmd" ] || { echo "readme-smoke: no command 1 in README.md"; exit 1; }
if [ "$serve_only" = 1 ]; then
  cmd=${cmd##*&& }
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
# The tour talks to the README's address, so the server must get it: a port already taken
# would fail the server's start (or, worse, send the tour to whatever listens there).
url=http://127.0.0.1:8000
if ! python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 8000)); s.close()" 2>/dev/null; then
  echo "readme-smoke: 127.0.0.1:8000, the README's address, is in use: stop what listens there and run again"
  exit 1
fi
work=$(mktemp -d)
log="$work/serve.log"
echo "readme-smoke: running README command 1: $cmd"
# Only the data dir and the model cache come from the environment. With no model named, serve
# looks for the default Qwen3-TTS release (cache, then the hub) and otherwise starts on the
# built-in random preset in one log line. The smoke pins that fallback: HF_HUB_OFFLINE=1 and an
# empty HF_HOME, so a CI machine that can reach huggingface.co (or has the model cached) does not
# spend the minute fetching and loading gigabytes. The hub path itself is tested against a local
# hub by tests/engines/checkpoints/test_model_hub.py.
export HF_HUB_OFFLINE=1 HF_HOME="$work/hf"  # the tour's in-process commands too
STREAMVOX_DATA_DIR="$work/data" setsid bash -c "$cmd" >"$log" 2>&1 &
pid=$!
cleanup() { kill -TERM -- -"$pid" 2>/dev/null || true; }
trap cleanup EXIT
start=$(date +%s)
ready=0
while [ $(( $(date +%s) - start )) -lt 60 ]; do
  if grep -q "listening on $url" "$log" && curl -fsS -o /dev/null "$url/readyz" 2>/dev/null; then
    ready=1
    break
  fi
  kill -0 "$pid" 2>/dev/null || break  # command 1 ended: it failed
  sleep 1
done
if [ "$ready" = 0 ]; then
  echo "readme-smoke: $url/readyz not reached within 60 s of README command 1"; tail -n 30 "$log"; exit 1
fi
echo "readme-smoke: ready at $url after $(( $(date +%s) - start ))s"
tour_start=$(date +%s)
bash scripts/readme-tour.sh || { echo "readme-smoke: the README tour failed; server log:"; tail -n 20 "$log"; exit 1; }
echo "readme-smoke: tour took $(( $(date +%s) - tour_start ))s"
kill -TERM -- -"$pid"
trap - EXIT
status=0
wait "$pid" || status=$?
[ "$status" -eq 0 ] || { echo "readme-smoke: serve exited $status after SIGTERM"; tail -n 20 "$log"; exit 1; }
echo "readme-smoke: serve drained and exited 0"
clone_start=$(date +%s)
bash scripts/readme-clone.sh || { echo "readme-smoke: the README's cloning block failed"; exit 1; }
echo "readme-smoke: the cloning block took $(( $(date +%s) - clone_start ))s"
models_start=$(date +%s)
bash scripts/readme-models.sh || { echo "readme-smoke: the README's Models block failed"; exit 1; }
echo "readme-smoke: the Models block took $(( $(date +%s) - models_start ))s"
