"""The OpenAI Responses API (`POST /v1/responses`) on the same recorded turns as chat completions.

    ResponsesRequest ──to_chat──> Chat (instructions, input items, function tools, tool_choice)
    Choice ──response_body──> a `response` object
    LiveTurn.events (streaming.py) ──response_events──> its typed SSE events, the text as it is generated

Input items become chat-template messages the way chat completions' do: `message` items (roles
user, system, developer, assistant; `input_text` / `output_text` parts), `function_call` items (the
assistant's calls, joined to the assistant message they follow, as a reply with text and calls is
sent back as a message item and then its calls), `function_call_output` items (tool messages). So a
client that sends back a reply's output items continues the session's segment exactly as a chat
client that sends back the reply's message does. A `reasoning` item (its `content` reasoning text,
else its `summary`) is the reasoning of the assistant message it precedes; a reply's reasoning
(reasoning.py) is a `reasoning` output item before its message, its text as `content`
(`reasoning_text`) and, when `reasoning.summary` asks for one, as its `summary` too (the endpoint
does not summarize: the summary is the whole reasoning); `reasoning.effort` is reasoning.py's.

Guarantees: nothing is silently dropped: an image or file part, a tool that is not a function
tool, an encrypted-only reasoning item, `previous_response_id` (the endpoint keeps no responses:
the whole conversation is the request's `input`) and every field `request_fields` refuses are a BadRequest
naming the item or field. `include` serves "message.output_text.logprobs" only (any other value is a
BadRequest naming it): the text part (and its delta and done events) then carries each sampled
token's logprob, with `top_logprobs` alternatives when asked (top_logprobs without that `include` is
a BadRequest). The reply reports the sampling law the turn was drawn under (the job's),
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
from collections.abc import AsyncIterator, Iterator
from typing import Any

from pydantic import ValidationError

from services.endpoint import reasoning
from services.endpoint.convert import (
    Chat,
    Choice,
    any_tool,
    call_arguments,
    check_choice,
    check_request_tools,
)
from services.endpoint.errors import BadRequest
from services.endpoint.logprobs import event_logprobs, output_text_logprobs
from services.endpoint.rendering import Message
from services.endpoint.request_fields import RESPONSES_NEUTRAL, check_supported
from services.endpoint.schemas import FunctionSpec, ResponsesRequest
from services.endpoint.sse import Failed, sse
from services.endpoint.streaming import Text
from services.endpoint.turns import TurnSampling

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS = "message.output_text.logprobs"  # the one `include` value served
SUMMARIES = ("auto", "concise", "detailed")


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
        top_logprobs=_top_logprobs(body),
        thinking=_thinking(body.reasoning),
    )


def wants_logprobs(body: ResponsesRequest) -> bool:
    """Whether the reply's output_text parts carry logprobs (`include` names them)."""
    return LOGPROBS in (body.include or ())


def _top_logprobs(body: ResponsesRequest) -> int:
    """How many alternatives per token the request asks for; BadRequest for an `include` not served."""
    for i, name in enumerate(body.include or ()):
        if name != LOGPROBS:
            raise BadRequest(f"include[{i}]: {name!r} is not supported (only {LOGPROBS!r})")
    if body.top_logprobs and not wants_logprobs(body):
        raise BadRequest(f"top_logprobs: add {LOGPROBS!r} to `include` to get them")
    return body.top_logprobs or 0


def _thinking(value: dict[str, Any] | None) -> reasoning.Thinking:
    """`reasoning`: {effort, summary}; effort as chat completions' `reasoning_effort`, summary one of SUMMARIES."""
    value = {k: v for k, v in (value or {}).items() if v is not None}  # null asks for nothing
    unknown = sorted(set(value) - {"effort", "summary"})
    if unknown:
        raise BadRequest(f"reasoning.{unknown[0]}: not supported (reasoning takes `effort` and `summary`)")
    if value.get("summary") not in (None, *SUMMARIES):
        raise BadRequest(f"reasoning.summary: {value['summary']!r} is not one of {list(SUMMARIES)}")
    return reasoning.effort_thinking(value.get("effort"), "reasoning.effort")


