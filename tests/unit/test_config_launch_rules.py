"""launch_errors: one entry per broken rule, with the field to change and a fix in the message."""

import pytest

from dockyard.config.launch_rules import launch_errors

GOOD = dict(
    async_enabled=True,
    is_correction="seq-mask-tis",
    is_min=0.5,
    is_max=2.0,
    dual_clip_c=3.0,
    dynamic_sampling=False,
    reward_scaling=False,
    reward_shaping=False,
    num_dataloaders=1,
    num_prompts_per_step=8,
    num_generations_per_prompt=4,
    train_global_batch_size=32,
    opd=False,
    zero_prev_logprobs=False,
    teachers={"expr": "runs/expr-teacher"},
    agent_name="expr",
)


def errors(**changes):
    return launch_errors(**{**GOOD, **changes})


def test_good_configs_have_no_errors():
    assert errors() == []
    # sync mode may use every batch-level feature and no correction
    assert (
        errors(
            async_enabled=False,
            is_correction=None,
            dynamic_sampling=True,
            reward_scaling=True,
            reward_shaping=True,
            num_dataloaders=3,
            dual_clip_c=None,
        )
        == []
    )
    assert errors(is_correction="tis", is_min=None) == []
    assert errors(is_correction="plain", is_min=None, is_max=None) == []
    assert errors(opd=True) == []


@pytest.mark.parametrize(
    "changes, field, words",
    [
        ({"is_correction": None}, "loss_fn.is_correction", ["async", "seq-mask-tis", "grpo.async_grpo.enabled"]),
        ({"dynamic_sampling": True}, "grpo.dynamic_sampling.enabled", ["async", "=false"]),
        ({"reward_scaling": True}, "grpo.reward_scaling.enabled", ["async", "=false"]),
        ({"reward_shaping": True}, "grpo.reward_shaping.enabled", ["async", "=false"]),
        ({"num_dataloaders": 2}, "data.num_dataloaders", ["async", "set it to 1"]),
        ({"dual_clip_c": 1.0}, "loss_fn.dual_clip_c", ["> 1", "null"]),
        ({"dual_clip_c": 0.5}, "loss_fn.dual_clip_c", ["> 1"]),
        ({"is_min": 3.0, "is_max": 2.0}, "loss_fn.is_min", ["is_min <= is_max"]),
        ({"is_correction": "vtrace"}, "loss_fn.is_correction", ["'vtrace'", "icepop"]),
        ({"is_correction": "tis", "is_max": None}, "loss_fn.is_max", ["set loss_fn.is_max"]),
        ({"is_correction": "icepop", "is_min": None}, "loss_fn.is_min", ["set loss_fn.is_min"]),
        ({"train_global_batch_size": 12}, "policy.train_global_batch_size", ["8 × 4 = 32", "set it to 32", "16"]),
        ({"train_global_batch_size": 2}, "policy.train_global_batch_size", ["whole groups", "set it to 32"]),
        ({"num_generations_per_prompt": 2}, "policy.train_global_batch_size", ["8 × 2 = 16", "set it to 16"]),
        ({"opd": True, "zero_prev_logprobs": True}, "loss_fn.zero_prev_logprobs", ["zero_prev_logprobs=false"]),
        (
            {"opd": True, "async_enabled": False, "is_correction": None},
            "grpo.async_grpo.enabled",
            ["asynchronous path only", "grpo.async_grpo.enabled=true"],
        ),
        (
            {"opd": True, "agent_name": "program_synthesis"},
            "on_policy_distillation.teacher_model_by_agent_name",
            ["'program_synthesis'", "names expr", "teacher_model_by_agent_name.program_synthesis="],
        ),
    ],
)
def test_each_rule_reports_its_field_and_a_fix(changes, field, words):
    result = errors(**changes)
    assert [f for f, _ in result] == [field]
    for word in words:
        assert word in result[0][1]


def test_async_rules_only_apply_in_async_mode():
    assert errors(async_enabled=False, is_correction=None) == []
    assert errors(async_enabled=False, dynamic_sampling=True, num_dataloaders=4) == []


def test_minibatches_of_whole_groups_that_divide_the_step_are_accepted():
    for size in (4, 8, 16, 32):
        assert errors(train_global_batch_size=size) == []


def test_non_positive_sizes_are_reported():
    result = errors(num_prompts_per_step=0, train_global_batch_size=0)
    assert [f for f, _ in result] == ["grpo.num_prompts_per_step", "policy.train_global_batch_size"]


def test_every_broken_rule_is_reported_at_once():
    result = errors(
        is_correction=None,
        dynamic_sampling=True,
        reward_scaling=True,
        reward_shaping=True,
        num_dataloaders=2,
        dual_clip_c=0.9,
        is_min=2.0,
        is_max=1.0,
        train_global_batch_size=31,
        opd=True,
        zero_prev_logprobs=True,
    )
    assert [f for f, _ in result] == [
        "loss_fn.is_correction",
        "grpo.dynamic_sampling.enabled",
        "grpo.reward_scaling.enabled",
        "grpo.reward_shaping.enabled",
        "data.num_dataloaders",
        "loss_fn.is_min",
        "loss_fn.dual_clip_c",
        "policy.train_global_batch_size",
        "loss_fn.zero_prev_logprobs",
    ]


def test_opd_rules_only_apply_to_opd():
    assert errors(zero_prev_logprobs=True, teachers={}) == []
