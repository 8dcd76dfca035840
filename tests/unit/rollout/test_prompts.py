"""A Generate request's prompt: exactly one form, each bounded, the field at fault named."""

from __future__ import annotations

import pytest

from dockyard.api.rollout.v1 import rollout_pb2
from dockyard.models.tokenizer import build_char_tokenizer
from dockyard.rpc.errors import InvalidArgument
from services.rollout.engine import UnsupportedRequest
from services.rollout.prompts import MAX_MESSAGES, MAX_PROMPT_BYTES, MAX_PROMPT_TOKENS, prompt_from_request


def request(**fields) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(job_id="job-1", num_samples=1, **fields)


def message(role: str, content: str) -> rollout_pb2.ChatMessage:
    return rollout_pb2.ChatMessage(role=role, content=content)


class _Engine:
    """What PromptInput.resolve needs of an engine: render_chat over a real tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def render_chat(self, messages):
        from services.rollout.engine import GenerationEngine

        return GenerationEngine.render_chat(self, messages)


@pytest.mark.parametrize(
    "fields, given",
    [
        ({}, "none"),
        ({"prompt": "1+2=", "prompt_token_ids": [4, 5]}, "prompt, prompt_token_ids"),
        ({"prompt_token_ids": [4], "messages": [message("user", "hi")]}, "prompt_token_ids, messages"),
    ],
)
def test_exactly_one_prompt_form(fields, given) -> None:
    with pytest.raises(InvalidArgument, match=f"exactly one of prompt, prompt_token_ids, messages \\(got {given}\\)"):
        prompt_from_request(request(**fields))


def test_bounds_name_the_field() -> None:
    with pytest.raises(InvalidArgument, match="prompt is .* bytes"):
        prompt_from_request(request(prompt="x" * (MAX_PROMPT_BYTES + 1)))
    with pytest.raises(InvalidArgument, match="prompt_token_ids has .* ids"):
        prompt_from_request(request(prompt_token_ids=[5] * (MAX_PROMPT_TOKENS + 1)))
    with pytest.raises(InvalidArgument, match=r"prompt_token_ids\[2\] is -7"):
        prompt_from_request(request(prompt_token_ids=[5, 6, -7, 8]))
    with pytest.raises(InvalidArgument, match=r"messages\[1\].role is empty"):
        prompt_from_request(request(messages=[message("user", "a"), message("", "b")]))
    with pytest.raises(InvalidArgument, match="messages has .* entries"):
        prompt_from_request(request(messages=[message("user", "a")] * (MAX_MESSAGES + 1)))
    with pytest.raises(InvalidArgument, match="messages are .* bytes"):
        prompt_from_request(request(messages=[message("user", "x" * MAX_PROMPT_BYTES)]))


def test_each_form_resolves_to_what_the_engine_takes() -> None:
    engine = _Engine(build_char_tokenizer())
    assert prompt_from_request(request(prompt="1+2=")).resolve(engine) == "1+2="
    ids = prompt_from_request(request(prompt_token_ids=[9, 0, 9])).resolve(engine)
    assert ids == [9, 0, 9]  # as given: nothing added, nothing re-tokenized
    chat = prompt_from_request(request(messages=[message("user", "f(3)"), message("tool", "7")])).resolve(engine)
    assert engine.tokenizer.decode(chat) == "user: f(3)\ntool: 7\nassistant: "


def test_messages_need_a_chat_template() -> None:
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(UnsupportedRequest, match="^messages: the policy's tokenizer has no chat template"):
        prompt_from_request(request(messages=[message("user", "a")])).resolve(_Engine(tokenizer))


def test_a_template_that_raises_is_the_callers_error() -> None:
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(UnsupportedRequest, match="^messages: the chat template refused them: .*roles must alternate"):
        prompt_from_request(request(messages=[message("user", "a")])).resolve(_Engine(tokenizer))
