"""File-producing tasks in the style of GDPval: a brief, reference files, deliverables, a held-out checker.

    <task set>/<task id>/
        task.yaml     prompt, deliverables (paths the agent must leave), sector, occupation, max_agent_timeout_sec
        reference/    files the agent's session starts with (its work folder holds a copy)
        checker.py    run by the sandbox after the agent, in the session's work folder, as `python3 -I -`
                      (the source on stdin: nothing the agent left can replace it); prints TAP lines
        solution.sh   the reference solution (run in the work folder with bash), for validating the task

    task.yaml ──task_of──> Task(prompt = the brief + the reference files + the deliverables, max_seconds)
    checker output ──parse_tap──> {check: passed?}  ("ok 1 - name" / "not ok 2 - name # why")

Guarantees: a task.yaml without `prompt` or `deliverables`, with a deliverable that is not a plain relative
path, or a folder without checker.py or solution.sh is refused with the task and field named; the task id is
the folder's name; `load_tasks` is deterministic for (path, n, seed) and cycles through seeded permutations;
checker output without any TAP line is None, never an empty pass.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from pydantic import BaseModel, ConfigDict, Field, field_validator

from dockyard.tasks.task import Task, draw

# One error type and one task.yaml reader for every task-folder format.
from dockyard.tasks.terminal import TaskFormatError, read_task_set, read_task_yaml

_TAP = re.compile(r"^(ok|not ok)\b\s*(\d+)?\s*(?:-\s*)?(.*?)\s*(?:#\s*(.*))?$")
REFERENCE_DIR = "reference"
CHECKER = "checker.py"
SOLUTION = "solution.sh"


class TaskConfig(BaseModel):
    """task.yaml of a file-producing task."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, description="The brief the agent works from.")
    deliverables: list[str] = Field(min_length=1, description="Files the agent must leave, relative paths.")
    sector: str = "unknown"
    occupation: str = "unknown"
    max_agent_timeout_sec: float = Field(600.0, gt=0)
    max_check_timeout_sec: float = Field(60.0, gt=0)

    @field_validator("deliverables")
    @classmethod
    def _relative(cls, paths: list[str]) -> list[str]:
        for path in paths:
            pure = PurePosixPath(path)
            if not path or pure.is_absolute() or ".." in pure.parts or "\\" in path:
                raise ValueError(f"{path!r} must be a relative path inside the work folder, without '..'")
        return paths


@dataclass(frozen=True)
class TaskFolder:
    path: Path
    config: TaskConfig

    @property
    def task_id(self) -> str:
        return self.path.name

    @property
    def reference_dir(self) -> Path:
        return self.path / REFERENCE_DIR

    @property
    def checker_path(self) -> Path:
        return self.path / CHECKER

    @property
    def solution_path(self) -> Path:
        return self.path / SOLUTION

    def reference_files(self) -> list[str]:
        """Relative paths of the reference files, sorted."""
        if not self.reference_dir.is_dir():
            return []
        return sorted(str(p.relative_to(self.reference_dir)) for p in self.reference_dir.rglob("*") if p.is_file())


def is_task_folder(path: Path) -> bool:
    return (path / "task.yaml").is_file() and (path / CHECKER).is_file()


def read_task(path: str | Path) -> TaskFolder:
    """The task folder at `path`; TaskFormatError naming what is missing or wrong."""
    folder = Path(path)
    config = read_task_yaml(folder, TaskConfig)
    for needed in (CHECKER, SOLUTION):
        if not (folder / needed).is_file():
            raise TaskFormatError(f"task {folder.name!r}: {needed} is missing")
    return TaskFolder(folder, config)


def task_folders(path: str | Path) -> list[TaskFolder]:
    """Every task folder (a folder holding task.yaml) of a task set, sorted by id."""
    return read_task_set(path, read_task, "file-producing tasks")


def prompt_of(folder: TaskFolder) -> str:
    given = folder.reference_files()
    lines = [folder.config.prompt.strip(), ""]
    if given:
        lines.append("Reference files in your work folder: " + ", ".join(given))
    lines.append("Leave these files in your work folder when you finish: " + ", ".join(folder.config.deliverables))
    return "\n".join(lines) + "\n"


def task_of(task_set: str, folder: TaskFolder) -> Task:
    return Task(
        task_id=f"{task_set}/{folder.task_id}",
        prompt=prompt_of(folder),
        tests=(),  # the checker stays with the sandbox
        solution="",
        max_seconds=folder.config.max_agent_timeout_sec,
    )


def load_tasks(path: str | Path, n: int, seed: int = 0) -> list[Task]:
    """n tasks of the task set at `path` (seeded permutations, cycling when n exceeds the set)."""
    root = Path(path)
    pool = [task_of(root.name, folder) for folder in task_folders(root)]
    return draw(pool, n, f"gdpval:{root.name}:{seed}")


def parse_tap(output: str) -> dict[str, tuple[bool, str]] | None:
    """{check name: (passed, why)} from TAP lines ("ok 1 - name", "not ok 2 - name # why"); None without any.
    A check without a name is named by its number; a name seen twice keeps its first result."""
    results: dict[str, tuple[bool, str]] = {}
    for line in output.splitlines():
        match = _TAP.match(line.strip())
        if not match:
            continue
        status, number, name, why = match.groups()
        key = name or f"check {number or len(results) + 1}"
        results.setdefault(key, (status == "ok", why or ""))
    return results or None
