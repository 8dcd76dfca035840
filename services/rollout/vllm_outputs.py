"""vLLM's request outputs as the engine's Completions: sampled tokens, their logprobs, top alternatives, finish reason.

    vllm CompletionOutput (token_ids, logprobs: one {token: Logprob} per step, text, finish_reason, stop_reason)
        ──> Completion(token_ids, logprobs of the sampled tokens, text, "eos" | "stop" | "length", versions, tops)

Guarantees: each step's top k come from vLLM's own logprobs of that step, most likely first (ties in
vLLM's rank order); a finish reason other than vLLM's "length" and "stop" is a RuntimeError, never
guessed.
"""

from __future__ import annotations

from typing import Any

from services.rollout.engine import Completion, TopLogprobs


def top_of_step(step: dict[int, Any], k: int) -> TopLogprobs:
    """The k most likely tokens of one step's vLLM logprobs (its top k, plus the sampled token when that
    ranks lower), most likely first; ties keep vLLM's rank order."""
    ranked = sorted(step.items(), key=lambda item: (-item[1].logprob, item[1].rank))[:k]
    return TopLogprobs([int(token) for token, _ in ranked], [float(lp.logprob) for _, lp in ranked])


def sampled(output: Any) -> tuple[list[int], list[float]]:
    """The token ids of a vLLM CompletionOutput and the logprob of each."""
    token_ids = [int(t) for t in output.token_ids]
    return token_ids, [float(step[token].logprob) for token, step in zip(token_ids, output.logprobs or [], strict=True)]


def finish_reason(output: Any) -> str:
    """ "eos", "stop" or "length" of a finished vLLM CompletionOutput."""
    if output.finish_reason == "length":
        return "length"
    if isinstance(output.stop_reason, str):
        return "stop"
    if output.finish_reason == "stop":
        return "eos"  # the eos token, or a stop token id
    raise RuntimeError(f"vLLM ended a completion with finish_reason={output.finish_reason!r}")


def completion_from_vllm(output: Any, versions: tuple[int, ...], top_logprobs: int = 0) -> Completion:
    """A Completion from a vLLM CompletionOutput (token_ids, logprobs, text, finish_reason, stop_reason);
    with top_logprobs = k > 0, each step's k most likely tokens too."""
    token_ids, logprobs = sampled(output)
    tops = [top_of_step(step, top_logprobs) for step in output.logprobs or []] if top_logprobs else []
    return Completion(token_ids, logprobs, output.text, finish_reason(output), versions, tops)
