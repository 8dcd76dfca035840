"""`env.verifiers`: a verifiers environment, named by its package and its `load_environment` arguments.

    env.verifiers {package, module, args, eval_args, verifiers}
        ──> the requirements of the session image: verifiers + the environment's package
        ──> the scaffold each trial runs (runner_scaffold): dockyard's verifiers runner under the image's
            /opt/venv python, its result in RESULT_FILE (docs/environments.md#verifiers)

Guarantees: `module` is a Python import name and `args` / `eval_args` are JSON objects (they reach the
runner as JSON); the scaffold derived here is the only one env.name verifiers runs, so a config that
names another is refused.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, field_validator

from dockyard.config.section import Section
from dockyard.config.tools import ScaffoldConfig

VERIFIERS_REQUIREMENT = "verifiers==0.4.0"
# The work-folder file the runner writes its result to ({"reward", ...} or {"error"}), read after it exits.
RESULT_FILE = ".verifiers-result.json"
# The runner's source reaches the session as this variable (dockyard/agents/verifiers_runner.py), and
# runs under the image's own interpreter, isolated (-I: no PYTHON* variables, no work folder on sys.path).
RUNNER_COMMAND = 'exec /opt/venv/bin/python -I -c "$DOCKYARD_VERIFIERS_RUNNER"'
_REQUIREMENT = r"^[A-Za-z0-9][A-Za-z0-9._\-\[\],]*\s*(?:[=<>!~]=?[^\s;]+)?$"


class VerifiersConfig(Section):
    """A verifiers environment run in each trial's session (env.name verifiers)."""

    package: str = Field(
        min_length=1,
        max_length=1024,
        description=(
            "The environment's package: a pip requirement (`my-env==1.2`), downloaded with its "
            "dependencies into the wheelhouse, or a local project folder (starting with `/`, `./` "
            "or `../`, relative to the sandbox service's working directory: `dockyard run`'s), "
            "built into a wheel there; installed into the session image (docker backend) beside "
            "`verifiers`, never into dockyard's environment."
        ),
    )
    module: str = Field(
        min_length=1,
        max_length=256,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$",
        description="Import name of the module whose `load_environment(**args)` gives the environment.",
    )
    args: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Keyword arguments of `load_environment` for training trials (JSON values); it returns a "
            "`vf.Env` or a `vf.Taskset`, whose tasks are the rows trials draw from."
        ),
    )
    eval_args: dict[str, Any] | None = Field(
        None, description="Keyword arguments of `load_environment` for validation trials; `null`: `args`."
    )
    verifiers: str = Field(
        VERIFIERS_REQUIREMENT,
        min_length=1,
        max_length=256,
        pattern=_REQUIREMENT,
        description="The pip requirement of verifiers itself, installed beside the package.",
    )

    @field_validator("package")
    @classmethod
    def _package(cls, value: str) -> str:
        if not is_project_folder(value) and not re.fullmatch(_REQUIREMENT, value):
            raise ValueError(f"env.verifiers.package: {value!r} is neither a pip requirement nor a ./folder")
        return value

    @property
    def requirements(self) -> tuple[str, ...]:
        return (self.verifiers, self.package)

    def load_args(self, split: str) -> dict[str, Any]:
        return self.args if split == "train" or self.eval_args is None else self.eval_args


def is_project_folder(requirement: str) -> bool:
    """A requirement that names a local project folder rather than a package of the index (the sandbox, which
    builds it, has the same rule in services/sandbox/images.py: its image carries no config package)."""
    return requirement.startswith(("/", "./", "../"))


def runner_scaffold() -> ScaffoldConfig:
    """The scaffold of every verifiers trial: the runner, its answer the result file."""
    return ScaffoldConfig(command=RUNNER_COMMAND, answer_file=RESULT_FILE)
