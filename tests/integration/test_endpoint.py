"""The policy endpoint on a real stack (`dockyard up`'s LocalStack with endpoint=True) and a running job.

The official openai and anthropic clients get text and tool-calling replies, streamed and not, from the tiny
job's policy (a random model: whatever it emits must come back as a valid reply, and a second turn must reuse
the first turn's tokens); bad input gets a clear 4xx while other sessions keep being served.
"""

from __future__ import annotations

import asyncio
import time

import anthropic
import httpx
import openai
import pytest

from dockyard.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from dockyard.config import load_config
from dockyard.rpc.auth import AuthSettings
from dockyard.rpc.client import connect
from dockyard.stack import LocalStack
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.slow

TOKEN = "endpoint-test-token"
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    runs = tmp_path_factory.mktemp("runs")
    stack = LocalStack(
        tmp_path_factory.mktemp("logs"), free_ports=True, endpoint=True, extra_env={"DOCKYARD_AUTH_TOKEN": TOKEN}
    )
    stack.start()
    try:
        cfg = load_config(
            REPO_ROOT / "examples" / "configs" / "tiny_expr.yaml",
            [
                "policy.model_name=null",
                "policy.bootstrap=null",
                "policy.model.max_position_embeddings=512",  # room for a tools line
                "grpo.max_num_steps=100000",
                f"logger.log_dir={runs}",
            ],
        )

        async def create() -> str:
            async with connect(stack.address("coordinator"), auth=AuthSettings(auth_token=TOKEN)) as channel:
                stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
                reply = await stub.CreateJob(coordinator_pb2.CreateJobRequest(config_yaml=cfg.resolved_yaml()))
                return reply.job.job_id

        job_id = asyncio.run(create())
        base = f"http://{stack.address('endpoint')}"
        headers = {"authorization": f"Bearer {TOKEN}"}
        body = {"model": job_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        deadline = time.monotonic() + 180
        while True:  # until the job runs and a replica holds its policy
            reply = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=60)
            if reply.status_code == 200:
                break
            assert reply.status_code in (404, 503), reply.text
            assert time.monotonic() < deadline, reply.text
            time.sleep(1)
        yield base, job_id, stack
    finally:
        stack.stop()


def test_openai_client_text_and_tools_streaming_and_not(served) -> None:
    base, job, _ = served
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=TOKEN, max_retries=0)
    assert job in [m.id for m in client.models.list().data]
    messages = [{"role": "user", "content": "f(0)=1 f(1)=3"}]
    reply = client.chat.completions.create(
        model=job,
        messages=messages,
        max_tokens=12,
        logprobs=True,
        n=2,
        seed=1,
        extra_headers={"X-Dockyard-Session": "oa"},
    )
    assert len(reply.choices) == 2 and reply.usage.completion_tokens > 0
    assert all(isinstance(c.message.content, str) for c in reply.choices)
    assert all(lp.logprob <= 0 for lp in reply.choices[0].logprobs.content)
    # Second turn of the session: its prompt starts with the first turn's recorded tokens.
    messages += [reply.choices[1].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
    client.chat.completions.create(
        model=job, messages=messages, max_tokens=4, extra_headers={"X-Dockyard-Session": "oa"}
    )
    trajectory = httpx.get(f"{base}/v1/sessions/oa/trajectory", headers={"x-api-key": TOKEN}).json()
    first, second = trajectory["segments"][0]["turns"]
    assert first["chosen"] == 1 and len(trajectory["segments"]) == 1
    recorded = first["prompt_token_ids"] + first["completions"][1]["token_ids"]
    assert second["prompt_token_ids"][: len(recorded)] == recorded
    with_tools = client.chat.completions.create(model=job, messages=messages[:1], tools=TOOLS, max_tokens=12)
    message = with_tools.choices[0].message
    assert message.content is not None or message.tool_calls
    chunks = list(
        client.chat.completions.create(model=job, messages=messages[:1], tools=TOOLS, max_tokens=8, stream=True)
    )
    assert chunks[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_anthropic_client_streaming_and_not(served) -> None:
    base, job, _ = served
    client = anthropic.Anthropic(base_url=base, api_key=TOKEN, max_retries=0)
    tools = [{"name": "add", "input_schema": {"type": "object"}}]
    reply = client.messages.create(
        model=job, max_tokens=8, system="be brief", messages=[{"role": "user", "content": "hi"}], tools=tools
    )
    assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use") and reply.content
    with client.messages.stream(model=job, max_tokens=8, messages=[{"role": "user", "content": "hi"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.content[0].text == text and final.usage.output_tokens > 0


def test_bad_input_gets_4xx_and_other_sessions_are_served(served) -> None:
    base, job, _ = served
    headers = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
    url = f"{base}/v1/chat/completions"
    assert httpx.post(url, content=b'{"model": ', headers=headers).status_code == 400
    big = {"model": job, "messages": [{"role": "user", "content": "x" * (10 * 1024 * 1024)}]}
    assert httpx.post(url, json=big, headers=headers, timeout=60).status_code == 413
    unknown = httpx.post(
        url, json={"model": "no-such-job", "messages": [{"role": "user", "content": "x"}]}, headers=headers
    )
    assert unknown.status_code == 404 and "no such job" in unknown.json()["error"]["message"]
    body = {"model": job, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    assert httpx.post(url, json=body).status_code == 401
    assert httpx.post(url, json=body, headers=headers, timeout=60).status_code == 200


def test_a_replica_that_dies_mid_session_ends_it_as_an_infrastructure_error(served) -> None:
    """Last in this module: it kills the only replica."""
    base, job, stack = served
    headers = {"authorization": f"Bearer {TOKEN}", "X-Dockyard-Session": "dies"}
    body = {"model": job, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    assert httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=60).status_code == 200
    stack.kill("rollout")
    lost = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert lost.status_code == 503 and lost.json()["error"]["type"] == "infrastructure_error", lost.text
    trajectory = httpx.get(f"{base}/v1/sessions/dies/trajectory", headers=headers).json()
    assert trajectory["status"] == "infrastructure_error" and trajectory["turns"] == 1
    assert httpx.get(f"{base}/health").status_code == 200
