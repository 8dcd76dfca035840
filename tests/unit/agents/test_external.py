"""External scaffolds: the config's checks, the command's environment, and the launch check."""

from __future__ import annotations

import subprocess

import pytest
from pydantic import ValidationError

from dockyard.agents.external import scaffold_environment, shell_line
from dockyard.agents.scaffold import Budget
from dockyard.config import ConfigError, ScaffoldConfig, load_config
from dockyard.tasks.envs import sandbox_env
from tests.conftest import REPO_ROOT

CONFIG = REPO_ROOT / "examples" / "configs" / "tiny_agent_external.yaml"


@pytest.mark.parametrize(
    ("env", "words"),
    [({"OPENAI_API_KEY": "x"}, "set by dockyard"), ({"lower": "x"}, "not a variable name"), ({"A-B": "x"}, "A-Z")],
)
def test_scaffold_env_cannot_override_the_trial_or_be_malformed(env, words) -> None:
    with pytest.raises(ValidationError, match=words):
        ScaffoldConfig(command="true", env=env)


def test_a_scaffold_excludes_the_built_in_tools() -> None:
    with pytest.raises(ConfigError, match="brings its own tools"):
        load_config(CONFIG, ["env.tools=[{name: f, kind: shell}]"])


def test_the_command_sees_the_task_as_data_never_as_code(tmp_path) -> None:
    """The task's text (and every value) reaches the shell quoted: quotes, $(...) and ; do nothing."""
    prompt = 'it\'s "$(touch pwned)"; touch pwned2 `touch pwned3` \n$HOME'
    scaffold = ScaffoldConfig(
        command='printf "%s|%s|%s|%s" "$DOCKYARD_TASK" "$OPENAI_BASE_URL" "$OPENAI_API_KEY" "$MY_SETTING"',
        env={"MY_SETTING": "a b'c"},
    )
    environment = scaffold_environment(
        scaffold,
        endpoint_url="http://127.0.0.1:8080/",
        api_key="dys-s-1-abc",
        model="job-1",
        prompt=prompt,
        budget=Budget(max_turns=3, max_tokens=100, seconds=30.0),
        max_new=16,
    )
    out = subprocess.run(["sh", "-c", shell_line(scaffold, environment)], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"{prompt}|http://127.0.0.1:8080/v1|dys-s-1-abc|a b'c"
    assert list(tmp_path.iterdir()) == []
    assert environment["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8080"
    assert (environment["DOCKYARD_MAX_TURNS"], environment["DOCKYARD_MAX_SECONDS"]) == ("3", "30")


def test_launch_needs_the_docker_backend(monkeypatch) -> None:
    config = load_config(CONFIG, [])
    monkeypatch.delenv("DOCKYARD_SANDBOX_BACKEND", raising=False)
    assert sandbox_env(config)["DOCKYARD_SANDBOX_BACKEND"] == "docker"
    monkeypatch.setenv("DOCKYARD_SANDBOX_BACKEND", "local")
    with pytest.raises(ValueError, match="DOCKYARD_SANDBOX_BACKEND=docker"):
        sandbox_env(config)
