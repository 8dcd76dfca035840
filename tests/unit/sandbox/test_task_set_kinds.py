"""Which kind a task set under the sandbox's task root is: terminal and file-producing task folders
both hold a task.yaml, and each set is taken for its own kind only."""

from __future__ import annotations

from services.sandbox.gdpval import FileTasks
from services.sandbox.terminal import is_terminal_set
from tests.conftest import REPO_ROOT

TASKS = REPO_ROOT / "examples" / "tasks"


def test_a_file_producing_task_set_is_not_a_terminal_one() -> None:
    assert FileTasks(str(TASKS)).is_task_set("gdpval")
    assert not is_terminal_set(TASKS, "gdpval")


def test_a_terminal_task_set_is_not_a_file_producing_one() -> None:
    assert is_terminal_set(TASKS, "terminal")
    assert not FileTasks(str(TASKS)).is_task_set("terminal")


def test_a_harbor_task_set_is_a_terminal_one() -> None:
    assert is_terminal_set(TASKS, "harbor")
    assert not FileTasks(str(TASKS)).is_task_set("harbor")
