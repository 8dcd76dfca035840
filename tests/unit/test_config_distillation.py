"""The launch rules of on-policy distillation, as `load_config` reports them (each names its field)."""

from __future__ import annotations

import pytest

from dockyard.config import ConfigError, load_config_text
from tests.unit.test_config import MINIMAL

OPD = [
    "grpo.adv_estimator.name=opd",
    "grpo.async_grpo.enabled=true",
    "loss_fn.is_correction=tis",
    "loss_fn.is_max=2",
    "+on_policy_distillation.teacher_model_by_agent_name.expr=runs/expr-teacher",
]


def test_an_opd_job_on_the_async_path_with_a_teacher_is_accepted() -> None:
    cfg = load_config_text(MINIMAL, OPD)
    assert cfg.opd and cfg.teacher_model() == "runs/expr-teacher"
    # loss_fn.opd is the same switch
    seed = [o for o in OPD if not o.startswith("grpo.adv")] + ["loss_fn.opd=true"]
    assert load_config_text(MINIMAL, seed).teacher_model() == "runs/expr-teacher"
    assert load_config_text(MINIMAL).teacher_model() is None


@pytest.mark.parametrize(
    ("changes", "field", "words"),
    [
        (["grpo.async_grpo.enabled=false"], "grpo.async_grpo.enabled", "asynchronous path only"),
        (["loss_fn.zero_prev_logprobs=true"], "loss_fn.zero_prev_logprobs", "replaces with zeros"),
        (
            ["env.name=program_synthesis", "data.train.source=humaneval", "data.validation.source=humaneval"],
            "on_policy_distillation.teacher_model_by_agent_name",
            "'program_synthesis'",
        ),
    ],
)
def test_each_opd_constraint_is_a_launch_error_naming_its_field(changes, field, words) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config_text(MINIMAL, [*OPD, *changes])
    message = str(caught.value)
    assert f"{field}: " in message and words in message
    # The same change without OPD is fine.
    plain = [c for c in changes if "async" not in c]
    load_config_text(MINIMAL, plain)
