#!/usr/bin/env bash
# Every GPU check in one command, for a lent GPU machine (one H100 80 GB, 16 cores, 128 GB
# of memory, no network; its python3 holds a CUDA torch and transformers; hetstore runs
# from src/): the CUDA tests, then one table of training steps (step_table.py): the 185M
# GPT and a 0.95B Llama, batches 8x512 and 32x512, plain PyTorch, hetstore (host, host
# without overlap, states on host with the parameters on the GPU, disk), FSDP2 CPU offload
# and torchao's CPUOffloadOptimizer, every row against plain PyTorch in the same process,
# then where each profiled step's time went. About 8 minutes in all.
#
#   bash benchmarks/gpu/fetch_wheels.sh      # here, once: torchao's wheel into .wheels/
#   GIT_COMMIT=<sha> bash benchmarks/gpu/run_all.sh   # there, with .wheels carried
#   SMOKE=1 bash benchmarks/gpu/run_all.sh   # anywhere: every row, tiny, on the CPU
#   PYTHON=.venv/bin/python PART_ARGS="--cpu --tiny" EVICT_ARGS="--device cpu --tiny" \
#       RESULTS_DIR=/tmp OUT=/tmp/rehearsal \
#       bash benchmarks/gpu/run_all.sh       # a rehearsal of this script without a GPU
#
# Logs go to $OUT (or ./gpu-logs), packed at the end into logs.tgz; the table is also written to
# benchmarks/results/gpu_step_engine_<date>_<device>.txt and copied to $OUT. Each part has
# its own time limit so that one hang cannot eat the rest: wheels 30 s, CUDA tests 90 s,
# the host probe 30 s, evict/restore 40 s, the GPT 100 s, the Llama what is left of TOTAL_S=465 s (at least 120 s), the table 20 s.
# The step parts also stop themselves in time (--budget-s: fewer timed steps, never fewer
# than one per batch shape) and write their rows after each timed round, so a part killed
# by its limit keeps what it finished and the table says which rows are missing.
#
# Sizing, assumed from the H100 runs of 2026-11-26 (benchmarks/results/gpu_offload_step_*):
# the GPT's steps take 0.1-0.5 s (plain, hetstore host) to about 1.5 s (hetstore disk), so
# a round of its six runners takes 3-5 s (the host row takes two steps a
# round: an untimed one before its timed one) and the part (build, warm-up, 5 timed, 1 profiled
# round per shape) about 80 s. The Llama is 5x the GPT: the host rows' CPU AdamW step on
# 0.95B fp32 parameters about 1 s, its disk row about 10 s a step (about 34 bytes of disk
# traffic per parameter at ~3 GB/s), so a round takes 15-17 s, set-up about a minute
# (pinning about 60 GB of host memory, writing the disk row's ~30 GB: hetstore's disk tier
# peaks at ~32 bytes per parameter with its shadow regions), and the part runs 3 timed
# steps per shape in the ~300 s the tests and the GPT leave (fewer if that runs short).
# GPU memory: the Llama's plain runner holds 15 GB between steps, torchao's 4 GB, a 32x512
# step's activations about 40 GB at most. Disk: ~30 GB free under OFFLOAD_DIR (else the
# Llama's disk row says OutOfTierMemory and the rest of the table is unaffected).
# Measured on the H200 of 2026-11-28: 288 s in all, the GPT part 83 s, the Llama's 145 s;
# the disk rows' steps (3.4 s GPT, 19 s Llama) took most of the parts' time, so they now
# take one timed step per shape (--one-step-s), and the rows with an overlap trial run it
# alone after each warm-up round (8 steps: about 25 s for the Llama's two host rows).
set -u
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
if [ "${SMOKE:-0}" = 1 ]; then
    exec "$PYTHON" benchmarks/gpu/step_table.py --smoke
fi
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONPATH="$PWD/src:$PWD" PYTHONUNBUFFERED=1
# torchao's compiled extensions are never loaded (built for another torch, they can fail
# or crash): only its pure-Python CPUOffloadOptimizer is used
export TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1
STARTED=$(date +%s)

nvidia-smi -L
"$PYTHON" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
# a per-test limit where pytest-timeout is there (it is not a project dependency)
PER_TEST=$("$PYTHON" -c 'import pytest_timeout' 2>/dev/null && echo "--timeout 60")
timeout "${TESTS_S:-90}" "$PYTHON" -m pytest -q -p no:cacheprovider -m cuda $PER_TEST \
    tests/api/test_cuda.py tests/tiers/test_device_tier.py tests/runtime/test_grad_contract.py \
    tests/runtime/test_upload.py \
    2>&1 | tee "$OUT/cuda_tests.log"
TESTS=$(grep -E '(passed|failed|error|no tests ran)' "$OUT/cuda_tests.log" | tail -n 1)

