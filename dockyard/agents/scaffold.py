"""The built-in scaffold: a small tool-calling loop that talks to the policy endpoint as any client would.

    messages = [user: task prompt]
    repeat ≤ max_turns:  chat.completions.create(model, messages, tools)  ──> assistant message
        no tool call        → the trial ends; its text is the answer (an invalid call is such a reply:
                              the endpoint returns it as text and counts it, dockyard/agents/tool_calls.py)
        tool calls          → each runs through the Toolbox (judged again by the same rule);
                              `submit` ends the trial with its answer
        else                → tool results appended, next turn

Guarantees: it uses only the public `openai` client (AsyncOpenAI, chat.completions.create), so what
it does an external scaffold can do, except that a validation trial (temperature 0) asks for greedy
decoding (SAMPLING_HEADER, the service token's only); every other turn is sampled with the job's
settings, which the endpoint enforces whatever a client sends, and a seed derived from the trial's
seed and the turn number (a resumed job samples alike); the trial ends
with finish_reason "submit" or "answer", or, when a budget runs out, "turns", "tokens" (the
endpoint's usage says the sequence reached `max_tokens`, or a 400 says the prompt outgrew the model's
context) or "time" (checked before each turn and
bounding each call); a turn the endpoint could not serve (a 5xx, a lost connection, a time-out)
raises TrialLost, and a refused one (another 4xx) TrialRefused: neither is ever trained on.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import openai

from dockyard.agents.contract import SAMPLING_GREEDY, SAMPLING_HEADER
from dockyard.agents.tools import Toolbox, schemas
from dockyard.config import SamplingConfig, ToolConfig


class TrialLost(RuntimeError):
    """The endpoint (or the replica behind it) failed mid-trial: an infrastructure failure."""


class TrialRefused(ValueError):
    """The endpoint refused a turn (a 4xx other than the session's turn limit)."""


@dataclass(frozen=True)
class Budget:
    max_turns: int
    max_tokens: int  # of the trial's whole sequence
    seconds: float


@dataclass
class Outcome:
    answer: str | None
    finish_reason: str  # submit, answer, turns, tokens, time
    turns: int
    messages: list[dict[str, Any]] = field(default_factory=list)
    model_seconds: float = 0.0  # waiting on the endpoint
    tool_seconds: float = 0.0  # waiting on the tools (the sandbox)


async def run_scaffold(
    client: openai.AsyncOpenAI,
    model: str,
    prompt: str,
    tools: list[ToolConfig],
    toolbox: Toolbox,
    sampling: SamplingConfig,
    budget: Budget,
    seed: int | None = None,
) -> Outcome:
    deadline = time.monotonic() + budget.seconds
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    clock = {"model": 0.0, "tool": 0.0}

    def end(answer: str | None, reason: str, turns: int) -> Outcome:
        return Outcome(answer, reason, turns, messages, clock["model"], clock["tool"])

    tool_schemas = schemas(tools)
    # The endpoint samples with the job's temperature/top_p/top_k; only greedy validation is asked for.
    headers = {SAMPLING_HEADER: SAMPLING_GREEDY} if sampling.temperature == 0 else None
    used = 0  # tokens of the sequence after the last turn (the endpoint's usage)
    for turn in range(budget.max_turns):
        left = deadline - time.monotonic()
        room = budget.max_tokens - used
        if left <= 0:
            return end(None, "time", turn)
        if room <= 0:
            return end(None, "tokens", turn)
        started = time.monotonic()
        try:
            reply = await asyncio.wait_for(
                client.chat.completions.create(
                    model=model,
                    messages=messages,
                    tools=tool_schemas,
                    max_tokens=min(sampling.max_new_tokens, room),
                    stop=sampling.stop_strings or None,
                    seed=None if seed is None else seed * 1009 + turn,
                    extra_body={"ignore_eos": True} if sampling.ignore_eos else None,  # the endpoint's vLLM extension
                    extra_headers=headers,
                ),
                timeout=left,
            )
        except TimeoutError:
            return end(None, "time", turn)
        except openai.RateLimitError:  # 429: the session's turn limit on the endpoint
            return end(None, "turns", turn)
        except openai.BadRequestError as exc:
            if "context" in exc.message.lower():  # the prompt grew past the model's context: out of tokens
                return end(None, "tokens", turn)
            raise TrialRefused(f"turn {turn}: the endpoint refused it (400): {exc.message}") from exc
        except openai.APIStatusError as exc:
            if exc.status_code >= 500:
                raise TrialLost(f"turn {turn}: the endpoint answered {exc.status_code}: {exc.message}") from exc
            raise TrialRefused(f"turn {turn}: the endpoint refused it ({exc.status_code}): {exc.message}") from exc
        except (openai.APIConnectionError, openai.APITimeoutError) as exc:
            raise TrialLost(f"turn {turn}: {exc}") from exc
        clock["model"] += time.monotonic() - started
        if reply.usage is not None:
            used = reply.usage.prompt_tokens + reply.usage.completion_tokens
        message = reply.choices[0].message
        calls = message.tool_calls or []
        messages.append(_assistant(message.content, calls))
        if not calls:
            return end(message.content or "", "answer", turn + 1)
        for call in calls:
            started = time.monotonic()
            result = await toolbox.call(call.function.name, call.function.arguments)
            clock["tool"] += time.monotonic() - started
            if result.submitted is not None:
                return end(result.submitted, "submit", turn + 1)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result.text})
        if used >= budget.max_tokens:
            return end(None, "tokens", turn + 1)
    return end(None, "turns", budget.max_turns)


def _assistant(content: str | None, calls) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in calls
        ]
    return message
