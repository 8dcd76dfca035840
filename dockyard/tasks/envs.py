"""Environments: how a task set is loaded and how a completion becomes a sandbox verdict.

    env.name            tasks (data.*.source)      completion ─> sandbox call
    expr                expr (tiny recipe)         first line as f's body ─> RunTests(program, asserts)
    expr_agent          expr_agent (no points      the answer (`f(x)=` dropped), as expr's completion
                        shown; a tool reads f)
    program_synthesis   humaneval (or a JSONL)     prompt + completion ─> RunTests(program, check(entry_point))
    swe                 swe (a task-set folder)    the diff in the completion ─> ScorePatch(task_set, instance_id)
                                                   (with env.tools: the session's diff ─> ScoreSession)
    terminal_bench      terminal_bench (a folder   agent trials only: the session's tests ─> ScoreSession
                        of terminal-bench tasks)   (run-tests.sh after the agent; docs/terminal_tasks.md)

An agent environment's trials (env.tools set) end with an answer that is scored like a completion
(swe's trials are scored from their session's work folder instead: services/coordinator/agent_trials.py).
Every environment is scored through the sandbox service; gRPC errors propagate to the caller (the
collector turns them into ERROR verdicts or a failed job). The verdict carries the integrity flag
(`integrity_violation`), which the collector turns into a zero reward.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from dockyard.api.common.v1 import common_pb2
from dockyard.api.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from dockyard.config import DatasetConfig, MasterConfig
from dockyard.tasks import expr, humaneval, swe, terminal
from dockyard.tasks.task import Task

# The RPC deadline is the sandbox's wall-clock limit plus this margin (queueing, checkout, transfer).
DEADLINE_MARGIN_SECONDS = 30.0


@dataclass(frozen=True)
class Environment:
    name: str
    agentic: bool = False  # env.tools set: each sample is a multi-turn trial (SWE: prompts ask for edits)

    def load(self, split: str, dataset: DatasetConfig) -> list[Task]:
        if self.name == "expr":
            return expr.make_tasks(split, dataset.size, dataset.seed)
        if self.name == "expr_agent":
            return expr.make_agent_tasks(split, dataset.size, dataset.seed)
        if self.name == "program_synthesis":
            return humaneval.make_tasks(split, dataset.size, dataset.seed, dataset.path)
        if dataset.path is None:
            raise ValueError(f"data.{split}.path must name a task-set folder for env {self.name}")
        if self.name == "terminal_bench":
            return terminal.load_tasks(dataset.path, dataset.size, dataset.seed)
        return swe.load_tasks(dataset.path, dataset.size, dataset.seed, agentic=self.agentic)

    async def score(
        self,
        sandbox: sandbox_pb2_grpc.SandboxServiceStub,
        task: Task,
        completion: str,
        request_id: str,
        limits: sandbox_pb2.Limits,
    ) -> common_pb2.Verdict:
        deadline = limits.timeout_seconds + DEADLINE_MARGIN_SECONDS
        if self.name == "terminal_bench":
            raise ValueError("terminal_bench tasks are scored from their agent session (ScoreSession), not an answer")
        if self.name == "swe":
            task_set, instance_id = swe.split_task_id(task.task_id)
            request = sandbox_pb2.ScorePatchRequest(
                request_id=request_id,
                task_set=task_set,
                instance_id=instance_id,
                patch=swe.extract_patch(completion),
                limits=limits,
            )
            return (await sandbox.ScorePatch(request, timeout=deadline)).verdict
        if self.name == "program_synthesis":
            program = humaneval.program_for(task.prompt, completion)
        elif self.name == "expr_agent":
            program = expr.program_for(expr.agent_answer(completion))
        else:
            program = expr.program_for(completion)
        request = sandbox_pb2.RunTestsRequest(
            request_id=request_id, program=program, tests=list(task.tests), limits=limits
        )
        return (await sandbox.RunTests(request, timeout=deadline)).verdict


def environment(config: MasterConfig) -> Environment:
    return Environment(config.env.name, config.env.agentic)


def sandbox_env(config: MasterConfig) -> dict[str, str]:
    """Sandbox settings a local stack needs for this config: for swe and terminal_bench, the task root
    that holds data.train.path (validation's task set lies beside it; the config checks that); the
    docker backend for terminal_bench (a task runs in its own image) and for an external scaffold
    (its session's only network route is the policy endpoint; ValueError when the environment names
    another backend); for agent trials, room for as many sessions as the job runs trials at once. A
    setting already in the environment is kept."""
    env = {}
    if config.env.scaffold is not None:
        backend = os.environ.get("DOCKYARD_SANDBOX_BACKEND", "docker")
        if backend != "docker":
            raise ValueError(
                f"env.scaffold runs an external scaffold, whose session's only network route is the policy "
                f"endpoint: that needs the docker sandbox backend, not DOCKYARD_SANDBOX_BACKEND={backend}; "
                "set DOCKYARD_SANDBOX_BACKEND=docker (and build the images: deploy/images/build.sh)"
            )
        env["DOCKYARD_SANDBOX_BACKEND"] = "docker"
    task_sets = ("swe", "terminal_bench")
    if config.env.name in task_sets and "DOCKYARD_SANDBOX_TASK_ROOT" not in os.environ and config.data.train.path:
        env["DOCKYARD_SANDBOX_TASK_ROOT"] = str(Path(config.data.train.path).resolve().parent)
    if config.env.name == "terminal_bench" and "DOCKYARD_SANDBOX_BACKEND" not in os.environ:
        env["DOCKYARD_SANDBOX_BACKEND"] = "docker"  # each task runs in its own image
    if config.env.agentic and "DOCKYARD_SANDBOX_MAX_SESSIONS" not in os.environ:
        env["DOCKYARD_SANDBOX_MAX_SESSIONS"] = str(config.grpo.max_concurrent_trials)
    return env
