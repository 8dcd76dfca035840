"""A Generate request's prompt: text, token ids, or chat messages, checked before any engine sees it.

    GenerateRequest ──prompt_from_request──> PromptInput ──resolve(engine)──> text | token ids ──> engine.generate

Guarantees: exactly one of `prompt`, `prompt_token_ids` and `messages` is set,
or INVALID_ARGUMENT says which were; text and messages are at most
MAX_PROMPT_BYTES, token ids at most MAX_PROMPT_TOKENS and never negative, a
conversation at most MAX_MESSAGES messages with a role on each. Token ids pass
through untouched (the engine checks them against its vocabulary); messages
become ids through the engine's chat template (`render_chat`), so what the
caller gets back in `prompt_token_ids` is exactly what was generated from; `check_context` refuses
a prompt whose tokens and max_new_tokens exceed the engine's context. Images go with text
or messages, never with token ids; the gate itself (dockyard/images.py) runs in the servicer,
which knows the job's limits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dockyard.api.rollout.v1 import rollout_pb2
from dockyard.rpc.errors import InvalidArgument
from services.rollout.engine import GenerationEngine, ImagePrompt, Prompt

MAX_PROMPT_BYTES = 256 * 1024  # far beyond any model context; bounds the tokenizer's work and memory
MAX_PROMPT_TOKENS = 256 * 1024  # the same bound for prompts that come as ids
MAX_MESSAGES = 4096


@dataclass(frozen=True)
class PromptInput:
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content)

    def resolve(self, engine: GenerationEngine, images: Sequence[Any] = ()) -> Prompt:
        """What engine.generate takes; blocking for messages (the chat template runs): call from a thread.

        With images (already through the gate), the text or the rendered conversation becomes an ImagePrompt.
        """
        if images:
            text = self.text if self.text is not None else engine.render_chat_text(self._message_dicts())
            return ImagePrompt(text=text, images=tuple(images))
        if self.text is not None:
            return self.text
        if self.token_ids is not None:
            return list(self.token_ids)
        assert self.messages is not None
        return engine.render_chat(self._message_dicts())

    def _message_dicts(self) -> list[dict[str, str]]:
        assert self.messages is not None
        return [{"role": role, "content": content} for role, content in self.messages]


def prompt_from_request(request: rollout_pb2.GenerateRequest) -> PromptInput:
    """The request's prompt, or InvalidArgument naming the field at fault."""
    given = [
        name
        for name, present in (
            ("prompt", bool(request.prompt)),
            ("prompt_token_ids", len(request.prompt_token_ids) > 0),
            ("messages", len(request.messages) > 0),
        )
        if present
    ]
    if len(given) != 1:
        which = ", ".join(given) if given else "none"
        raise InvalidArgument(f"prompt: give exactly one of prompt, prompt_token_ids, messages (got {which})")
    if request.images and request.prompt_token_ids:
        raise InvalidArgument(
            "images: they go with prompt text or messages, not prompt_token_ids (the model's processor "
            "inserts the image tokens; their ids come back in prompt_token_ids)"
        )
    if request.prompt:
        if (size := len(request.prompt.encode())) > MAX_PROMPT_BYTES:
            raise InvalidArgument(f"prompt is {size} bytes; at most {MAX_PROMPT_BYTES}")
        return PromptInput(text=request.prompt)
    if request.prompt_token_ids:
        ids = tuple(request.prompt_token_ids)
        if len(ids) > MAX_PROMPT_TOKENS:
            raise InvalidArgument(f"prompt_token_ids has {len(ids)} ids; at most {MAX_PROMPT_TOKENS}")
        if (low := min(ids)) < 0:
            raise InvalidArgument(f"prompt_token_ids[{ids.index(low)}] is {low}; token ids are >= 0")
        return PromptInput(token_ids=ids)
    if len(request.messages) > MAX_MESSAGES:
        raise InvalidArgument(f"messages has {len(request.messages)} entries; at most {MAX_MESSAGES}")
    size = 0
    for i, message in enumerate(request.messages):
        if not message.role:
            raise InvalidArgument(f"messages[{i}].role is empty")
        size += len(message.role.encode()) + len(message.content.encode())
    if size > MAX_PROMPT_BYTES:
        raise InvalidArgument(f"messages are {size} bytes; at most {MAX_PROMPT_BYTES}")
    return PromptInput(messages=tuple((m.role, m.content) for m in request.messages))


async def check_context(engine: GenerationEngine, prompt: Prompt, max_new_tokens: int) -> None:
    """INVALID_ARGUMENT when the prompt and its new tokens cannot fit the model's context."""
    if (context := engine.context_tokens) is None:
        return
    if isinstance(prompt, ImagePrompt):
        return  # image tokens are counted by the processor; the model's own limit applies
    if isinstance(prompt, str):
        tokens = len(await asyncio.to_thread(lambda: engine.tokenizer(prompt)["input_ids"]))
    else:
        tokens = len(prompt)
    if tokens + max_new_tokens > context:
        raise InvalidArgument(
            f"prompt is {tokens} tokens; with max_new_tokens {max_new_tokens} that exceeds the model's "
            f"context of {context} tokens"
        )
