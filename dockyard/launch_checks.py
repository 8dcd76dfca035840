"""The launch checks that `dockyard preflight` shares with the services, and the Finding they report.

    check_reward_functions(config)  ──> Finding("reward", ok | error | skip)
                                        used by: preflight, the coordinator's CreateJob
    docker_problem(exc, env)        ──> one line: no Docker engine answers, and what to do
                                        used by: preflight's docker check, the sandbox service's start

Guarantees: nothing here imports or runs a user's reward function (reward_functions.py finds and parses
it); importing this module loads no config library, torch or docker (the sandbox service's image has
no config libraries, and it imports docker_problem from here). The services import these checks from
here, never from preflight.py, which belongs to the CLI.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dockyard.config import MasterConfig

OK, ERROR, SKIP = "ok", "error", "skip"


@dataclass(frozen=True)
class Finding:
    check: str
    status: str  # OK, ERROR or SKIP
    message: str


def check_reward_functions(config: MasterConfig) -> Finding:
    """Each function env.reward names: its file found and parsed (never imported), the function defined."""
    from dockyard.tasks.reward_functions import RewardFunctionError, is_function, load

    specs = [spec for spec, _ in config.env.reward_terms if is_function(spec)]
    if not specs:
        return Finding("reward", SKIP, "built-in rewards only")
    problems, found = [], []
    for spec in specs:
        try:
            found.append(f"{spec} ({load(spec).path})")
        except RewardFunctionError as exc:
            problems.append(str(exc))
    if problems:
        return Finding("reward", ERROR, "; ".join(problems))
    return Finding("reward", OK, f"defined: {', '.join(found)}")


def docker_problem(exc: Exception, env: Mapping[str, str] = os.environ, required: str | None = None) -> str:
    """One line for a Docker client that cannot reach an engine (instead of the client's traceback); the
    local backend is proposed only when the config does not need docker (`required` says why it does)."""
    where = env.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    said = f"the docker sandbox backend needs a Docker engine and none answers at {where} ({type(exc).__name__}): "
    if required:
        return said + f"start dockerd (or set DOCKER_HOST); {required}, so the local backend cannot run it"
    return said + "start dockerd (or set DOCKER_HOST), or use the local backend (DOCKYARD_SANDBOX_BACKEND=local)"
