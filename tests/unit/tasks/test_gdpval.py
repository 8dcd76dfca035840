"""File-producing tasks (env gdpval): the task folder, the prompt, TAP lines, the config's rules."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from dockyard.api.sandbox.v1 import sandbox_pb2
from dockyard.config import ConfigError, load_config
from dockyard.tasks.envs import Environment, sandbox_env
from dockyard.tasks.gdpval import TaskFormatError, load_tasks, parse_tap, read_task, task_folders
from tests.conftest import REPO_ROOT

SHIPPED = REPO_ROOT / "examples" / "tasks" / "gdpval"
CONFIGS = REPO_ROOT / "examples" / "configs"


def copy_task(tmp_path: Path, name: str = "sales-summary") -> Path:
    target = tmp_path / "set" / name
    shutil.copytree(SHIPPED / "sales-summary", target)
    return target


def test_shipped_tasks_read_and_their_prompts_name_inputs_and_deliverables():
    folders = task_folders(SHIPPED)
    assert len(folders) >= 4 and all(f.solution_path.is_file() and f.reference_files() for f in folders)
    task = next(t for t in load_tasks(SHIPPED, 8) if t.task_id == "gdpval/invoice-totals")
    assert "Reference files in your work folder: items.csv" in task.prompt
    assert "Leave these files in your work folder when you finish: totals.json, invoice.md" in task.prompt
    assert task.tests == () and task.max_seconds == 300
    assert load_tasks(SHIPPED, 9, seed=2) == load_tasks(SHIPPED, 9, seed=2)


@pytest.mark.parametrize(
    ("yaml_text", "words"),
    [
        ("deliverables: [a.csv]\n", ["prompt", "Field required"]),
        ("prompt: do it\n", ["deliverables", "Field required"]),
        ("prompt: do it\ndeliverables: []\n", ["deliverables"]),
        ("prompt: do it\ndeliverables: [../escape.txt]\n", ["'../escape.txt'", "relative path"]),
        ("prompt: do it\ndeliverables: [/etc/passwd]\n", ["'/etc/passwd'"]),
        ("prompt: do it\ndeliverables: [a]\ndeliverable: [b]\n", ["deliverable", "Extra inputs"]),
        ("prompt: [unclosed\n", ["not YAML"]),
    ],
)
def test_a_bad_task_yaml_is_named(tmp_path: Path, yaml_text: str, words: list[str]):
    folder = copy_task(tmp_path)
    (folder / "task.yaml").write_text(yaml_text)
    with pytest.raises(TaskFormatError) as info:
        read_task(folder)
    assert "task 'sales-summary'" in str(info.value)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("missing", ["solution.sh", "checker.py"])
def test_a_task_without_its_checker_or_solution_is_refused(tmp_path: Path, missing: str):
    folder = copy_task(tmp_path)
    (folder / missing).unlink()
    with pytest.raises(TaskFormatError, match=f"{missing} is missing"):
        read_task(folder)


def test_tap_lines_are_read_and_no_line_is_none():
    output = "noise\nok 1 - header\nnot ok 2 - totals # ValueError: x\nnot ok 3\n  ok 4 - indented\nok 1 - header\n"
    assert parse_tap(output) == {
        "header": (True, ""),
        "totals": (False, "ValueError: x"),
        "check 3": (False, ""),
        "indented": (True, ""),
    }
    assert parse_tap("Traceback (most recent call last):\n  boom\n") is None
    assert parse_tap("") is None


def test_gdpval_configs_need_a_file_changing_tool_and_one_task_root(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("DOCKYARD_SANDBOX_TASK_ROOT", raising=False)
    monkeypatch.delenv("DOCKYARD_SANDBOX_BACKEND", raising=False)
    config = CONFIGS / "grpo_gdpval.yaml"
    cfg = load_config(config)
    env = sandbox_env(cfg)
    assert env["DOCKYARD_SANDBOX_TASK_ROOT"] == str(SHIPPED.parent) and "DOCKYARD_SANDBOX_BACKEND" not in env
    with pytest.raises(ConfigError, match="env.tools: env gdpval scores the files"):
        load_config(config, ["env.tools=[]"])
    with pytest.raises(ConfigError, match="env.tools: env gdpval scores the files"):
        load_config(config, ["env.tools=[{name: read_file, kind: read_file}]"])
    with pytest.raises(ConfigError, match="same folder"):
        load_config(config, [f"data.validation.path={tmp_path / 'elsewhere' / 'gdpval'}"])
    with pytest.raises(ConfigError, match="data.train.source"):
        load_config(config, ["data.train.source=qa"])


def test_gdpval_is_scored_from_its_session_never_from_an_answer():
    env, task = Environment("gdpval", agentic=True), load_tasks(SHIPPED, 1)[0]
    with pytest.raises(ValueError, match="ScoreSession"):
        asyncio.run(env.score(None, task, "done", "r", sandbox_pb2.Limits(timeout_seconds=5)))


def test_hle_config_needs_its_questions_file():
    config = CONFIGS / "grpo_hle.yaml"
    assert load_config(config).env.name == "hle"
    with pytest.raises(ConfigError, match="data.train.path: env hle needs a JSONL file of questions"):
        load_config(config, ["data.train.path=null"])
