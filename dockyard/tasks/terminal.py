"""Terminal tasks in terminal-bench's folder format, read as its harness reads them.

    <task set>/<task id>/
        task.yaml            instruction, timeouts, metadata ──TaskConfig──> Task(prompt = instruction)
        solution.sh          the reference (or solution.yaml: keystrokes, not run here)
        run-tests.sh         run after the agent as `bash /tests/run-tests.sh`, TEST_DIR=/tests
        docker-compose.yaml  one `client` service built from Dockerfile
        Dockerfile           the task's image (services/sandbox/terminal_images.py builds it offline)
        tests/               copied into /tests only once the agent has finished

    pytest output ──parse_pytest_summary──> {test: passed?}  (the "short test summary info" lines)

Guarantees: task.yaml's fields, their defaults and the task id (the folder's name) are terminal-bench's
(0.2.x); a task.yaml without `instruction` or `difficulty`, with an unknown parser, a bad timeout or a
missing file of the format is refused with the task and field named (terminal_sets.py makes a set's
folders, of this format or Harbor's, into tasks); a pytest summary is
read as terminal-bench's pytest parser reads it (passed, skipped and xfail pass; failed, error and
xpass fail); no summary at all is None, never an empty pass.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

# Where the harness puts run-tests.sh and the contents of tests/, and what TEST_DIR says.
CONTAINER_TEST_DIR = "/tests"
# Where the oracle's solution.sh goes before `bash /oracle/solution.sh` runs it.
CONTAINER_SOLUTION_DIR = "/oracle"
# The files of the format itself: never part of the image's build context.
FORMAT_FILES = ("task.yaml", "solution.sh", "solution.yaml", "run-tests.sh", "docker-compose.yaml", "tests")
_TASK_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class TaskConfig(BaseModel):
    """task.yaml: terminal-bench's fields and defaults (unknown keys are ignored, as there)."""

    model_config = ConfigDict(extra="ignore")

    instruction: str = Field(min_length=1)
    author_name: str = "unknown"
    author_email: str = "unknown"
    difficulty: Literal["easy", "medium", "hard", "unknown"]
    category: str = "software_engineering"
    tags: list[str] = Field(default_factory=list)
    parser_name: Literal["pytest"] = "pytest"  # the only parser dockyard reads
    max_agent_timeout_sec: float = Field(360.0, gt=0)
    max_test_timeout_sec: float = Field(60.0, gt=0)
    run_tests_in_same_shell: bool = False
    disable_asciinema: bool = False
    estimated_duration_sec: float | None = None
    expert_time_estimate_min: int | None = None
    junior_time_estimate_min: int | None = None


class TaskFormatError(ValueError):
    """A task folder that does not follow the format; the message names the task and what is wrong."""


Config = TypeVar("Config", bound=BaseModel)
Folder = TypeVar("Folder")


def check_task_id(folder: Path) -> str:
    """The task id (the folder's name); TaskFormatError when it is not one."""
    if not _TASK_ID.match(folder.name):
        raise TaskFormatError(f"task {folder.name!r}: a task id is 1-128 characters of A-Z a-z 0-9 . _ -")
    return folder.name


def read_task_yaml(folder: Path, schema: type[Config]) -> Config:
    """The task.yaml of a task folder (of any format) read by `schema`; TaskFormatError naming the task and
    what is wrong with its id or its task.yaml."""
    name = check_task_id(folder)
    config_path = folder / "task.yaml"
    if not config_path.is_file():
        raise TaskFormatError(f"task {name!r}: {config_path} does not exist")
    try:
        return schema.model_validate(yaml.safe_load(config_path.read_text(encoding="utf-8")))
    except yaml.YAMLError as exc:
        raise TaskFormatError(f"task {name!r}: task.yaml is not YAML: {exc}") from None
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'task.yaml'}: {e['msg']}" for e in exc.errors())
        raise TaskFormatError(f"task {name!r}: task.yaml: {problems}") from None