def summarized(body: ResponsesRequest) -> bool:
    """Whether the reply's reasoning items carry a summary (the request's `reasoning.summary`)."""
    return (body.reasoning or {}).get("summary") is not None


def _add_item(messages: list[Message], item: dict[str, Any], where: str) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        role = ROLES.get(item.get("role", ""))
        if role is None:
            raise BadRequest(f"{where}.role: {item.get('role')!r} is not one of {sorted(ROLES)}")
        content = _text(item.get("content"), f"{where}.content")
        if role == "assistant" and _thought_only(messages):  # the reasoning item before it was its reasoning
            messages[-1]["content"] = content
        else:
            messages.append({"role": role, "content": content})
    elif kind == "function_call":
        if not isinstance(item.get("call_id"), str) or not isinstance(item.get("name"), str):
            raise BadRequest(f"{where}: a function_call item needs its `call_id` and `name`")
        arguments = call_arguments(item.get("arguments"), f"{where}.arguments")
        call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": arguments}}
        if messages and messages[-1]["role"] == "assistant":  # the reply's text, or its earlier calls
            messages[-1].setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "reasoning":
        messages.append({"role": "assistant", "content": "", reasoning.KEY: _reasoning_text(item, where)})
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
        raise BadRequest(
            f"{where}: a {kind!r} item is not supported (message, reasoning, function_call, function_call_output)"
        )


