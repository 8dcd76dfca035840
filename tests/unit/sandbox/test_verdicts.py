"""The verdict rules both backends share (services/sandbox/verdicts.py), on hand-made runs."""

from __future__ import annotations

from dataclasses import dataclass

from services.sandbox import verdicts
from services.sandbox.backend import DISK_FULL_MESSAGE, Status
from services.sandbox.verdicts import command_verdict


@dataclass
class Run:
    error: str = ""
    timed_out: bool = False
    exit_code: int = 0
    stdout: bytes = b"out"
    stderr: bytes = b"\xff"
    truncated: bool = False
    duration: float = 1.5
    disk_full: bool = False


def test_a_command_passes_on_exit_code_zero_only() -> None:
    passed = command_verdict(Run())
    assert (passed.status, passed.tests_passed, passed.tests_total) == (Status.PASSED, 1, 1)
    assert (passed.stdout, passed.stderr, passed.duration_seconds) == ("out", "\ufffd", 1.5)
    assert command_verdict(Run(exit_code=-11)).status is Status.FAILED


def test_an_infrastructure_error_comes_before_the_timeout() -> None:
    verdict = command_verdict(Run(error="cannot spawn", timed_out=True))
    assert (verdict.status, verdict.error_message) == (Status.ERROR, "cannot spawn")
    assert command_verdict(Run(timed_out=True)).status is Status.TIMEOUT


def test_a_full_work_folder_fails_a_pass_but_not_a_timeout() -> None:
    full = command_verdict(Run(disk_full=True))
    assert (full.status, full.tests_passed, full.error_message) == (Status.FAILED, 0, DISK_FULL_MESSAGE)
    assert command_verdict(Run(disk_full=True, timed_out=True)).status is Status.TIMEOUT
    tests = verdicts.tests_verdict(Run(disk_full=True), total=2, started=True, results=[True, True])
    assert (tests.status, tests.tests_passed) == (Status.FAILED, 0)


def test_run_tests_counts_the_report() -> None:
    some = verdicts.tests_verdict(Run(), total=3, started=True, results=[True, False, True])
    assert (some.status, some.tests_passed, some.tests_total) == (Status.FAILED, 2, 3)
    assert verdicts.tests_verdict(Run(), total=2, started=True, results=[True, True]).status is Status.PASSED


def test_a_harness_that_never_started_is_an_error_but_a_missing_report_is_a_failure() -> None:
    never = verdicts.tests_verdict(Run(exit_code=1), total=2, started=False, results=None)
    assert (never.status, never.error_message) == (Status.ERROR, "the test harness did not start (exit code 1)")
    spoiled = verdicts.tests_verdict(Run(exit_code=1), total=2, started=True, results=None)
    assert (spoiled.status, spoiled.tests_passed, spoiled.tests_total) == (Status.FAILED, 0, 2)
    late = verdicts.tests_verdict(Run(timed_out=True), total=2, started=False, results=None)
    assert late.status is Status.TIMEOUT  # killed by the clock before the harness said it started
