"""SWE tasks on the coordinator's side: a task set's public part, prompts, and patches out of completions.

    <task set>/instances.jsonl | instances.parquet ─load_tasks─> Task(task_id = "<task set>/<instance_id>", prompt)
    single-shot: completion ─extract_patch─> unified diff ─sandbox.ScorePatch(task_set, instance_id, patch)─> verdict
    multi-turn (agentic): the prompt asks for edits in the session's checkout; ScoreSession scores its diff

Guarantees: only `instance_id`, `repo` and `problem_statement` are read here (R2E-Gym's rows:
`docker_image`, `repo_name`, public_fields); the gold patch, the
held-out test patch and the test lists stay with the sandbox, which loads the same task set from its
task root (`DOCKYARD_SANDBOX_TASK_ROOT`, the folder that holds the task-set folder). Splits are the
task set's own: each split names its task-set folder (`data.train.path`, `data.validation.path`).
"""

from __future__ import annotations

import re
from pathlib import Path

from dockyard.tasks.rows import read_rows
from dockyard.tasks.task import Task, draw

PROMPT = (
    "You are working in the repository {repo} at its current commit.\n"
    "Issue:\n{problem}\n\n"
    "Answer with a single unified diff (git format, paths prefixed a/ and b/) that fixes the issue.\n"
)
# Multi-turn trials: the agent edits the checkout in its sandbox session; the session's diff is scored.
# How the agent hands its work in is its scaffold's (dockyard/tasks/instructions.py adds it).
AGENT_PROMPT = (
    "You are working in the repository {repo}, checked out at its current commit in your working "
    "directory.\nIssue:\n{problem}\n\n"
    "Fix the issue by editing the repository's files. Do not add or change test files: held-out "
    "tests judge the fix, and a change to a test file earns nothing.\n"
)
_FENCE = re.compile(r"```(?:diff|patch)?\n(.*?)```", re.DOTALL)


INSTANCE_FILES = ("instances.jsonl", "instances.parquet")  # SWE-bench's datasets come as either


def instances_file(folder: Path) -> Path | None:
    """The task set's instances file (the first of INSTANCE_FILES it has), or None."""
    return next((folder / name for name in INSTANCE_FILES if (folder / name).is_file()), None)


def load_tasks(path: str | Path, n: int, seed: int = 0, *, agentic: bool = False) -> list[Task]:
    """n tasks drawn from a task-set folder (seeded permutations, cycling when n exceeds the set); an
    agentic task's prompt asks for edits in the session rather than a diff."""
    folder = Path(path)
    file = instances_file(folder)
    if file is None:
        raise FileNotFoundError(f"{folder} holds neither {' nor '.join(INSTANCE_FILES)} (a task-set folder does)")
    records = [(where, public_fields(item)) for where, item in read_rows(file)]
    for where, item in records:
        if missing := [f for f in ("instance_id", "repo") if not item[f]]:
            raise ValueError(f"{where}: missing field {missing[0]!r} (an instance needs instance_id, repo)")
    pool = []
    template = AGENT_PROMPT if agentic else PROMPT
    for _, item in records:
        prompt = template.format(repo=item["repo"], problem=item["problem_statement"].strip())
        pool.append(Task(task_id=f"{folder.name}/{item['instance_id']}", prompt=prompt, tests=(), solution=""))
    if not pool:
        raise ValueError(f"{file} holds no instance")
    return draw(pool, n, f"swe:{folder.name}:{seed}")


def public_fields(row: dict) -> dict[str, str]:
    """instance_id, repo and problem_statement of a row; an R2E-Gym row (docker_image without
    install_config) has neither id nor repo column: its docker_image is its id and repo_name its
    repository, as the sandbox reads it (services/sandbox/swe_formats.py)."""
    r2e = "docker_image" in row and "install_config" not in row and "image_name" not in row
    return {
        "instance_id": str(row.get("instance_id") or (row.get("docker_image") if r2e else "") or ""),
        "repo": str(row.get("repo") or (row.get("repo_name") if r2e else "") or ""),
        "problem_statement": str(row.get("problem_statement") or ""),
    }


def split_task_id(task_id: str) -> tuple[str, str]:
    task_set, _, instance_id = task_id.partition("/")
    return task_set, instance_id


def extract_patch(completion: str) -> str:
    """The diff in a completion: a fenced ```diff block if there is one, else from the first header on."""
    fenced = _FENCE.search(completion)
    if fenced:
        return fenced.group(1)
    for marker in ("diff --git ", "--- "):
        # A header counts only at the start of a line; prose that quotes one mid-line does not.
        header = re.search(f"^{re.escape(marker)}", completion, re.MULTILINE)
        if header:
            return completion[header.start() :]
    return completion
