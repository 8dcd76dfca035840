"""An external scaffold's answer, handed in the way its prompt says, is the answer scored.

A scripted scaffold (a shell line, no model) does in a real sandbox session (the local backend, served
in process over gRPC) what the tiny external recipe's prompt tells mini-swe-agent to do with its bash
tool: it reads f with `python f.py <x>` and writes the expression, unquoted as the tiny model writes it,
to the file the prompt names. run_external reads that file once the command has exited, and the
sandbox's RunTests scores it as the job does (Environment.score, then reward_of with the recipe's
reward): the right expression earns 1, a wrong one 0, and a scaffold that writes no answer file 0.
"""

from __future__ import annotations

import re

import grpc
import pytest

from dockyard.agents.external import run_external
from dockyard.agents.scaffold import Budget
from dockyard.agents.session import SandboxSession
from dockyard.api.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from dockyard.config import load_config
from dockyard.tasks.envs import environment, split_tasks
from services.coordinator.rewards import reward_of
from services.sandbox.local import LocalBackend
from services.sandbox.servicer import SandboxServicer
from services.sandbox.settings import SandboxSettings
from tests.conftest import REPO_ROOT, require_tool

CONFIG = REPO_ROOT / "examples" / "configs" / "tiny_agent_external.yaml"


@pytest.fixture
async def sandbox(tmp_path):
    """A sandbox service on the local backend, in this process, behind a real gRPC server."""
    require_tool("/usr/bin/bwrap", "bwrap")
    settings = SandboxSettings(work_root=str(tmp_path), max_timeout_seconds=120)
    servicer = SandboxServicer(LocalBackend(max_concurrency=2, work_root=str(tmp_path)), settings)
    server = grpc.aio.server()
    sandbox_pb2_grpc.add_SandboxServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield sandbox_pb2_grpc.SandboxServiceStub(channel)
    finally:
        await channel.close()
        await server.stop(None)
        servicer.close()


async def trial_reward(stub, answer: str | None) -> tuple[float, str | None]:
    """(reward, answer read) of one trial whose scripted scaffold writes `answer` (None: writes nothing)."""
    config = load_config(CONFIG)
    task = split_tasks(config, "train")[0]
    # The file the prompt tells the scaffold to write: the scripted scaffold takes it from the prompt.
    named = re.search(r"write f as an expression in x to (\S+)\.$", task.prompt)
    assert named and named.group(1) == config.env.scaffold.answer_file, task.prompt
    steps = ["python f.py 0", "python f.py 1"] + ([f"echo {answer} > {named.group(1)}"] if answer else [])
    scaffold = config.env.scaffold.model_copy(update={"command": " && ".join(steps), "package": None})
    limits = sandbox_pb2.Limits(**config.env.sandbox.model_dump())
    session = await SandboxSession.open(stub, "trial-1", files=dict(task.files), limits=limits, idle_timeout_seconds=60)
    try:
        run = await run_external(
            session,
            scaffold,
            endpoint_url="http://127.0.0.1:8080",
            api_key="dys-trial-1-unused",
            model="job-1",
            prompt=task.prompt,
            budget=Budget(max_turns=3, max_tokens=1024, seconds=60.0),
            max_new=128,
        )
    finally:
        await session.close()
    assert (run.error, run.outcome.finish_reason) == ("", "exit"), run.output_tail
    verdict = await environment(config).score(stub, task, run.outcome.answer or "", "trial-1", limits)
    reward, valid = reward_of(verdict, config.env.reward_terms[0][0])
    assert valid, verdict.error_message
    return reward, run.outcome.answer


async def test_the_right_answer_in_the_named_file_earns_1_and_a_wrong_one_0(sandbox):
    task = split_tasks(load_config(CONFIG), "train")[0]
    assert await trial_reward(sandbox, task.solution) == (1.0, task.solution)
    # Wrong at every point the tests read (the right function plus one).
    assert await trial_reward(sandbox, f"{task.solution}+1") == (0.0, f"{task.solution}+1")


async def test_a_scaffold_that_writes_no_answer_file_scores_the_empty_answer(sandbox):
    assert await trial_reward(sandbox, None) == (0.0, None)
