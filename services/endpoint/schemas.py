"""Request bodies of the OpenAI Chat Completions and Anthropic Messages APIs, as pydantic models.

Guarantees: a body that does not fit is a 422 naming the field (FastAPI's
validation); top-level fields not declared here are kept, and the endpoint refuses
each one that would change the reply (convert.check_supported: a 400 naming it)
and accepts those that change nothing (`user`, `metadata`, ...); sampling
values are bounded here (n 1..16, temperature 0..2, top_p (0, 1], at most 16
stop strings), so nothing out of range reaches a replica. Chat completions also
take vLLM's extensions `top_k` and `ignore_eos`. A client's temperature, top_p and
top_k are checked against the API's bounds (a client learns it sent nonsense) and
then ignored: the job's sampling settings are authoritative (services/endpoint/turns.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dockyard.config.sampling import (
    ANTHROPIC_MAX_TEMPERATURE,
    MAX_TOP_P,
    MIN_TEMPERATURE,
    MIN_TOP_K,
    OPENAI_MAX_TEMPERATURE,
    TOP_P_ABOVE,
)

TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Request(BaseModel):
    """A top-level body: its unknown fields are kept, for the endpoint to refuse by name (convert.check_supported)."""

    model_config = ConfigDict(extra="allow")


class FunctionSpec(_Body):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(_Body):
    type: Literal["function"] = "function"
    function: FunctionSpec


class CalledFunction(_Body):
    name: str
    arguments: str = "{}"


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ContentPart(_Body):
    type: str
    text: str | None = None
    image_url: dict[str, Any] | None = None  # {"url": "data:image/png;base64,..."}


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an assistant turn's reasoning, as vLLM returns it


class ChatCompletionRequest(_Request):
    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    tools: list[ToolSpec] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    n: int = Field(1, ge=1, le=16)
    temperature: float | None = Field(None, ge=MIN_TEMPERATURE, le=OPENAI_MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=TOP_P_ABOVE, le=MAX_TOP_P)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    reasoning_effort: str | None = None  # services/endpoint/reasoning.py: "none" or a share of the reply
    # Extensions, as vLLM's OpenAI server names them (clients send them in `extra_body`).
    top_k: int | None = Field(None, ge=MIN_TOP_K)
    ignore_eos: bool = False


class ContentBlock(_Body):
    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[ContentBlock] | None = None
    is_error: bool | None = None
    source: dict[str, Any] | None = None  # an image block's {"type": "base64", "media_type", "data"}
    thinking: str | None = None  # a thinking block's text (its `signature` is not read back)


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(_Body):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class CountTokensRequest(_Request):
    """Anthropic's `messages.count_tokens` body: a Messages request without its generation settings."""

    model: str = Field(min_length=1)
    messages: list[AnthropicMessage] = Field(min_length=1, max_length=4096)
    system: str | list[ContentBlock] | None = None
    tools: list[AnthropicTool] | None = Field(None, max_length=128)
    tool_choice: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(None, max_length=16)
    temperature: float | None = Field(None, ge=MIN_TEMPERATURE, le=ANTHROPIC_MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=TOP_P_ABOVE, le=MAX_TOP_P)
    top_k: int | None = Field(None, ge=MIN_TOP_K)
    stream: bool = False
    thinking: dict[str, Any] | None = None  # {"type": "enabled", "budget_tokens": N} or {"type": "disabled"}


class ResponsesRequest(_Request):
    """The OpenAI Responses API's body; `input` items are checked one by one (responses.to_chat)."""

    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]] = Field(max_length=4096)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=MIN_TEMPERATURE, le=OPENAI_MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=TOP_P_ABOVE, le=MAX_TOP_P)
    previous_response_id: str | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    # Extra output: only "message.output_text.logprobs" (checked in responses.to_chat).
    include: list[str] | None = Field(None, max_length=16)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    reasoning: dict[str, Any] | None = None  # {"effort", "summary"}: services/endpoint/reasoning.py
