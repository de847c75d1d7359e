#!/usr/bin/env bash
# The wheels the lent GPU machine needs and cannot fetch (it has no package registry),
# downloaded here into .wheels/ (git-ignored); run_all.sh installs them there
# (pip --no-index --no-deps --target) when the run carries .wheels.
#
# torchao: for the torchao cpu-offload row (torchao.optim.CPUOffloadOptimizer, pure
# Python; step_table.py skips loading torchao's compiled extensions). 0.18.0 is built
# against torch 2.11, the GPU machine's torch (2026-11); its wheel is cp310-abi3, so one
# file serves Python 3.10 to 3.13. Another version: TORCHAO_VERSION=0.17.0.
set -eu
cd "$(dirname "$0")/../.."
PIP=${PIP:-.venv/bin/pip}
mkdir -p .wheels
rm -f .wheels/torchao-*.whl
"$PIP" download --no-deps --only-binary=:all: -d .wheels \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    "torchao==${TORCHAO_VERSION:-0.18.0}"
ls -l .wheels
