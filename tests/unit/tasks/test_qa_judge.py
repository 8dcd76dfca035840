"""The hle model judge over real HTTP: an OpenAI-compatible server on loopback answers with scripted replies.

yes ─> PASSED, no ─> FAILED; a reply without `correct:`, a 500, a refused connection ─> ERROR (masked);
the judge is asked only about what the sandbox's answer rules reject.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import socket
import threading
from collections.abc import Iterator

import pytest

from dockyard.api.common.v1 import common_pb2
from dockyard.api.sandbox.v1 import sandbox_pb2
from dockyard.config import ConfigError, load_config
from dockyard.tasks import qa
from dockyard.tasks.envs import Environment, judge_for
from dockyard.tasks.qa_judge import Judge, JudgeFailed, parse_judgement, render
from services.coordinator.rewards import reward_of
from tests.conftest import REPO_ROOT

CONFIG = REPO_ROOT / "examples" / "configs" / "grpo_hle.yaml"
PASSED, FAILED, ERROR = (
    common_pb2.VERDICT_STATUS_PASSED,
    common_pb2.VERDICT_STATUS_FAILED,
    common_pb2.VERDICT_STATUS_ERROR,
)


class Scripted(http.server.BaseHTTPRequestHandler):
    replies: list[tuple[int, str]] = []
    seen: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        type(self).seen.append(body)
        status, text = type(self).replies.pop(0)
        payload = {
            "id": "c",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        }
        data = json.dumps(payload if status == 200 else {"error": {"message": text}}).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    Scripted.replies, Scripted.seen = [], []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def judge_at(address: str) -> Judge:
    config = load_config(CONFIG, ["env.judge.enabled=true", "env.judge.timeout_seconds=10"])
    judge = judge_for(config, "job-1", address, "secret")
    assert judge is not None and judge.base_url == f"http://{address}/v1" and judge.model == "job-1"
    return judge


def test_the_judges_yes_and_no_are_verdicts_and_its_prompt_carries_the_three_texts(server: str):
    Scripted.replies = [
        (200, "extracted_final_answer: 1/2\nreasoning: same value\ncorrect: yes"),
        (200, "extracted_final_answer: 3\n**correct:** No"),
    ]
    judge = judge_at(server)
    yes = asyncio.run(judge.verdict("What is 2/4?", "Answer: one half", "0.5"))
    no = asyncio.run(judge.verdict("What is 2/4?", "Answer: 3", "0.5"))
    assert (yes.status, yes.tests_passed, yes.tests_total) == (PASSED, 1, 1) and "'1/2'" in yes.stdout
    assert (no.status, no.tests_passed, no.tests_total) == (FAILED, 0, 1)
    prompt = Scripted.seen[0]["messages"][0]["content"]
    assert "What is 2/4?" in prompt and "Answer: one half" in prompt and "[correct_answer]: 0.5" in prompt
    assert Scripted.seen[0]["model"] == "job-1" and Scripted.seen[0]["temperature"] == 0.0


@pytest.mark.parametrize(
    ("reply", "words"),
    [((200, "I think it is right."), "no 'correct: yes|no' line"), ((500, "replica lost"), "InternalServerError")],
)
def test_a_judge_failure_is_an_error_verdict_masked_never_a_zero(server: str, reply, words: str):
    Scripted.replies = [reply, reply]  # the client retries once
    verdict = asyncio.run(judge_at(server).verdict("q", "Answer: x", "y"))
    assert verdict.status == ERROR and words in verdict.error_message
    assert reward_of(verdict, "all_pass") == (0.0, False)  # invalid: masked out of the group


def test_an_unreachable_endpoint_is_an_error_verdict():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    verdict = asyncio.run(judge_at(f"127.0.0.1:{port}").verdict("q", "Answer: x", "y"))
    assert verdict.status == ERROR and "APIConnectionError" in verdict.error_message


class RulesSay:
    """A sandbox whose RunTests answers one scripted verdict."""

    def __init__(self, status: int) -> None:
        self.status = status

    async def RunTests(self, request, timeout=None):  # noqa: N802 (the RPC's name)
        return sandbox_pb2.RunTestsResponse(verdict=common_pb2.Verdict(status=self.status, tests_total=1))


def test_the_judge_is_asked_only_about_what_the_rules_reject(server: str):
    task = qa.load_rows(REPO_ROOT / "examples" / "tasks" / "qa" / "train.jsonl")[0]
    env = Environment("hle", judge=judge_at(server))
    limits = sandbox_pb2.Limits(timeout_seconds=5)
    Scripted.replies = [(200, "correct: yes")]
    assert asyncio.run(env.score(RulesSay(PASSED), task, "Answer: 15", "r", limits)).status == PASSED
    assert Scripted.seen == []  # the rules accepted it: no model call
    judged = asyncio.run(env.score(RulesSay(FAILED), task, "Answer: fifteen", "r", limits))
    assert judged.status == PASSED and len(Scripted.seen) == 1
    assert f"[correct_answer]: {task.answer}" in Scripted.seen[0]["messages"][0]["content"]


def test_parsing_and_rendering():
    assert parse_judgement("correct: no\nwait\ncorrect: YES") == (True, "")
    with pytest.raises(JudgeFailed):
        parse_judgement("incorrect")
    # A response holding a placeholder of its own is not filled in again.
    assert render("{question}|{response}|{correct_answer}", "a{response}", "b", "c") == "a{response}|b|c"


def test_judge_config_rules():
    assert judge_for(load_config(CONFIG), "j", "127.0.0.1:1", "") is None  # off by default
    with pytest.raises(ConfigError, match="must hold {correct_answer}"):
        load_config(CONFIG, ["env.judge.prompt_template='Is {response} right for {question}?'"])
    with pytest.raises(ConfigError, match="env.judge grades question answering"):
        load_config(REPO_ROOT / "examples" / "configs" / "tiny_expr.yaml", ["env.judge.enabled=true"])
