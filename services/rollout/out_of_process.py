"""What the vLLM and SGLang adapters share: engines whose model runs in processes of their own.

    job config ──engine_arguments──> checked_arguments (ValueError -> InvalidArgument)
    prompt ──prompt_ids──> ImagePrompt: refused ("images: <why>")
                           text: the model's tokenizer (no tokens: refused)
                           anything else: the adapter's own check of token ids
    weights ──receive_weights (the adapter's)──> worker processes; named_weights() is empty here

Guarantees: an ImagePrompt never reaches either adapter's model (UnsupportedRequest
naming `images` and why); a text prompt that tokenizes to nothing is UnsupportedRequest
("prompt: tokenizes to no tokens"); a config the adapter refuses is InvalidArgument with
the adapter's message; `exclusive()` holds nothing, because these engines' loads go
through their own receive_weights, which holds generations off itself.

Imports: services.rollout.engine and dockyard.rpc.errors only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from dockyard.rpc.errors import InvalidArgument
from services.rollout.engine import GenerationEngine, ImagePrompt, Prompt, UnsupportedRequest

Arguments = TypeVar("Arguments")


class OutOfProcessEngine(GenerationEngine):
    """A GenerationEngine whose weights live in another process (vLLM's workers, SGLang's scheduler)."""

    def named_weights(self) -> dict[str, torch.Tensor]:
        return {}  # nothing to load into here: the adapter's receive_weights moves them

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        yield  # loads go through receive_weights, which holds generations off itself


def checked_arguments(engine_arguments: Callable[[Any], Arguments], cfg: Any) -> Arguments:
    """`engine_arguments(cfg)`, its ValueError (naming the config field) as InvalidArgument."""
    try:
        return engine_arguments(cfg)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def image_refusal(engine: str, why: str) -> str:
    """Why the `engine` adapter takes no ImagePrompt, and what to use instead."""
    return (
        f"the {engine} engine takes no image inputs {why}; "
        "use policy.generation.backend=torch with a vision-language policy"
    )


def prompt_ids(engine: GenerationEngine, prompt: Prompt, token_ids: Callable[[Any], list[int]]) -> list[int]:
    """The ids `engine` generates from: images refused with its `image_refusal`, text through its tokenizer,
    anything else `token_ids(prompt)`."""
    if isinstance(prompt, ImagePrompt):
        raise UnsupportedRequest(f"images: {engine.image_refusal}")
    if isinstance(prompt, str):
        ids = list(engine.tokenizer(prompt)["input_ids"])
        if not ids:
            raise UnsupportedRequest("prompt: tokenizes to no tokens")
        return ids
    return token_ids(prompt)


def outside_vocabulary(ids: list[int], vocab_size: int) -> list[int]:
    """The ids of `ids` that are no token of a vocabulary of `vocab_size`, in order."""
    return [t for t in ids if not 0 <= t < vocab_size]
