"""The OpenAI Responses API (`POST /v1/responses`) on the same recorded turns as chat completions.

    ResponsesRequest ──to_chat──> Chat (instructions, input items, function tools, tool_choice)
    Choice ──response_body──> a `response` object
    LiveTurn.events (streaming.py) ──response_events──> its typed SSE events, the text as it is generated

Input items become chat-template messages the way chat completions' do: `message` items (roles
user, system, developer, assistant; `input_text` / `output_text` parts), `function_call` items (the
assistant's calls, joined to the assistant message they follow, as a reply with text and calls is
sent back as a message item and then its calls), `function_call_output` items (tool messages). So a
client that sends back a reply's output items continues the session's segment exactly as a chat
client that sends back the reply's message does.

Guarantees: nothing is silently dropped: a `reasoning` item, an image or file part, a tool that is
not a function tool, `previous_response_id` (the endpoint keeps no responses: the whole
conversation is the request's `input`) and every field `request_fields` refuses are a BadRequest
naming the item or field. The reply reports the sampling law the turn was drawn under (the job's),
not the one the client asked for. The stream carries the same output as the reply, as the API's
typed events in order (`response.created` ... `response.completed`, or `response.incomplete` when
the reply ran out of tokens), each with its `sequence_number`; the message's text is sent as it is
generated (`response.output_text.delta`), its calls once the reply is finished; a turn that fails
after the stream started ends it with an `error` event.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError

from services.endpoint.convert import (
    Chat,
    Choice,
    any_tool,
    call_arguments,
    check_choice,
    check_request_tools,
)
from services.endpoint.errors import BadRequest
from services.endpoint.rendering import Message
from services.endpoint.request_fields import RESPONSES_NEUTRAL, check_supported
from services.endpoint.schemas import FunctionSpec, ResponsesRequest
from services.endpoint.sse import Failed, sse
from services.endpoint.streaming import Text
from services.endpoint.turns import TurnSampling

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text")


def to_chat(body: ResponsesRequest) -> Chat:
    if body.previous_response_id is not None:
        raise BadRequest(
            "previous_response_id: the endpoint keeps no responses; send the whole conversation in `input`"
        )
    check_supported(body, RESPONSES_NEUTRAL)
    messages: list[Message] = [{"role": "system", "content": body.instructions}] if body.instructions else []
    items = [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    for i, item in enumerate(items):
        _add_item(messages, item, f"input[{i}]")
    if not messages:
        raise BadRequest("input: the conversation is empty")
    tools = [_function_tool(t, f"tools[{i}]") for i, t in enumerate(body.tools or ())] or None
    check_request_tools(tools)
    required = None
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise BadRequest(f"tool_choice: a {choice.get('type')!r} choice is not supported; only function tools")
        required = check_choice(choice.get("name"), tools, "tool_choice.name")
    elif choice == "required":
        required = any_tool(tools, "tool_choice: 'required'")
    if choice == "none":
        tools = None
    return Chat(
        messages=messages,
        tools=tools,
        n=1,
        max_tokens=body.max_output_tokens,
        stop=[],
        seed=None,
        required_call=required,
    )


def _add_item(messages: list[Message], item: dict[str, Any], where: str) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        role = ROLES.get(item.get("role", ""))
        if role is None:
            raise BadRequest(f"{where}.role: {item.get('role')!r} is not one of {sorted(ROLES)}")
        messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
    elif kind == "function_call":
        if not isinstance(item.get("call_id"), str) or not isinstance(item.get("name"), str):
            raise BadRequest(f"{where}: a function_call item needs its `call_id` and `name`")
        arguments = call_arguments(item.get("arguments"), f"{where}.arguments")
        call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": arguments}}
        if messages and messages[-1]["role"] == "assistant":  # the reply's text, or its earlier calls
            messages[-1].setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        messages.append(
            {
                "role": "tool",
                "content": _text(output, f"{where}.output"),
                "tool_call_id": str(item.get("call_id") or ""),
            }
        )
    else:
        raise BadRequest(f"{where}: a {kind!r} item is not supported (message, function_call, function_call_output)")


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise BadRequest(f"{where}: a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise BadRequest(f"{where}[{j}]: a {kind!r} part is not supported (only text parts)")
        texts.append(part.get("text") or "")
    return "".join(texts)


def _function_tool(tool: dict[str, Any], where: str) -> dict:
    if tool.get("type") != "function":
        raise BadRequest(f"{where}: a {tool.get('type')!r} tool is not supported; only function tools")
    try:
        spec = FunctionSpec.model_validate({k: v for k, v in tool.items() if k != "type"})
    except ValidationError as exc:
        first = exc.errors()[0]
        raise BadRequest(f"{where}.{'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    return {"type": "function", "function": spec.model_dump(exclude_none=True, exclude={"strict"})}


def output_items(choice: Choice) -> list[dict[str, Any]]:
    """The reply as output items: its text as one message (also when empty and there is no call), then each call."""
    items: list[dict[str, Any]] = []
    status = "incomplete" if choice.finish_reason == "length" else "completed"
    if choice.content or not choice.tool_calls:
        text = {"type": "output_text", "text": choice.content, "annotations": [], "logprobs": []}
        message = {"type": "message", "role": "assistant", "status": status, "content": [text]}
        items.append({"id": f"msg_{uuid.uuid4().hex}", **message})
    for call in choice.tool_calls:
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{uuid.uuid4().hex}",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": json.dumps(call["function"]["arguments"]),
                "status": "completed",
            }
        )
    return items


def response_body(
    body: ResponsesRequest,
    choice: Choice | None,
    usage: dict[str, int] | None,
    law: TurnSampling,
    response_id: str,
    items: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The `response` object; with no choice yet, the in-progress one a stream starts with."""
    if choice is None:
        status, details = "in_progress", None
    elif choice.finish_reason == "length":
        status, details = "incomplete", {"reason": "max_output_tokens"}
    else:
        status, details = "completed", None
    tools = [
        {"type": "function", "strict": t.get("strict"), "parameters": t.get("parameters"), **t}
        for t in body.tools or ()
    ]
    return {
        "id": response_id,
        "object": "response",
        "created_at": time.time(),
        "status": status,
        "model": body.model,
        "output": items or [],
        "instructions": body.instructions,
        "parallel_tool_calls": True,
        "tool_choice": body.tool_choice or "auto",
        "tools": tools,
        "temperature": law.temperature,
        "top_p": law.top_p,
        "max_output_tokens": body.max_output_tokens,
        "error": None,
        "incomplete_details": details,
        "metadata": {},
        "usage": _usage(usage) if usage else None,
    }


