"""terminal-bench's task format as dockyard reads it: task.yaml, the task folder, the pytest summary."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dockyard.tasks.terminal import TaskFormatError, parse_pytest_summary, read_task, task_folders
from dockyard.tasks.terminal_sets import load_tasks
from tests.conftest import REPO_ROOT

SHIPPED = REPO_ROOT / "examples" / "tasks" / "terminal"


def copy_task(tmp_path: Path, name: str = "hello-file") -> Path:
    target = tmp_path / "set" / name
    shutil.copytree(SHIPPED / "hello-file", target)
    return target


def test_task_yaml_defaults_are_terminal_benchs(tmp_path: Path) -> None:
    folder = copy_task(tmp_path)
    (folder / "task.yaml").write_text("instruction: do it\ndifficulty: medium\nsomething_new: 1\n")
    task = read_task(folder)
    c = task.config
    assert (c.max_agent_timeout_sec, c.max_test_timeout_sec, c.parser_name) == (360.0, 60.0, "pytest")
    assert (c.author_name, c.category, c.tags, c.run_tests_in_same_shell) == (
        "unknown",
        "software_engineering",
        [],
        False,
    )
    assert task.task_id == "hello-file" and task.solution_path.name == "solution.sh"


@pytest.mark.parametrize(
    ("yaml_text", "words"),
    [
        ("difficulty: easy\n", "instruction"),
        ("instruction: x\n", "difficulty"),
        ("instruction: x\ndifficulty: easy\nparser_name: swebench\n", "parser_name"),
        ("instruction: x\ndifficulty: easy\nmax_test_timeout_sec: -1\n", "max_test_timeout_sec"),
        ("instruction: [unclosed\n", "not YAML"),
    ],
)
def test_a_bad_task_yaml_is_refused_naming_the_field(tmp_path: Path, yaml_text: str, words: str) -> None:
    folder = copy_task(tmp_path)
    (folder / "task.yaml").write_text(yaml_text)
    with pytest.raises(TaskFormatError, match=words) as caught:
        read_task(folder)
    assert "hello-file" in str(caught.value)


@pytest.mark.parametrize("missing", ["run-tests.sh", "Dockerfile", "docker-compose.yaml", "solution.sh"])
def test_a_missing_file_of_the_format_is_refused(tmp_path: Path, missing: str) -> None:
    folder = copy_task(tmp_path)
    (folder / missing).unlink()
    with pytest.raises(TaskFormatError, match=missing.split(".")[0]):
        read_task(folder)


def test_solution_yaml_stands_in_for_solution_sh(tmp_path: Path) -> None:
    folder = copy_task(tmp_path)
    (folder / "solution.sh").rename(folder / "solution.yaml")
    assert read_task(folder).solution_path.name == "solution.yaml"


def test_shipped_tasks_load_as_prompts_with_their_time_limit() -> None:
    tasks = load_tasks(SHIPPED, 20, seed=3)
    assert len(tasks) == 20 and load_tasks(SHIPPED, 20, seed=3) == tasks
    ids = {t.task_id for t in tasks}
    assert ids == {f"terminal/{f.task_id}" for f in task_folders(SHIPPED)}  # 20 draws cover all nine
    assert all(t.tests == () and t.prompt and t.max_seconds == 120.0 for t in tasks)


SUMMARY = """\
============================= test session starts ==============================
collected 4 items

../tests/test_outputs.py ..F.                                            [100%]
=========================== short test summary info ============================
PASSED ../tests/test_outputs.py::test_a
PASSED ../tests/test_outputs.py::test_b[x - y]
FAILED ../tests/test_outputs.py::test_c - AssertionError: assert 1 == 2
SKIPPED [1] ../tests/test_outputs.py:9: no reason
XFAIL ../tests/test_outputs.py::test_d - flaky
ERROR ../tests/test_outputs.py::test_e - RuntimeError
========================= 1 failed, 2 passed in 0.05s ==========================
"""


def test_the_pytest_summary_is_read_as_the_harness_reads_it() -> None:
    assert parse_pytest_summary(SUMMARY) == {
        "test_a": True,
        "test_b[x - y]": True,
        "test_c": False,
        "[1] ../tests/test_outputs.py:9: no reason": True,
        "test_d - flaky": True,  # only a FAILED line loses its message, as in the harness
        "test_e - RuntimeError": False,
    }


def test_no_summary_is_none_not_a_pass() -> None:
    assert parse_pytest_summary("bash: pytest: command not found\n") is None
