#!/usr/bin/env bash
# The trainer's one-GPU benchmarks, one command: each one's full output goes to $OUT/<name>.txt.
#
#   OUT=/tmp/out bash bench/gpu_trainer.sh
#
# Needs, beside torch and transformers: pydantic, omegaconf, pyyaml (what dockyard.config imports).
#   trainer.txt            bench/trainer.py as it defaults: the Qwen2.5-0.5B shape, 32 sequences, one
#                          optimizer step, compile_layers and sequence_packing `auto` (on, on CUDA), the
#                          top ops of one step, then the same step padded: trainer_mfu, packed_vs_padded
#                          (no full-logits or plain step: their full logits of a 16k-token packed row do
#                          not fit 80 GB beside the step)
#   trainer_eager.txt      the eager padded step (both off), the top ops of one step, and its baselines:
#                          peak_memory_vs_full_logits, trainer_mfu, trainer_vs_plain_step
#   trainer_eager_packed.txt  eager, packed: trainer_mfu, packed_vs_padded (eager)
#   trainer_minibatch.txt  the same batch in 4 minibatches of 8 (4 optimizer steps, ρ ≠ 1 after the first)
#   checksum.txt           bench/checksum.py: the weight-sync fingerprint of 15.2 GB vs a device copy
set -uo pipefail
OUT=${OUT:?set OUT to the folder for the outputs}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
status=0
python bench/trainer.py --skip-full-logits --skip-plain --profile 25 2>&1 | tee "$OUT/trainer.txt" || status=1
python bench/trainer.py --compile-layers false --packing false --profile 25 2>&1 \
  | tee "$OUT/trainer_eager.txt" || status=1
python bench/trainer.py --compile-layers false --packing --skip-full-logits --skip-plain 2>&1 \
  | tee "$OUT/trainer_eager_packed.txt" || status=1
python bench/trainer.py --minibatch 8 --skip-full-logits --skip-plain 2>&1 | tee "$OUT/trainer_minibatch.txt" || status=1
python bench/checksum.py 2>&1 | tee "$OUT/checksum.txt" || status=1
grep -H -E "^[a-z_]+: [0-9.]+$" "$OUT"/trainer*.txt "$OUT"/checksum.txt
exit $status
