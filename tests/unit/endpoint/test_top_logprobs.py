"""top_logprobs through the official `openai` client (strict response validation) on the scripted backend:
chat completions streamed and not, the Responses API with `include`, a thinking budget's forced ids, and what
is refused by name."""

from __future__ import annotations

import math

import anthropic
import httpx
import openai
import pytest

from services.endpoint.app import create_app
from services.endpoint.settings import EndpointSettings
from tests.unit.endpoint.scripted import ALTERNATIVES, TOKEN, ScriptedBackend, an
from tests.unit.endpoint.thinking_tokenizer import build_thinking_tokenizer

MESSAGES = [{"role": "user", "content": "x"}]


def strict(app) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://endpoint")
    return openai.AsyncOpenAI(
        base_url="http://endpoint/v1", api_key=TOKEN, http_client=http, max_retries=0, _strict_response_validation=True
    )


def expected_alternatives(token: str, k: int) -> list[tuple[str, float, list[int]]]:
    """What the scripted backend answers for `token`, as the reply must write it (text, logprob, UTF-8 bytes)."""
    others = [c for c in ALTERNATIVES if c != token][: k - 1]
    pairs = [(token, -0.25)] + [(c, -2.5 - i) for i, c in enumerate(others)]
    return [(text, logprob, list(text.encode())) for text, logprob in pairs]


def check_tokens(entries, text: str, k: int, with_bytes: bool = True) -> None:
    """One entry per sampled token (the text's characters, then eos), each with its k alternatives in order."""
    assert [e.token for e in entries] == [*text, "<eos>"]
    for entry in entries:
        assert entry.logprob == -0.25
        got = [(t.token, t.logprob, t.bytes if with_bytes else None) for t in entry.top_logprobs]
        want = [(t, lp, b if with_bytes else None) for t, lp, b in expected_alternatives(entry.token, k)]
        assert got == want
        assert entry.top_logprobs[0].logprob >= entry.logprob  # most likely first, the sampled one among them


@pytest.mark.parametrize("k", [1, 3, 20])
async def test_chat_completion_reports_k_alternatives_per_token(app, backend, k: int) -> None:
    backend.script = ["hello"]
    reply = await strict(app).chat.completions.create(model="job-1", messages=MESSAGES, logprobs=True, top_logprobs=k)
    assert backend.top_logprobs == [k]  # Generate was asked for them
    choice = reply.choices[0]
    assert choice.message.content == "hello"
    check_tokens(choice.logprobs.content, "hello", k)


async def test_the_stream_carries_the_same_alternatives(app, backend) -> None:
    backend.script = ["abc", "xyz"]
    stream = await strict(app).chat.completions.create(
        model="job-1", messages=MESSAGES, logprobs=True, top_logprobs=4, n=2, stream=True
    )
    by_choice: dict[int, list] = {0: [], 1: []}
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs is not None:
                by_choice[choice.index] += choice.logprobs.content
    assert backend.top_logprobs == [4]
    check_tokens(by_choice[0], "abc", 4)
    check_tokens(by_choice[1], "xyz", 4)


async def test_logprobs_without_top_logprobs_ask_for_none(app, backend) -> None:
    reply = await strict(app).chat.completions.create(model="job-1", messages=MESSAGES, logprobs=True)
    assert backend.top_logprobs == [0]
    content = reply.choices[0].logprobs.content
    assert [e.token for e in content] == ["o", "k", "<eos>"] and all(e.top_logprobs == [] for e in content)
    plain = await strict(app).chat.completions.create(model="job-1", messages=MESSAGES)
    assert plain.choices[0].logprobs is None and backend.top_logprobs == [0, 0]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"top_logprobs": 2}, "top_logprobs: set logprobs to true"),
        ({"logprobs": False, "top_logprobs": 2}, "top_logprobs: set logprobs to true"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ],
)
async def test_bad_chat_requests_are_refused_by_name(app, backend, fields: dict, message: str) -> None:
    with pytest.raises((openai.BadRequestError, openai.UnprocessableEntityError)) as info:
        await strict(app).chat.completions.create(model="job-1", messages=MESSAGES, **fields)
    assert message in str(info.value.body)
    assert backend.top_logprobs == []  # no replica was asked


