#!/usr/bin/env bash
# FP8 rollouts on one FP8-capable GPU (H100/H200), one command: tests/gpu/test_fp8_gpu.py, then
# bench/fp8_rollout.py (tokens/s, engine refit time and the logprob mismatch, fp8 against bf16).
#
#   OUT=/tmp/out bash bench/gpu_fp8.sh
#
# Needs the project's dependencies importable by $PYTHON (default python) beside a CUDA torch.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
PY=${PYTHON:-python}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
nvidia-smi --query-gpu=name,memory.total,compute_cap --format=csv,noheader | tee "$OUT/gpu.txt"
CI=1 timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_gpu.py 2>&1 | tee "$OUT/fp8_tests.txt" || status=1
timeout 420 "$PY" bench/fp8_rollout.py ${FP8_ARGS:-} 2>&1 | tee "$OUT/fp8_rollout.txt" || status=1
grep -h -E "^[a-z0-9_]+: [0-9.e+-]+$" "$OUT/fp8_rollout.txt"
exit $status
