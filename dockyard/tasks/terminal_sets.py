"""Terminal task sets of either format: Harbor's (task.toml, harbor.py) or terminal-bench's (task.yaml,
terminal.py), read into the coordinator's tasks.

    <task set>/<task id>/task.toml ──harbor.read_harbor_task──┐
    <task set>/<task id>/task.yaml ──terminal.read_task───────┴─> Task(task_id = "<task set>/<task id>",
                                                                    prompt = the instruction, max_seconds)

Guarantees: a folder holding task.toml is a Harbor task, else one holding task.yaml a terminal-bench
task (a set may mix them); `load_tasks` is deterministic for (path, n, seed) and cycles through seeded
permutations like the other task sets.
"""

from __future__ import annotations

from pathlib import Path

from dockyard.tasks.harbor import HarborTask, is_harbor_task, read_harbor_task
from dockyard.tasks.task import Task, draw
from dockyard.tasks.terminal import TaskFolder, read_task, read_task_set


def read_any_task(path: str | Path) -> TaskFolder | HarborTask:
    """The task folder at `path` in either format: Harbor's (task.toml) or terminal-bench's (task.yaml)."""
    return read_harbor_task(path) if is_harbor_task(Path(path)) else read_task(path)


def any_task_folders(path: str | Path) -> list[TaskFolder | HarborTask]:
    """Every task folder of a task set, in either format (a set may mix them), sorted by id."""
    return read_task_set(path, read_any_task, "terminal tasks", markers=("task.toml", "task.yaml"))


def task_of(task_set: str, folder: TaskFolder | HarborTask) -> Task:
    """The coordinator's Task of a task folder of either format."""
    return Task(
        task_id=f"{task_set}/{folder.task_id}",
        prompt=folder.instruction,
        tests=(),  # held out: they stay with the sandbox
        solution="",
        max_seconds=folder.max_agent_seconds,
    )


def load_tasks(path: str | Path, n: int, seed: int = 0) -> list[Task]:
    """n tasks of the task set at `path` (seeded permutations, cycling when n exceeds the set)."""
    root = Path(path)
    pool = [task_of(root.name, folder) for folder in any_task_folders(root)]
    return draw(pool, n, f"terminal:{root.name}:{seed}")
