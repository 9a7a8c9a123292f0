#!/usr/bin/env bash
# Issue 6 on a lent GPU machine (the `device` tool): CUDA tests, then the benchmarks,
# each step bounded so the whole run fits one 10-minute call. Logs go to $OUT (or
# ./gpu-out). Wheels the device image lacks travel in .whl/ (see docs/GPU.md):
#   .whl/proj  soundfile cffi pycparser soxr websockets pytest-asyncio  (project side)
#   .whl/ref   transformers==4.57.3 tokenizers==0.22.1 huggingface-hub==0.36.0
#              qwen-tts==0.1.1 accelerate==1.12.0                      (official baseline)
# Usage: bash scripts/gpu-verify.sh [steps...]
#   steps: tests cp tick engine talker e2e            (the DiT path and components)
#          ckpt talker_e2e profile_talker profile_dit  (issue 19: the served talker and the profiles)
#          clone   (issue 15: cloning served on CUDA and its TTFA; carry tests/fixtures/oracle/clone)
#   default: all of the first line.
# TESTS='tests/x.py ...' narrows the test step. SIZES='0.6b 1.7b' picks the talker sizes (random
# checkpoints in the official layout, written by the `ckpt` step into /tmp/ckpt-SIZE).
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STEPS=${*:-tests cp tick engine talker e2e}
T0=$(date +%s)
say() { echo "[gpu-verify +$(( $(date +%s) - T0 ))s] $*"; }

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  git log -1 --format='commit %H %s' 2>/dev/null || true
} | tee "$OUT/device.txt"

