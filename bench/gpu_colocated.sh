#!/usr/bin/env bash
# One GPU, trainer and rollout colocated: what issue 19 asks to measure, each part one command.
#
#   bench/gpu_colocated.sh sync     bench/colocated_sync.py: refit of the 0.5B and 7B shapes vs a raw copy
#   bench/gpu_colocated.sh recipe   `dockyard run` of the tiny recipe, both services on cuda:0, colocated transport
#   bench/gpu_colocated.sh tests    tests/gpu/test_colocated_gpu.py (CUDA IPC exactness, NCCL refused on one GPU)
#   bench/gpu_colocated.sh all      the three in turn (default)
#
# Outputs go under $OUT (default ./out): one .txt per part, the recipe's run folder and service logs.
# Needs the project's dependencies importable by $PYTHON (default python) beside a CUDA torch.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
PY=${PYTHON:-python}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" NCCL_NVLS_ENABLE=0
status=0

sync() {
  timeout 540 "$PY" bench/colocated_sync.py 2>&1 | tee "$OUT/colocated_sync.txt" || status=1
}

recipe() {
  DOCKYARD_TRAINER_DEVICE=cuda DOCKYARD_ROLLOUT_DEVICE=cuda timeout 560 "$PY" -m dockyard.cli run --prepare \
    examples/configs/tiny_expr.yaml cluster.device=cuda cluster.weight_sync_transport=colocated \
    policy.model_name="${TMPDIR:-/tmp}/dockyard-tiny-expr-sft" logger.log_dir="$OUT/runs" ${RECIPE_ARGS:-} \
    2>&1 | tee "$OUT/tiny_colocated.txt" || status=1
  grep -h "weights received" "$OUT"/runs/logs/*/rollout.log | tail -3 >> "$OUT/tiny_colocated.txt" || true
}

tests() {
  CI=1 timeout 300 "$PY" -m pytest -q -rs tests/gpu/test_colocated_gpu.py 2>&1 | tee "$OUT/gpu_tests.txt" || status=1
}

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
case "${1:-all}" in
  sync) sync ;;
  recipe) recipe ;;
  tests) tests ;;
  all) sync; recipe; tests ;;
  *) echo "usage: $0 [sync|recipe|tests|all]" >&2; exit 2 ;;
esac
exit $status
