"""The policy endpoint on a real stack (`dockyard up`'s LocalStack with endpoint=True) and a running job.

The official openai and anthropic clients get text and tool-calling replies, streamed and not, from the tiny
job's policy (a random model: whatever it emits must come back as a valid reply, and a second turn must reuse
the first turn's tokens); bad input gets a clear 4xx while other sessions keep being served. Two replicas serve
the job: sessions spread over them and stick, the sessions of a replica that dies go on on the other, and a
session whose last replica dies ends as an infrastructure error.
"""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from dockyard.models.tokenizer import build_char_tokenizer
from dockyard.stack import LocalStack
from tests.integration.endpoint_stack import TOKEN, served_job, wait_until_replicas_serve

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    with served_job(tmp_path_factory.mktemp("logs"), tmp_path_factory.mktemp("runs"), replicas=2) as job:
        yield job.base, job.job_id, job.stack


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


def test_a_stream_arrives_token_by_token_from_the_replica(served) -> None:
    base, job, _ = served
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=TOKEN, max_retries=0)
    messages = [{"role": "user", "content": "count"}]
    headers = {"X-Dockyard-Session": "live"}
    chunks = list(
        client.chat.completions.create(
            model=job,
            messages=messages,
            max_tokens=32,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            extra_headers=headers,
        )
    )
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    finish = [i for i, c in enumerate(chunks) if c.choices and c.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == 32
    # Content came in several chunks, each before the final one: the replica's tokens as they were sampled
    # (the first at once, the rest at most every DOCKYARD_ROLLOUT_STREAM_INTERVAL_MS).
    assert len(texts) >= 2, texts
    assert finish == [len(chunks) - 2]  # then the usage chunk
    # The recorded completion is what was streamed: the same ids decode to the same content.
    turn = httpx.get(f"{base}/v1/sessions/live/trajectory", headers={"x-api-key": TOKEN}).json()
    (completion,) = turn["segments"][0]["turns"][0]["completions"]
    assert len(completion["token_ids"]) == 32
    assert build_char_tokenizer().decode(completion["token_ids"], skip_special_tokens=True) == "".join(texts)


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


def test_sessions_stick_spread_move_when_a_replica_dies_and_end_when_the_last_does(served) -> None:
    """Kills rollout-1, then rollout-2, and restarts both: the module's other tests may run after it.

    The sessions rollout-1 held go on on rollout-2, their trajectories whole and "ok"; a session whose last
    replica dies ends as an infrastructure error while the endpoint stays healthy.
    """
    base, job, stack = served
    try:
        _sessions_move_when_their_replica_dies(base, job, stack)
        _a_session_whose_last_replica_dies_ends_as_an_infrastructure_error(base, job, stack)
    finally:
        for name in ("rollout-1", "rollout-2"):
            if name in stack.dead():
                stack.restart(name)
    wait_until_replicas_serve(stack, job, replicas=2)


def _sessions_move_when_their_replica_dies(base: str, job: str, stack: LocalStack) -> None:
    headers = {"authorization": f"Bearer {TOKEN}"}
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=TOKEN, max_retries=0, timeout=120)
    histories: dict[str, list] = {}
    sessions = ("m1", "m2", "m3", "m4")

    def turn(session: str) -> None:
        messages = histories.setdefault(session, [])
        messages.append({"role": "user", "content": f"f({len(messages)})=?"})
        reply = client.chat.completions.create(
            model=job, messages=messages, max_tokens=6, seed=1, extra_headers={"X-Dockyard-Session": session}
        )
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})

    def routing() -> dict:
        return httpx.get(f"{base}/v1/routing", headers=headers).json()

    before = routing()
    held = {name: r["sessions"] for name, r in before["replicas"].items()}
    for session in sessions:
        turn(session)
    now = {name: r["sessions"] for name, r in routing()["replicas"].items()}
    spread = {name: now[name] - held.get(name, 0) for name in now}
    # New sessions go to the replica with fewer sessions: both get some, and the two end balanced.
    assert sorted(now) == ["rollout-1", "rollout-2"] and min(spread.values()) >= 1, (held, now)
    assert abs(now["rollout-1"] - now["rollout-2"]) <= 1, now
    for session in sessions:
        turn(session)
    after = routing()
    assert {name: r["sessions"] for name, r in after["replicas"].items()} == now  # each stayed on its replica
    assert after["moved_sessions"] == before["moved_sessions"] and after["retried_calls"] == before["retried_calls"]
    assert all(r["kv_capacity_tokens"] == 4096 for r in after["replicas"].values()), after

    stack.kill("rollout-1")
    for session in sessions:
        turn(session)  # the sessions of rollout-1 go on on rollout-2
    after = routing()
    assert after["moved_sessions"] - before["moved_sessions"] >= spread["rollout-1"], after
    assert after["replicas"]["rollout-2"]["sessions"] >= len(sessions), after
    for session in sessions:
        trajectory = httpx.get(f"{base}/v1/sessions/{session}/trajectory", headers=headers).json()
        assert trajectory["status"] == "ok" and trajectory["turns"] == 3, trajectory


def _a_session_whose_last_replica_dies_ends_as_an_infrastructure_error(base: str, job: str, stack: LocalStack) -> None:
    headers = {"authorization": f"Bearer {TOKEN}", "X-Dockyard-Session": "dies"}
    body = {"model": job, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    assert httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=60).status_code == 200
    stack.kill("rollout-2")
    lost = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert lost.status_code == 503 and lost.json()["error"]["type"] == "infrastructure_error", lost.text
    trajectory = httpx.get(f"{base}/v1/sessions/dies/trajectory", headers=headers).json()
    assert trajectory["status"] == "infrastructure_error" and trajectory["turns"] == 1
    assert httpx.get(f"{base}/health").status_code == 200
