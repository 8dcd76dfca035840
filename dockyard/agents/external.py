"""External scaffolds: an unchanged agent program run as one command in the trial's sandbox session.

    ScaffoldConfig.command, with the environment of the trial:
        OPENAI_BASE_URL / OPENAI_API_BASE = <route>/v1, ANTHROPIC_BASE_URL = <route>,
        OPENAI_API_KEY = ANTHROPIC_API_KEY = the endpoint session's key (binds every call to the trial),
        DOCKYARD_MODEL, DOCKYARD_TASK, DOCKYARD_MAX_TURNS / _SECONDS / _NEW_TOKENS, then ScaffoldConfig.env
    ──SessionExec(shell, timeout = the trial's seconds)──> the session's container (docker backend), whose
        only network route is the policy endpoint (services/sandbox/endpoint_route.py)
    ──> Outcome: finish_reason exit (status 0), failed (any other status), time (killed at the limit);
        the answer is answer_file's text when the config names one; a container that died (the
        sandbox's ERROR) raises TrialRefused: an infrastructure error, masked, never a reward

Guarantees: the scaffold is never changed or imported here: it sees only its environment, its work
folder and the endpoint; every value reaches the shell quoted (shlex), so a task's text is data, never
code; the command cannot outlive the trial's seconds (the sandbox kills it and everything it started);
its output is clipped by the session's limits and kept only as the outcome's last lines.
"""

from __future__ import annotations

import shlex
import time

import grpc

from dockyard.agents.scaffold import Budget, Outcome, TrialRefused
from dockyard.agents.session import SandboxSession
from dockyard.config import ScaffoldConfig

TAIL_CHARS = 2000  # of the scaffold's output, kept for the log of a failed trial


def scaffold_environment(
    scaffold: ScaffoldConfig, *, endpoint_url: str, api_key: str, model: str, prompt: str, budget: Budget, max_new: int
) -> dict[str, str]:
    """The variables the command runs with: the endpoint's, the trial's budget, then the scaffold's own."""
    base = endpoint_url.rstrip("/")
    return {
        "OPENAI_BASE_URL": f"{base}/v1",
        "OPENAI_API_BASE": f"{base}/v1",  # the older name, which litellm and others still read
        "OPENAI_API_KEY": api_key,
        "ANTHROPIC_BASE_URL": base,
        "ANTHROPIC_API_KEY": api_key,
        "DOCKYARD_MODEL": model,
        "DOCKYARD_TASK": prompt,
        "DOCKYARD_MAX_TURNS": str(budget.max_turns),
        "DOCKYARD_MAX_SECONDS": str(int(budget.seconds)),
        "DOCKYARD_MAX_NEW_TOKENS": str(max_new),
        **scaffold.env,
    }


def shell_line(scaffold: ScaffoldConfig, environment: dict[str, str]) -> str:
    exports = "".join(f"export {name}={shlex.quote(value)}\n" for name, value in environment.items())
    return f"{exports}{scaffold.command}\n"


async def run_external(
    sandbox: SandboxSession,
    scaffold: ScaffoldConfig,
    *,
    endpoint_url: str,
    api_key: str,
    model: str,
    prompt: str,
    budget: Budget,
    max_new: int,
) -> tuple[Outcome, str]:
    """Run the scaffold to its end (or the trial's time limit); (outcome, the tail of its output)."""
    environment = scaffold_environment(
        scaffold, endpoint_url=endpoint_url, api_key=api_key, model=model, prompt=prompt, budget=budget, max_new=max_new
    )
    start = time.monotonic()
    result = await sandbox.run(shell=shell_line(scaffold, environment), timeout=budget.seconds)
    seconds = time.monotonic() - start
    if result.error:
        raise TrialRefused(f"the scaffold's sandbox failed: {result.error[:300]}")
    reason = "time" if result.timed_out else "exit" if result.exit_code == 0 else "failed"
    answer = None
    if scaffold.answer_file and not result.timed_out:
        try:
            content, _ = await sandbox.read_file(scaffold.answer_file, 64 * 1024)
            answer = content.decode("utf-8", "replace").strip()
        except grpc.aio.AioRpcError:  # no answer file: the scaffold gave none, scored as the empty answer
            answer = None
    tail = (result.stdout + result.stderr)[-TAIL_CHARS:]
    return Outcome(answer=answer, finish_reason=reason, turns=0, model_seconds=seconds), tail
