"""What the recipe tests score an answer by: the task's own tests, run on the program the sandbox would run."""

from __future__ import annotations

from dockyard.tasks.expr import program_for
from dockyard.tasks.task import Task


def passes_all(answer: str, task: Task) -> bool:
    """Whether the expression ``answer`` passes every test of ``task``."""
    namespace: dict = {}
    exec(program_for(answer), namespace)
    try:
        for test in task.tests:
            exec(test, namespace)
    except AssertionError:
        return False
    return True
