"""A terminal-bench task set written out in Harbor's folder format (`dockyard tasks to-harbor SRC DST`).

    <src>/<id>/task.yaml      ──> <dst>/<id>/task.toml          [metadata] author, difficulty, category, tags;
                                                                [verifier] timeout_sec = max_test_timeout_sec;
                                                                [agent] timeout_sec = max_agent_timeout_sec
                 instruction  ──> instruction.md
                 Dockerfile + the context's other files ──> environment/ (docker-compose's literal
                                                            environment entries become ENV lines)
                 run-tests.sh + tests/* ──> tests/ , with tests/test.sh: run-tests.sh's exit status -> reward.txt
                 solution.sh  ──> solution/solve.sh

Guarantees: every converted folder reads back with harbor.read_harbor_task; the destination's task
folders must not exist yet (nothing is overwritten); a source task that does not read (or has only a
solution.yaml) is refused with its name before anything is written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from dockyard.tasks.harbor import CONTAINER_VERIFIER_DIR, read_harbor_task
from dockyard.tasks.terminal import FORMAT_FILES, TaskFolder, TaskFormatError, client_environment, task_folders

TEST_SH = f"""#!/bin/bash
# run-tests.sh (terminal-bench's) decides: its exit status is pytest's, and all tests passing is reward 1.
mkdir -p {CONTAINER_VERIFIER_DIR}
TEST_DIR=/tests bash /tests/run-tests.sh
if [ $? -eq 0 ]; then reward=1; else reward=0; fi
echo $reward > {CONTAINER_VERIFIER_DIR}/reward.txt
"""


def _toml_value(value) -> str:
    return json.dumps(value)  # strings, numbers and lists of strings are written alike in TOML and JSON


def task_toml(task: TaskFolder) -> str:
    c = task.config
    metadata = {
        "author_name": c.author_name,
        "author_email": c.author_email,
        "difficulty": c.difficulty,
        "category": c.category,
        "tags": c.tags,
    }
    lines = ['version = "1.0"', "", "[metadata]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in metadata.items()]
    lines += ["", "[verifier]", f"timeout_sec = {float(c.max_test_timeout_sec)}"]
    lines += ["", "[agent]", f"timeout_sec = {float(c.max_agent_timeout_sec)}", ""]
    return "\n".join(lines)


def convert_task(task: TaskFolder, dest: Path) -> None:
    """Write `task` as the Harbor task folder `dest` (which must not exist)."""
    if not task.solution_path.name.endswith(".sh"):
        raise TaskFormatError(f"task {task.task_id!r}: only a solution.sh converts (solution/solve.sh)")
    dest.mkdir(parents=True)
    (dest / "task.toml").write_text(task_toml(task), encoding="utf-8")
    (dest / "instruction.md").write_text(task.instruction.rstrip() + "\n", encoding="utf-8")
    environment = dest / "environment"
    shutil.copytree(task.path, environment, ignore=lambda d, names: FORMAT_FILES if Path(d) == task.path else ())
    env_lines = [f"ENV {k}={json.dumps(v)}" for k, v in client_environment(task).items()]
    if env_lines:
        with (environment / "Dockerfile").open("a", encoding="utf-8") as dockerfile:
            dockerfile.write("\n".join(env_lines) + "\n")
    shutil.copytree(task.test_dir, dest / "tests") if task.test_dir.is_dir() else (dest / "tests").mkdir()
    shutil.copy2(task.run_tests_path, dest / "tests" / "run-tests.sh")
    (dest / "tests" / "test.sh").write_text(TEST_SH, encoding="utf-8")
    (dest / "solution").mkdir()
    shutil.copy2(task.solution_path, dest / "solution" / "solve.sh")
    read_harbor_task(dest)  # the guarantee: what was written reads back


def convert_task_set(src: str | Path, dst: str | Path) -> list[str]:
    """Every task of the terminal-bench task set `src` written into `dst` in Harbor's format; the ids written."""
    tasks = task_folders(src)
    root = Path(dst)
    taken = [t.task_id for t in tasks if (root / t.task_id).exists()]
    if taken:
        raise FileExistsError(f"{root} already holds {', '.join(taken)}: nothing is overwritten")
    for task in tasks:
        if not task.solution_path.name.endswith(".sh"):
            raise TaskFormatError(f"task {task.task_id!r}: only a solution.sh converts (solution/solve.sh)")
    for task in tasks:
        convert_task(task, root / task.task_id)
    return [t.task_id for t in tasks]
