"""The job's tokenizer as the endpoint uses it: render a conversation, tokenize, decode, close a turn.

    messages (internal form) ──render(tools, generation_prompt)──> text ──encode──> ids

Messages here are chat-template dicts: `role`, `content` (a string), and on an
assistant message optional `tool_calls` ([{id, type: "function", function: {name,
arguments: dict}}]); a tool result has `role: "tool"` and `tool_call_id`.
Guarantees: `encode` adds no special token (templates write their own), so the
ids are exactly the rendered text's; `closing` is the text the template puts
after an assistant message's content (e.g. "<|im_end|>\\n"), found by rendering
a sentinel, or None when the template does not render content verbatim.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

Message = dict[str, Any]
_SENTINEL = "DOCKYARDCONTENTSENTINEL"


class Renderer:
    """A tokenizer and its chat template (thread-safe for reads; call from a worker thread: it is CPU work)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if not tokenizer.chat_template:
            raise ValueError("the policy's tokenizer has no chat_template; the endpoint needs one")
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id

    def render(self, messages: list[Message], tools: list[dict] | None, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=generation_prompt, tokenize=False
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def decode_each(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([i], skip_special_tokens=False) for i in ids]

    def closing(self, before: list[Message], tools: list[dict] | None) -> str | None:
        """What the template writes after an assistant message's content, at the end of `before`."""
        prompt = self.render(before, tools, generation_prompt=True)
        full = self.render([*before, {"role": "assistant", "content": _SENTINEL}], tools, generation_prompt=False)
        if not full.startswith(prompt) or _SENTINEL not in full[len(prompt) :]:
            return None
        return full[len(prompt) :].split(_SENTINEL, 1)[1]


def bridge(sampled_text: str, closing: str) -> str:
    """The part of `closing` the model did not write itself (it may have ended with, e.g., <|im_end|>)."""
    for k in range(len(closing), 0, -1):
        if sampled_text.endswith(closing[:k]):
            return closing[k:]
    return closing
