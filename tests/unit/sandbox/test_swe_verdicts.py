"""How the host reads the SWE driver's run: every branch of swe.interpret, and instance validation."""

from __future__ import annotations

import json

import pytest

from services.sandbox.backend import Outcome, Status
from services.sandbox.swe import EXIT_PATCH_FAILED, EXIT_TEST_PATCH_FAILED, SweInstance, interpret

NONCE = "n" * 32
INSTANCE = SweInstance.from_dict(
    {
        "instance_id": "i",
        "repo": "o/r",
        "base_commit": "a" * 40,
        "test_patch": "--- a/t.py\n+++ b/t.py\n@@ -1 +1 @@\n-a\n+b\n",
        "FAIL_TO_PASS": '["t.py::test_fix"]',  # JSON text, as SWE-bench datasets store it
        "PASS_TO_PASS": ["t.py::test_keep", "t.py::test_skip"],
        "test_cmd": "pytest -rA t.py",
    }
)


def log(*lines: str, done: bool = True) -> str:
    body = "\n".join(lines)
    return f"noise\n{NONCE} tests-start\n{body}\n" + (f"\n{NONCE} tests-done 1\n" if done else "")


def test_instance_fields():
    assert INSTANCE.test_cmd == ["pytest", "-rA", "t.py"] and INSTANCE.fail_to_pass == ["t.py::test_fix"]
    with pytest.raises(ValueError, match="FAIL_TO_PASS is empty"):
        SweInstance.from_dict({**_raw(), "FAIL_TO_PASS": []})
    with pytest.raises(ValueError, match="log_parser"):
        SweInstance.from_dict({**_raw(), "log_parser": "parse_log_junit"})
    with pytest.raises(ValueError, match="base_commit"):
        SweInstance.from_dict({**_raw(), "base_commit": "HEAD; rm -rf /"})


def _raw() -> dict:
    return {
        "instance_id": "i",
        "repo": "o/r",
        "base_commit": "a" * 40,
        "test_patch": "x",
        "FAIL_TO_PASS": ["t"],
        "test_cmd": ["pytest"],
    }


def test_resolved_when_every_listed_test_passes_or_is_kept():
    out = log("PASSED t.py::test_fix", "PASSED t.py::test_keep", "SKIPPED t.py::test_skip")
    result = interpret(INSTANCE, Outcome(Status.FAILED, exit_code=0, stdout=out), NONCE, [])
    assert result.status == "passed" and (result.tests_passed, result.tests_total) == (3, 3)
    assert result.pass_rate == 1.0 and result.fail_to_pass == {"t.py::test_fix": True}


def test_not_resolved_counts_what_passed():
    out = log("FAILED t.py::test_fix - assert 1 == 2", "PASSED t.py::test_keep")
    result = interpret(INSTANCE, Outcome(Status.PASSED, stdout=out), NONCE, ["t.py"])
    assert result.status == "failed" and (result.tests_passed, result.tests_total) == (1, 3)
    assert result.integrity_violation and result.statuses["t.py::test_fix"] == "FAILED"


def test_lines_before_the_start_marker_and_after_the_end_marker_are_ignored():
    out = "PASSED t.py::test_fix\n" + log("FAILED t.py::test_fix") + "PASSED t.py::test_fix\n"
    assert interpret(INSTANCE, Outcome(Status.PASSED, stdout=out), NONCE, []).fail_to_pass == {"t.py::test_fix": False}


def test_a_forged_end_marker_without_the_nonce_does_not_end_the_log():
    out = log("PASSED t.py::test_fix", "x" * 32 + " tests-done 0", done=False)
    result = interpret(INSTANCE, Outcome(Status.FAILED, exit_code=-9, stdout=out), NONCE, [])
    assert result.status == "failed" and result.tests_passed == 0 and "did not finish" in result.error_message


def test_a_log_cut_at_the_service_ceiling_is_an_error_that_says_so():
    out = log("PASSED t.py::test_fix", done=False)
    result = interpret(INSTANCE, Outcome(Status.PASSED, stdout=out, output_truncated=True), NONCE, [])
    assert result.status == "error" and "ceiling" in result.error_message


@pytest.mark.parametrize(
    "outcome,status,words",
    [
        (Outcome(Status.ERROR, error_message="cannot spawn"), "error", "cannot spawn"),
        (Outcome(Status.TIMEOUT, exit_code=-9), "timeout", "wall-clock"),
        (Outcome(Status.FAILED, exit_code=EXIT_PATCH_FAILED, stderr="git apply: exit 1"), "patch_failed", "git apply"),
        (Outcome(Status.FAILED, exit_code=EXIT_TEST_PATCH_FAILED), "error", "held-out test patch"),
        (Outcome(Status.FAILED, exit_code=1, stderr="Traceback"), "error", "did not reach the tests"),
    ],
)
def test_other_endings(outcome, status, words):
    result = interpret(INSTANCE, outcome, NONCE, [])
    assert result.status == status and words in result.error_message and result.tests_passed == 0
    assert result.tests_total == 3


async def test_a_missing_mirror_is_an_error_verdict_and_a_broken_task_set_is_named(tmp_path):
    from services.sandbox.backend import ResourceLimits
    from services.sandbox.local import LocalBackend
    from services.sandbox.swe import SweScorer, TaskSetError, TaskSets

    (tmp_path / "set").mkdir()
    line = {**_raw(), "test_patch": INSTANCE.test_patch}
    (tmp_path / "set" / "instances.jsonl").write_text(json.dumps(line) + "\n")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "instances.jsonl").write_text('{"instance_id": "x"}\n')
    task_sets = TaskSets(str(tmp_path))
    assert task_sets.names() == ["broken", "set"]
    scorer = SweScorer(LocalBackend(max_concurrency=1), task_sets, log_cap_bytes=4096, checkout_root=str(tmp_path))
    try:
        patch = "--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-a\n+b\n"
        result = await scorer.score("set", task_sets.instance("set", "i"), patch, ResourceLimits(5, 256, 5, 4096))
        assert result.status == "error" and "does not exist" in result.error_message
    finally:
        scorer.close()
    with pytest.raises(TaskSetError, match=r"broken.*instances.jsonl:1") as err:
        task_sets.instances("broken")
    assert err.value.kind == "unusable"
    with pytest.raises(TaskSetError) as err:
        task_sets.instance("set", "nope")
    assert err.value.kind == "not_found"
