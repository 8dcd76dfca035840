"""OpenAI and Anthropic bodies <-> the chat-template messages and tools the recorder works on; replies.

    ChatCompletionRequest | MessagesRequest ──to_chat──> Chat(messages, tools, n, max_tokens, stop, seed)
    Choice (parsed text + tokens, logprobs: logprobs.py) ──openai_reply / anthropic_reply──> JSON body
    (streams: services/endpoint/sse.py, on the same reply builders)

Guarantees: image parts (OpenAI `image_url` with a data: URL, Anthropic `image` blocks with a
base64 source) become `Chat.images` (bytes, in order), never silently dropped; an image by http URL,
or data that is not base64, is a BadRequest naming the part (the endpoint fetches nothing); the
multimodal gate itself runs in the app, which knows the job's limits. A client's temperature, top_p
and top_k (top level or in `extra_body`) are not carried: the job's settings are authoritative
(turns.turn_sampling); what a Chat keeps (n, max_tokens, stop, seed, ignore_eos) shapes the reply,
never the sampling law the trainer assumes. Tool-call arguments become
dicts (a string that is not a JSON object is a BadRequest naming the message); a `tool_choice` naming a tool the
request does not define is a BadRequest, and so is a tool whose parameters are not a JSON schema the
endpoint can judge calls by (`dockyard.agents.tool_calls.check_tools`). A reply's reasoning
(reasoning.py) is OpenAI's `reasoning_content` and Anthropic's `thinking` block, whose `signature` is
`dockyard:` and a digest of the thinking text; reasoning a client sends back (`reasoning_content`,
thinking blocks; signatures are not checked: history is matched modulo reasoning) is kept on the message
for the template.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from dockyard.agents.tool_calls import check_tools
from dockyard.config.sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS
from services.endpoint import reasoning
from services.endpoint.errors import BadRequest
from services.endpoint.logprobs import chat_logprobs
from services.endpoint.reasoning import Thinking
from services.endpoint.rendering import Message
from services.endpoint.request_fields import ANTHROPIC_NEUTRAL, OPENAI_NEUTRAL, check_supported
from services.endpoint.schemas import ChatCompletionRequest, ContentBlock, MessagesRequest


@dataclass
class Chat:
    messages: list[Message]
    tools: list[dict] | None
    n: int
    max_tokens: int | None
    stop: list[str]
    seed: int | None
    ignore_eos: bool = False
    images: list[bytes] = field(default_factory=list)  # file bytes, for the multimodal gate
    top_logprobs: int = 0  # alternatives per sampled token the reply reports (Generate's top_logprobs)
    # A call the reply must make: None (none required), "" (any of the tools), or that tool's name.
    required_call: str | None = None
    thinking: Thinking = field(default_factory=Thinking)  # what the request asked of the model's reasoning


@dataclass
class Choice:
    content: str
    tool_calls: list[dict]
    finish_reason: str  # the rollout's: "stop", "eos" or "length"
    stop: str | None  # the stop string that ended it, if any
    tokens: list[str]
    logprobs: list[float]
    # Per token, when the request asked top_logprobs = k: the step's k most likely (token text, logprob).
    top_logprobs: list[list[tuple[str, float]]] = field(default_factory=list)
    reasoning: str | None = None  # the completion's thinking block's text (None: it wrote none)
    reasoning_tokens: int = 0  # how many of `tokens` are the thinking block


def _text(content: str | list | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.text or "" for part in content if part.type in ("text", "input_text"))


def _decoded(data: Any, where: str) -> bytes:
    try:
        return base64.b64decode(data if isinstance(data, str) else "", validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"{where}: the image data is not valid base64") from None


def _openai_images(content: str | list | None, where: str) -> list[bytes]:
    """The image parts of an OpenAI message's content: data: URLs only."""
    images = []
    for j, part in enumerate(content if isinstance(content, list) else ()):
        if part.type not in ("image_url", "input_image"):
            continue
        url = str((part.image_url or {}).get("url", ""))
        header, _, payload = url.partition(",")
        if not header.startswith("data:") or not header.endswith(";base64"):
            raise BadRequest(
                f"{where}.content[{j}].image_url.url: only base64 data: URLs (data:image/png;base64,...) are "
                "taken; the endpoint fetches nothing"
            )
        images.append(_decoded(payload, f"{where}.content[{j}].image_url.url"))
    return images


