"""The `data` section: the training and validation task sets and how their rows map to tasks.

Guarantees: which source an environment takes, and which need a path, is checked by
launch_rules.py; here each field is bounded.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dockyard.config.section import MAX_SEED, Section


class FieldsConfig(Section):
    """Which column of a dataset's rows holds what (docs/datasets.md); program-synthesis rows only."""

    id: str = Field("task_id", min_length=1, description="Task id; a row without it is named by its file and line.")
    prompt: str = Field("prompt", min_length=1, description="Prompt text (a row needs it or messages).")
    messages: str = Field(
        "messages", min_length=1, description="Chat messages [{role, content}], always rendered by the chat template."
    )
    tests: str = Field("tests", min_length=1, description="Python test source (one test) or a list of asserts.")
    answer: str = Field("answer", min_length=1, description="Reference answer, carried on the task for rewards.")
    solution: str = Field("solution", min_length=1, description="Reference completion (demonstrations).")
    metadata: list[str] = Field(
        default_factory=list, max_length=256, description="Further columns carried on the task as its metadata."
    )


class SourceConfig(Section):
    path: str = Field(min_length=1, description="A JSONL(.gz), Parquet, or Hugging Face datasets folder.")
    fields: FieldsConfig = Field(default_factory=FieldsConfig)


class DatasetConfig(Section):
    source: Literal[
        "expr", "expr_agent", "humaneval", "program_bench", "swe", "terminal_bench", "qa", "gdpval", "osworld"
    ] = Field("expr", description="Task set.")
    path: str | None = Field(
        None,
        description="humaneval / program_bench: a JSONL(.gz), Parquet or Hugging Face datasets folder of "
        "problems (docs/datasets.md); swe: task-set folder; terminal_bench: a folder of terminal-bench task folders; "
        "qa: a JSONL of questions; gdpval: a folder of file-producing task folders (docs/environments.md); "
        "osworld: OSWorld's evaluation_examples folder.",
    )
    fields: FieldsConfig = Field(default_factory=FieldsConfig)
    sources: list[SourceConfig] = Field(
        default_factory=list, max_length=64, description="More files of problems mixed in, each with its own fields."
    )
    size: int = Field(256, ge=1, le=100_000_000, description="Tasks drawn from the source.")
    seed: int = Field(0, ge=0, le=MAX_SEED)


class DataConfig(Section):
    train: DatasetConfig = Field(default_factory=DatasetConfig)
    validation: DatasetConfig = Field(default_factory=lambda: DatasetConfig(size=64, seed=1))
    num_dataloaders: int = Field(1, ge=1, le=64, description="Training task sources.")
    chat_template: bool = Field(
        False, description="Render each text prompt as a user message through the policy tokenizer's chat template."
    )
