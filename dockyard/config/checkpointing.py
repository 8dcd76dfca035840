"""The `checkpointing` section: when, where and in which format checkpoints are written.

Guarantees: resuming needs a checkpoint folder shared by the runs.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from dockyard.config.section import MAX_STEPS, Section


class CheckpointingConfig(Section):
    enabled: bool = True
    save_period: int = Field(0, ge=0, le=MAX_STEPS, description="Save every this many steps; 0 = only at the end.")
    checkpoint_dir: str | None = Field(None, description="Checkpoints go here; null = <log_dir>/<job_id>/checkpoints.")
    keep_top_k: int | None = Field(
        None, ge=1, le=10_000, description="Keep the k best by metric_name, plus the latest; null = keep all."
    )
    metric_name: str = Field("pass_rate", min_length=1, description="Validation metric that ranks checkpoints.")
    higher_is_better: bool = Field(True, description="Direction of metric_name.")
    resume: bool = Field(False, description="Start from the latest checkpoint in checkpoint_dir, if there is one.")
    format: Literal["hf", "sharded"] = Field(
        "hf",
        description="hf: rank 0 writes a Hugging Face folder (from_pretrained loads it); sharded: every rank writes "
        "its own shards with torch.distributed.checkpoint (`dockyard export hf` converts one).",
    )
    async_save: bool = Field(
        False, description="sharded: write in the background while training goes on (one save in flight at a time)."
    )

    @model_validator(mode="after")
    def _resume_needs_dir(self) -> CheckpointingConfig:
        if self.resume and self.checkpoint_dir is None:
            raise ValueError("checkpointing.resume needs checkpointing.checkpoint_dir (a folder shared by the runs)")
        return self