def _thought_only(messages: list[Message]) -> bool:
    """Whether the last message is a reasoning item's alone (an assistant turn with nothing else yet)."""
    last = messages[-1] if messages else {}
    if last.get("role") != "assistant" or reasoning.KEY not in last:
        return False
    return not last["content"] and "tool_calls" not in last


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its `content` (reasoning_text parts), else its `summary` (summary_text parts)."""
    for key, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key) or []
        if not isinstance(parts, list) or any(not isinstance(p, dict) or p.get("type") != part_type for p in parts):
            raise BadRequest(f"{where}.{key}: a list of {part_type!r} parts")
        if parts:
            return "\n".join(str(p.get("text") or "") for p in parts)
    if item.get("encrypted_content"):
        raise BadRequest(f"{where}: an encrypted-only reasoning item cannot be read (the endpoint encrypts none)")
    return ""


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


def output_items(choice: Choice, summary: bool = False, logprobs: bool = False) -> list[dict[str, Any]]:
    """The reply as output items: its reasoning, its text as one message (also when empty and there is no
    call), then each call; with `logprobs`, the text part carries every sampled token's (its alternatives as
    the request asked)."""
    items: list[dict[str, Any]] = []
    status = "incomplete" if choice.finish_reason == "length" else "completed"
    if choice.reasoning is not None:
        summaries = [{"type": "summary_text", "text": choice.reasoning}] if summary else []
        thought = {"type": "reasoning", "summary": summaries, "content": [_reasoning_part(choice.reasoning)]}
        items.append({"id": f"rs_{uuid.uuid4().hex}", **thought, "status": status})
    if choice.content or not choice.tool_calls:
        text = {
            "type": "output_text",
            "text": choice.content,
            "annotations": [],
            "logprobs": output_text_logprobs(choice) if logprobs else [],
        }
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


def _reasoning_part(text: str) -> dict[str, str]:
    return {"type": "reasoning_text", "text": text}


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
        "top_logprobs": body.top_logprobs,
        "error": None,
        "incomplete_details": details,
        "metadata": {},
        "usage": _usage(usage, choice.reasoning_tokens if choice else 0) if usage else None,
        "reasoning": body.reasoning,
    }


def _usage(usage: dict[str, int], reasoning_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": usage["total_tokens"],
    }


async def response_events(body: ResponsesRequest, law: TurnSampling, events: AsyncIterator[Any]) -> AsyncIterator[str]:
    """The reply as the Responses stream: created, in_progress, the reasoning's and the message's text as they
    come, each item's events, then completed/incomplete (or `error` when the turn failed after the stream
    started)."""
    response_id = f"resp_{uuid.uuid4().hex}"
    message_id, reasoning_id = f"msg_{uuid.uuid4().hex}", f"rs_{uuid.uuid4().hex}"
    logprobs = wants_logprobs(body)
    sequence = iter(range(1 << 30))

    def event(kind: str, **fields: Any) -> str:
        return sse({"type": kind, "sequence_number": next(sequence), **fields}, event=kind)

    started = response_body(body, None, None, law, response_id)
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    thought_open = text_open = False  # the reasoning item (output 0) and the message, once announced
    thought = {"item_id": reasoning_id, "output_index": 0}
    async for live in events:
        if isinstance(live, Failed):
            yield event("error", code=live.code, message=live.message, param=None)
            return
        if isinstance(live, Text):
            if live.block and not thought_open and not text_open:
                thought_open = True
                item = {"id": reasoning_id, "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
                yield event("response.output_item.added", output_index=0, item=item)
            if live.reasoning and thought_open:
                yield event("response.reasoning_text.delta", **thought, content_index=0, delta=live.reasoning)
            if not live.text:
                continue
            where = {"item_id": message_id, "output_index": int(thought_open)}
            if not text_open:
                text_open = True
                item = {"id": message_id, "type": "message", "role": "assistant", "status": "in_progress"}
                yield event(
                    "response.output_item.added", output_index=where["output_index"], item={**item, "content": []}
                )
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                yield event("response.content_part.added", **where, content_index=0, part=part)
            tokens = event_logprobs(live) if logprobs else []
            yield event("response.output_text.delta", **where, content_index=0, delta=live.text, logprobs=tokens)
            continue
        served = live
    choice = served.choices[0]
    items = output_items(choice, summarized(body), logprobs)
    tokens = event_logprobs(choice) if logprobs else []
    for k, item in enumerate(items):
        at = {"item_id": item["id"], "output_index": k}
        if item["type"] == "reasoning":
            if thought_open:  # its text went as it came: its summary and its done events now
                item["id"] = at["item_id"] = reasoning_id
            for line in _reasoning_events(event, item, k, streamed=thought_open):
                yield line
        elif item["type"] == "message":
            part = item["content"][0]
            if text_open:
                item["id"] = at["item_id"] = message_id  # the id its text was streamed under
            else:  # no text came (an empty reply, or one held to the end): the message is announced now
                yield event(
                    "response.output_item.added", output_index=k, item={**item, "status": "in_progress", "content": []}
                )
                opened = {**part, "text": "", "logprobs": []}  # its text and logprobs come with the events below
                yield event("response.content_part.added", **at, content_index=0, part=opened)
                yield event("response.output_text.delta", **at, content_index=0, delta=part["text"], logprobs=tokens)
            yield event("response.output_text.done", **at, content_index=0, text=part["text"], logprobs=tokens)
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


def _reasoning_events(event, item: dict[str, Any], k: int, streamed: bool = False) -> Iterator[str]:
    """A reasoning item's events between its added and done: each summary part's, then its text's (`streamed`:
    its added event and text deltas were sent as the text came)."""
    where = {"item_id": item["id"], "output_index": k}
    if not streamed:
        started = {**item, "status": "in_progress", "summary": [], "content": []}
        yield event("response.output_item.added", output_index=k, item=started)
    for j, part in enumerate(item["summary"]):
        yield event("response.reasoning_summary_part.added", **where, summary_index=j, part={**part, "text": ""})
        yield event("response.reasoning_summary_text.delta", **where, summary_index=j, delta=part["text"])
        yield event("response.reasoning_summary_text.done", **where, summary_index=j, text=part["text"])
        yield event("response.reasoning_summary_part.done", **where, summary_index=j, part=part)
    text = item["content"][0]["text"]
    if not streamed:
        yield event("response.reasoning_text.delta", **where, content_index=0, delta=text)
    yield event("response.reasoning_text.done", **where, content_index=0, text=text)
