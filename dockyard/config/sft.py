"""The `sft` section: present, it makes the job supervised fine-tuning instead of GRPO."""

from __future__ import annotations

from pydantic import Field

from dockyard.config.section import MAX_BATCH, MAX_STEPS, Section


class SFTConfig(Section):
    max_num_steps: int = Field(100, ge=1, le=MAX_STEPS, description="Supervised optimizer steps of the job.")
    batch_size: int = Field(
        32,
        ge=1,
        le=MAX_BATCH,
        description="Demonstrations (training tasks with their reference, or sft.dataset records) per step.",
    )
    val_period: int = Field(0, ge=0, le=MAX_STEPS, description="Validate every this many steps; 0 = only at start/end.")
    val_at_start: bool = Field(False, description="Validate before the first step.")
    val_at_end: bool = Field(True, description="Validate after the last step.")
    dataset: str | None = Field(
        None,
        description=(
            "A JSONL(.gz) of demonstrations instead of the training tasks' references: `{prompt, "
            "completion}` records, or `{messages}` records, with optional `tools` schemas (chat "
            "messages rendered with the policy's chat template and those tools; each assistant turn "
            "trained once, after everything before it as context). Read in a seeded order "
            "(`data.train.seed`), reshuffled every pass. `dockyard export-sft` writes one from a run."
        ),
    )
