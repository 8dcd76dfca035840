#!/usr/bin/env bash
# The trainer's one-GPU benchmarks, one command: each one's full output goes to $OUT/<name>.txt.
#
#   OUT=/tmp/out bash bench/gpu_trainer.sh
#
# Needs, beside torch and transformers: pydantic, omegaconf, pyyaml (what dockyard.config imports).
#   trainer.txt            bench/trainer.py: the Qwen2.5-0.5B shape, 32 sequences, one optimizer step;
#                          peak_memory_vs_full_logits, trainer_mfu, trainer_vs_plain_step
#   trainer_compiled.txt   the same with --compile-layers (policy.compile_layers)
#   trainer_packed.txt     --packing (policy.sequence_packing: varlen attention), the top ops of one step
#   trainer_compiled_packed.txt  --compile-layers --packing, the top ops of one step
#   trainer_minibatch.txt  the same batch in 4 minibatches of 8 (4 optimizer steps, ρ ≠ 1 after the first)
#   checksum.txt           bench/checksum.py: the weight-sync fingerprint of 15.2 GB vs a device copy
set -uo pipefail
OUT=${OUT:?set OUT to the folder for the outputs}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
status=0
python bench/trainer.py 2>&1 | tee "$OUT/trainer.txt" || status=1
python bench/trainer.py --compile-layers 2>&1 | tee "$OUT/trainer_compiled.txt" || status=1
python bench/trainer.py --packing --skip-full-logits --profile 25 2>&1 | tee "$OUT/trainer_packed.txt" || status=1
python bench/trainer.py --compile-layers --packing --skip-full-logits --profile 25 2>&1 \
  | tee "$OUT/trainer_compiled_packed.txt" || status=1
python bench/trainer.py --minibatch 8 --skip-full-logits 2>&1 | tee "$OUT/trainer_minibatch.txt" || status=1
python bench/checksum.py 2>&1 | tee "$OUT/checksum.txt" || status=1
grep -H -E "^[a-z_]+: [0-9.]+$" "$OUT"/trainer*.txt "$OUT"/checksum.txt
exit $status
