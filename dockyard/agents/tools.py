"""The scaffold's tools: env.tools as OpenAI tool schemas, and each call carried out in a sandbox session.

    ToolConfig(kind, name, parameters, command) ──schemas──> [{"type": "function", "function": {...}}]
    (name, arguments JSON) ──Toolbox.call──> ToolResult(text for the model, or the submitted answer)

Guarantees: a call is judged by the same rule the endpoint's parsers apply
(`dockyard.agents.tool_calls.ToolRules` over `schemas(tools)`, whose parameters refuse unknown keys):
a call the model got wrong (an unknown tool, arguments that are not a JSON object, a missing, unknown
or ill-typed parameter) reaches no sandbox and is answered with an error text the model reads as the
tool's result, and the trial goes on; a command tool's arguments only ever replace `{name}` in its argv
items, never pass through a shell (a `shell` tool is a shell by design, inside the session); a tool's
text is clipped to `max_output_chars`. Sandbox failures (gRPC errors) propagate: they are the
infrastructure's, not the policy's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from dockyard.agents.session import CommandResult, SandboxSession
from dockyard.agents.tool_calls import ToolRules
from dockyard.config import ToolConfig


def schemas(tools: list[ToolConfig]) -> list[dict[str, Any]]:
    """The tools as the OpenAI Chat Completions API describes them."""
    out = []
    for tool in tools:
        params = tool.parameter_types
        function: dict[str, Any] = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        function["parameters"] = {
            "type": "object",
            "properties": {name: {"type": kind} for name, kind in params.items()},
            "required": list(params),
            "additionalProperties": False,  # a parameter the tool does not take is a mistake, not ignored
        }
        out.append({"type": "function", "function": function})
    return out


@dataclass(frozen=True)
class ToolResult:
    text: str  # what the model reads as the tool's result
    submitted: str | None = None  # the answer, when this was the submit tool


class Toolbox:
    def __init__(self, tools: list[ToolConfig], session: SandboxSession, max_output_chars: int = 4096) -> None:
        self._tools = {t.name: t for t in tools}
        self._rules = ToolRules(schemas(tools))
        self._session = session
        self._max_chars = max_output_chars

    async def call(self, name: str, arguments: str | dict[str, Any]) -> ToolResult:
        if isinstance(arguments, str):  # the OpenAI wire format carries them as JSON text
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as exc:
                return ToolResult(f"error: the arguments of {name} are not JSON: {exc.msg}")
        if error := self._rules.arguments_error(name, arguments):
            return ToolResult(f"error: {error}")
        tool, args = self._tools[name], arguments
        if tool.kind == "submit":
            return ToolResult("submitted", submitted=str(args["answer"]))
        if tool.kind == "read_file":
            content, truncated = await self._session.read_file(args["path"], max_bytes=self._max_chars)
            return ToolResult(content.decode("utf-8", "replace") + ("\n[truncated]" if truncated else ""))
        if tool.kind == "write_file":
            await self._session.write_file(args["path"], args["content"].encode())
            return ToolResult(f"wrote {len(args['content'])} characters to {args['path']}")
        if tool.kind == "shell":
            return ToolResult(self._clip(_command_text(await self._session.run(shell=args["command"]))))
        argv = [_substitute(item, args) for item in tool.command or ()]
        return ToolResult(self._clip(_command_text(await self._session.run(argv=argv))))

    def _clip(self, text: str) -> str:
        return text if len(text) <= self._max_chars else text[: self._max_chars] + "\n[truncated]"


def _substitute(item: str, args: dict[str, Any]) -> str:
    for name, value in args.items():
        item = item.replace("{" + name + "}", json.dumps(value) if not isinstance(value, str) else value)
    return item


def _command_text(result: CommandResult) -> str:
    """What the model reads: the output, and how the command ended when that is not plain success."""
    text = (result.stdout + result.stderr).strip()
    if result.timed_out:
        return f"{text}\n[killed: time limit]".strip()
    if result.exit_code != 0:
        return f"{text}\n[exit code {result.exit_code}]".strip()
    return text
