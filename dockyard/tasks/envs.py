"""Environments: how a task set is loaded and how a completion becomes a sandbox verdict.

    env.name            tasks (data.*.source)      completion ─> sandbox call
    expr                expr (tiny recipe)         first line as f's body ─> RunTests(program, asserts)
    expr_agent          expr_agent (no points      the answer (`f(x)=` dropped), as expr's completion
                        shown; a tool reads f)
    program_synthesis   humaneval (or your files:  HumanEval-shaped rows: prompt + completion ─> RunTests(program,
                        JSONL, Parquet, HF folder) check(entry_point)); others: the completion's code ─> RunTests
    program_bench       program_bench (HumanEval   as program_synthesis
                        plus your files)
    swe                 swe (a task-set folder)    the diff in the completion ─> ScorePatch(task_set, instance_id)
                                                   (with env.tools: the session's diff ─> ScoreSession)
    terminal_bench      terminal_bench (a folder   agent trials only: the session's tests ─> ScoreSession
                        of terminal-bench or       (run-tests.sh, or Harbor's tests/test.sh and its reward
                        Harbor tasks)              file, after the agent; docs/terminal_tasks.md)
    hle                 qa (a JSONL of questions)  the final "Answer:" line ─> RunTests(qa_grading + the completion,
                                                   assert grade(...)) (docs/environments.md)
    gdpval              gdpval (a folder of file-  agent trials only: the files the agent left ─> ScoreSession
                        producing task folders)    (deliverables checked, then checker.py in the session)
    osworld             osworld (OSWorld task      desktop trials in a VM: no provider here, refused at launch
                        JSON files)                (dockyard/tasks/osworld.py; docs/osworld.md)
    verifiers           verifiers (row indices of  agent trials only: the environment's runner in the session
                        env.verifiers' own rows)   rolls the row out and scores it with its rubric; its result
                                                   file ─> a verdict (dockyard/tasks/verifiers_rows.py)

An agent environment's trials (env.tools or env.scaffold set) end with an answer that is scored like a
completion (swe, terminal_bench and gdpval trials are scored from their session instead:
services/coordinator/agent_trials.py); each trial's prompt says how its scaffold, built-in or external,
hands the work in (dockyard/tasks/instructions.py, the one home of those words).
Every environment is scored through the sandbox service; gRPC errors propagate to the caller (the
collector turns them into ERROR verdicts or a failed job). The verdict carries the integrity flag
(`integrity_violation`), which the collector turns into a zero reward.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from dockyard.api.common.v1 import common_pb2
from dockyard.api.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from dockyard.config import JUDGE_TEMPLATE, DatasetConfig, MasterConfig
from dockyard.tasks import expr, gdpval, osworld, programs, qa, swe, terminal_sets, verifiers_rows
from dockyard.tasks.instructions import HandIn, agent_prompt, hand_in
from dockyard.tasks.qa_judge import Judge
from dockyard.tasks.task import Task

# The RPC deadline is the sandbox's wall-clock limit plus this margin (queueing, checkout, transfer).
DEADLINE_MARGIN_SECONDS = 30.0
# Program synthesis: a prompt (or chat messages) plus tests, scored by RunTests (dockyard/tasks/programs.py).
PROGRAM_ENVS = ("program_synthesis", "program_bench")


@dataclass(frozen=True)
class Environment:
    name: str
    agentic: bool = False  # env.tools set: each sample is a multi-turn trial (SWE: prompts ask for edits)
    judge: Judge | None = None  # hle with env.judge.enabled: asked about what the answer rules reject
    # Agent trials: how the trial's scaffold hands its work in, which every prompt says (instructions.py).
    hand_in: HandIn | None = None
    module: str = ""  # env verifiers: the environment's module (its rows' labels)

    def load(self, split: str, dataset: DatasetConfig, other: DatasetConfig | None = None) -> list[Task]:
        """The tasks of `split`; `other` is the other split's config (program tasks: which files serve both).
        With `hand_in`, each prompt is the one the trial's scaffold gets (instructions.agent_prompt)."""
        tasks = self._tasks(split, dataset, other)
        if self.hand_in is None:
            return tasks
        how = self.hand_in
        return [replace(task, prompt=agent_prompt(self.name, task.prompt, how)) for task in tasks]

    def _tasks(self, split: str, dataset: DatasetConfig, other: DatasetConfig | None) -> list[Task]:
        if self.name == "verifiers":
            return verifiers_rows.make_tasks(split, dataset.size, dataset.seed, self.module)
        if self.name == "expr":
            return expr.make_tasks(split, dataset.size, dataset.seed, dataset.families)
        if self.name == "expr_agent":
            return expr.make_agent_tasks(split, dataset.size, dataset.seed, dataset.families)
        if self.name in PROGRAM_ENVS:
            return programs.load_tasks(split, dataset, other, bench=self.name == "program_bench")
        if dataset.path is None:
            raise ValueError(f"data.{split}.path must name a task-set folder for env {self.name}")
        if self.name == "terminal_bench":
            return terminal_sets.load_tasks(dataset.path, dataset.size, dataset.seed)
        if self.name == "hle":
            return qa.load_tasks(dataset.path, dataset.size, dataset.seed)
        if self.name == "gdpval":
            return gdpval.load_tasks(dataset.path, dataset.size, dataset.seed)
        if self.name == "osworld":
            return osworld.load_tasks(dataset.path, dataset.size, dataset.seed)
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
        if self.name in ("terminal_bench", "gdpval"):
            raise ValueError(f"{self.name} tasks are scored from their agent session (ScoreSession), not an answer")
        if self.name == "osworld":
            raise osworld.DesktopUnavailable(osworld.DESKTOP_REQUIREMENTS)
        if self.name == "verifiers":  # scored in the session by the environment's rubric: its result file
            return verifiers_rows.verdict(completion)
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
        if self.name in PROGRAM_ENVS:
            program = programs.program_for(task, completion)
        elif self.name == "expr_agent":
            program = expr.program_for(expr.agent_answer(completion))
        elif self.name == "hle":
            program = qa.program_for(completion)
        else:
            program = expr.program_for(completion)
        request = sandbox_pb2.RunTestsRequest(
            request_id=request_id, program=program, tests=list(task.tests), limits=limits
        )
        verdict = (await sandbox.RunTests(request, timeout=deadline)).verdict
        if self.judge is not None and verdict.status == common_pb2.VERDICT_STATUS_FAILED:
            return await self.judge.verdict(task.prompt, completion, task.answer)
        return verdict