# torchao travels as a wheel (the machine has no package registry): install it apart,
# without dependencies, and put it after src/ on the path
if ls .wheels/*.whl >/dev/null 2>&1; then
    SITE=/tmp/hetstore-gpu-wheels
    rm -rf "$SITE"
    if timeout "${WHEELS_S:-30}" "$PYTHON" -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --target "$SITE" .wheels/*.whl >"$OUT/wheels.log" 2>&1; then
        export PYTHONPATH="$PYTHONPATH:$SITE"
        echo "wheels installed: $(cd .wheels && ls *.whl | tr '\n' ' ')"
    elif "$PYTHON" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
        "$SITE" .wheels/*.whl >>"$OUT/wheels.log" 2>&1; then
        # (no pip there: a pure-Python wheel needs only unpacking)
        export PYTHONPATH="$PYTHONPATH:$SITE"
        echo "wheels unpacked (pip failed, see $OUT/wheels.log): $(cd .wheels && ls *.whl | tr '\n' ' ')"
    else
        echo "wheels not installed (see $OUT/wheels.log): their rows will say why"
    fi
else
    echo "no .wheels/ here (bash benchmarks/gpu/fetch_wheels.sh, then carry .wheels): the torchao row will say so"
fi

# the host's side of a host unit's step, piece by piece (the step, the home's cast, the
# copies each way): seconds
timeout "${PROBE_S:-30}" "$PYTHON" benchmarks/gpu/host_probe.py 2>&1 | tee "$OUT/host_probe.log"

# hetstore.evict / restore against a pinned copy_ of the same bytes (the colocated-RL
# cycle): ~1.7 GB of states on the GPU, seconds
timeout "${EVICT_S:-40}" "$PYTHON" benchmarks/evict_restore.py --device cuda --width 1024 \
    --depth 8 --repeats 5 \
    --out "${RESULTS_DIR:-benchmarks/results}/evict_restore_$(date +%F)_cuda.txt" \
    --json "${RESULTS_DIR:-benchmarks/results}/evict_restore_$(date +%F)_cuda.json" \
    ${EVICT_ARGS:-} 2>&1 | tee "$OUT/evict_restore.log" | grep -v Warning
cp "${RESULTS_DIR:-benchmarks/results}"/evict_restore_"$(date +%F)"_cuda.* "$OUT/" 2>/dev/null

# One process per model; every runner of it in that process. expandable segments: six
# runners' different allocation patterns in one process without fragmentation.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
OFFLOAD_DIR=${OFFLOAD_DIR:-/tmp}
FREE=$(df -h --output=avail "$OFFLOAD_DIR" 2>/dev/null | tail -n 1 | tr -d ' ')
part() {  # part MODEL LIMIT_S STEPS
    local started=$SECONDS
    timeout -k 20 "$2" "$PYTHON" benchmarks/gpu/step_table.py part --model "$1" \
        --steps "$3" --budget-s "$(($2 - 10))" --reserve-s 20 --offload-dir "$OFFLOAD_DIR" \
        --slow-s "${SLOW_S:-15}" \
        --json "$OUT/step_$1.json" ${PART_ARGS:-} >"$OUT/step_$1.log" 2>&1
    local rc=$?
    rm -rf "$OFFLOAD_DIR"/hetstore-step-table-*  # what a killed part left on disk
    echo "$1 part: exit $rc after $((SECONDS - started)) s (log: $OUT/step_$1.log)"
    if [ "$rc" != 0 ]; then tail -n 15 "$OUT/step_$1.log"; fi
}
part gpt "${GPT_S:-100}" "${GPT_STEPS:-5}"
# A runner whose step took over SLOW_S=15 s at 8x512 is not run at 32x512 (its row says
# so): the Llama's disk row (~25 s a step at the last H100's 1.2-1.5 GB/s disk) would
# otherwise leave the other Llama 32x512 rows no time.
# the Llama part gets what is left of the whole run's TOTAL_S (less the table's limit and
# the 20 s a killed part is given to exit)
LEFT=$((${TOTAL_S:-465} - ($(date +%s) - STARTED) - ${TABLE_S:-20} - 20))
part llama "$((LEFT < ${LLAMA_MIN_S:-120} ? ${LLAMA_MIN_S:-120} : LEFT))" "${LLAMA_STEPS:-3}"

timeout "${TABLE_S:-20}" "$PYTHON" benchmarks/gpu/step_table.py table --dir "$OUT" \
    --results-dir "${RESULTS_DIR:-benchmarks/results}" --copy-to "$OUT" \
    --run-command "bash benchmarks/gpu/run_all.sh" \
    --note "CUDA tests: ${TESTS:-no summary (see cuda_tests.log)}" \
    --note "PYTORCH_CUDA_ALLOC_CONF=$PYTORCH_CUDA_ALLOC_CONF; disk tier under $OFFLOAD_DIR (${FREE:-?} free at the start)" \
    2>&1
# a lent machine returns at most 8 files from $OUT: the logs and the parts' rows go back
# as one archive beside the results files
(cd "$OUT" && tar czf logs.tgz --remove-files ./*.log ./step_*.json 2>/dev/null)
echo "run_all.sh: $(($(date +%s) - STARTED)) s (in $OUT: $(cd "$OUT" && ls | tr '\n' ' '))"
