"""Streamed replies as server-sent events: OpenAI chat completion chunks and Anthropic message events.

    LiveTurn.events: Text (reasoning and content as they come) ... Text (the rest), Served | Failed
        ──openai_chunks──> role chunks, reasoning_content and content chunks, then each choice's tool calls
            and finish chunk, [DONE]
        ──anthropic_events──> message_start, a thinking block then a text block as they come, tool_use
            blocks, message_stop

    the lines ──EventStream──> one HTTP write per burst: what became ready together (the role chunk with the
        first content, the finish chunk with [DONE] and the response's end) goes out in one write whenever
        the turn's events pause to wait for the generation (LiveTurn.events' `pause`), never later

Guarantees: the events carry the same content, tool calls and finish reason as the non-streamed reply
(the reply builders of convert.py make both), content arriving as it is generated; OpenAI chunks carry
each token's logprob once (its alternatives when asked), with the text it came with, when asked; a
thinking block's signature (reasoning.signature, over its whole text) closes it. A turn that fails after the
stream started ends it with the API's error event (OpenAI: a chunk with `error`; Anthropic: `error`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Send

from services.endpoint import reasoning
from services.endpoint.convert import anthropic_reply, openai_calls, openai_finish
from services.endpoint.logprobs import chat_logprobs
from services.endpoint.streaming import Text


@dataclass(frozen=True)
class Failed:
    """A turn that failed once its stream had started: the error the client is told."""

    kind: str
    message: str
    code: str | None = None

    def error(self) -> dict[str, Any]:
        return {"type": self.kind, "message": self.message, "param": None, "code": self.code}


class EventStream(StreamingResponse):
    """A text/event-stream response whose lines are written in bursts: lines collect until `flush` (the
    turn's events pausing for the generation) or the end, then go out in one write. A line is never held
    past the point where its stream would wait for the generation, so no text comes later than it would
    line by line; it costs the server, and the client, one write and one read per burst, not per line."""

    def __init__(self, lines: AsyncIterator[str], headers: dict[str, str]) -> None:
        super().__init__(lines, media_type="text/event-stream", headers=headers)
        self._held: list[str] = []
        self._send: Send | None = None

    async def flush(self) -> None:
        """Write the lines collected so far (a no-op before the response started or with none held)."""
        if self._send is not None and self._held:
            body = "".join(self._held).encode()
            self._held.clear()
            await self._send({"type": "http.response.body", "body": body, "more_body": True})

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        self._send = send
        async for line in self.body_iterator:
            self._held.append(line)
        # The last burst and the end of the body in one message (one write of the chunked encoding).
        body = "".join(self._held).encode()
        self._held.clear()
        await send({"type": "http.response.body", "body": body, "more_body": False})


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
            more = {"logprobs": chat_logprobs(event)} if logprobs else {}
            if event.reasoning:  # OpenAI-compatible servers' field for a reasoning model's thinking
                yield chunk(event.index, {"reasoning_content": event.reasoning}, **more)
                more = {}  # each token's logprob goes once
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
    blocks: list[str] = []  # the blocks opened as text came: "thinking", then "text"
    thought = ""

    def opened(kind: str) -> str:
        blocks.append(kind)
        block = (
            {"type": "thinking", "thinking": "", "signature": ""}
            if kind == "thinking"
            else {"type": "text", "text": ""}
        )
        return sse(
            {"type": "content_block_start", "index": len(blocks) - 1, "content_block": block}, "content_block_start"
        )

    def closed_thinking() -> Iterator[str]:
        at = blocks.index("thinking")
        delta = {"type": "signature_delta", "signature": reasoning.signature(thought)}
        yield sse({"type": "content_block_delta", "index": at, "delta": delta}, "content_block_delta")
        yield sse({"type": "content_block_stop", "index": at}, "content_block_stop")

    async for event in events:
        if isinstance(event, Failed):
            yield sse({"type": "error", "error": event.error()}, "error")
            return
        if isinstance(event, Text):
            if event.block and not blocks:
                yield opened("thinking")
            if event.reasoning and blocks == ["thinking"]:
                thought += event.reasoning
                delta = {"type": "thinking_delta", "thinking": event.reasoning}
                yield sse({"type": "content_block_delta", "index": 0, "delta": delta}, "content_block_delta")
            if not event.text:
                continue
            if "text" not in blocks:
                if blocks:  # the thinking is over once the answer starts
                    for line in closed_thinking():
                        yield line
                yield opened("text")
            delta = {"type": "text_delta", "text": event.text}
            yield sse({"type": "content_block_delta", "index": len(blocks) - 1, "delta": delta}, "content_block_delta")
            continue
        served = event
    message = anthropic_reply(model, served.choices[0], served.usage)
    for i, block in enumerate(message["content"]):
        if i < len(blocks):  # its text went as it came
            if block["type"] == "thinking" and "text" not in blocks:
                for line in closed_thinking():
                    yield line
            elif block["type"] == "text":
                yield sse({"type": "content_block_stop", "index": i}, "content_block_stop")
            continue
        deltas: list[dict] = []
        if block["type"] == "thinking":
            start = {"type": "thinking", "thinking": "", "signature": ""}
            deltas = [
                {"type": "thinking_delta", "thinking": block["thinking"]},
                {"type": "signature_delta", "signature": block["signature"]},
            ]
        elif block["type"] == "text":  # empty: the reply had no content and no call
            start, deltas = {"type": "text", "text": ""}, [{"type": "text_delta", "text": block["text"]}]
        else:
            start = {**block, "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": json.dumps(block["input"])}]
        yield sse({"type": "content_block_start", "index": i, "content_block": start}, "content_block_start")
        for delta in deltas:
            yield sse({"type": "content_block_delta", "index": i, "delta": delta}, "content_block_delta")
        yield sse({"type": "content_block_stop", "index": i}, "content_block_stop")
    delta = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
    usage = {"input_tokens": served.usage["prompt_tokens"], "output_tokens": served.usage["completion_tokens"]}
    yield sse({"type": "message_delta", "delta": delta, "usage": usage}, "message_delta")
    yield sse({"type": "message_stop"}, "message_stop")
