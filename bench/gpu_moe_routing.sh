#!/usr/bin/env bash
# Routing replay's cost per training step on one GPU: bench/moe_replay_cost.py's full output to $OUT/moe_replay_cost.txt.
#
#   OUT=/tmp/out bash bench/gpu_moe_routing.sh
#
# Needs, beside torch and transformers: pydantic, omegaconf, pyyaml (what dockyard.config imports).
#   moe_replay_cost.txt   a Qwen3-MoE shape (16 layers, hidden 1024, 64 experts, top 8; bf16, fp32 master weights),
#                         16 sequences of 1,024 tokens: record_vs_plain_step, replay_vs_plain_step
set -uo pipefail
OUT=${OUT:?set OUT to the folder for the outputs}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
status=0
python bench/moe_replay_cost.py 2>&1 | tee "$OUT/moe_replay_cost.txt" || status=1
grep -H -E "^[a-z_]+: [0-9.]+$" "$OUT"/moe_replay_cost.txt
exit $status
