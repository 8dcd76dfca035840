#!/usr/bin/env bash
# The JAX trainer backend on one GPU against the torch backend: bench/trainer.py --backend jax.
#
#   OUT=/tmp/out bash bench/gpu_jax.sh
#
# The GPU image brings CUDA JAX (0.11), torch and transformers; flax, optax and the project's own
# dependencies (grpcio, protobuf, pydantic, structlog, omegaconf, pyyaml, ...) come as cp312/py3
# wheels from .gpuwheels/ when that folder exists (installed with --no-index --no-deps: nothing is
# fetched and the image's jax, jaxlib and torch stay as they are).
#   jax_smoke.txt   a tiny model in fp32 on the GPU: the two backends' losses agree, compiles are seconds
#   jax.txt         the Qwen2.5-0.5B shape in bf16, 32 sequences of 0.75k-2k tokens, one optimizer step:
#                   tokens/s and MFU of each backend; jax_mfu, torch_mfu, jax_vs_torch. The JAX warmup
#                   step compiles one program per micro-batch shape (a few; minutes for 24 layers).
set -uo pipefail
OUT=${OUT:?set OUT to the folder for the outputs}
PY=${PYTHON:-python}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} NCCL_NVLS_ENABLE=0
# JAX shares the GPU with torch in this process: allocate on demand, not 75% up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ -d .gpuwheels ]; then
  "$PY" -m pip install -q --no-index --no-deps --find-links .gpuwheels .gpuwheels/*.whl 2>&1 | tail -3
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
"$PY" -c "import jax, flax, optax, torch; print('jax', jax.__version__, jax.devices(), 'flax', flax.__version__, \
'optax', optax.__version__, 'torch', torch.__version__)" 2>&1 | tee "$OUT/versions.txt" || exit 1
status=0
timeout 300 "$PY" bench/trainer.py --backend jax --smoke --device cuda 2>&1 | tee "$OUT/jax_smoke.txt" || status=1
timeout 570 "$PY" bench/trainer.py --backend jax --warmup 1 --steps 3 2>&1 | tee "$OUT/jax.txt" || status=1
grep -h -E "^[a-z_]+: [0-9.]+$" "$OUT"/jax.txt
exit $status