if [ -d .whl/proj ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/proj/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
ORACLE_PY=python3
if [ -d .whl/ref ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ref-site .whl/ref/*.whl
  ORACLE_PY=/tmp/oracle-python
  printf '#!/bin/sh\nPYTHONPATH=/tmp/ref-site:/tmp/site exec python3 "$@"\n' > $ORACLE_PY
  chmod +x $ORACLE_PY
fi
say "wheels installed"

for step in $STEPS; do
  case $step in
    tests)
      say "CUDA tests"
      timeout 300 python3 -m pytest -q -p no:cacheprovider -rs --timeout 250 ${TESTS:-tests/test_graphed_predictor.py \
        tests/test_graphed_dit.py tests/test_graphed_decoder.py tests/test_stream.py tests/test_code_predictor.py \
        tests/test_gpu_engine.py tests/test_talker_paged.py tests/test_talker_source.py} 2>&1 | tee "$OUT/tests.log" ;;
    engine)
      say "bench_engine (stage attribution, synced)"
      STREAMVOX_STAGE_SYNC=1 timeout 200 python3 benchmarks/bench_engine.py --preset base --device cuda \
        --levels 1,64 --rounds 2 --max-slots 128 2>&1 | tee "$OUT/bench_engine_sync.log"
      say "bench_engine"
      timeout 240 python3 benchmarks/bench_engine.py --preset base --device cuda --levels 1,8,32,64,128 \
        --rounds 2 --max-slots 128 2>&1 | tee "$OUT/bench_engine.log" ;;
    cp)
      say "bench_code_predictor"
      timeout 150 python3 benchmarks/bench_code_predictor.py --preset base --device cuda --dtype bfloat16 \
        --batches 1 8 64 512 --min-seconds 0.5 --oracle-python "$ORACLE_PY" 2>&1 | tee "$OUT/bench_cp.log" ;;
    tick)
      say "bench_tick"
      timeout ${TICK_TIMEOUT:-150} python3 benchmarks/bench_tick.py --preset base --device cuda --dtype bfloat16 \
        --depths ${TICK_DEPTHS:-1,4,8,16,32,64} --steps 8 --ticks 16 --repeats ${TICK_REPEATS:-2} 2>&1 \
        | tee "$OUT/bench_tick.log" ;;
    clone)
      say "clone tests + TTFA (saved voice vs inline ref_audio)"
      timeout 300 python3 -m pytest -q -p no:cacheprovider -rs --timeout 250 tests/test_clone_parity.py \
        2>&1 | tee "$OUT/clone_tests.log"
      timeout 200 python3 benchmarks/bench_clone_ttfa.py --device cuda --runs 9 \
        2>&1 | tee "$OUT/bench_clone_ttfa.log" ;;
    talker)
      say "bench_talker"
      timeout 200 python3 benchmarks/bench_talker.py --size 0.6b --device cuda --dtype bfloat16 --batches 1 8 64 \
        --ticks 10 --step-graphs --oracle-python "$ORACLE_PY" 2>&1 | tee "$OUT/bench_talker.log" ;;
    e2e)
      say "bench_e2e"
      set -o pipefail
      timeout ${E2E_TIMEOUT:-240} python3 benchmarks/bench_e2e.py --preset base --device cuda \
        --levels ${E2E_LEVELS:-1,8,32,64,128,256} --serve-arg=--max-queue=1024 --serve-arg=--max-slots=128 \
        2>&1 | tee "$OUT/bench_e2e.log" \
      || { say "bench_e2e failed: again without torch.compile"; STREAMVOX_COMPILE=0 timeout 200 python3 \
           benchmarks/bench_e2e.py --preset base --device cuda --levels 1,8,64,128 --serve-arg=--max-queue=1024 \
           --serve-arg=--max-slots=128 2>&1 | tee "$OUT/bench_e2e_nocompile.log"; }
      set +o pipefail ;;
    ckpt)
      for size in ${SIZES:-0.6b}; do
        say "random $size checkpoint"
        [ -d /tmp/ckpt-$size ] || timeout 300 "$ORACLE_PY" benchmarks/make_checkpoint.py --size $size /tmp/ckpt-$size \
          2>&1 | grep -v -i "flash-attn\|^\*\*\*\|^ *$" | tee -a "$OUT/ckpt.log"
      done ;;
    talker_bench)
      for size in ${SIZES:-0.6b}; do
        say "bench_talker $size"
        timeout 240 python3 benchmarks/bench_talker.py --size $size --device cuda --dtype bfloat16 \
          --batches ${TALKER_BATCHES:-1 8 64 256} --official-batches ${OFFICIAL_BATCHES:-1 8 64} --ticks 10 --step-graphs \
          --oracle-python "$ORACLE_PY" 2>&1 | tee "$OUT/bench_talker_$size.log"
      done ;;
    talker_e2e)
      for size in ${SIZES:-0.6b}; do
        say "bench_e2e talker $size"
        timeout ${E2E_TIMEOUT:-300} python3 benchmarks/bench_e2e.py --device cuda --checkpoint /tmp/ckpt-$size \
          --levels ${E2E_LEVELS:-1,8,32,64,128,256} --serve-arg=--max-queue=1024 \
          --serve-arg=--max-slots=${TALKER_SLOTS:-256} 2>&1 | tee "$OUT/bench_e2e_talker_$size.log"
      done ;;
    profile_talker)
      say "bench_engine talker 0.6b + profile at 64"
      timeout 300 python3 benchmarks/bench_engine.py --checkpoint /tmp/ckpt-0.6b --device cuda --levels 1,8,64 \
        --rounds 1 --max-slots ${TALKER_SLOTS:-256} --profile 64 --trace-dir "$OUT" 2>&1 \
        | tee "$OUT/profile_talker.log"
      gzip -f "$OUT"/trace_64.json && mv "$OUT"/trace_64.json.gz "$OUT"/trace_talker_64.json.gz ;;
    profile_dit)
      say "bench_engine DiT base + profile at 64"
      timeout 300 python3 benchmarks/bench_engine.py --preset base --device cuda --levels 1,8,64 \
        --rounds 1 --max-slots 128 --profile 64 --trace-dir "$OUT" 2>&1 | tee "$OUT/profile_dit.log"
      gzip -f "$OUT"/trace_64.json && mv "$OUT"/trace_64.json.gz "$OUT"/trace_dit_64.json.gz ;;
    *) echo "unknown step $step" ;;
  esac
done
say "done"
