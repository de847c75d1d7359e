#!/usr/bin/env bash
# Every GPU check in one command, for a lent GPU machine (its python3 holds a CUDA torch;
# hetstore runs from src/): the CUDA tests, then the GPU benchmark's placements, then
# everything on disk with a clip at 1.0, with step_in_forward (the default) and without. Logs go to
# $OUT (or ./gpu-logs). Each part has its own time limit so that one hang cannot eat
# the rest.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD" PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
timeout "${TESTS_S:-180}" python3 -m pytest -q -p no:cacheprovider -m cuda --timeout 60 \
    tests/test_cuda.py tests/test_device_tier.py tests/test_grad_contract.py \
    2>&1 | tee "$OUT/cuda_tests.log"
timeout "${BENCH_S:-150}" python3 benchmarks/gpu/offload_step.py --steps 4 \
    --variants cpu-cpu,cpu-cpu:in-forward,cpu-cpu:no-overlap,none-cpu,disk-cpu \
    2>&1 | tee "$OUT/bench.log"
timeout "${DISK_S:-110}" python3 benchmarks/gpu/offload_step.py --steps 3 --clip 1.0 \
    --variants disk-disk:step-after,disk-disk 2>&1 | tee "$OUT/bench_disk_clip.log"
