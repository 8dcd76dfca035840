"""FSDP2 across 2 ranks (torchrun, gloo, CPU) takes the same steps as one rank on the same batch.

The test runs this file under torchrun; each rank builds the same PolicyTrainer,
takes one GRPO step on the same groups (two minibatches of one group each, so
two optimizer steps against the logprobs of the policy that started the step;
dealt over the ranks, micro-batched under a token budget) and one supervised step on the same rows, then writes
its metrics, the gathered weights and a checkpoint. The same step taken in the
test process (one rank, no FSDP) must give the same loss, gradient norm and
weights, and the 2-rank checkpoint must load with AutoModelForCausalLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dockyard.config import load_config_text
from services.trainer.experience import Sample, TrainingGroup
from tests.conftest import REPO_ROOT, free_port

CONFIG = """
policy:
  model: {model_type: qwen2, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2,
          num_attention_heads: 2, num_key_value_heads: 1, max_position_embeddings: 64}
  train_global_batch_size: 3
  train_micro_batch_size: 4
  max_tokens_per_micro_batch: 40
  optimizer: {lr: 0.01, max_grad_norm: 0.5}
loss_fn: {kl_penalty: 0.05}
grpo: {num_prompts_per_step: 2, num_generations_per_prompt: 3}
"""


def groups() -> list[TrainingGroup]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for g in range(2):
        samples = []
        for i in range(3):
            prompt = torch.randint(4, 60, (5 + 2 * g,), generator=gen).tolist()
            completion = torch.randint(4, 60, (2 + 3 * i + g,), generator=gen).tolist()
            samples.append(
                Sample(
                    trajectory_id=f"g{g}/{i}",
                    prompt_ids=prompt,
                    completion_ids=completion,
                    generation_logprobs=(-torch.rand(len(completion), generator=gen) * 3).tolist(),
                    reward=float(i == g),
                    valid=True,
                )
            )
        out.append(TrainingGroup(group_id=f"g{g}", samples=samples))
    return out


# LoRA under FSDP2: frozen base and trained adapters share each decoder layer's shard group.
LORA = [
    "policy.lora.enabled=true",
    "policy.lora.rank=4",
    "policy.optimizer.lr=0.05",
    "policy.optimizer.max_grad_norm=0.2",
]
# Compiled decoder layers, then FSDP2 over them: the same step as one compiled rank.
COMPILED = ["policy.compile_layers=true"]
# Mixture-of-experts layers (dockyard/models/moe.py): the fused 3-D expert weights and the router shard on dim 0.
# A small lr: at the dense runs' lr, Adam's first updates amplify the two reductions' rounding differences past
# float32 tolerance in these models (seen on embeddings and attention under q/k norms, and on the experts).
QWEN3_MOE = [
    "policy.model.model_type=qwen3_moe",
    "+policy.model.num_experts=4",
    "+policy.model.num_experts_per_tok=2",
    "+policy.model.moe_intermediate_size=16",
    "policy.optimizer.lr=0.002",
]
MIXTRAL = [
    "policy.model.model_type=mixtral",
    "+policy.model.num_local_experts=4",
    "+policy.model.num_experts_per_tok=2",
    "policy.optimizer.lr=0.002",
]


def take_step(overrides: list[str]):
    from services.trainer.policy import PolicyTrainer

    policy = PolicyTrainer(load_config_text(CONFIG, overrides))
    metrics = policy.train_step(groups())
    # Then a supervised step on the same rows (the SFT job's step), sharded the same way.
    demos = [(s.prompt_ids, s.completion_ids) for g in groups() for s in g.samples]
    metrics["sft_loss"] = policy.sft_step(demos)["loss"]
    weights = {name: tensor.clone() for name, tensor in policy.named_weights()}
    grads = {}
    for name, param in policy.model.named_parameters():
        grad = param.grad
        if grad is None:  # a frozen base weight under LoRA
            continue
        grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).clone()
    return policy, metrics, weights, grads


def main(out: Path, overrides: list[str]) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    policy, metrics, weights, grads = take_step(overrides)
    assert policy.world == 2
    policy.save(out / "checkpoint")
    if dist.get_rank() == 0:
        torch.save({"weights": weights, "grads": grads}, out / "weights.pt")
        (out / "metrics.json").write_text(json.dumps(metrics))
    # Both ranks leave together: a rank that tore its group down while the other still wrote once aborted
    # ("terminate called without an active exception", exit -6).
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "overrides", [[], LORA, COMPILED, QWEN3_MOE, MIXTRAL], ids=["full", "lora", "compiled", "qwen3_moe", "mixtral"]
)
def test_two_ranks_take_the_single_rank_step(tmp_path: Path, overrides: list[str]) -> None:
    # Loopback only: the ranks never depend on how the machine resolves its hostname.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    cmd += ["-m", "tests.unit.trainer.test_ranks", str(tmp_path), *overrides]
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    policy, single, weights, grads = take_step(overrides)
    sharded = json.loads((tmp_path / "metrics.json").read_text())
    # Several micro-batches under the token budget; the step is still the global one.
    assert single["num_micro_batches"] >= 2 and sharded["num_micro_batches"] >= 1
    assert single["optimizer_steps"] == sharded["optimizer_steps"] == 2
    if overrides in ([], COMPILED):  # full fine-tuning moves far enough in one update for the second minibatch to clip
        assert single["clip_fraction"] > 0
    keys = ("loss", "pg_loss", "kl", "grad_norm", "entropy", "num_tokens", "gen_train_kl", "clip_fraction", "sft_loss")
    for key in keys:
        assert abs(single[key] - sharded[key]) <= 1e-5 * max(1.0, abs(single[key])), key
    # Clipping was active: the global norm must agree across ranks.
    assert single["grad_norm"] > policy.config.policy.optimizer.max_grad_norm
    two = torch.load(tmp_path / "weights.pt")
    assert list(two["weights"]) == list(weights)
    # The clipped gradients agree to float32 rounding; the weights after AdamW too, up to
    # Adam's amplification of rounding noise in gradients that are zero in exact arithmetic
    # (a key bias cannot change a softmax).
    # MoE: Qwen3's q/k norms leave q/k gradients with directions that are zero in exact arithmetic, which Adam
    # amplifies (seen up to 1e-6 on gradients, 2e-5 on weights); 5e-5 is 1/40 of one update at lr 0.002, far
    # below what a wrong shard would move.
    grad_atol, weight_atol = (5e-6, 5e-5) if overrides in (QWEN3_MOE, MIXTRAL) else (1e-7, 1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(two["grads"][name], grad, rtol=1e-4, atol=grad_atol, msg=name)
    for name, tensor in weights.items():
        torch.testing.assert_close(two["weights"][name], tensor, rtol=1e-5, atol=weight_atol, msg=name)

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint")
    for name, tensor in loaded.named_parameters():
        torch.testing.assert_close(tensor, two["weights"][name], rtol=0, atol=0, msg=name)
    if policy.peft is not None:  # the adapter gathered from the shards is the one-rank adapter
        from peft import get_peft_model_state_dict
        from safetensors.torch import load_file

        saved = load_file(tmp_path / "checkpoint" / "adapter" / "adapter_model.safetensors")
        mine = get_peft_model_state_dict(policy.peft)
        assert saved.keys() == mine.keys()
        for name, tensor in mine.items():
            torch.testing.assert_close(saved[name], tensor, rtol=1e-5, atol=1e-5, msg=name)


def test_rank_zero_finishes_every_gather_even_when_its_send_fails(tmp_path: Path) -> None:
    # The other ranks drain every gather of "weights"; a rank 0 that stopped early would hang them.
    from services.trainer.ranks import Ranks

    ranks = Ranks("cpu")
    policy = ranks.collective("load", "job", CONFIG, str(tmp_path))
    gathered = []
    gather = policy.named_weights

    def weights():
        for name, tensor in gather():
            gathered.append(name)
            yield name, tensor

    def send(it) -> None:
        next(it)
        raise RuntimeError("the sync failed")

    policy.named_weights = weights
    with pytest.raises(RuntimeError, match="the sync failed"):
        ranks.collective("weights", "job", send=send)
    assert gathered == [name for name, _ in policy.model.named_parameters()]
    ranks.collective("unload", "job")
    assert ranks.policies.jobs == {}


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
