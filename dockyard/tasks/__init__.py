"""Task generators: prompts paired with execution-grounded tests."""

from dockyard.tasks.expr import Task, make_tasks, program_for

__all__ = ["Task", "make_tasks", "program_for"]