def _anthropic_image(block: ContentBlock, where: str) -> bytes:
    source = block.source or {}
    if source.get("type") != "base64":
        raise BadRequest(f"{where}.source: only base64 image sources are taken; the endpoint fetches nothing")
    return _decoded(source.get("data"), f"{where}.source.data")


def call_arguments(raw: str | None, field: str) -> dict:
    """A call's arguments as the client sends them back (JSON text) -> the dict the template renders."""
    try:
        value = json.loads(raw or "{}")
    except ValueError:
        raise BadRequest(f"{field} is not JSON") from None
    if not isinstance(value, dict):
        raise BadRequest(f"{field} is not a JSON object")
    return value


def check_request_tools(tools: list[dict] | None) -> None:
    try:
        check_tools(tools)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None


def check_choice(choice_name: str | None, tools: list[dict] | None, field: str) -> str | None:
    if choice_name is not None and choice_name not in {t["function"]["name"] for t in tools or ()}:
        raise BadRequest(f"{field} names tool {choice_name!r}, which `tools` does not define")
    return choice_name


def any_tool(tools: list[dict] | None, field: str) -> str:
    if not tools:
        raise BadRequest(f"{field} asks for a tool call, but the request defines no `tools`")
    return ""


def _stops(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    if len(stops) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise BadRequest(f"stop: at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters")
    return stops


def from_openai(body: ChatCompletionRequest) -> Chat:
    messages: list[Message] = []
    images: list[bytes] = []
    for i, m in enumerate(body.messages):
        images += _openai_images(m.content, f"messages[{i}]")
        message: Message = {"role": "system" if m.role == "developer" else m.role, "content": _text(m.content)}
        if m.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id or "",
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": call_arguments(
                            c.function.arguments, f"messages[{i}].tool_calls[{j}].function.arguments"
                        ),
                    },
                }
                for j, c in enumerate(m.tool_calls)
            ]
        if m.role == "tool":
            message["tool_call_id"] = m.tool_call_id or ""
        if m.reasoning_content is not None:
            if m.role != "assistant":
                raise BadRequest(f"messages[{i}].reasoning_content: only an assistant message carries reasoning")
            message[reasoning.KEY] = m.reasoning_content
        messages.append(message)
    check_supported(body, OPENAI_NEUTRAL)
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    check_request_tools(tools)
    required = None
    if isinstance(body.tool_choice, dict):
        required = check_choice((body.tool_choice.get("function") or {}).get("name"), tools, "tool_choice")
    elif body.tool_choice == "required":
        required = any_tool(tools, "tool_choice: 'required'")
    if body.tool_choice == "none":
        tools = None
    if body.top_logprobs and not body.logprobs:
        raise BadRequest("top_logprobs: set logprobs to true to get them (as the OpenAI API requires)")
    return Chat(
        messages=messages,
        tools=tools,
        n=body.n,
        max_tokens=body.max_completion_tokens or body.max_tokens,
        stop=_stops(body.stop),
        seed=body.seed,
        ignore_eos=body.ignore_eos,
        images=images,
        required_call=required,
        top_logprobs=body.top_logprobs or 0,
        thinking=reasoning.effort_thinking(body.reasoning_effort, "reasoning_effort"),
    )


def _blocks(content: str | list[ContentBlock]) -> list[ContentBlock]:
    return [ContentBlock(type="text", text=content)] if isinstance(content, str) else content


