"""The trainer on tiny mixture-of-experts policies (Qwen3-MoE and Mixtral shapes): step, gradients, checkpoints, LoRA.

A GRPO step is finite, moves every parameter that takes part (experts and router included) and learns in the
rewarded direction; its gradients equal those of transformers' per-expert reference loop (so the grouped
expert kernels the engine and trainer run route and scale every token alike, empty experts included); a
checkpoint, HF or sharded (exported), loads in transformers with the same logits and resumes exactly; LoRA
trains attention adapters only, and the default targets are refused with a message that says so.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dockyard.config import ConfigError
from dockyard.export.hf_export import export_hf
from dockyard.models.moe import MOE_FAMILIES, num_experts
from services.trainer.policy import PolicyTrainer
from tests.unit.rollout.test_moe_engine import PROMPTS, group, moe_config, trainer_logprobs

ATTENTION = "policy.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]"


@pytest.fixture(params=MOE_FAMILIES)
def family(request) -> str:
    torch.set_num_threads(1)
    return request.param


def sequence_logprob(policy: PolicyTrainer, text: str) -> float:
    tok = policy.tokenizer
    prompt, ids = tok(PROMPTS[0])["input_ids"], tok(text, add_special_tokens=False)["input_ids"]
    return float(trainer_logprobs(policy.model, prompt, ids, 1.0).sum())


def test_a_grpo_step_moves_experts_and_router_and_learns(family: str) -> None:
    policy = PolicyTrainer(moe_config(family))
    assert num_experts(policy.model.config) > 0 and policy.model.config.output_router_logits is False
    before = {name: p.detach().clone() for name, p in policy.model.named_parameters()}
    rewarded = sequence_logprob(policy, "2*x+1")
    metrics = policy.train_step([group(policy.tokenizer, [1.0, 0.0, 0.0, 0.0])])
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    moved = {name for name, p in policy.model.named_parameters() if not torch.equal(p, before[name])}
    assert {n for n in before if "experts" in n} <= moved and any("gate.weight" in n for n in moved)
    assert moved == set(before)  # full fine-tuning, no weight decay: every parameter had a gradient
    assert sequence_logprob(policy, "2*x+1") > rewarded


def test_gradients_equal_the_per_expert_reference_loop(family: str) -> None:
    grads = []
    for implementation in ("grouped_mm", "eager"):
        policy = PolicyTrainer(moe_config(family))
        policy.model.set_experts_implementation(implementation)
        policy.accumulate_gradients([group(policy.tokenizer, [1.0, 0.0, 0.5, 0.0])])
        grads.append({name: p.grad.clone() for name, p in policy.model.named_parameters()})
    grouped, eager = grads
    for name, grad in eager.items():
        torch.testing.assert_close(grouped[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # Experts no token was routed to get exactly zero gradient on both paths (none, if every expert was hit).
    for name, grad in eager.items():
        if "experts" in name:
            idle = grad.flatten(1).abs().sum(1) == 0
            assert torch.equal(grouped[name].flatten(1).abs().sum(1) == 0, idle), name


@pytest.mark.parametrize("checkpoint_format", ["hf", "sharded"])
def test_a_checkpoint_loads_in_transformers_and_resumes(family: str, checkpoint_format: str, tmp_path: Path) -> None:
    overrides = [f"checkpointing.checkpoint_dir={tmp_path}", "checkpointing.resume=true"]
    overrides.append(f"checkpointing.format={checkpoint_format}")
    policy = PolicyTrainer(moe_config(family, *overrides), checkpoint_dir=tmp_path)
    batch = [group(policy.tokenizer, [1.0, 0.0, 0.0, 0.0])]
    policy.train_step(batch)
    folder = policy.save(tmp_path / "step-1")
    next_loss = policy.train_step([group(policy.tokenizer, [0.0, 1.0, 0.0, 0.0])])["loss"]
    policy.close()
    if checkpoint_format == "sharded":
        folder = export_hf(folder, tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert loaded.config.model_type == family and loaded.config.output_router_logits is False
    resumed = PolicyTrainer(moe_config(family, *overrides), checkpoint_dir=tmp_path)
    assert resumed.weight_version == 1
    ids = torch.tensor([policy.tokenizer(p)["input_ids"][:4] for p in PROMPTS])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, resumed.model.eval()(ids).logits, rtol=0, atol=0)
    resumed.model.train()
    assert resumed.train_step([group(policy.tokenizer, [0.0, 1.0, 0.0, 0.0])])["loss"] == next_loss


def test_lora_trains_attention_adapters_only(family: str) -> None:
    with pytest.raises(ConfigError, match="mixture-of-experts policy; only attention takes adapters"):
        PolicyTrainer(moe_config(family, "policy.lora.enabled=true"))  # the default targets include the MLP
    policy = PolicyTrainer(moe_config(family, "policy.lora.enabled=true", "policy.optimizer.lr=0.05", ATTENTION))
    trainable = {name for name, p in policy.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name and "self_attn" in name for name in trainable)
    base = dict(policy.named_weights())
    policy.train_step([group(policy.tokenizer, [1.0, 0.0, 0.0, 0.0])])
    merged = dict(policy.named_weights())
    assert list(merged) == list(base)  # the plain model's names: the engines need no peft
    changed = {name for name in base if not torch.equal(base[name], merged[name])}
    assert changed and all("self_attn" in name for name in changed)  # experts and router as loaded
