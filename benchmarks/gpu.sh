#!/usr/bin/env bash
# benchmarks/gpu.py in one call on a GPU machine that has JAX (with CUDA) but neither Keras nor
# TensorFlow: installs the wheels carried in .whl/ (Keras and the two it needs that JAX's
# machine lacks), then runs the benchmark, its JSON to $OUT (or /tmp). Arguments go to gpu.py.
#
# Fetch the wheels here first, for the machine's Python (3.12 on the H200 machine):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     -d .whl keras==3.15.1 namex==0.1.0 optree==0.20.0
# then run this with .whl carried (the device tool: carry [".whl"], timeout_s 600):
#   bash benchmarks/gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD" KERAS_BACKEND=jax PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current \
    --format=csv 2>/dev/null || true
python3 benchmarks/gpu.py --json "${OUT:-/tmp}/gpu.json" "$@"
