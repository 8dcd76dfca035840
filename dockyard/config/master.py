"""MasterConfig: one job config, assembled from its sections.

Guarantees: every section validates on its own first, then the knobs `loss_fn.name` presets are
filled where the config leaves them unset (presets.py), then the cross-field rules
(launch_rules.py) run once and report every broken rule together; `resolved_yaml()` is the exact
config a job ran with, and parses back to an equal MasterConfig; `unknown_keys()` lists the keys
no section defines (kept, never read).
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, Field, model_validator

from dockyard.config.checkpointing import CheckpointingConfig
from dockyard.config.cluster import ClusterConfig
from dockyard.config.data import DataConfig
from dockyard.config.distillation import OnPolicyDistillationConfig
from dockyard.config.env import EnvConfig
from dockyard.config.grpo import GRPOConfig
from dockyard.config.launch_rules import config_errors
from dockyard.config.logger import LoggerConfig
from dockyard.config.loss import LossConfig
from dockyard.config.policy import PolicyConfig
from dockyard.config.presets import apply_presets
from dockyard.config.section import Section
from dockyard.config.sft import SFTConfig


class MasterConfig(Section):
    policy: PolicyConfig
    sft: SFTConfig | None = Field(None, description="Present: a supervised fine-tuning job instead of GRPO.")
    loss_fn: LossConfig = Field(default_factory=LossConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    checkpointing: CheckpointingConfig = Field(default_factory=CheckpointingConfig)
    on_policy_distillation: OnPolicyDistillationConfig = Field(default_factory=OnPolicyDistillationConfig)

    @property
    def opd(self) -> bool:
        """Whether the job trains by on-policy distillation (grpo.adv_estimator.name=opd or loss_fn.opd)."""
        return self.sft is None and (self.grpo.adv_estimator.name == "opd" or self.loss_fn.opd)

    def teacher_model(self) -> str | None:
        """The teacher folder of this job's rollouts (their agent name is env.name); None without OPD."""
        return self.on_policy_distillation.teacher_model_by_agent_name.get(self.env.name) if self.opd else None

    @model_validator(mode="after")
    def _presets(self) -> MasterConfig:
        apply_presets(self)
        return self

    @model_validator(mode="after")
    def _launch_rules(self) -> MasterConfig:
        if errors := config_errors(self):
            raise ValueError("; ".join(f"{field}: {message}" for field, message in errors))
        return self

    @property
    def max_num_steps(self) -> int:
        """Optimizer steps of the job: sft.max_num_steps for a supervised job, else grpo.max_num_steps."""
        return self.sft.max_num_steps if self.sft else self.grpo.max_num_steps

    def checkpoint_folder(self, job_id: str) -> Path:
        """checkpointing.checkpoint_dir, or <log_dir>/<job_id>/checkpoints."""
        if self.checkpointing.checkpoint_dir is not None:
            return Path(self.checkpointing.checkpoint_dir)
        return Path(self.logger.log_dir) / job_id / "checkpoints"

    def resolved_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def unknown_keys(self) -> list[str]:
        """Dotted paths of keys no section defines: kept, never read (often a typo)."""
        return _extras(self, "")


def _extras(model: BaseModel, prefix: str) -> list[str]:
    found = [f"{prefix}{key}" for key in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            found += _extras(value, f"{prefix}{name}.")
    return found
