"""External scaffolds: an unchanged agent program run as one command in the trial's sandbox session.

    ScaffoldConfig.command, with the environment of the trial:
        OPENAI_BASE_URL / OPENAI_API_BASE = <route>/v1, ANTHROPIC_BASE_URL = <route>,
        OPENAI_API_KEY = ANTHROPIC_API_KEY = the endpoint session's key (binds every call to the trial),
        DOCKYARD_MODEL, DOCKYARD_TASK, DOCKYARD_MAX_TURNS / _SECONDS / _NEW_TOKENS, then ScaffoldConfig.env
    ──SessionExec(shell, timeout = the trial's seconds)──> the session's container (docker backend), whose
        only network route is the policy endpoint (services/sandbox/endpoint_route.py)
    ──> ScaffoldRun: the Outcome (finish_reason exit (status 0), failed (any other status), time
        (killed at the limit); the answer is answer_file's text when the config names one), the tail
        of the scaffold's stderr, and `error` when the run is the scaffold's failure:
            a non-zero exit status, the time limit, an answer file that is not text (garbage output);
        the agent worker adds the last kind, a scaffold that made no model call (nothing recorded)
    a container that died (the sandbox's ERROR) raises TrialRefused: an infrastructure error

Guarantees: the scaffold is never changed or imported here: it sees only its environment, its work
folder and the endpoint; every value reaches the shell quoted (shlex), so a task's text is data, never
code; the command cannot outlive the trial's seconds (the sandbox kills it and everything it started);
its output is clipped by the session's limits and kept only as its last TAIL_CHARS characters. A
scaffold error is the trial's, never the job's: the trial is masked (no tokens, no reward, out of its
group's baseline) and its verdict's error_message starts with SCAFFOLD_ERROR_PREFIX, the one mark
every counter reads (is_scaffold_error).
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass

import grpc

from dockyard.agents.scaffold import Budget, Outcome, TrialRefused
from dockyard.agents.session import SandboxSession
from dockyard.api.common.v1 import common_pb2
from dockyard.config import EnvConfig, ScaffoldConfig

TAIL_CHARS = 2000  # of the scaffold's stderr (its stdout when stderr is empty): samples.jsonl, the job's error
ANSWER_BYTES = 64 * 1024  # an answer file longer than this is not an answer
# Starts the verdict error of every scaffold error: what the collector, samples and metrics count.
SCAFFOLD_ERROR_PREFIX = "scaffold error: "


@dataclass(frozen=True)
class ScaffoldRun:
    """One run of the scaffold: the trial's outcome, the tail of its output and, when the run is the
    scaffold's own failure, what went wrong ("" when it ended by itself with status 0)."""

    outcome: Outcome
    output_tail: str
    error: str = ""


def scaffold_name(scaffold: ScaffoldConfig) -> str:
    """How errors name the scaffold: its package, else the command's first word."""
    return scaffold.package or scaffold.command.split()[0]


def env_scaffold_name(env: EnvConfig) -> str:
    """How an env's scaffold errors name what failed: a verifiers environment's module, else scaffold_name."""
    if env.verifiers is not None:
        return f"verifiers environment {env.verifiers.module}"
    assert env.scaffold is not None
    return scaffold_name(env.scaffold)


def session_packages(env: EnvConfig) -> tuple[str, ...]:
    """What an env's session image installs: a verifiers environment's requirements, or the scaffold's package."""
    if env.verifiers is not None:
        return env.verifiers.requirements
    return (env.scaffold.package,) if env.scaffold and env.scaffold.package else ()


def is_scaffold_error(trajectory: common_pb2.Trajectory) -> bool:
    """A masked trial whose scaffold failed (not the infrastructure: those are regenerated or ERROR)."""
    return not trajectory.valid and trajectory.verdict.error_message.startswith(SCAFFOLD_ERROR_PREFIX)


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
    extra: dict[str, str] | None = None,
) -> ScaffoldRun:
    """Run the scaffold to its end (or the trial's time limit): its outcome, output tail and error, if any.
    `extra`: the trial's own variables besides the scaffold's (env verifiers: the runner and its row)."""
    environment = scaffold_environment(
        scaffold, endpoint_url=endpoint_url, api_key=api_key, model=model, prompt=prompt, budget=budget, max_new=max_new
    )
    environment.update(extra or {})
    start = time.monotonic()
    result = await sandbox.run(shell=shell_line(scaffold, environment), timeout=budget.seconds)
    seconds = time.monotonic() - start
    if result.error:
        raise TrialRefused(f"the scaffold's sandbox failed: {result.error[:300]}")
    tail = (result.stderr or result.stdout)[-TAIL_CHARS:]
    reason = "time" if result.timed_out else "exit" if result.exit_code == 0 else "failed"
    outcome = Outcome(answer=None, finish_reason=reason, turns=0, model_seconds=seconds)
    if result.timed_out:
        return ScaffoldRun(outcome, tail, f"killed at the trial's time limit ({budget.seconds:.0f} s)")
    if result.exit_code != 0:
        return ScaffoldRun(outcome, tail, f"exited with status {result.exit_code}")
    if scaffold.answer_file:
        try:
            content, truncated = await sandbox.read_file(scaffold.answer_file, ANSWER_BYTES)
        except grpc.aio.AioRpcError:  # no answer file: the scaffold gave none, scored as the empty answer
            return ScaffoldRun(outcome, tail)
        problem = _not_text(content, truncated)
        if problem:
            return ScaffoldRun(outcome, tail, f"garbage output: its answer file {scaffold.answer_file} {problem}")
        outcome.answer = content.decode("utf-8").strip()
    return ScaffoldRun(outcome, tail)


def _not_text(content: bytes, truncated: bool) -> str:
    """Why an answer file's bytes are no answer ("" when they are one)."""
    if truncated:
        return f"is longer than {ANSWER_BYTES} bytes"
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"is not UTF-8 text ({exc.reason} at byte {exc.start})"
    if "\x00" in text:
        return "holds NUL bytes"
    return ""
