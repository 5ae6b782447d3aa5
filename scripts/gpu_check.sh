#!/usr/bin/env bash
# The GPU tests and the GPU attention benchmark, on a machine with MLX's CUDA
# (or Metal) build installed.  Logs go to $OUT (default /tmp/out).
#   bash scripts/gpu_check.sh
set -u
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c 'import mlx.core as mx; print(mx.__version__, mx.default_device())' | tee "$OUT/device.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null | tee -a "$OUT/device.txt"
python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/tests.log" | tail -30
python3 -m benchmarks.gpu_attention --json "$OUT/gpu_attention.json" 2>&1 | tee "$OUT/gpu_attention.log"
