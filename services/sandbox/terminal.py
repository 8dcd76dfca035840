"""Terminal tasks on the sandbox's side: task sets under the task root, their sessions, their tests.

    OpenSession(task_set, instance_id = task id)  where <task root>/<task_set>/ is a folder of task folders
        ──TerminalTasks.prepare──> (the task's image, its WORKDIR's files as the seed, the WORKDIR)
                                   (terminal_images.TerminalImages: built offline once, then reused)
        ──> a docker session of that image: the agent starts in WORKDIR (a link to /work)
    PrepareSessions(task_set, instance_ids = task ids the job draws) ──prepare_images──> those images built now
    ScoreSession (after the agent) ──score──> run-tests.sh + tests/* as a tar into /tests (a fresh folder)
        ──> `cd WORKDIR && bash /tests/run-tests.sh` (TEST_DIR=/tests), at most max_test_timeout_sec
        ──> the pytest summary ──> SweResult: passed iff at least one test ran and all passed;
            tests_passed / tests_total from the summary (env.reward picks all_pass or the fraction)

Guarantees: the tests reach the container only once the agent has finished, into a folder emptied
first (nothing the agent left there is run); the verdict comes from the summary, never from the
exit code; a run past max_test_timeout_sec is a TIMEOUT (a zero, as terminal-bench counts it); output
without a pytest summary is FAILED with no test (terminal-bench counts it unresolved), since the agent's
actions can cause it; only an infrastructure failure (the container gone, the tests not copied in, a
task image that cannot be built) is an ERROR, masked from training.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import re
import tarfile
from collections.abc import Sequence
from pathlib import Path

import structlog

from dockyard.rpc.errors import FailedPrecondition
from dockyard.tasks.gdpval import is_task_folder as is_file_task
from dockyard.tasks.terminal import (
    CONTAINER_TEST_DIR,
    TaskFolder,
    TaskFormatError,
    parse_pytest_summary,
)
from dockyard.tasks.terminal_sets import read_any_task
from services.sandbox.backend import Outcome, ResourceLimits, SessionHandle, Status
from services.sandbox.swe import SweResult, TaskSetError
from services.sandbox.terminal_images import TESTS_TARGET, Task, TerminalImages

log = structlog.get_logger()

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclasses.dataclass(frozen=True)
class Prepared:
    image: str
    seed_dir: str
    workdir: str


def is_terminal_set(root: Path | None, task_set: str) -> bool:
    """True when <root>/<task_set> is a folder of terminal task folders of either format (not a SWE task
    set, and not file-producing tasks, whose folders hold a task.yaml too)."""
    if root is None or not _NAME.match(task_set):
        return False
    folder = root / task_set
    if not folder.is_dir() or (folder / "instances.jsonl").is_file():
        return False
    return any(
        (p / "task.toml").is_file() or ((p / "task.yaml").is_file() and not is_file_task(p)) for p in folder.iterdir()
    )


def tests_archive(task: TaskFolder) -> bytes:
    """run-tests.sh and the contents of tests/, side by side at the archive's top (as /tests holds them)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(task.run_tests_path, arcname=task.run_tests_path.name)
        if task.test_dir.is_dir():
            for path in sorted(task.test_dir.rglob("*")):
                tar.add(path, arcname=str(path.relative_to(task.test_dir)), recursive=False)
    return buffer.getvalue()


def _copy_in(target: str) -> list[str]:
    return ["sh", "-c", f"rm -rf {target} && mkdir -p {target} && tar -x -f - -C {target}"]


def error(message: str, outcome: Outcome | None = None) -> SweResult:
    return SweResult(status="error", outcome=outcome, error_message=message)


