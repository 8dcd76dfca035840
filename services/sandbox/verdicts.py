"""The verdict rules of both sandbox backends (local.py, docker_backend.py), in one place.

    a finished run (FinishedRun) ──command_verdict──> Outcome     Execute, a session's command
                                 ──tests_verdict────> Outcome     RunTests (harness started? results?)

Rule: ERROR only when the infrastructure failed (the work folder, the spawn or the container,
the engine, a missing image, the test harness never started); whatever the code does to itself
(raising, exiting, a crash, a signal of its own limits, an OOM kill, killing the harness before it
reports, spoiling its report) is FAILED; the wall-clock kill is TIMEOUT. A run that leaves its work
folder full is FAILED with DISK_FULL_MESSAGE, never PASSED. An infrastructure failure is checked
first, then the wall-clock kill, then (RunTests) whether the harness started, then its report.

Guarantees: pure functions of the run's facts; the error message is the caller's when given,
else the run's infrastructure error; output is decoded as run_outcome does (invalid UTF-8 replaced).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from services.sandbox.backend import DISK_FULL_MESSAGE, Outcome, Status, run_outcome


class FinishedRun(Protocol):
    """What a backend observed of one run (each backend's own record of it provides these)."""

    error: str  # an infrastructure failure; "" when the run itself happened
    timed_out: bool
    exit_code: int
    stdout: bytes
    stderr: bytes
    truncated: bool
    duration: float
    disk_full: bool  # the work folder was full when the run ended


def outcome(run: FinishedRun, status: Status, *, passed: int, total: int, error_message: str = "") -> Outcome:
    """The Outcome of `run` as `status`, except that a full work folder turns a pass or a fail into FAILED."""
    if run.disk_full and status in (Status.PASSED, Status.FAILED):
        status, passed, error_message = Status.FAILED, 0, DISK_FULL_MESSAGE
    return run_outcome(
        status,
        passed=passed,
        total=total,
        exit_code=run.exit_code,
        stdout=run.stdout,
        stderr=run.stderr,
        truncated=run.truncated,
        duration=run.duration,
        error_message=error_message or run.error,
    )


def command_verdict(run: FinishedRun) -> Outcome:
    """A command's verdict: ERROR when it could not run, TIMEOUT when killed, else PASSED iff exit code 0."""
    if run.error:
        status = Status.ERROR
    elif run.timed_out:
        status = Status.TIMEOUT
    else:
        status = Status.PASSED if run.exit_code == 0 else Status.FAILED
    return outcome(run, status, passed=int(status is Status.PASSED), total=1)


def tests_verdict(run: FinishedRun, *, total: int, started: bool, results: Sequence[bool] | None) -> Outcome:
    """RunTests' verdict over `total` tests. `started`: the harness proved (with the run's nonce) that it
    began before any untrusted code ran; how a backend learns that differs (see each backend's call),
    which is why it is the caller's to say. `results`: the per-test results of the harness's report, or
    None when there is no valid report (the program ended the harness or spoiled its report)."""
    if run.error:
        return outcome(run, Status.ERROR, passed=0, total=total)
    if run.timed_out:
        return outcome(run, Status.TIMEOUT, passed=0, total=total)
    if not started:
        message = f"the test harness did not start (exit code {run.exit_code})"
        return outcome(run, Status.ERROR, passed=0, total=total, error_message=message)
    if results is None:
        return outcome(run, Status.FAILED, passed=0, total=total)
    passed = sum(results)
    return outcome(run, Status.PASSED if passed == total else Status.FAILED, passed=passed, total=total)
