"""The verifiers runner ends a rollout on the endpoint's budget refusals only: a turn past the trial's turns
(429) or context (400 generate_refused) is scored as the rollout stands; any other refusal is the runner's
own failure, raised (a scaffold error, masked), never scored as if the budget had run out."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import openai
import pytest

from dockyard.agents.verifiers_runner import rollout


class _Refusing:
    """An AsyncOpenAI whose chat.completions.create answers with one error body."""

    def __init__(self, status: int, code: str) -> None:
        self.chat = SimpleNamespace(completions=self)
        self.status, self.code = status, code

    async def create(self, **_):
        response = httpx.Response(self.status, request=httpx.Request("POST", "http://endpoint/v1/chat/completions"))
        body = {"type": "invalid_request_error", "message": "refused", "code": self.code}
        raise openai.APIStatusError("refused", response=response, body=body)


def _rollout(status: int, code: str) -> int:
    messages = [{"role": "user", "content": "f(0)=1"}]
    return asyncio.run(rollout(_Refusing(status, code), "job", messages, SimpleNamespace(schemas=[]), 4, 16))


@pytest.mark.parametrize(("status", "code"), [(429, "session_limit"), (400, "generate_refused")])
def test_a_budget_refusal_ends_the_rollout_for_scoring(status: int, code: str) -> None:
    assert _rollout(status, code) == 0


OTHER_REFUSALS = [(400, "invalid_request"), (422, "invalid_value"), (401, "invalid_api_key")]


@pytest.mark.parametrize(("status", "code"), OTHER_REFUSALS)
def test_any_other_refusal_is_the_runners_failure(status: int, code: str) -> None:
    with pytest.raises(openai.APIStatusError):
        _rollout(status, code)
