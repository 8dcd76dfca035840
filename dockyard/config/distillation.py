"""The `on_policy_distillation` section: the teacher of each agent's rollouts.

Guarantees: the rules that make a job an OPD job are in launch_rules.py.
"""

from __future__ import annotations

from pydantic import Field

from dockyard.config.section import Section


class OnPolicyDistillationConfig(Section):
    teacher_model_by_agent_name: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Teacher folder (a local Hugging Face folder sharing the student's tokenizer) per agent "
            "(environment) name, e.g. `{expr: runs/expr-grpo/checkpoints/step-30}`; a rollout's agent "
            "name is its job's `env.name`; the trainer loads each one frozen, without an optimizer."
        ),
    )
