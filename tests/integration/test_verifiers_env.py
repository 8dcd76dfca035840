"""A verifiers environment (examples/verifiers_env) runs as a trial does: in a docker session whose only route
is the policy endpoint, under its own interpreter, through the real openai client; the endpoint records
its calls token for token and its rubric's reward is the trial's.

The session image is the sandbox image plus verifiers 0.4.0 and the example's package (a local folder,
built into a wheel of the wheelhouse), built from the wheelhouse the first time. The endpoint is the
real app (services/endpoint/app.py: its recorder and Hermes parser) served on the host; its model is a
scripted one that solves the task from what its prompt shows: the tool mode reads f(0), f(1), f(2) with
the tool `f`, then answers; the single-turn mode answers at once. Each run goes through
`run_external` (the agent worker's path) with the runner's variables of `verifiers_rows`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from dockyard.agents.external import run_external
from dockyard.agents.scaffold import Budget
from dockyard.agents.session import SandboxSession
from dockyard.api.common.v1 import common_pb2
from dockyard.api.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from dockyard.config.verifiers import VerifiersConfig, runner_scaffold
from dockyard.rpc.client import connect
from dockyard.tasks import verifiers_rows
from services.endpoint.app import create_app
from services.endpoint.settings import EndpointSettings
from tests.conftest import REPO_ROOT, docker_sandbox_env
from tests.unit.endpoint.scripted import TOKEN, ScriptedBackend

# The image is built on first use (about 2 minutes: verifiers' 98 wheels); each run imports verifiers.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

PACKAGE = "./examples/verifiers_env"
SECONDS = 120.0


def config(mode: str) -> VerifiersConfig:
    return VerifiersConfig(
        package=PACKAGE, module="dockyard_verifiers_example", args={"mode": mode, "split": "train", "size": 64}
    )


def solve(points: dict[int, int]) -> str:
    """f from f(0), f(1), f(2): the example's functions are a*x+b or a*x*x+b."""
    curve = (points[2] - 2 * points[1] + points[0]) // 2
    return f"{curve}*x*x+{points[0]}" if curve else f"{points[1] - points[0]}*x+{points[0]}"


class SolvingBackend(ScriptedBackend):
    """Replies as a policy that reads f(0..2) and answers f (or `wrong`, when set), from its prompt's text."""

    wrong = ""

    async def complete(self, job_id, session, prompt_ids, n, sampling, *args, **kwargs):
        text = self.model_.renderer.decode(prompt_ids)
        seen = {int(x): int(y) for x, y in re.findall(r"f\((\d+)\)=(-?\d+)", text)}
        if len(seen) < 3:
            call = {"name": "f", "arguments": {"x": len(seen)}}
            reply = "<tool_call>" + json.dumps(call) + "</tool_call>"
        else:
            reply = "f(x)=" + (self.wrong or solve(seen))
        self.script = [reply] * n
        return await super().complete(job_id, session, prompt_ids, n, sampling, *args, **kwargs)


@pytest.fixture
def endpoint():
    backend = SolvingBackend()
    backend.model_.max_new_tokens = 64
    app = create_app(EndpointSettings(), TOKEN, backend)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield backend, port
    server.should_exit = True
    thread.join(10)


@pytest.fixture
def sandbox(start_service, docker_sandbox_image):
    return start_service("sandbox", docker_sandbox_env(docker_sandbox_image, project_root=str(REPO_ROOT / "examples")))


def trial(sandbox_address: str, port: int, verifiers: VerifiersConfig, row: int):
    """One trial's run: (the ScaffoldRun, the endpoint's recording of its session)."""
    base = f"http://127.0.0.1:{port}"
    auth = {"authorization": f"Bearer {TOKEN}"}
    opened = httpx.post(f"{base}/v1/sessions", headers=auth).json()
    task = verifiers_rows.make_tasks("train", 64, 0, verifiers.module)[0]
    task = dataclasses.replace(task, task_id=f"verifiers-train-{row:06d}")

    async def body():
        async with connect(sandbox_address) as channel:
            stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
            limits = sandbox_pb2.Limits(timeout_seconds=SECONDS, memory_mb=1024, cpu_seconds=SECONDS)
            session = await SandboxSession.open(
                stub,
                opened["session_id"],
                files={},
                limits=limits,
                endpoint_address=f"127.0.0.1:{port}",
                packages=verifiers.requirements,
            )
            try:
                return await run_external(
                    session,
                    runner_scaffold(),
                    endpoint_url=session.endpoint_url,
                    api_key=opened["api_key"],
                    model="job-1",
                    prompt=task.prompt,
                    budget=Budget(max_turns=6, max_tokens=1024, seconds=SECONDS),
                    max_new=64,
                    extra=verifiers_rows.runner_environment(verifiers, task),
                )
            finally:
                await session.close()

    run = asyncio.run(body())
    recorded = httpx.get(f"{base}/v1/sessions/{opened['session_id']}/trajectory", headers=auth).json()
    return run, recorded


