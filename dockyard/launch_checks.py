"""The launch checks that `dockyard preflight` shares with the services, and the Finding they report.

    check_reward_functions(config)  ──> Finding("reward", ok | error | skip)
                                        used by: preflight, the coordinator's CreateJob
    docker_problem(exc, env, ...)   ──> one line: no Docker engine answers, and what works instead:
                                        the local backend only for a job that needs no container
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

# WARN: the run can start, but it will not get what it asked for (a preflight line, never an exit status).
OK, ERROR, SKIP, WARN = "ok", "error", "skip", "warn"


@dataclass(frozen=True)
class Finding:
    check: str
    status: str  # OK, ERROR, SKIP or WARN
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


# What the local backend cannot serve: it refuses the first three, naming the docker backend; a SWE
# instance runs there on the service's interpreter, without its repository's dependencies. The sandbox
# service serves any job, so where it says that no engine answers it names these, not knowing the job.
NEEDS_CONTAINERS = (
    "an external scaffold (env.scaffold), env terminal_bench, sessions that install packages, or SWE "
    "instances that need their repository's environment image"
)


def docker_problem(
    exc: Exception, env: Mapping[str, str] = os.environ, required: str | None = None, *, any_job: bool = False
) -> str:
    """One line for a Docker client that cannot reach an engine (instead of the client's traceback): how
    to get one, and the local backend only where it can run the job. `required`: why the job needs
    docker (the local backend is never proposed); `any_job` (the sandbox service, which serves jobs it
    does not know yet): the local backend is proposed for jobs that need no container, naming those that do;
    neither (preflight, for a job that does not need docker): the local backend is proposed."""
    where = env.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    said = f"the docker sandbox backend needs a Docker engine and none answers at {where} ({type(exc).__name__}): "
    engine = "start the Docker daemon (dockerd) or point DOCKER_HOST at one that runs"
    if required:
        return said + f"{engine}; {required}, so the local backend cannot run it"
    local = "the local backend (DOCKYARD_SANDBOX_BACKEND=local, with bubblewrap installed)"
    if any_job:
        # Under deploy/compose the engine is the host's, reached through the socket DOCKER_SOCKET names.
        return (
            said + f"{engine} (deploy/compose mounts the socket that DOCKER_SOCKET names); only a job that needs "
            f"no container can use {local} instead: not {NEEDS_CONTAINERS}"
        )
    return said + f"{engine}, or use {local}"
