"""The tiny recipe on the vLLM engine (`policy.generation.backend=vllm`, vLLM's CPU build) learns too.

`dockyard run` of the shipped recipe, as tests/e2e/test_tiny_recipe_learns.py runs it, with the
rollout service generating through vLLM's AsyncLLM: every GRPO step's weights reach vLLM's worker
over the gloo weight-sync group and its logprobs feed the trainer's importance ratios. Only what
vLLM needs on a small CPU is added (eager mode, the model's context length, 1 GiB of KV cache).
Where vLLM is not installed it skips loudly (fails under CI=1); `make install-vllm` installs it.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

from tests.conftest import missing
from tests.e2e.conftest import MIN_GAIN, run_tiny_recipe

pytestmark = pytest.mark.slow

# As for the torch engine (0.23 -> 0.56 measured there).
VLLM_ON_CPU = [
    "policy.generation.backend=vllm",
    "+policy.generation.vllm_cfg.enforce_eager=true",
    "+policy.generation.vllm_cfg.max_model_len=128",  # the recipe's max_position_embeddings
    "+policy.generation.vllm_cfg.env_vars.VLLM_CPU_KVCACHE_SPACE=1",
]


# vLLM's start and 30 steps (and the warm start, when this runs alone): past pytest's default 600 s when loaded.
@pytest.mark.timeout(1800)
def test_tiny_recipe_on_vllm_raises_the_validation_pass_rate(tmp_path: Path, tiny_policy_folder: Path) -> None:
    if importlib.util.find_spec("vllm") is None:
        missing("vLLM is not installed (make install-vllm)")
    start = time.monotonic()
    records = run_tiny_recipe(tmp_path, tiny_policy_folder, *VLLM_ON_CPU, timeout=1700)
    val = [r for r in records if r["kind"] == "validation"]
    assert [r["step"] for r in val] == [0, 10, 20, 30]
    first, last = val[0]["pass_rate"], val[-1]["pass_rate"]
    print(f"\nvLLM recipe: validation pass rate {first:.3f} -> {last:.3f} in {time.monotonic() - start:.0f}s")
    assert last >= first + MIN_GAIN, f"validation pass rate {first:.3f} -> {last:.3f}"