def test_a_multi_turn_verifiers_rollout_with_a_tool_is_recorded_and_scored_by_its_rubric(sandbox, endpoint):
    backend, port = endpoint
    run, recorded = trial(sandbox.address, port, config("tool"), row=3)
    assert run.error == "", run.output_tail
    result = json.loads(run.outcome.answer)
    # The rubric's reward is the trial's: the right f earns 1 on every point, PASSED.
    assert result["rewards"] == {"correct": 1.0} and result["turns"] == 4, result
    assert verifiers_rows.result_error(run.outcome.answer) == ""
    assert verifiers_rows.verdict(run.outcome.answer).status == common_pb2.VERDICT_STATUS_PASSED
    # Token-faithful: one segment (the conversation only grew), its sampled tokens exactly the four replies.
    [segment] = recorded["segments"]
    assert recorded["turns"] == 4
    renderer = backend.model_.renderer
    sampled = [t for t, m in zip(segment["token_ids"], segment["loss_mask"], strict=True) if m]
    text = renderer.decode(sampled)
    # What the model wrote, each reply with its <eos>: three calls of f(0), f(1), f(2), then the answer.
    calls = re.findall(r"<tool_call>(.*?)</tool_call>", text)
    assert [json.loads(c)["arguments"] for c in calls] == [{"x": 0}, {"x": 1}, {"x": 2}], text
    assert text.count(renderer.tokenizer.eos_token) == 4 and re.search(r"f\(x\)=-?\d+\*x", text), text
    # The tool's results reached the model as context, not trained: the prompt holds them, the sampled text not.
    context = renderer.decode([t for t, m in zip(segment["token_ids"], segment["loss_mask"], strict=True) if not m])
    assert "find f(x)." in context and "tool: f(0)=" in context and "tools: f(x)" in context, context
    assert "tool:" not in text


def test_a_single_turn_rollout_is_the_rows_prompt_and_a_wrong_answer_scores_its_fraction(sandbox, endpoint):
    backend, port = endpoint
    backend.wrong = "x"  # agrees with no f of the example on all points: a fraction below 1
    run, recorded = trial(sandbox.address, port, config("single"), row=5)
    assert run.error == "", run.output_tail
    result = json.loads(run.outcome.answer)
    assert result["turns"] == 1 and 0.0 <= result["reward"] < 1.0, result
    verdict = verifiers_rows.verdict(run.outcome.answer)
    assert verdict.status == common_pb2.VERDICT_STATUS_FAILED
    assert verdict.tests_passed / verdict.tests_total == pytest.approx(result["reward"])
    [segment] = recorded["segments"]
    prompt = backend.model_.renderer.decode(
        [t for t, m in zip(segment["token_ids"], segment["loss_mask"], strict=True) if not m]
    )
    # The row's own prompt (f at 0..5, then f(x)=), no tool line.
    assert re.search(r"user: f\(0\)=-?\d+ f\(1\)=-?\d+ .* f\(5\)=-?\d+\nf\(x\)=", prompt), prompt
    assert "tools:" not in prompt


def test_a_rubric_that_raises_is_the_trials_error_not_a_reward(sandbox, endpoint):
    _, port = endpoint
    # The example's `broken` variant: the same tasks, a reward function that raises.
    verifiers = VerifiersConfig(
        package=PACKAGE,
        module="dockyard_verifiers_example.broken",
        args={"mode": "single"},
    )
    run, _ = trial(sandbox.address, port, verifiers, row=0)
    assert run.error == "", run.output_tail
    error = verifiers_rows.result_error(run.outcome.answer)
    assert error.startswith("the rubric raised") and "ZeroDivisionError" in error, run.outcome.answer
    assert verifiers_rows.verdict(run.outcome.answer).status == common_pb2.VERDICT_STATUS_ERROR
