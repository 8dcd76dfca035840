"""Token logprobs as the OpenAI APIs write them: chat completions' `logprobs.content`, Responses' `output_text`.

    Choice(tokens, logprobs, top_logprobs) ──chat_logprobs──> {"content": [{token, logprob, bytes, top_logprobs}]}
                                           ──output_text_logprobs──> [{token, bytes, logprob, top_logprobs}]
                                           ──event_logprobs──> [{token, logprob, top_logprobs}] (Responses events)

Guarantees: one entry per sampled token, in order, with the logprob the rollout reported (the law the
trainer recomputes: log_softmax(logits / temperature) before truncation); its `top_logprobs` are the
alternatives the request asked for (top_logprobs = k: the step's k most likely tokens, most likely first,
under the same law; the sampled token among them only when it is one of the k), empty when it asked
none; `bytes` are the UTF-8 bytes of each token's text. The Responses stream events carry no `bytes`,
as their type defines.
"""

from __future__ import annotations

from typing import Any, Protocol


class Choice(Protocol):
    """What these functions read of a reply's choice (convert.Choice)."""

    tokens: list[str]
    logprobs: list[float]
    top_logprobs: list[list[tuple[str, float]]]  # per token (empty: none asked), (token text, logprob) each


def _entry(token: str, logprob: float, with_bytes: bool) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, **({"bytes": list(token.encode())} if with_bytes else {})}


def _entries(choice: Choice, with_bytes: bool) -> list[dict[str, Any]]:
    tops = choice.top_logprobs or [[] for _ in choice.tokens]
    return [
        {**_entry(token, logprob, with_bytes), "top_logprobs": [_entry(t, lp, with_bytes) for t, lp in top]}
        for token, logprob, top in zip(choice.tokens, choice.logprobs, tops, strict=True)
    ]


def chat_logprobs(choice: Choice) -> dict[str, Any]:
    """A chat completion choice's `logprobs` (ChatCompletionTokenLogprob entries)."""
    return {"content": _entries(choice, with_bytes=True)}


def output_text_logprobs(choice: Choice) -> list[dict[str, Any]]:
    """An `output_text` part's `logprobs` (the Responses API's Logprob entries)."""
    return _entries(choice, with_bytes=True)


def event_logprobs(choice: Choice) -> list[dict[str, Any]]:
    """The `logprobs` of `response.output_text.delta` / `.done` events."""
    return _entries(choice, with_bytes=False)
