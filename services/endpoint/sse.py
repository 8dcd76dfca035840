"""Streamed replies as server-sent events: OpenAI chat completion chunks and Anthropic message events.

    LiveTurn.events: Text (content as it comes) ... Text (the rest), Served | Failed
        ──openai_chunks──> role chunks, content chunks, then each choice's tool calls and finish chunk, [DONE]
        ──anthropic_events──> message_start, a text block as content comes, tool_use blocks, message_stop

Guarantees: the events carry the same content, tool calls and finish reason as the non-streamed reply
(the reply builders of convert.py make both), content arriving as it is generated; OpenAI chunks carry
each token's logprob once, with the content it came with, when asked. A turn that fails after the
stream started ends it with the API's error event (OpenAI: a chunk with `error`; Anthropic: `error`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from services.endpoint.convert import (
    anthropic_reply,
    logprob_entries,
    openai_calls,
    openai_finish,
)
from services.endpoint.streaming import Text


@dataclass(frozen=True)
class Failed:
    """A turn that failed once its stream had started: the error the client is told."""

    kind: str
    message: str
    code: str | None = None

    def error(self) -> dict[str, Any]:
        return {"type": self.kind, "message": self.message, "param": None, "code": self.code}


def sse(data: dict | str, event: str | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data)
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


async def openai_chunks(
    model: str, n: int, events: AsyncIterator[Any], logprobs: bool, with_usage: bool
) -> AsyncIterator[str]:
    base = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
    }

    def chunk(index: int, delta: dict, finish: str | None = None, **more: Any) -> str:
        return sse({**base, "choices": [{"index": index, "delta": delta, "finish_reason": finish, **more}]})

    for i in range(n):
        yield chunk(i, {"role": "assistant", "content": ""})
    async for event in events:
        if isinstance(event, Failed):
            yield sse({"error": event.error()})
            return
        if isinstance(event, Text):
            more = {"logprobs": {"content": logprob_entries(event.tokens, event.logprobs)}} if logprobs else {}
            if event.text or more:
                yield chunk(event.index, {"content": event.text}, **more)
            continue
        served = event
    for i, c in enumerate(served.choices):
        for k, call in enumerate(openai_calls(c.tool_calls)):
            yield chunk(i, {"tool_calls": [{"index": k, **call}]})
        yield chunk(i, {}, openai_finish(c))
    if with_usage:
        yield sse({**base, "choices": [], "usage": served.usage})
    yield sse("[DONE]")


async def anthropic_events(model: str, prompt_tokens: int, events: AsyncIterator[Any]) -> AsyncIterator[str]:
    message_id = f"msg_{uuid.uuid4().hex}"
    start = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
    }
    yield sse({"type": "message_start", "message": start}, "message_start")
    text_open = False
    async for event in events:
        if isinstance(event, Failed):
            yield sse({"type": "error", "error": event.error()}, "error")
            return
        if isinstance(event, Text):
            if not event.text:
                continue
            if not text_open:
                text_open = True
                block = {"type": "text", "text": ""}
                yield sse({"type": "content_block_start", "index": 0, "content_block": block}, "content_block_start")
            delta = {"type": "text_delta", "text": event.text}
            yield sse({"type": "content_block_delta", "index": 0, "delta": delta}, "content_block_delta")
            continue
        served = event
    message = anthropic_reply(model, served.choices[0], served.usage)
    for i, block in enumerate(message["content"]):
        if i == 0 and text_open:  # its text went as it came
            yield sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
            continue
        if block["type"] == "text":  # empty: the reply had no content and no call
            opened, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        else:
            opened = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        yield sse({"type": "content_block_start", "index": i, "content_block": opened}, "content_block_start")
        yield sse({"type": "content_block_delta", "index": i, "delta": delta}, "content_block_delta")
        yield sse({"type": "content_block_stop", "index": i}, "content_block_stop")
    delta = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
    usage = {"input_tokens": served.usage["prompt_tokens"], "output_tokens": served.usage["completion_tokens"]}
    yield sse({"type": "message_delta", "delta": delta, "usage": usage}, "message_delta")
    yield sse({"type": "message_stop"}, "message_stop")