class TerminalTasks:
    """Terminal task sets under the task root; `images` is None on a backend without containers."""

    def __init__(self, root: str | None, images: TerminalImages | None) -> None:
        self.root = Path(root) if root else None
        self._images = images
        self._tasks: dict[tuple[str, str], Task] = {}

    def is_terminal_set(self, task_set: str) -> bool:
        return is_terminal_set(self.root, task_set)

    def task(self, task_set: str, task_id: str) -> Task:
        key = (task_set, task_id)
        if key not in self._tasks:
            assert self.root is not None
            folder = self.root / task_set / task_id
            if not _NAME.match(task_id) or not any((folder / m).is_file() for m in ("task.toml", "task.yaml")):
                raise TaskSetError(f"task {task_id!r} not found in task set {task_set!r}", kind="not_found")
            try:
                self._tasks[key] = read_any_task(folder)
            except TaskFormatError as exc:
                raise TaskSetError(str(exc)) from None
        return self._tasks[key]

    async def prepare(self, task: Task) -> Prepared:
        if self._images is None:
            raise FailedPrecondition(
                "terminal tasks run in their own images: start the sandbox with the docker backend"
            )
        return Prepared(*await asyncio.to_thread(self._images.ensure, task))

    async def prepare_images(self, task_set: str, task_ids: Sequence[str]) -> int:
        """The image of each of `task_set`'s tasks named in `task_ids` built now, as its first session would,
        one after another; returns how many are ready. An id the set does not hold is skipped; an image that
        cannot be built is logged and left to the task's first session, which reports it. Without containers
        (the local backend) there is no image to make: 0."""
        ready = 0
        for task_id in dict.fromkeys(task_ids) if self._images is not None else ():
            try:
                await self.prepare(self.task(task_set, task_id))
                ready += 1
            except Exception as exc:  # noqa: BLE001 -- its first session reports it, as without a preparation
                if not (isinstance(exc, TaskSetError) and exc.kind == "not_found"):
                    log.warning("a terminal task's image is not ready", task=task_id, error=str(exc)[:300])
        return ready


async def run_test_script(
    handle: SessionHandle,
    copy: tuple[list[str], bytes],
    command: list[str],
    limits: ResourceLimits,
    *,
    script: str,
    timeout: tuple[str, float],
    max_timeout: float,
    log_cap: int,
) -> Outcome | SweResult:
    """Copy the tests in (`copy`: the command and its tar), then run `command` for at most the task's `timeout`
    (its key and seconds) under `max_timeout`, keeping `log_cap` bytes of each stream. The run's outcome, or
    the verdict that ends the scoring: ERROR when the copy or the run failed, TIMEOUT past the timeout."""
    copied = await handle.exec(*copy, limits)
    if copied.status is not Status.PASSED:
        return error(f"the tests could not be copied into the session: {copied.error_message or copied.stderr}", copied)
    key, seconds = timeout
    test_limits = dataclasses.replace(
        limits, timeout_seconds=min(seconds, max_timeout), max_output_bytes=max(limits.max_output_bytes, log_cap)
    )
    outcome = await handle.exec(command, None, test_limits)
    if outcome.status is Status.ERROR:
        return error(f"{script} could not run: {outcome.error_message}", outcome)
    if outcome.status is Status.TIMEOUT:
        message = f"{script} ran past {key}={test_limits.timeout_seconds:g}"
        return SweResult(status="timeout", outcome=outcome, error_message=message)
    return outcome


async def score(
    handle: SessionHandle, task: TaskFolder, workdir: str, limits: ResourceLimits, *, max_timeout: float, log_cap: int
) -> SweResult:
    """Copy the tests in, run run-tests.sh at most max_test_timeout_sec (under `max_timeout`), read the summary
    (from at most `log_cap` bytes of each stream: the summary comes last, so the whole log is kept)."""
    command = ["bash", "-c", f"cd {workdir} && TEST_DIR={CONTAINER_TEST_DIR} bash {CONTAINER_TEST_DIR}/run-tests.sh"]
    outcome = await run_test_script(
        handle,
        (_copy_in(TESTS_TARGET), tests_archive(task)),
        command,
        limits,
        script="run-tests.sh",
        timeout=("max_test_timeout_sec", task.config.max_test_timeout_sec),
        max_timeout=max_timeout,
        log_cap=log_cap,
    )
    if isinstance(outcome, SweResult):
        return outcome
    results = parse_pytest_summary(outcome.stdout + "\n" + outcome.stderr)
    if results is None:
        message = "run-tests.sh printed no pytest summary (run pytest with -rA): unresolved"
        return SweResult(status="failed", outcome=outcome, error_message=message)
    passed = sum(results.values())
    return SweResult(
        status="passed" if results and passed == len(results) else "failed",
        tests_passed=passed,
        tests_total=len(results),
        statuses={name: "PASSED" if ok else "FAILED" for name, ok in results.items()},
        outcome=outcome,
    )
