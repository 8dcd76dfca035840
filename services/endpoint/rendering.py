"""The job's tokenizer as the endpoint uses it: render a conversation, tokenize, decode, close a turn.

    messages (internal form) ──render(tools, generation_prompt)──> text ──encode──> ids

Messages here are chat-template dicts: `role`, `content` (a string), and on an
assistant message optional `tool_calls` ([{id, type: "function", function: {name,
arguments: dict}}]); a tool result has `role: "tool"` and `tool_call_id`.
Guarantees: `encode` adds no special token (templates write their own), so the
ids are exactly the rendered text's; `closing` is the text the template puts
after an assistant message's content (e.g. "<|im_end|>\\n"), found by rendering
a sentinel, or None when the template does not render content verbatim;
`continuation` is the text the template renders for the messages after a reply,
found the same way, so a template that writes the last assistant turn
differently from earlier ones (Qwen3's empty `<think>` block) still continues.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

Message = dict[str, Any]
_SENTINEL = "DOCKYARDCONTENTSENTINEL"


class Renderer:
    """A tokenizer and its chat template (thread-safe for reads: a long render runs in a worker thread, turns.py)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if not tokenizer.chat_template:
            raise ValueError("the policy's tokenizer has no chat_template; the endpoint needs one")
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id

    def render(self, messages: list[Message], tools: list[dict] | None, generation_prompt: bool, **switches) -> str:
        """The template's text; `switches` are its own variables (e.g. enable_thinking=False)."""
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=generation_prompt, tokenize=False, **switches
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

    def continuation(self, before: list[Message], reply: Message, rest: list[Message], tools) -> str | None:
        """The text the template renders for `rest` (and the generation prompt) after `reply`, which follows
        `before`; None when the template does not render the conversation so (its earlier messages, or the
        reply's calls and closing, change with what follows them)."""
        marked = {**reply, "content": _SENTINEL}
        context = self.render(before, tools, generation_prompt=False)
        alone = self.render([*before, marked], tools, generation_prompt=False)
        full = self.render([*before, marked, *rest], tools, generation_prompt=True)
        if alone.count(_SENTINEL) != 1 or full.count(_SENTINEL) != 1:
            return None
        # What comes between the context and the reply's content may differ (the header of the last
        # assistant turn): the reply's recorded ids stand for it, as for the content.
        head, ending = alone.split(_SENTINEL)
        full_head, after = full.split(_SENTINEL)
        if not head.startswith(context) or not full_head.startswith(context) or not after.startswith(ending):
            return None
        return after[len(ending) :]


def bridge(sampled_text: str, closing: str) -> str:
    """The part of `closing` the model did not write itself (it may have ended with, e.g., <|im_end|>)."""
    for k in range(len(closing), 0, -1):
        if sampled_text.endswith(closing[:k]):
            return closing[k:]
    return closing
