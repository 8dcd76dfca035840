"""Harbor's task format as dockyard reads it: task.toml, the task folder, the reward file, the converter."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dockyard.cli.main import main
from dockyard.tasks.harbor import parse_reward, read_harbor_task
from dockyard.tasks.harbor_convert import convert_task_set
from dockyard.tasks.terminal import TaskFormatError, task_folders
from dockyard.tasks.terminal_sets import any_task_folders, load_tasks
from tests.conftest import REPO_ROOT

SHIPPED = REPO_ROOT / "examples" / "tasks" / "harbor"
TERMINAL = REPO_ROOT / "examples" / "tasks" / "terminal"


def copy_task(tmp_path: Path, name: str = "hello-file") -> Path:
    target = tmp_path / "set" / name
    shutil.copytree(SHIPPED / "hello-file", target)
    return target


def test_a_shipped_task_reads_with_its_toml(tmp_path: Path) -> None:
    task = read_harbor_task(SHIPPED / "hello-file")
    assert task.task_id == "hello-file" and task.instruction.startswith("Create the file /app/greeting.txt")
    assert (task.config.verifier.timeout_sec, task.config.agent.timeout_sec) == (30.0, 120.0)
    assert task.config.metadata["tags"] == ["files", "shell"]
    assert task.dockerfile_path == SHIPPED / "hello-file" / "environment" / "Dockerfile"


def test_task_toml_defaults_are_harbors_and_unknown_keys_are_ignored(tmp_path: Path) -> None:
    folder = copy_task(tmp_path)
    (folder / "task.toml").write_text('something_new = 1\n[verifier]\nfuture_key = "x"\n[brand_new_table]\na = 1\n')
    c = read_harbor_task(folder).config
    assert (c.version, c.metadata, c.verifier.timeout_sec, c.verifier.env) == ("1.0", {}, 600.0, {})
    assert (c.agent.timeout_sec, c.environment.build_timeout_sec, c.environment.cpus) == (600.0, 600.0, 1)
    assert (c.environment.memory_mb, c.environment.allow_internet, c.solution.env) == (2048, True, {})
    assert not hasattr(c, "something_new") and not hasattr(c.verifier, "future_key")


@pytest.mark.parametrize(
    ("toml_text", "words"),
    [
        ("[verifier]\ntimeout_sec = [unclosed\n", "not TOML"),
        ('[verifier]\ntimeout_sec = "soon"\n', "verifier.timeout_sec"),
        ("[agent]\ntimeout_sec = -5\n", "agent.timeout_sec"),
        ("[verifier]\nenv = 3\n", "verifier.env"),
        ('metadata = "flat"\n', "metadata"),
        ('[[steps]]\ninstruction = "a.md"\n', "several steps"),
    ],
)
def test_a_bad_task_toml_is_refused_naming_the_key(tmp_path: Path, toml_text: str, words: str) -> None:
    folder = copy_task(tmp_path)
    (folder / "task.toml").write_text(toml_text)
    with pytest.raises(TaskFormatError, match=words) as caught:
        read_harbor_task(folder)
    assert "hello-file" in str(caught.value) and "task.toml" in str(caught.value)


@pytest.mark.parametrize(
    "missing", ["task.toml", "instruction.md", "tests/test.sh", "environment/Dockerfile", "environment"]
)
def test_a_missing_part_of_the_format_is_refused_by_name(tmp_path: Path, missing: str) -> None:
    folder = copy_task(tmp_path)
    path = folder / missing
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    with pytest.raises(TaskFormatError, match=missing if missing != "environment" else "environment/Dockerfile"):
        read_harbor_task(folder)


def test_an_empty_instruction_and_a_compose_environment_are_refused(tmp_path: Path) -> None:
    folder = copy_task(tmp_path)
    (folder / "instruction.md").write_text("\n  \n")
    with pytest.raises(TaskFormatError, match="instruction.md is empty"):
        read_harbor_task(folder)
    (folder / "instruction.md").write_text("do it\n")
    (folder / "environment" / "docker-compose.yaml").write_text("services: {}\n")
    with pytest.raises(TaskFormatError, match="docker-compose.yaml: tasks of several services"):
        read_harbor_task(folder)


@pytest.mark.parametrize(
    ("reward_json", "reward_txt", "expected"),
    [
        (None, "1\n", 1.0),
        (None, " 0.25 ", 0.25),
        ('{"reward": 0.5, "other": 1}', "0", 0.5),  # reward.json first, as harbor's verifier reads it
        ('{"reward": 1}', None, 1.0),
    ],
)
def test_the_reward_file_is_read_as_harbor_reads_it(reward_json, reward_txt, expected: float) -> None:
    assert parse_reward(reward_json, reward_txt) == expected


@pytest.mark.parametrize(
    ("reward_json", "reward_txt", "words"),
    [
        (None, None, "wrote no reward"),
        (None, "passed", "reward.txt does not hold a number"),
        ("{not json", None, "reward.json is not JSON"),
        ('{"score": 1}', None, 'no "reward" key'),
        ('{"reward": "1"}', None, "not a number"),
        ('{"reward": true}', None, "not a number"),
    ],
)
def test_a_missing_or_unreadable_reward_is_named(reward_json, reward_txt, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_reward(reward_json, reward_txt)


def test_the_shipped_harbor_tasks_are_the_terminal_ones_and_load_as_prompts() -> None:
    harbor = {t.task_id: t for t in any_task_folders(SHIPPED)}
    terminal = {t.task_id: t for t in task_folders(TERMINAL)}
    assert set(harbor) == set(terminal) and len(harbor) == 9
    for task_id, task in harbor.items():
        assert task.instruction == terminal[task_id].instruction.strip(), task_id
        assert task.max_agent_seconds == terminal[task_id].max_agent_seconds, task_id
    tasks = load_tasks(SHIPPED, 20, seed=3)
    assert {t.task_id for t in tasks} == {f"harbor/{i}" for i in harbor}
    assert all(t.tests == () and t.prompt and t.max_seconds == 120.0 for t in tasks)


def test_a_task_set_may_mix_both_formats(tmp_path: Path) -> None:
    root = tmp_path / "mixed"
    shutil.copytree(SHIPPED / "hello-file", root / "a-harbor")
    shutil.copytree(TERMINAL / "fix-mean", root / "b-terminal")
    kinds = [type(t).__name__ for t in any_task_folders(root)]
    assert kinds == ["HarborTask", "TaskFolder"]


def test_the_converter_writes_the_shipped_set_and_overwrites_nothing(tmp_path: Path, capsys) -> None:
    out = tmp_path / "harbor"
    assert main(["tasks", "to-harbor", str(TERMINAL), str(out)]) == 0
    assert "wrote 9 Harbor task folders" in capsys.readouterr().out
    for shipped in sorted(SHIPPED.iterdir()):  # the shipped folders are this converter's output
        written = sorted(p.relative_to(out / shipped.name) for p in (out / shipped.name).rglob("*"))
        assert written == sorted(p.relative_to(shipped) for p in shipped.rglob("*")), shipped.name
        for rel in written:
            if (shipped / rel).is_file():
                assert (out / shipped.name / rel).read_bytes() == (shipped / rel).read_bytes(), (shipped.name, rel)
    assert main(["tasks", "to-harbor", str(TERMINAL), str(out)]) == 2
    assert "already holds" in capsys.readouterr().err
    with pytest.raises(FileExistsError, match="nothing is overwritten"):
        convert_task_set(TERMINAL, out)