def read_task_set(
    path: str | Path, read: Callable[[Path], Folder], kind: str, markers: tuple[str, ...] = ("task.yaml",)
) -> list[Folder]:
    """Every task folder (a folder holding one of `markers`) of a task set, read by `read`, sorted by id."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a folder of {kind}")
    tasks = [read(p) for p in sorted(root.iterdir()) if any((p / m).is_file() for m in markers)]
    if not tasks:
        raise ValueError(f"{root} holds no task folder (a folder with {' or '.join(markers)})")
    return tasks


@dataclass(frozen=True)
class TaskFolder:
    """One task folder: its paths, as terminal-bench's TaskPaths names them, and its task.yaml."""

    path: Path
    config: TaskConfig

    @property
    def task_id(self) -> str:
        return self.path.name

    @property
    def instruction(self) -> str:
        return self.config.instruction

    @property
    def max_agent_seconds(self) -> float:
        return self.config.max_agent_timeout_sec

    @property
    def environment_dir(self) -> Path:
        """The image's build context (less the format's own files)."""
        return self.path

    @property
    def solution_path(self) -> Path:
        """solution.sh, else solution.yaml."""
        sh = self.path / "solution.sh"
        return sh if sh.is_file() else self.path / "solution.yaml"

    @property
    def run_tests_path(self) -> Path:
        return self.path / "run-tests.sh"

    @property
    def test_dir(self) -> Path:
        return self.path / "tests"

    @property
    def dockerfile_path(self) -> Path:
        return self.path / "Dockerfile"

    @property
    def docker_compose_path(self) -> Path:
        return self.path / "docker-compose.yaml"


def client_environment(task: TaskFolder) -> dict[str, str]:
    """docker-compose.yaml's `client` service's literal environment entries (TEST_DIR is the harness's own);
    TaskFormatError for a compose file of another shape (one `client` service built from Dockerfile)."""
    try:
        compose = yaml.safe_load(task.docker_compose_path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise TaskFormatError(f"docker-compose.yaml is not YAML: {exc}") from None
    services = compose.get("services") or {}
    if not isinstance(services, dict) or list(services) != ["client"]:
        raise TaskFormatError(
            f"docker-compose.yaml: one service named `client` is supported, got {list(services) or 'none'}"
        )
    client = services["client"] or {}
    build = client.get("build") or {}
    dockerfile = build.get("dockerfile", "Dockerfile") if isinstance(build, dict) else "Dockerfile"
    if dockerfile != "Dockerfile":
        raise TaskFormatError(f"docker-compose.yaml: the client is built from Dockerfile, not {dockerfile!r}")
    env = client.get("environment") or {}
    items = env.items() if isinstance(env, dict) else (str(e).partition("=")[::2] for e in env)
    return {str(k): str(v) for k, v in items if k != "TEST_DIR" and "$" not in str(v)}


def read_task(path: str | Path) -> TaskFolder:
    """The task folder at `path`; TaskFormatError naming what is missing or wrong."""
    folder = Path(path)
    name = folder.name
    task = TaskFolder(folder, read_task_yaml(folder, TaskConfig))
    for needed in (task.run_tests_path, task.dockerfile_path, task.docker_compose_path):
        if not needed.is_file():
            raise TaskFormatError(f"task {name!r}: {needed.name} is missing")
    if not task.solution_path.is_file():
        raise TaskFormatError(f"task {name!r}: neither solution.sh nor solution.yaml is there")
    return task


def task_folders(path: str | Path) -> list[TaskFolder]:
    """Every task folder (a folder holding task.yaml) of a task set, sorted by id."""
    return read_task_set(path, read_task, "terminal tasks")


_SUMMARY = re.compile(r"=+\s*short test summary info\s*=+", re.IGNORECASE)
_PASSING = {"PASSED": True, "SKIPPED": True, "XFAIL": True, "FAILED": False, "ERROR": False, "XPASS": False}


def parse_pytest_summary(output: str) -> dict[str, bool] | None:
    """{test name: passed} from the lines after pytest's "short test summary info" (run with -rA);
    None when the output has no such section (the tests did not get as far as a summary)."""
    parts = _SUMMARY.split(output, maxsplit=1)
    if len(parts) < 2:
        return None
    results: dict[str, bool] = {}
    for line in parts[1].splitlines():
        words = line.split(maxsplit=1)
        if len(words) < 2 or words[0].rstrip(":") not in _PASSING:
            continue
        status, rest = words[0].rstrip(":"), words[1]
        if status == "FAILED" and " - " in rest:  # drop the failure's message
            rest = " - ".join(rest.split(" - ")[:-1])
        name = rest.strip().split("::", 1)[-1]
        if name:
            results[name] = _PASSING[status]
    return results
