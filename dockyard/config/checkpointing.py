"""The `checkpointing` section: when, where and in which format checkpoints are written.

Guarantees: resuming needs a checkpoint folder shared by the runs.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from dockyard.config.section import MAX_STEPS, Section


class CheckpointingConfig(Section):
    enabled: bool = Field(
        True, description="Save checkpoints; when true, a final checkpoint is always saved after the last step."
    )
    save_period: int = Field(
        0,
        ge=0,
        le=MAX_STEPS,
        description=(
            "Save every this many steps; 0 = only at the end. Checkpoints go to "
            "`<checkpoint_dir>/step-<N>/` (see [trainer.md](trainer.md#checkpoints) for what one "
            "holds)."
        ),
    )
    checkpoint_dir: str | None = Field(
        None,
        description=(
            "Folder of the job's checkpoints; null = `<log_dir>/<job-id>/checkpoints`. Set it to a "
            "folder shared by the runs of one training to resume."
        ),
    )
    keep_top_k: int | None = Field(
        None,
        ge=1,
        le=10_000,
        description=(
            "Keep the k checkpoints with the best `metric_name` plus the latest (resume needs it); "
            "delete the others after each save. A checkpoint is ranked by the validation of its own "
            "step; one without a validation at its step only survives as the latest. null = keep "
            "every checkpoint."
        ),
    )
    metric_name: str = Field(
        "pass_rate",
        min_length=1,
        description=("Validation metric that ranks checkpoints (a key of the `validation` records of metrics.jsonl)."),
    )
    higher_is_better: bool = Field(True, description="Direction of `metric_name`.")
    resume: bool = Field(
        False,
        description=(
            "Start from the latest complete checkpoint in `checkpoint_dir` (weights, optimizer, "
            "scheduler, RNG, step, task position) and run the remaining steps up to "
            "`grpo.max_num_steps` (`sft.max_num_steps`); with no checkpoint there, start fresh. Needs "
            "`checkpoint_dir`."
        ),
    )
    format: Literal["hf", "sharded"] = Field(
        "hf",
        description=(
            "`hf`: rank 0 gathers the model and writes a Hugging Face folder (`from_pretrained` loads "
            "a checkpoint as it is); `sharded`: every rank writes its own shards with "
            "`torch.distributed.checkpoint`, no gather (`dockyard export hf` makes an HF folder of "
            "one; [trainer.md](trainer.md#sharded-checkpoints)). Not with `policy.lora`."
        ),
    )
    async_save: bool = Field(
        False,
        description=(
            "With `format: sharded`: copy the shards to host memory and write them in the background "
            "while training goes on; the checkpoint counts once every rank's shards are written."
        ),
    )

    @model_validator(mode="after")
    def _resume_needs_dir(self) -> CheckpointingConfig:
        if self.resume and self.checkpoint_dir is None:
            raise ValueError("checkpointing.resume needs checkpointing.checkpoint_dir (a folder shared by the runs)")
        return self
