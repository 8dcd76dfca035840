"""Task generators: prompts paired with execution-grounded tests."""

from dockyard.tasks.expr import make_tasks, program_for
from dockyard.tasks.task import Task

__all__ = ["Task", "make_tasks", "program_for"]