def from_anthropic(body: MessagesRequest) -> Chat:
    check_supported(body, ANTHROPIC_NEUTRAL)
    messages: list[Message] = []
    images: list[bytes] = []
    system = body.system if isinstance(body.system, str) else "".join(b.text or "" for b in body.system or ())
    if system:
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(body.messages):
        text, calls, thoughts = [], [], []
        for j, block in enumerate(_blocks(m.content)):
            if block.type == "text":
                text.append(block.text or "")
            elif block.type == "thinking" and m.role == "assistant":
                thoughts.append(block.thinking or "")
            elif block.type == "image" and m.role == "user":
                images.append(_anthropic_image(block, f"messages[{i}].content[{j}]"))
            elif block.type == "tool_use" and m.role == "assistant":
                calls.append(
                    {
                        "id": block.id or "",
                        "type": "function",
                        "function": {"name": block.name, "arguments": block.input or {}},
                    }
                )
            elif block.type == "tool_result" and m.role == "user":
                result = (
                    block.content
                    if isinstance(block.content, str)
                    else "".join(b.text or "" for b in block.content or () if b.type == "text")
                )
                messages.append({"role": "tool", "content": result, "tool_call_id": block.tool_use_id or ""})
            else:
                raise BadRequest(
                    f"messages[{i}].content[{j}]: a {block.type!r} block is not supported in a {m.role} turn"
                )
        if text or calls or not any(b.type == "tool_result" for b in _blocks(m.content)):
            message: Message = {"role": m.role, "content": "".join(text)}
            if calls:
                message["tool_calls"] = calls
            if any(thoughts):
                message[reasoning.KEY] = "\n".join(thoughts)
            messages.append(message)
    tools = (
        [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema},
            }
            for t in body.tools
        ]
        if body.tools
        else None
    )
    check_request_tools(tools)
    choice = body.tool_choice or {}
    required = None
    if choice.get("type") == "tool":
        required = check_choice(choice.get("name"), tools, "tool_choice.name")
    elif choice.get("type") == "any":
        required = any_tool(tools, "tool_choice: {'type': 'any'}")
    if choice.get("type") == "none":
        tools = None
    return Chat(
        messages=messages,
        tools=tools,
        n=1,
        max_tokens=body.max_tokens,
        stop=_stops(body.stop_sequences),
        seed=None,
        images=images,
        required_call=required,
        thinking=reasoning.anthropic_thinking(body.thinking, body.max_tokens),
    )


def reply_message(choice: Choice) -> Message:
    """The assistant message as the client will send it back (what the recorder compares)."""
    message: Message = {"role": "assistant", "content": choice.content}
    if choice.tool_calls:
        message["tool_calls"] = choice.tool_calls
    if choice.reasoning is not None:
        message[reasoning.KEY] = choice.reasoning
    return message


def openai_calls(calls: list[dict]) -> list[dict]:
    return [
        {
            "id": c["id"],
            "type": "function",
            "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])},
        }
        for c in calls
    ]


def openai_finish(choice: Choice) -> str:
    return "tool_calls" if choice.tool_calls else ("length" if choice.finish_reason == "length" else "stop")


def openai_reply(model: str, choices: list[Choice], usage: dict, logprobs: bool) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": i,
                "message": {
                    "role": "assistant",
                    "content": c.content if (c.content or not c.tool_calls) else None,
                    **({"reasoning_content": c.reasoning} if c.reasoning is not None else {}),
                    **({"tool_calls": openai_calls(c.tool_calls)} if c.tool_calls else {}),
                },
                "logprobs": chat_logprobs(c) if logprobs else None,
                "finish_reason": openai_finish(c),
            }
            for i, c in enumerate(choices)
        ],
        "usage": usage,
    }


def anthropic_stop(choice: Choice) -> tuple[str, str | None]:
    if choice.tool_calls:
        return "tool_use", None
    if choice.finish_reason == "length":
        return "max_tokens", None
    if choice.stop is not None:
        return "stop_sequence", choice.stop
    return "end_turn", None


def anthropic_content(choice: Choice) -> list[dict]:
    blocks: list[dict] = []
    if choice.reasoning is not None:
        blocks.append(
            {"type": "thinking", "thinking": choice.reasoning, "signature": reasoning.signature(choice.reasoning)}
        )
    if choice.content or not choice.tool_calls:
        blocks.append({"type": "text", "text": choice.content})
    blocks += [
        {
            "type": "tool_use",
            "id": c["id"].replace("call_", "toolu_", 1),
            "name": c["function"]["name"],
            "input": c["function"]["arguments"],
        }
        for c in choice.tool_calls
    ]
    return blocks


def anthropic_reply(model: str, choice: Choice, usage: dict) -> dict[str, Any]:
    stop_reason, stop_sequence = anthropic_stop(choice)
    return {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": anthropic_content(choice),
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]},
    }