async def test_responses_include_logprobs_with_alternatives(app, backend) -> None:
    backend.script = ["hi", "hi"]
    include = ["message.output_text.logprobs"]
    reply = await strict(app).responses.create(model="job-1", input="x", include=include, top_logprobs=2)
    [message] = reply.output
    check_tokens(message.content[0].logprobs, "hi", 2)
    assert reply.top_logprobs == 2 and backend.top_logprobs == [2]
    stream = await strict(app).responses.create(model="job-1", input="x", include=include, top_logprobs=2, stream=True)
    events = [event async for event in stream]
    delta = next(e for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    check_tokens(delta.logprobs, "hi", 2, with_bytes=False)
    check_tokens(done.logprobs, "hi", 2, with_bytes=False)
    final = events[-1].response.output[0].content[0]
    check_tokens(final.logprobs, "hi", 2)
    # Without `include`, no logprobs and none asked for.
    plain = await strict(app).responses.create(model="job-1", input="x")
    assert plain.output[0].content[0].logprobs == [] and backend.top_logprobs[-1] == 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"top_logprobs": 3}, "top_logprobs: add 'message.output_text.logprobs' to `include`"),
        ({"include": ["reasoning.encrypted_content"]}, "include[0]: 'reasoning.encrypted_content' is not supported"),
    ],
)
async def test_bad_responses_requests_are_refused_by_name(app, backend, fields: dict, message: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await strict(app).responses.create(model="job-1", input="x", **fields)
    assert info.value.body["message"].startswith(message)
    assert backend.top_logprobs == []


async def test_anthropic_messages_have_no_such_field(app, backend) -> None:
    with pytest.raises(anthropic.BadRequestError, match="top_logprobs: not a field"):
        await an(app).messages.create(model="job-1", max_tokens=8, messages=MESSAGES, extra_body={"top_logprobs": 2})
    assert backend.top_logprobs == []


def test_scripted_alternatives_are_a_distribution_prefix() -> None:
    """The stand-in's numbers are ones a policy could give: k most likely first, total mass below 1."""
    pairs = expected_alternatives("a", 20)
    assert len(pairs) == 20 and sum(math.exp(lp) for _, lp, _ in pairs) < 1.0
    assert [lp for _, lp, _ in pairs] == sorted((lp for _, lp, _ in pairs), reverse=True)


async def test_a_thinking_budgets_forced_ids_have_no_alternatives() -> None:
    """Both Generate calls of a budgeted reply ask for the alternatives; the closing tag the endpoint forced
    was not sampled, so its entries carry logprob 0.0 and none."""
    backend = ScriptedBackend(build_thinking_tokenizer(), reasoning=True, limits=True)
    app = create_app(EndpointSettings(max_body_bytes=64 * 1024), TOKEN, backend)
    backend.script = ["<think>long long reasoning</think>never", "the answer"]
    reply = await strict(app).chat.completions.create(
        model="job-1", messages=MESSAGES, max_tokens=40, reasoning_effort="low", logprobs=True, top_logprobs=3
    )
    assert backend.top_logprobs == [3, 3]
    entries = reply.choices[0].logprobs.content
    forced = "\n</think>\n\n"
    budget = backend.sampling[0].max_new_tokens
    assert "".join(e.token for e in entries[budget : budget + len(forced)]) == forced
    for i, entry in enumerate(entries):
        if budget <= i < budget + len(forced):
            assert entry.logprob == 0.0 and entry.top_logprobs == []
        else:
            assert entry.logprob == -0.25 and len(entry.top_logprobs) == 3
            assert entry.top_logprobs[0].token == entry.token
