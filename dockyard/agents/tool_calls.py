"""Is this tool call valid for these tools: the one rule the endpoint's parsers and the built-in scaffold apply.

    the request's tools (OpenAI function tools) ──ToolRules──> .call_error(call) / .arguments_error(name, args)
                                                           ──> None: a valid call, else why it is not

A call the model wrote is valid exactly when it is a JSON object with the keys `name` and `arguments`
and no other (a misnamed key such as `ahguments` is no call), the name is one of the tools', and the
arguments are a JSON object valid for that tool's JSON schema (`function.parameters`; a tool without
one takes no arguments, as the OpenAI API defines it). Anything else is an invalid action: never
repaired into a call, counted, and penalized by grpo.invalid_action_penalty (docs/agents.md).

Guarantees: pure functions of the call and the tools, no state; nothing is ever fetched (a schema's
`$ref` resolves only inside that schema; `check_tools` refuses one that does not, and a schema that
is not a valid JSON schema, before any call is judged by it), so a tool's schema is the client's
fault, never the policy's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from jsonschema.exceptions import SchemaError, best_match
from jsonschema.validators import validator_for
from referencing import Registry
from referencing.exceptions import Unresolvable
from referencing.jsonschema import DRAFT202012

CALL_KEYS = ("name", "arguments")
# `parameters` omitted: the function takes no arguments (the OpenAI API's definition).
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
_NO_RETRIEVAL = Registry()  # no `retrieve`: a $ref outside the schema is unresolvable, never fetched


def _schema(function: dict[str, Any]) -> dict[str, Any]:
    schema = function.get("parameters")
    return NO_PARAMETERS if schema is None else schema


def _refs(schema: Any) -> Iterator[str]:
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key in ("$ref", "$dynamicRef") and isinstance(value, str):
                yield value
            else:
                yield from _refs(value)
    elif isinstance(schema, list):
        for item in schema:
            yield from _refs(item)


def check_tools(tools: list[dict[str, Any]] | None) -> None:
    """ValueError naming the tool whose schema is not a JSON schema or has a $ref outside itself."""
    for i, tool in enumerate(tools or ()):
        function = tool.get("function", tool)
        schema = _schema(function)
        where = f"tools[{i}] ({function.get('name')!r})"
        try:
            validator_for(schema).check_schema(schema)
        except SchemaError as exc:
            raise ValueError(f"{where}: the parameters are not a valid JSON schema: {exc.message}") from None
        resolver = _NO_RETRIEVAL.resolver_with_root(DRAFT202012.create_resource(schema))
        for ref in _refs(schema):
            try:
                resolver.lookup(ref)
            except Unresolvable:
                raise ValueError(
                    f"{where}: the parameters' $ref {ref!r} does not resolve inside the schema "
                    "(the endpoint fetches nothing)"
                ) from None


class ToolRules:
    """The tools a call may name and the schema each one's arguments must satisfy."""

    def __init__(self, tools: list[dict[str, Any]] | None) -> None:
        functions = [tool.get("function", tool) for tool in tools or ()]
        self.schemas: dict[str, dict[str, Any]] = {f["name"]: _schema(f) for f in functions}

    def call_error(self, call: Any) -> str | None:
        """Why the call object the model wrote is not a valid call, or None when it is."""
        if not isinstance(call, dict):
            return f"a tool call must be a JSON object with {' and '.join(CALL_KEYS)}, not {type(call).__name__}"
        if unknown := sorted(set(call) - set(CALL_KEYS)):
            return f"a tool call has only the keys {' and '.join(CALL_KEYS)}; it has {', '.join(map(repr, unknown))}"
        if not isinstance(call.get("name"), str):
            return "the tool call has no string `name`"
        if "arguments" not in call:
            return f"the call of {call['name']!r} has no `arguments`"
        return self.arguments_error(call["name"], call["arguments"])

    def arguments_error(self, name: str, arguments: Any) -> str | None:
        """Why `name(arguments)` is not a valid call of these tools, or None when it is."""
        schema = self.schemas.get(name)
        if schema is None:
            return f"no tool {name!r}; the tools are {', '.join(self.schemas) or 'none'}"
        if not isinstance(arguments, dict):
            return f"the arguments of {name} must be a JSON object, not {type(arguments).__name__}"
        try:
            error = best_match(validator_for(schema)(schema, registry=_NO_RETRIEVAL).iter_errors(arguments))
        except Unresolvable as exc:  # check_tools refuses such a schema before; kept from passing a call unchecked
            return f"the schema of {name} does not resolve: {exc}"
        if error is None:
            return None
        where = "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
        return f"the arguments{where} of {name}: {error.message}"