def environment(config: MasterConfig, judge: Judge | None = None) -> Environment:
    module = config.env.verifiers.module if config.env.verifiers is not None else ""
    return Environment(config.env.name, config.env.agentic, judge, hand_in(config.env), module)


def judge_for(config: MasterConfig, job_id: str, endpoint_address: str, endpoint_token: str) -> Judge | None:
    """With env.judge.enabled, the judge that asks the job's model (`job_id`) at the policy endpoint."""
    j = config.env.judge
    if not j.enabled:
        return None
    base = endpoint_address if endpoint_address.startswith(("http://", "https://")) else f"http://{endpoint_address}"
    return Judge(
        base_url=f"{base.rstrip('/')}/v1",
        api_key=endpoint_token or "none",
        model=job_id,
        prompt_template=j.prompt_template or JUDGE_TEMPLATE,
        max_new_tokens=j.max_new_tokens,
        temperature=j.temperature,
        timeout_seconds=j.timeout_seconds,
    )


def split_tasks(config: MasterConfig, split: str) -> list[Task]:
    """The tasks of one split of the job's data (the other split's config says which files serve both).
    Training draws `size` tasks, repeating a smaller pool in reshuffled passes; validation takes each
    task once: a pool smaller than data.validation.size gives fewer tasks (preflight says so), never
    the same task scored several times over."""
    data = config.data
    dataset, other = (data.train, data.validation) if split == "train" else (data.validation, data.train)
    tasks = environment(config).load(split, dataset, other)
    if split == "validation":
        once: dict[str, Task] = {}
        for task in tasks:
            once.setdefault(task.task_id, task)
        return list(once.values())
    return tasks


def docker_required(config: MasterConfig) -> str | None:
    """Why a local stack runs this config's sandbox on the docker backend (sandbox_env sets it), or None."""
    if config.env.name == "verifiers":
        return "env verifiers runs its environment in a session whose only network route is the policy endpoint"
    if config.env.scaffold is not None:
        return "env.scaffold runs an external scaffold, whose session's only network route is the policy endpoint"
    if config.env.name == "terminal_bench":
        return "env terminal_bench runs each task in its own image"
    return None


def sandbox_env(config: MasterConfig) -> dict[str, str]:
    """Sandbox settings a local stack needs for this config: for swe, terminal_bench and gdpval, the task root
    that holds data.train.path (validation's task set lies beside it; the config checks that); the
    docker backend for terminal_bench (a task runs in its own image) and for an external scaffold
    (its session's only network route is the policy endpoint): ValueError when the environment names
    another backend, which would refuse every trial; for agent trials, room for as many sessions as
    the job runs trials at once. A setting already in the environment is kept. ValueError for env
    osworld: its trials need a desktop VM provider, which is not available (dockyard/tasks/osworld.py),
    so `dockyard run` stops here."""
    env = {}
    if config.env.name == "osworld":
        raise ValueError(f"{osworld.DESKTOP_REQUIREMENTS} (see docs/osworld.md)")
    if (required := docker_required(config)) is not None:
        backend = os.environ.get("DOCKYARD_SANDBOX_BACKEND", "docker")
        if backend != "docker":
            raise ValueError(
                f"{required}: that needs the docker sandbox backend, not "
                f"DOCKYARD_SANDBOX_BACKEND={backend}; set DOCKYARD_SANDBOX_BACKEND=docker (and build the images: "
                "deploy/images/build.sh)"
            )
        env["DOCKYARD_SANDBOX_BACKEND"] = "docker"
    task_sets = ("swe", "terminal_bench", "gdpval")
    if config.env.name in task_sets and "DOCKYARD_SANDBOX_TASK_ROOT" not in os.environ and config.data.train.path:
        env["DOCKYARD_SANDBOX_TASK_ROOT"] = str(Path(config.data.train.path).resolve().parent)
    if config.env.agentic and "DOCKYARD_SANDBOX_MAX_SESSIONS" not in os.environ:
        env["DOCKYARD_SANDBOX_MAX_SESSIONS"] = str(config.grpo.max_concurrent_trials)
    return env
