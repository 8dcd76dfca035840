"""env.verifiers: where it is allowed, what it sets, what it refuses."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from dockyard.config.env import EnvConfig
from dockyard.config.verifiers import RESULT_FILE, RUNNER_COMMAND, VerifiersConfig

VERIFIERS = {"package": "./examples/verifiers_env", "module": "dockyard_verifiers_example", "args": {"mode": "tool"}}


def test_env_verifiers_runs_the_runner_as_its_scaffold_and_round_trips():
    env = EnvConfig(name="verifiers", verifiers=VERIFIERS)
    assert env.scaffold is not None and env.agentic
    assert (env.scaffold.command, env.scaffold.answer_file, env.scaffold.package) == (RUNNER_COMMAND, RESULT_FILE, None)
    assert EnvConfig(**env.model_dump()) == env  # a resolved config (scaffold written out) loads again
    assert env.verifiers.requirements == ("verifiers==0.4.0", "./examples/verifiers_env")


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"name": "verifiers"}, "env.verifiers names the environment of env.name verifiers"),
        ({"name": "expr_agent", "verifiers": VERIFIERS}, "env.verifiers names the environment"),
        (
            {"name": "verifiers", "verifiers": VERIFIERS, "tools": [{"name": "f", "kind": "shell"}]},
            "brings its own tools",
        ),
        (
            {"name": "verifiers", "verifiers": VERIFIERS, "scaffold": {"command": "mini", "answer_file": "a.txt"}},
            "runs dockyard's verifiers runner",
        ),
    ],
)
def test_misplaced_or_conflicting_settings_are_refused(fields, says):
    with pytest.raises(ValidationError, match=says):
        EnvConfig(**fields)


@pytest.mark.parametrize("package", ["my-env==1.2", "my_env", "/abs/folder", "./rel", "../up"])
def test_a_package_is_a_requirement_or_a_folder(package):
    assert VerifiersConfig(package=package, module="m").package == package


@pytest.mark.parametrize("package", ["my env", "pkg; rm -rf /", "-e ./x", "https://x/y.whl"])
def test_anything_else_is_not_a_package(package):
    with pytest.raises(ValidationError):
        VerifiersConfig(package=package, module="m")


@pytest.mark.parametrize("module", ["a-b", "1x", "a..b", "os; x"])
def test_the_module_is_an_import_name(module):
    with pytest.raises(ValidationError):
        VerifiersConfig(package="p", module=module)
