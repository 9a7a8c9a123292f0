#!/usr/bin/env bash
# Measure streamvox on a GPU host in one bounded run; everything is appended to
# $OUT/gpu-verify.log (default ./gpu-out) as each step finishes, so a run cut short still
# leaves the figures of the steps it finished.
#
#   bash scripts/gpu-verify.sh quick        # the prepared measurement (below), <= QUICK_BUDGET_S
#   bash scripts/gpu-verify.sh STEP...      # chosen steps (names below; `quick` among them stands for its list)
#   GPU_VERIFY_DRY=1 bash scripts/gpu-verify.sh quick   # CPU dry run at tiny sizes (tests/scripts/test_gpu_verify.py)
#
# quick, in this order, each step bounded by its own limit and by what is left of the budget:
#   env            GPU, torch, commit
#   ckpt           a random released-size 0.6B CustomVoice checkpoint in the official layout
#                  (benchmarks/make_checkpoint.py, official code) at /tmp/ckpt-0.6b
#   kernel         the paged-attention kernel against its reference (pytest -m cuda); if it fails, the
#                  later steps run the gather fallback (STREAMVOX_PAGED_ATTENTION=0) and say so
#   preflight      the CUDA tests of the graphed prompt prefill and of rows started together; a path
#                  whose test fails is turned off for the steps below (STREAMVOX_PREFILL_GRAPHS=0 /
#                  STREAMVOX_BATCHED_ADMISSION=0), said in the log
#   costs          the device cost table the virtual device replays (benchmarks/measure_costs.py):
#                  decode step by rows x KV blocks, prefill by prompts x width, codec decode by rows x
#                  frames, graph capture; written to $OUT/costs-$SIZE.json
#   talker_e2e     the served talker (real server, WebSocket clients) at 1/16/64/256 clients:
#                  TTFA p50/p95, RTF, underruns, graph captures after start, stage shares per level
#   peers          faster-qwen3-tts on the same checkpoint beside ours at 1 client, chunk sizes 1/2/4/8,
#                  rotating rounds (benchmarks/bench_peers.py)
#   talker_bench   talker ms/frame at batch 1/64, eager step vs whole-step CUDA graphs (the default)
#                  vs step graphs with the talker's layers compiled, and the memory floor
#   tests          the CUDA tests (pytest -m cuda), with whatever time is left
# openloop         first audio the way the peers measure it (benchmarks/bench_openloop.py): open-loop Poisson
#                  arrivals at 1/5/10/20/40 requests/s over benchmarks/sentences/en.txt, length from the text,
#                  WebSocket and HTTP clients: p50/p95/p99, streams within 50 ms of underrun, audio-s/s, the
#                  rate where p95 crosses 100 ms; faster-qwen3-tts under the same arrivals at 1 request/s
# openloop_virtual the same protocol on the virtual device of the table `costs` just wrote, on this host's CPU:
#                  the virtual device beside the GPU, same run (needs $OUT/costs-$SIZE.json)
#   The first-audio device step, one command (~6 min):
#     QUICK_BUDGET_S=560 COST_GRID="..." bash scripts/gpu-verify.sh env ckpt kernel preflight openloop costs openloop_virtual
# Other steps: profile_talker (torch.profiler at 64 streams: top kernels, host gaps), dit_e2e (the DiT
#   path served), talker_e2e_ctalk / talker_e2e_eager (served with the talker's layers compiled / the
#   step eager), cp tick engine clone (component benchmarks; see docs/GPU.md),
#   prefix_cache (time to first audio with the talker's prompt-prefix cache cold vs warm),
#   fused (the fused Triton kernels: their CUDA tests against the generic loop and the plain layers,
#   the step timed beside the graphed path at 1/8/64/256 rows in rotating rounds with the floor
#   (benchmarks/bench_fused.py), and the cost table with them, $OUT/costs-$SIZE-fused.json; after ckpt)
#
# Wheels the GPU host lacks travel in .whl/ (docs/GPU.md says how to download them):
#   .whl/proj  the project's runtime and test packages missing from the host image
#   .whl/ref   transformers==4.57.3 tokenizers==0.22.1 huggingface-hub==0.36.0 qwen-tts==0.1.1
#              accelerate==1.12.0 (the official code: checkpoint writer and baseline)
#   .whl/peers faster-qwen3-tts==0.5.4 qwen-tts-hf==0.1.1.post1 (the peer; the host's transformers 5)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
LOG="$OUT/gpu-verify.log"
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
T0=$(date +%s)
BUDGET_S=${QUICK_BUDGET_S:-520}
say() { echo "[gpu-verify +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }

if [ "${GPU_VERIFY_DRY:-0}" = "1" ]; then  # the same steps on a CPU at tiny sizes
  DEVICE=cpu DTYPE=float32 SIZE=tiny DIT_PRESET=tiny
  TALKER_BATCHES=${TALKER_BATCHES:-1 2} OFFICIAL_BATCHES=${OFFICIAL_BATCHES:-1} TALKER_TICKS=3
  TALKER_LEVELS=${TALKER_LEVELS:-1,2} DIT_LEVELS=${DIT_LEVELS:-1,2} PROFILE_AT=2 TALKER_SLOTS=4
  PY=${PYTHON:-.venv/bin/python} ORACLE_PY=${ORACLE_PYTHON:-.venv-oracle/bin/python}
  PEER_PY=${PEER_PYTHON:-$PY}  # without faster-qwen3-tts installed the peer is reported missing
  COMPILE=0  # the compiled variants' plumbing runs; inductor on a 2-core CPU would take minutes
  PREFIX_ROUNDS=1 PEER_CHUNKS=${PEER_CHUNKS:-1} PEER_ROUNDS=1
  COST_GRID="--rows 1 2 4 --kv-blocks 1 2 --prompts 1 2 --widths 8 16 --decoder-rows 1 2 --frames 1 4 --repeats 2"
  FUSED_BENCH="--rows 1 --kv-blocks 1 --rounds 1 --repeats 1"  # under Triton's interpreter: seconds per step
  OPENLOOP_ARGS=${OPENLOOP_ARGS:---rates 1,2 --seconds 2 --min-requests 3 --max-frames 12}
  OPENLOOP_VIRTUAL_ARGS="--rates 2 --seconds 1 --min-requests 2 --max-frames 4"  # the tiny CPU table's steps are slow
else
  DEVICE=cuda DTYPE=bfloat16 SIZE=${SIZE:-0.6b} DIT_PRESET=base
  TALKER_BATCHES=${TALKER_BATCHES:-1 64} OFFICIAL_BATCHES=${OFFICIAL_BATCHES:-1} TALKER_TICKS=10
  TALKER_LEVELS=${TALKER_LEVELS:-1,16,64,256} DIT_LEVELS=${DIT_LEVELS:-1,64} PROFILE_AT=64
  TALKER_SLOTS=${TALKER_SLOTS:-256}
  PY=${PYTHON:-python3} ORACLE_PY=python3 PEER_PY=python3
  COMPILE=${STREAMVOX_COMPILE:-1}
  PREFIX_ROUNDS=3 PEER_CHUNKS=${PEER_CHUNKS:-1 2 4 8} PEER_ROUNDS=3
  COST_GRID=${COST_GRID:-}
  FUSED_BENCH=${FUSED_BENCH:-"--rows 1 8 64 256 --kv-blocks 1 64 --rounds 3 --repeats 5"}
  OPENLOOP_ARGS=${OPENLOOP_ARGS:---rates 1,5,10,20,40 --seconds 20}
  OPENLOOP_VIRTUAL_ARGS=$OPENLOOP_ARGS
fi
FUSED_MODE=${FUSED_MODE:-persistent}  # the fused predictor's launch in the fused cost table (or phased)
FUSED_TESTS="tests/engines/models/test_fused_predictor.py tests/engines/models/test_fused_talker.py"
CKPT=${CKPT_DIR:-/tmp/ckpt-$SIZE}
UTTERANCE_TOKENS=76  # the served utterances: 75 frames, 6 s (make_checkpoint's default, as in every recorded run)
KERNEL_TEST=tests/engines/models/test_paged_attention.py
KERNEL_TESTS=${KERNEL_TESTS:-$([ "$DEVICE" = cuda ] && echo cuda || echo "not cuda")}  # on a GPU: the native kernel test alone
CUDA_TESTS="tests/engines/runtime/test_graphed_prefill.py tests/engines/runtime/test_graphed_predictor.py tests/engines/runtime/test_graphed_dit.py tests/engines/runtime/test_graphed_decoder.py tests/engines/pipelines/dit/test_stream.py
  tests/engines/core/test_gpu_engine.py tests/engines/pipelines/talker/test_talker_paged.py tests/engines/pipelines/talker/test_talker_source.py"

if [ "$DEVICE" = cuda ] && [ -d .whl/proj ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/proj/*.whl 2>&1 | tail -2
  export PYTHONPATH=/tmp/site:$PWD
fi
if [ "$DEVICE" = cuda ] && [ -d .whl/ref ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ref-site \
    .whl/ref/*.whl 2>&1 | tail -2
  ORACLE_PY=/tmp/oracle-python
  printf '#!/bin/sh\nPYTHONPATH=/tmp/ref-site:/tmp/site:%s exec python3 "$@"\n' "$PWD" > $ORACLE_PY
  chmod +x $ORACLE_PY
fi
if [ "$DEVICE" = cuda ] && [ -d .whl/peers ]; then  # the peer beside the host's transformers 5
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/peers-site \
    .whl/peers/*.whl 2>&1 | tail -2
  PEER_PY=/tmp/peer-python
  printf '#!/bin/sh\nPYTHONPATH=/tmp/peers-site:/tmp/site:%s exec python3 "$@"\n' "$PWD" > $PEER_PY
  chmod +x $PEER_PY
fi

# run_step NAME LIMIT_S MIN_S CMD...: runs CMD under min(LIMIT_S, budget left), appending its
# output to the log; skipped when less than MIN_S of the budget is left.
run_step() {
  local name=$1 limit=$2 min=$3; shift 3
  local left=$(( BUDGET_S - ($(date +%s) - T0) ))
  if [ "$left" -lt "$min" ]; then say "SKIP $name: ${left}s of the budget left, it needs ${min}s"; return 0; fi
  [ "$limit" -gt "$left" ] && limit=$left
  say "BEGIN $name (limit ${limit}s)"
  local t=$(date +%s)
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  case $rc in
    0) say "END $name ok in $(( $(date +%s) - t ))s" ;;
    124|137) say "END $name TIMED OUT after ${limit}s" ;;
    *) say "END $name FAILED rc=$rc in $(( $(date +%s) - t ))s" ;;
  esac
}

# served_talker NAME LIMIT_S [LEVELS]: the talker served to WebSocket clients (bench_e2e), at
# LEVELS (default 1 and the profile's level); the caller's environment picks the variant.
served_talker() {
  run_step "$1" "$2" 60 "$PY" benchmarks/bench_e2e.py --device "$DEVICE" --checkpoint "$CKPT" \
    --levels "${3:-1,$PROFILE_AT}" --max-new-tokens "$UTTERANCE_TOKENS" --serve-arg=--max-queue=1024 \
    --serve-arg="--max-slots=$TALKER_SLOTS"
}

step() {
  case $1 in
    env)
      run_step env 30 5 bash -c '{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
        || echo "no nvidia-smi"; '"$PY"' -c "import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"threads\", torch.get_num_threads())"; \
        git log -1 --format="commit %H %s" 2>/dev/null || true; git status --short | head -20; }' ;;
    ckpt)
      if [ -f "$CKPT/config.json" ] && [ -f "$CKPT/speech_tokenizer/config.json" ]; then
        say "checkpoint $CKPT already there"
      else
        run_step ckpt 150 30 "$ORACLE_PY" benchmarks/make_checkpoint.py --size "$SIZE" "$CKPT"
      fi ;;
    talker_bench)
      # shellcheck disable=SC2086
      STREAMVOX_COMPILE=$COMPILE run_step talker_bench 200 60 "$PY" benchmarks/bench_talker.py --size "$SIZE" \
        --device "$DEVICE" --dtype "$DTYPE" --batches $TALKER_BATCHES --official-batches $OFFICIAL_BATCHES \
        --ticks "$TALKER_TICKS" --step-graphs --compile-talker --oracle-python "$ORACLE_PY" ;;
    kernel)
      run_step kernel 90 20 "$PY" -m pytest -q -p no:cacheprovider -rs --timeout 80 "$KERNEL_TEST" -k "$KERNEL_TESTS"
      if [ "$DEVICE" = cuda ] && ! grep -q "END kernel ok" "$LOG"; then
        export STREAMVOX_PAGED_ATTENTION=0
        say "the paged-attention kernel failed its test: the steps below run the gather fallback"
      fi ;;
    preflight)
      run_step prefill_graphs 90 20 "$PY" -m pytest -q -p no:cacheprovider -rs --timeout 80 \
        tests/engines/runtime/test_graphed_prefill.py -k cuda  # (skipped on a CPU dry run: its CPU tests run in the suite)
      if [ "$DEVICE" = cuda ] && ! grep -q "END prefill_graphs ok" "$LOG"; then
        export STREAMVOX_PREFILL_GRAPHS=0
        say "the graphed prefill failed its test: the steps below prefill eagerly"
      fi
      run_step admission 90 20 "$PY" -m pytest -q -p no:cacheprovider -rs --timeout 80 \
        tests/engines/pipelines/talker/test_talker_source.py -k "started_together_equal_rows_started_one_by_one"
      if [ "$DEVICE" = cuda ] && ! grep -q "END admission ok" "$LOG"; then
        export STREAMVOX_BATCHED_ADMISSION=0
        say "rows started together failed their test: the steps below start admitted rows one by one"
      fi ;;
    costs)
      # shellcheck disable=SC2086
      run_step costs 150 40 "$PY" benchmarks/measure_costs.py --checkpoint "$CKPT" --device "$DEVICE" \
        --size "$SIZE" --slots "$TALKER_SLOTS" --out "$OUT/costs-$SIZE.json" $COST_GRID ;;
    peers)
      # shellcheck disable=SC2086
      run_step peers 150 60 "$PY" benchmarks/bench_peers.py --checkpoint "$CKPT" --device "$DEVICE" \
        --chunks $PEER_CHUNKS --rounds "$PEER_ROUNDS" --peer-python "$PEER_PY" \
        --serve-arg=--max-slots="$TALKER_SLOTS" ;;
    talker_e2e) served_talker talker_e2e 200 "$TALKER_LEVELS" ;;
    openloop)
      # shellcheck disable=SC2086
      run_step openloop 330 60 "$PY" benchmarks/bench_openloop.py --device "$DEVICE" --checkpoint "$CKPT" \
        $OPENLOOP_ARGS --peer-python "$PEER_PY" --serve-arg=--max-queue=1024 --serve-arg="--max-slots=$TALKER_SLOTS" ;;
    openloop_virtual)
      if [ -f "$OUT/costs-$SIZE.json" ]; then
        # shellcheck disable=SC2086
        run_step openloop_virtual 300 60 "$PY" benchmarks/bench_openloop.py --virtual-device "$OUT/costs-$SIZE.json" \
          --checkpoint "$CKPT" $OPENLOOP_VIRTUAL_ARGS --serve-arg=--max-queue=1024 --serve-arg="--max-slots=$TALKER_SLOTS"
      else
        say "SKIP openloop_virtual: no $OUT/costs-$SIZE.json (run the costs step first)"
      fi ;;
    talker_e2e_ctalk) STREAMVOX_COMPILE=$COMPILE STREAMVOX_COMPILE_TALKER=1 served_talker talker_e2e_ctalk 120 ;;
    talker_e2e_eager) STREAMVOX_TALKER_STEP_GRAPHS=0 served_talker talker_e2e_eager 120 ;;
    profile_talker)
      run_step profile_talker 120 45 "$PY" benchmarks/bench_engine.py --checkpoint "$CKPT" --device "$DEVICE" \
        --levels "$PROFILE_AT" --rounds 1 --max-slots "$TALKER_SLOTS" --profile "$PROFILE_AT" --trace-dir "$OUT"
      [ -f "$OUT/trace_$PROFILE_AT.json" ] && gzip -f "$OUT/trace_$PROFILE_AT.json" \
        && mv "$OUT/trace_$PROFILE_AT.json.gz" "$OUT/trace_talker.json.gz" ;;
    dit_e2e)
      run_step dit_e2e 150 60 "$PY" benchmarks/bench_e2e.py --preset "$DIT_PRESET" --device "$DEVICE" \
        --levels "$DIT_LEVELS" --serve-arg=--max-queue=1024 ;;
    tests)
      # one pytest per file: a device-side assert aborts the process, and the other files still run
      # the files travel as arguments ("$@"), never spliced into the script text (a newline in the list broke it)
      # shellcheck disable=SC2086
      run_step tests 300 40 bash -c 'py=$1; shift; rc=0; for f in "$@"; do echo "== $f"; "$py" -m pytest \
        -q -p no:cacheprovider -rs -m cuda --timeout 200 --continue-on-collection-errors "$f" > /tmp/gpu-verify-test.log \
        2>&1 || rc=1; tail -40 /tmp/gpu-verify-test.log; done; exit $rc' gpu-verify-tests "$PY" ${TESTS:-$CUDA_TESTS} ;;
    cp)
      run_step cp 150 30 "$PY" benchmarks/bench_code_predictor.py --preset base --device "$DEVICE" --dtype "$DTYPE" \
        --batches 1 8 64 512 --min-seconds 0.5 --oracle-python "$ORACLE_PY" ;;
    tick)
      run_step tick 150 30 "$PY" benchmarks/bench_tick.py --preset base --device "$DEVICE" --dtype "$DTYPE" \
        --depths 1,4,8,16,32,64 --steps 8 --ticks 16 --repeats 2 ;;
    engine)
      run_step engine 240 30 "$PY" benchmarks/bench_engine.py --preset base --device "$DEVICE" \
        --levels 1,8,32,64,128 --rounds 2 --max-slots 128 ;;
    clone)
      run_step clone 300 60 "$PY" benchmarks/bench_clone_ttfa.py --device "$DEVICE" --runs 9 ;;
    prefix_cache)
      run_step prefix_cache 90 30 "$PY" benchmarks/bench_prefix_cache.py --size "$SIZE" --device "$DEVICE" \
        --dtype "$DTYPE" --rounds "$PREFIX_ROUNDS" ;;
    fused)
      # the kernels against the reference on this GPU (on a CPU dry run: collected and skipped; their
      # interpreted tests run in the suite), then timed beside the graphed step, then the cost table
      # shellcheck disable=SC2086
      run_step fused_check 300 40 "$PY" -m pytest -q -p no:cacheprovider -rs -s --timeout 290 -m cuda $FUSED_TESTS
      if [ "$DEVICE" = cuda ] && ! grep -q "END fused_check ok" "$LOG"; then
        say "the fused kernels failed their CUDA tests: timed below all the same, their figures are not to be used"
      fi
      # shellcheck disable=SC2086
      TRITON_INTERPRET=$([ "$DEVICE" = cuda ] && echo 0 || echo 1) STREAMVOX_COMPILE=$COMPILE run_step fused_bench 240 60 \
        "$PY" benchmarks/bench_fused.py --size "$SIZE" --device "$DEVICE" --dtype "$DTYPE" $FUSED_BENCH
      # shellcheck disable=SC2086
      run_step fused_costs 150 40 "$PY" benchmarks/measure_costs.py --checkpoint "$CKPT" --device "$DEVICE" \
        --size "$SIZE" --slots "$TALKER_SLOTS" --out "$OUT/costs-$SIZE-fused.json" --fused-predictor "$FUSED_MODE" \
        --fused-talker $COST_GRID ;;
    *) say "unknown step $1" ;;
  esac
}

QUICK="env ckpt kernel preflight talker_e2e costs talker_bench peers tests"
STEPS=""
for s in ${*:-quick}; do
  if [ "$s" = quick ]; then STEPS="$STEPS $QUICK"; else STEPS="$STEPS $s"; fi
done
STEPS=${STEPS# }
say "steps: $STEPS; budget ${BUDGET_S}s; device $DEVICE, talker $SIZE, dtype $DTYPE"
for s in $STEPS; do
  case " ${SKIP_STEPS:-} " in *" $s "*) say "SKIP $s (SKIP_STEPS)" ;; *) step "$s" ;; esac
done
say "done"