def _usage(usage: dict[str, int]) -> dict[str, Any]:
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


async def response_events(body: ResponsesRequest, law: TurnSampling, events: AsyncIterator[Any]) -> AsyncIterator[str]:
    """The reply as the Responses stream: created, in_progress, the message's text as it comes, each item's
    events, then completed/incomplete (or `error` when the turn failed after the stream started)."""
    response_id = f"resp_{uuid.uuid4().hex}"
    message_id = f"msg_{uuid.uuid4().hex}"
    sequence = iter(range(1 << 30))

    def event(kind: str, **fields: Any) -> str:
        return sse({"type": kind, "sequence_number": next(sequence), **fields}, event=kind)

    started = response_body(body, None, None, law, response_id)
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    text_open = False
    where = {"item_id": message_id, "output_index": 0}
    async for live in events:
        if isinstance(live, Failed):
            yield event("error", code=live.code, message=live.message, param=None)
            return
        if isinstance(live, Text):
            if not live.text:
                continue
            if not text_open:
                text_open = True
                item = {"id": message_id, "type": "message", "role": "assistant", "status": "in_progress"}
                yield event("response.output_item.added", output_index=0, item={**item, "content": []})
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                yield event("response.content_part.added", **where, content_index=0, part=part)
            yield event("response.output_text.delta", **where, content_index=0, delta=live.text, logprobs=[])
            continue
        served = live
    choice = served.choices[0]
    items = output_items(choice)
    if items[0]["type"] == "message":
        items[0]["id"] = message_id  # the id its text was streamed under
    for k, item in enumerate(items):
        at = {"item_id": item["id"], "output_index": k}
        if item["type"] == "message":
            part = item["content"][0]
            if not text_open:  # no text came (an empty reply): the message is announced now
                yield event(
                    "response.output_item.added", output_index=k, item={**item, "status": "in_progress", "content": []}
                )
                yield event("response.content_part.added", **at, content_index=0, part={**part, "text": ""})
                yield event("response.output_text.delta", **at, content_index=0, delta=part["text"], logprobs=[])
            yield event("response.output_text.done", **at, content_index=0, text=part["text"], logprobs=[])
            yield event("response.content_part.done", **at, content_index=0, part=part)
        else:
            yield event(
                "response.output_item.added", output_index=k, item={**item, "status": "in_progress", "arguments": ""}
            )
            yield event("response.function_call_arguments.delta", **at, delta=item["arguments"])
            yield event("response.function_call_arguments.done", **at, arguments=item["arguments"], name=item["name"])
        yield event("response.output_item.done", output_index=k, item=item)
    final = response_body(body, choice, served.usage, law, response_id, items)
    yield event("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)
