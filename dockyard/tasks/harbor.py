"""Terminal tasks in Harbor's folder format (Terminal-Bench 2), read as the harbor package (0.25) reads them.

    <task set>/<task id>/
        task.toml            [metadata] [verifier] [agent] [environment] [solution] ──HarborConfig──>
                             Task(prompt = instruction.md, max_seconds = agent.timeout_sec)
        instruction.md       the prompt
        environment/         the image's build context: its Dockerfile (services/sandbox/terminal_images.py)
        tests/test.sh        run after the agent as `bash /tests/test.sh`; writes the reward to
                             /logs/verifier/reward.txt (a number) or reward.json ({"reward": number, ...})
        solution/solve.sh    the reference (harbor's oracle runs it from /solution)

Guarantees: task.toml's tables, keys and defaults are harbor's (those of its single-step tasks); a key
not read here is ignored, as harbor ignores keys it does not know, but `[[steps]]` (a task of several
steps) is refused; a task.toml that is not TOML or has a value of the wrong type, a missing
instruction.md, tests/test.sh or environment/Dockerfile, and an environment/docker-compose.yaml (several
services are not run here) are refused with the task and the file named (TaskFormatError). A reward
file is read as harbor's verifier reads it: reward.json, when there, before reward.txt.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dockyard.tasks.terminal import TaskFormatError, check_task_id

# Where harbor's verifier looks for the reward, inside the task's container.
CONTAINER_VERIFIER_DIR = "/logs/verifier"
# Where harbor's oracle puts solution/ before `bash /solution/solve.sh`.
CONTAINER_SOLUTION_DIR = "/solution"


class _Section(BaseModel):
    model_config = ConfigDict(extra="ignore")  # harbor's models ignore keys they do not know


class VerifierConfig(_Section):
    timeout_sec: float = Field(600.0, gt=0)
    env: dict[str, str] = Field(default_factory=dict)


class AgentConfig(_Section):
    timeout_sec: float = Field(600.0, gt=0)


class EnvironmentConfig(_Section):
    build_timeout_sec: float = Field(600.0, gt=0)
    docker_image: str | None = None
    cpus: int = 1
    memory_mb: int = 2048
    storage_mb: int = 10240
    gpus: int = 0
    allow_internet: bool = True


class SolutionConfig(_Section):
    env: dict[str, str] = Field(default_factory=dict)


class HarborConfig(_Section):
    """task.toml: harbor's tables with their defaults; metadata is free-form, as in harbor."""

    version: str = "1.0"
    metadata: dict[str, Any] = Field(default_factory=dict)
    verifier: VerifierConfig = Field(default_factory=VerifierConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    environment: EnvironmentConfig = Field(default_factory=EnvironmentConfig)
    solution: SolutionConfig = Field(default_factory=SolutionConfig)


@dataclass(frozen=True)
class HarborTask:
    """One Harbor task folder: its paths, as harbor's TaskPaths names them, its task.toml and instruction."""

    path: Path
    config: HarborConfig
    instruction: str

    @property
    def task_id(self) -> str:
        return self.path.name

    @property
    def environment_dir(self) -> Path:
        return self.path / "environment"

    @property
    def dockerfile_path(self) -> Path:
        return self.environment_dir / "Dockerfile"

    @property
    def test_dir(self) -> Path:
        return self.path / "tests"

    @property
    def test_path(self) -> Path:
        return self.test_dir / "test.sh"

    @property
    def solution_dir(self) -> Path:
        return self.path / "solution"

    @property
    def solution_path(self) -> Path:
        return self.solution_dir / "solve.sh"

    @property
    def max_agent_seconds(self) -> float:
        return self.config.agent.timeout_sec


def is_harbor_task(path: Path) -> bool:
    return (path / "task.toml").is_file()


def read_harbor_task(path: str | Path) -> HarborTask:
    """The Harbor task folder at `path`; TaskFormatError naming the task and what is missing or wrong."""
    folder = Path(path)
    name = check_task_id(folder)
    config_path = folder / "task.toml"
    if not config_path.is_file():
        raise TaskFormatError(f"task {name!r}: {config_path} does not exist")
    try:
        data = tomllib.loads(config_path.read_text(encoding="utf-8"))
        if "steps" in data:  # ignoring it would run a task of several steps as its first one
            raise TaskFormatError(f"task {name!r}: task.toml: [[steps]]: tasks of several steps are not run here")
        config = HarborConfig.model_validate(data)
    except tomllib.TOMLDecodeError as exc:
        raise TaskFormatError(f"task {name!r}: task.toml is not TOML: {exc}") from None
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'task.toml'}: {e['msg']}" for e in exc.errors())
        raise TaskFormatError(f"task {name!r}: task.toml: {problems}") from None
    instruction_path = folder / "instruction.md"
    if not instruction_path.is_file():
        raise TaskFormatError(f"task {name!r}: instruction.md is missing (it is the prompt)")
    instruction = instruction_path.read_text(encoding="utf-8").strip()
    if not instruction:
        raise TaskFormatError(f"task {name!r}: instruction.md is empty")
    task = HarborTask(folder, config, instruction)
    if not task.test_path.is_file():
        raise TaskFormatError(f"task {name!r}: tests/test.sh is missing (it runs the tests and writes the reward)")
    if (task.environment_dir / "docker-compose.yaml").is_file():
        raise TaskFormatError(
            f"task {name!r}: environment/docker-compose.yaml: tasks of several services are not run here; "
            "give the task one environment/Dockerfile"
        )
    if not task.dockerfile_path.is_file():
        raise TaskFormatError(f"task {name!r}: environment/Dockerfile is missing (the task's image)")
    return task


def parse_reward(reward_json: str | None, reward_txt: str | None) -> float:
    """The reward test.sh wrote, as harbor's verifier reads it (reward.json first, its "reward" key; else
    reward.txt, one number); ValueError saying what is wrong, including when neither file is there."""
    if reward_json is not None:
        try:
            rewards = json.loads(reward_json)
        except json.JSONDecodeError as exc:
            raise ValueError(f"reward.json is not JSON: {exc}") from None
        if not isinstance(rewards, dict) or "reward" not in rewards:
            raise ValueError(f'reward.json holds no "reward" key: {reward_json[:200]!r}')
        value = rewards["reward"]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f'reward.json\'s "reward" is not a number: {value!r}')
        return float(value)
    if reward_txt is not None:
        try:
            return float(reward_txt.strip())
        except ValueError:
            raise ValueError(f"reward.txt does not hold a number: {reward_txt[:200]!r}") from None
    raise ValueError(f"tests/test.sh wrote no reward ({CONTAINER_VERIFIER_DIR}/reward.txt or reward.json)")
