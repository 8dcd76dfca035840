"""A scripted stand-in for the endpoint's backend, and clients bound to an app in process.

ScriptedBackend serves one job ("job-1") on the character tokenizer (or the one it is given); each call to
`complete` answers with the next text of `script` (then "ok"), ending in eos, every token at logprob -0.25.
With `limits`, a call also ends as a replica's would: at the first of its stop strings (kept, "stop") or
after its max_new_tokens ("length"). Asked for top_logprobs = k, each token's alternatives are itself at
-0.25 then the first letters of ALTERNATIVES that differ from it, at -2.5, -3.5, ... (k in all).
With `routing_shape` set, a call that asks for routing returns a row for every prompt position and every
completion token but the last, each naming its position (layer 0: position % 256, position // 256) and the
call that ran it (layer 1: the call's number, from 0, twice): a replica without a prefix cache.
A streamed call (`on_tokens`) passes each completion's tokens on one at a time, `token_seconds` apart, as
a replica's GenerateStream would, then answers the same.
"""

from __future__ import annotations

import asyncio

import anthropic
import httpx
import httpx2
import openai

from dockyard.api.rollout.v1 import rollout_pb2
from dockyard.config import SamplingConfig
from dockyard.experience.routing_layout import RoutingShape
from dockyard.models.tokenizer import build_char_tokenizer
from services.endpoint.backend import Generated, JobModel, ReplicaLost, UnknownModel
from services.endpoint.rendering import Renderer
from services.endpoint.routing import Replica, Router

TOKEN = "sekret"
CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
OA_TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
AN_TOOLS = [{"name": "add", "input_schema": {"type": "object"}}]
ALTERNATIVES = "xyzwvutsrqponmlkjihgfedcba"


class ScriptedBackend:
    def __init__(self, tokenizer=None, reasoning: bool = False, limits: bool = False) -> None:
        renderer = Renderer(tokenizer or build_char_tokenizer())
        self.model_ = JobModel("job-1", renderer, "hermes", 16, sampling=SamplingConfig(), reasoning=reasoning)
        self.limits = limits
        self.sampling: list = []  # each call's SamplingParams
        self.script: list[str] = []
        self.prompts: list[list[int]] = []
        self.images: list = []  # what each call carried besides ids (Prompted), or None
        self.top_logprobs: list[int] = []  # what each call asked Generate's top_logprobs to be
        self.lose = False
        self.token_seconds = 0.0  # a streamed call's pause before each token
        self.streamed = 0  # streamed calls answered
        self.cancelled = 0  # streamed calls cancelled before their last token
        self.lose_after: int | None = None  # a streamed call's replica dies after this many tokens
        self.router = Router()
        self.routing_shape: RoutingShape | None = None
        self.calls = 0  # calls answered (the routing rows' call number)

    async def close(self) -> None: ...

    async def running_jobs(self):
        from dockyard.api.coordinator.v1 import coordinator_pb2

        return [coordinator_pb2.Job(job_id="job-1", state=coordinator_pb2.JOB_STATE_RUNNING)]

    async def model(self, job_id: str) -> JobModel:
        if job_id != "job-1":
            raise UnknownModel(f"model {job_id!r}: no such job")
        return self.model_

    async def complete(
        self, job_id, session, prompt_ids, n, sampling, images=None, on_tokens=None, *, top_logprobs=0, routing=False
    ) -> Generated:
        self.router.route(session, [Replica("rollout", "127.0.0.1:1")], len(prompt_ids))
        if self.lose:
            raise ReplicaLost("replica rollout failed mid-session: UNAVAILABLE")
        self.prompts.append(list(prompt_ids))
        self.sampling.append(sampling)
        self.images.append(images)
        self.top_logprobs.append(top_logprobs)
        if images is not None:  # the rollout's processor would insert image tokens: 3 per image here
            prompt_ids = [9] * (3 * len(images.images)) + list(prompt_ids)
        renderer = self.model_.renderer
        completions = []
        for _ in range(n):
            text = self.script.pop(0) if self.script else "ok"
            ids, finish = renderer.encode(text) + [renderer.eos_token_id], "eos"
            if self.limits:
                ids, finish = _limited(text, ids, sampling, renderer)
            tops = [self._alternatives(token, top_logprobs) for token in ids] if top_logprobs else []
            completions.append(
                rollout_pb2.Completion(
                    token_ids=ids, logprobs=[-0.25] * len(ids), text=text, finish_reason=finish, top_logprobs=tops
                )
            )
        if on_tokens is not None:
            self.streamed += 1
            try:
                for t in range(max(len(c.token_ids) for c in completions)):
                    for i, c in enumerate(completions):
                        if t < len(c.token_ids):
                            if t == self.lose_after:
                                raise ReplicaLost("replica rollout failed mid-session: UNAVAILABLE")
                            await asyncio.sleep(self.token_seconds)
                            on_tokens(i, [c.token_ids[t]], [c.logprobs[t]])
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        call, self.calls = self.calls, self.calls + 1
        if not (routing and self.routing_shape):
            return Generated(list(prompt_ids), completions, 7, [7], "rollout")
        for c in completions:
            c.routing = rows(range(len(prompt_ids), len(prompt_ids) + len(c.token_ids) - 1), call)
        return Generated(
            list(prompt_ids), completions, 7, [7], "rollout", rows(range(len(prompt_ids)), call), self.routing_shape
        )

    def _alternatives(self, token: int, k: int) -> rollout_pb2.TopLogprobs:
        others = [t for t in self.model_.renderer.encode(ALTERNATIVES) if t != token][: k - 1]
        logprobs = [-0.25] + [-2.5 - i for i in range(len(others))]
        return rollout_pb2.TopLogprobs(token_ids=[token, *others], logprobs=logprobs)


def rows(positions: range, call: int) -> bytes:
    """The scripted routing rows of `positions` run by call number `call` (shape 2 layers × top 2 of 256)."""
    return b"".join(bytes([p % 256, p // 256, call, call]) for p in positions)


def _limited(text: str, ids: list[int], sampling, renderer: Renderer) -> tuple[list[int], str]:
    """The completion a replica would return under `sampling`'s stop strings and max_new_tokens."""
    ends = [(text.find(s) + len(s), "stop") for s in sampling.stop if s in text]
    if ends:
        end, _ = min(ends)
        ids, finish = renderer.encode(text[:end]), "stop"
    else:
        finish = "eos"
    if len(ids) > sampling.max_new_tokens:
        return ids[: sampling.max_new_tokens], "length"
    return ids, finish


def oa(app, key: str = TOKEN) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://endpoint")
    return openai.AsyncOpenAI(base_url="http://endpoint/v1", api_key=key, http_client=http, max_retries=0)


def an(app, key: str = TOKEN) -> anthropic.AsyncAnthropic:
    # This anthropic release is built on httpx2 (httpx's successor), openai on httpx.
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://endpoint")
    return anthropic.AsyncAnthropic(base_url="http://endpoint", api_key=key, http_client=http, max_retries=0)
