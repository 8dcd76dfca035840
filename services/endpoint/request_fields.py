"""Request fields the endpoint does not implement: refused by name unless they ask for nothing.

Guarantees: a top-level field that would change the reply and that the endpoint does not implement
is a BadRequest naming it, unless it carries the value that asks for nothing (the API's default);
fields that change nothing the model is asked or how it samples are accepted; any other field not
in the request's schema is a BadRequest naming it. Nothing a client asks for is silently dropped.
"""

from __future__ import annotations

from typing import Any

from services.endpoint.errors import BadRequest

# Request fields the endpoint does not implement, with the values that ask for nothing (the API's
# defaults): any other value is a 400 naming the field, never a silent no-op.
OPENAI_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "repetition_penalty": (1,),  # vLLM's extension
    "min_p": (0,),  # vLLM's extension
    "logit_bias": ({},),
    "response_format": ({"type": "text"},),
    "parallel_tool_calls": (True,),  # a reply may hold several calls; one cannot be enforced
    "modalities": (["text"],),
    "functions": (),
    "function_call": (),
    "audio": (),
    "prediction": (),
    "web_search_options": (),
}
# Anthropic's `thinking` is implemented (services/endpoint/reasoning.py): nothing left here.
ANTHROPIC_NEUTRAL: dict[str, tuple[Any, ...]] = {}
RESPONSES_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "parallel_tool_calls": (True,),
    "truncation": ("disabled",),
    "text": ({"format": {"type": "text"}},),
    "background": (False,),
    "max_tool_calls": (),
    "prompt": (),
    "conversation": (),
}
# Fields that change nothing the model is asked or how it samples: accepted (and unused).
NO_EFFECT = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"})


def check_supported(body: Any, neutral: dict[str, tuple[Any, ...]]) -> None:
    """BadRequest naming the first field the body sets that the endpoint does not implement."""
    given = {**(body.model_extra or {}), **{k: getattr(body, k) for k in neutral if k in type(body).model_fields}}
    for name, value in given.items():
        if value is None or name in NO_EFFECT or (name in neutral and value in neutral[name]):
            continue
        if name in neutral:
            allowed = " or ".join(repr(v) for v in (None, *neutral[name]))
            raise BadRequest(f"{name}: not supported by the dockyard policy endpoint (send {allowed}, or leave it out)")
        raise BadRequest(f"{name}: not a field the dockyard policy endpoint supports (docs/endpoint-api.md lists them)")
