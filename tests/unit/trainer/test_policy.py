"""The trainer's GRPO step: batch layout, micro-batch invariance, learning direction, atomic saves."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dockyard.config import load_config_text
from services.trainer.batch import build_batch
from services.trainer.experience import Sample, TrainingGroup
from services.trainer.logprobs import token_logprobs
from services.trainer.policy import PolicyTrainer

CONFIG = """
policy:
  model: {model_type: qwen2, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1,
          num_attention_heads: 2, num_key_value_heads: 1, max_position_embeddings: 64}
  train_global_batch_size: 4
  train_micro_batch_size: 4
  optimizer: {lr: 0.002, max_grad_norm: null}
  generation: {temperature: 1.0}
grpo: {num_prompts_per_step: 1, num_generations_per_prompt: 4}
"""


def _group(policy: PolicyTrainer, completions: list[str], rewards: list[float], valid=None) -> TrainingGroup:
    tok = policy.tokenizer
    prompt = tok("f(1)=2 f(x)=")["input_ids"]
    samples = []
    for i, (text, reward) in enumerate(zip(completions, rewards, strict=True)):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        samples.append(
            Sample(
                trajectory_id=f"g/{i}",
                prompt_ids=list(prompt),
                completion_ids=ids,
                generation_logprobs=[-1.0] * len(ids),
                weight_version=0,
                reward=reward,
                valid=True if valid is None else valid[i],
            )
        )
    return TrainingGroup(group_id="g", samples=samples)


@pytest.fixture
def policy() -> PolicyTrainer:
    return PolicyTrainer(load_config_text(CONFIG))


def test_batch_masks_exactly_the_completion_tokens(policy: PolicyTrainer) -> None:
    group = _group(policy, ["2*x", "x+1"], [1.0, 0.0])
    batch = build_batch([group], policy.tokenizer.pad_token_id)
    prompt_len = len(group.samples[0].prompt_ids)
    row = batch.token_mask[0]
    assert row[: prompt_len - 1].sum() == 0
    assert row.sum() == 3
    # position t scores token t+1: the masked targets are the completion ids
    targets = batch.input_ids[0, 1:][row.bool()].tolist()
    assert targets == list(group.samples[0].completion_ids)


def test_micro_batching_does_not_change_the_gradient(policy: PolicyTrainer) -> None:
    group = _group(policy, ["2*x", "x+10", "x", "3*x+1"], [1.0, 0.0, 0.5, 0.25])
    grads = []
    for micro in (4, 1):
        p = PolicyTrainer(load_config_text(CONFIG, [f"policy.train_micro_batch_size={micro}"]))
        p.accumulate_gradients([group])
        grads.append(torch.cat([q.grad.flatten() for q in p.model.parameters() if q.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-7)


def test_a_step_raises_the_likelihood_of_the_rewarded_completion(policy: PolicyTrainer) -> None:
    group = _group(policy, ["2*x", "x+9", "x*x", "7"], [1.0, 0.0, 0.0, 0.0])
    batch = build_batch([group], policy.tokenizer.pad_token_id)

    def seq_logprob(row: int) -> float:
        with torch.no_grad():
            lp = token_logprobs(policy.model, batch.slice(row, row + 1), 1.0)
        return float((lp * batch.token_mask[row : row + 1]).sum())

    before = [seq_logprob(i) for i in range(4)]
    metrics = policy.train_step([group])
    after = [seq_logprob(i) for i in range(4)]
    assert after[0] > before[0]
    assert sum(after[1:]) < sum(before[1:])
    assert policy.weight_version == 1 and metrics["weight_version"] == 1.0
    for key in (
        "loss",
        "pg_loss",
        "grad_norm",
        "lr",
        "clip_fraction",
        "gen_train_logprob_abs_diff",
        "tokens_per_second",
    ):
        assert key in metrics


def test_invalid_trajectories_carry_no_gradient(policy: PolicyTrainer) -> None:
    # The invalid sample has a wildly different reward; masking it must leave the step unchanged.
    a = _group(policy, ["2*x", "x+9", "x*x", "7"], [1.0, 0.0, 0.0, 0.0], valid=[True, True, True, False])
    b = _group(policy, ["2*x", "x+9", "x*x", "7"], [1.0, 0.0, 0.0, 99.0], valid=[True, True, True, False])
    grads = []
    for group in (a, b):
        p = PolicyTrainer(load_config_text(CONFIG))
        p.accumulate_gradients([group])
        grads.append(torch.cat([q.grad.flatten() for q in p.model.parameters() if q.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1])


def test_no_reference_model_without_kl(policy: PolicyTrainer) -> None:
    assert policy.reference is None
    with_kl = PolicyTrainer(load_config_text(CONFIG, ["loss_fn.kl_penalty=0.1"]))
    assert with_kl.reference is not None
    assert not any(p.requires_grad for p in with_kl.reference.parameters())


def test_save_writes_a_folder_from_pretrained_loads(policy: PolicyTrainer, tmp_path: Path) -> None:
    out = policy.save(tmp_path / "step-0")
    assert not list(tmp_path.glob(".*tmp*"))
    loaded = AutoModelForCausalLM.from_pretrained(out)
    for (name, a), (_, b) in zip(policy.model.state_dict().items(), loaded.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, msg=name)


def _grads(policy: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "extra",
    [
        "  max_tokens_per_micro_batch: 40\n",
        "  max_tokens_per_micro_batch: 48\n  sequence_packing: true\n",
        "  activation_checkpointing: true\n  train_micro_batch_size: 1\n",
    ],
    ids=["token-budget", "packing", "activation-checkpointing"],
)
def test_batching_choices_give_the_same_loss_and_gradients(extra: str) -> None:
    base = PolicyTrainer(load_config_text(CONFIG))
    other = PolicyTrainer(
        load_config_text(CONFIG.replace("  train_micro_batch_size: 4\n", "  train_micro_batch_size: 4\n" + extra))
    )
    group = _group(base, ["2*x", "x+1", "(x*x)-1", "7"], [1.0, 0.5, 0.0, 0.0])
    group.samples[0].generation_logprobs[:] = [-0.5, -1.5, -2.0]
    if "checkpointing" in extra:
        model = other.model
        assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    a = base.accumulate_gradients([group])
    b = other.accumulate_gradients([group])
    assert b["num_micro_batches"] > a["num_micro_batches"] or "checkpointing" in extra or "packing" in extra
    for key in ("loss", "pg_loss", "entropy", "gen_train_kl", "num_tokens"):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    ga, gb = _grads(base), _grads(other)
    assert ga.keys() == gb.keys()
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], rtol=1e-4, atol=1e-6, msg=name)


def test_packing_puts_several_sequences_in_one_row() -> None:
    extra = "  max_tokens_per_micro_batch: 64\n  sequence_packing: true\n"
    policy = PolicyTrainer(
        load_config_text(CONFIG.replace("  train_micro_batch_size: 4\n", "  train_micro_batch_size: 4\n" + extra))
    )
    group = _group(policy, ["2*x", "x+1", "x", "7"], [1.0, 0.5, 0.0, 0.0])
    metrics = policy.accumulate_gradients([group])
    # 4 sequences of 13-15 tokens fit in one 64-token row: no padding at all.
    assert metrics["num_micro_batches"] == 1
    lengths = sum(len(s.prompt_ids) + len(s.completion_ids) for s in group.samples)
    assert metrics["sequence_tokens"] == lengths


@pytest.mark.parametrize(
    ("mutate", "words"),
    [
        (lambda g: g.samples[1].__setattr__("reward", float("nan")), ["trajectories[1]", "reward is nan"]),
        (lambda g: g.samples[0].generation_logprobs.append(-1.0), ["completion_logprobs for"]),
        (lambda g: g.samples[2].prompt_ids.append(10_000), ["token id 10000", "vocabulary"]),
        (lambda g: g.samples[0].generation_logprobs.__setitem__(0, float("inf")), ["non-finite"]),
        (lambda g: g.samples[3].prompt_ids.extend([5] * 80), ["exceed", "64 positions"]),
        (
            lambda g: [s.completion_ids.clear() or s.generation_logprobs.clear() for s in g.samples],
            ["empty batch"],
        ),
        (lambda g: g.samples.clear(), ["empty batch"]),
    ],
    ids=["nan-reward", "shape", "vocab", "inf-logprob", "too-long", "no-tokens", "no-trajectories"],
)
def test_bad_batches_are_refused_before_training(policy: PolicyTrainer, mutate, words) -> None:
    from dockyard.experience.trainable import BatchError

    group = _group(policy, ["2*x", "x+1", "x", "7"], [1.0, 0.5, 0.0, 0.0])
    mutate(group)
    before = [p.detach().clone() for p in policy.model.parameters()]
    with pytest.raises(BatchError) as info:
        policy.train_step([group])
    for word in words:
        assert word in str(info.value)
    assert policy.weight_version == 0
    assert all(torch.equal(a, b) for a, b in zip(before, policy.model.parameters(), strict=True))


@pytest.mark.parametrize(
    ("rows", "words"),
    [
        ([([5], [6, 1]), ([], [6, 1])], ["demonstrations[1]", "empty prompt"]),
        ([([5], [6, 10**6])], ["demonstrations[0]", "vocabulary"]),
        ([([5], [6] * 1000)], ["demonstrations[0]", "positions"]),
        ([([5], [])], ["empty batch"]),
        ([], ["empty batch"]),
    ],
    ids=["empty-prompt", "vocab", "too-long", "no-tokens", "no-rows"],
)
def test_bad_demonstrations_are_refused_before_training(policy: PolicyTrainer, rows, words) -> None:
    from dockyard.experience.trainable import BatchError

    with pytest.raises(BatchError) as info:
        policy.sft_step(rows)
    for word in words:
        assert word in str(info.value)
    assert policy.weight_version == 0


def test_bfloat16_keeps_fp32_master_weights() -> None:
    config = load_config_text(
        CONFIG.replace("  train_global_batch_size: 4\n", "  train_global_batch_size: 4\n  dtype: bfloat16\n")
    )
    policy = PolicyTrainer(config)
    assert all(p.dtype == torch.float32 for p in policy.model.parameters())
    assert all(t.dtype == torch.bfloat16 for _, t in policy.named_weights())  # what the rollout receives
    metrics = policy.train_step([_group(policy, ["2*x", "x+1", "x", "7"], [1.0, 0.5, 0.0, 0.0])])
    assert metrics["grad_norm"] > 0 and math.isfinite(metrics["loss"])


def test_warmup_then_cosine_schedule() -> None:
    config = load_config_text(
        CONFIG.replace("lr: 0.002", "lr: 0.002, warmup_steps: 2, schedule: cosine, min_lr_ratio: 0.1") + "\n"
    )
    config.grpo.max_num_steps = 6
    policy = PolicyTrainer(config)
    factors = [policy._lr_factor(s) for s in range(7)]
    assert factors[:3] == [0.5, 1.0, 1.0]
    assert factors[2] > factors[3] > factors[4] > factors[5] > factors[6] == pytest.approx(0.1)


def test_supervised_steps_learn_the_demonstrations(policy: PolicyTrainer) -> None:
    tok = policy.tokenizer
    demos = [
        (tok("f(1)=2 f(x)=")["input_ids"], tok("2*x", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]),
        (tok("f(1)=3 f(x)=")["input_ids"], tok("x+2", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]),
    ]
    losses = [policy.sft_step(demos)["loss"] for _ in range(15)]
    assert policy.weight_version == 15
    assert losses[-1] < losses[0] - 1.0 and losses == sorted(losses, reverse=True)
    # The loss is the NLL of the completion tokens only: the untrained model's is about log |V|.
    assert abs(PolicyTrainer(load_config_text(CONFIG)).sft_step(demos)["loss"] - math.log(len(tok))) < 0.5


def test_status_summarises_the_step_metrics(policy: PolicyTrainer) -> None:
    from dockyard.cli.views import trainer_summary

    metrics = policy.train_step([_group(policy, ["2*x", "x+1", "x", "7"], [1.0, 0.5, 0.0, 0.0])])
    lines = trainer_summary(metrics)
    text = "\n".join(lines)
    for word in ("loss", "entropy", "clip", "grad norm", "lr", "tokens/s", "|Δlogprob|", "prob error", "fwd/bwd"):
        assert word in text, word
    assert f"grad norm {metrics['grad_norm']:.3f}" in text
    assert trainer_summary({}) == []


def test_status_shows_the_pipeline_staleness_buffer_and_verdicts() -> None:
    from dockyard.cli.views import pipeline_summary

    lines = pipeline_summary(
        {"staleness_1": 24.0, "staleness_0": 40.0, "staleness_mean": 0.375, "buffer_held": 3.0, "verdict_error": 2.0}
    )
    assert lines == [
        "staleness:    age 0: 40  age 1: 24  (mean 0.38)",
        "buffer:       held 3",
        "verdicts:     error 2",
    ]
    assert pipeline_summary({"loss": 1.0}) == []
