"""File-producing tasks on the sandbox's side: task sets under the task root, their sessions, their checkers.

    OpenSession(task_set, instance_id = task id)  where <task root>/<task_set>/ is a folder of such tasks
        ──FileTasks.task──> the task folder; its reference/ is the session's seed (any backend)
    ScoreSession (after the agent) ──score──> every deliverable there? (no: FAILED naming the missing files)
        ──> `python3 -I -` in the work folder with checker.py on stdin, at most max_check_timeout_sec
        ──> its TAP lines ──> SweResult: tests_passed / tests_total over the checks; PASSED iff all passed

Guarantees: the checker reaches the session only once the agent has finished, on stdin (no file the agent
left can replace it, and -I keeps the work folder off its import path); the verdict comes from the TAP
lines, never from the exit code; a check run past max_check_timeout_sec is a TIMEOUT; a checker that prints
no TAP line is FAILED (the agent's files can cause that); only an infrastructure failure (the session gone,
the checker not started) is an ERROR, masked from training.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from dockyard.tasks.gdpval import TaskFolder, TaskFormatError, is_task_folder, parse_tap, read_task
from services.sandbox.backend import ResourceLimits, SessionHandle, Status
from services.sandbox.session_files import FileProblem
from services.sandbox.swe import SweResult, TaskSetError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class FileTasks:
    """File-producing task sets under the task root (read once per task, then kept)."""

    def __init__(self, root: str | None) -> None:
        self.root = Path(root) if root else None
        self._tasks: dict[tuple[str, str], TaskFolder] = {}

    def is_task_set(self, task_set: str) -> bool:
        """True when <root>/<task_set> is a folder of file-producing task folders (task.yaml and checker.py)."""
        if self.root is None or not _NAME.match(task_set):
            return False
        folder = self.root / task_set
        return folder.is_dir() and any(is_task_folder(p) for p in folder.iterdir())

    def task(self, task_set: str, task_id: str) -> TaskFolder:
        key = (task_set, task_id)
        if key not in self._tasks:
            assert self.root is not None
            if not _NAME.match(task_id) or not is_task_folder(self.root / task_set / task_id):
                raise TaskSetError(f"task {task_id!r} not found in task set {task_set!r}", kind="not_found")
            try:
                self._tasks[key] = read_task(self.root / task_set / task_id)
            except TaskFormatError as exc:
                raise TaskSetError(str(exc)) from None
        return self._tasks[key]

    @staticmethod
    def seed_dir(task: TaskFolder) -> str | None:
        return str(task.reference_dir) if task.reference_dir.is_dir() else None


async def _missing(handle: SessionHandle, task: TaskFolder) -> list[str]:
    missing = []
    for path in task.config.deliverables:
        try:
            await handle.read_file(path, 1)
        except FileProblem as problem:  # not there, or a link / not a regular file
            missing.append(path if problem.kind == "not_found" else f"{path} ({problem})")
    return missing


async def score(handle: SessionHandle, task: TaskFolder, limits: ResourceLimits, *, max_timeout: float) -> SweResult:
    """FAILED naming the missing deliverables, else the checker's TAP lines as a pass fraction."""
    if missing := await _missing(handle, task):
        message = "missing deliverable: " + "; ".join(missing)
        return SweResult(status="failed", tests_total=len(task.config.deliverables), error_message=message)
    check_limits = dataclasses.replace(limits, timeout_seconds=min(task.config.max_check_timeout_sec, max_timeout))
    checker = task.checker_path.read_bytes()
    outcome = await handle.exec(["python3", "-I", "-"], checker, check_limits)
    if outcome.status is Status.ERROR:
        return SweResult(
            status="error", outcome=outcome, error_message=f"checker.py could not run: {outcome.error_message}"
        )
    if outcome.status is Status.TIMEOUT:
        message = f"checker.py ran past max_check_timeout_sec={check_limits.timeout_seconds:g}"
        return SweResult(status="timeout", outcome=outcome, error_message=message)
    results = parse_tap(outcome.stdout)
    if results is None:
        message = f"checker.py printed no TAP line (exit code {outcome.exit_code}): {outcome.stderr[-500:]}"
        return SweResult(status="failed", outcome=outcome, error_message=message)
    passed = sum(ok for ok, _ in results.values())
    failing = [f"{name}: {why}" if why else name for name, (ok, why) in results.items() if not ok]
    return SweResult(
        status="passed" if passed == len(results) else "failed",
        tests_passed=passed,
        tests_total=len(results),
        statuses={name: "PASSED" if ok else "FAILED" for name, (ok, _) in results.items()},
        outcome=outcome,
        error_message="failing checks: " + "; ".join(failing) if failing else "",
    )
