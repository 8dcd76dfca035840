"""The agent's tools (`env.tools`) and an external scaffold (`env.scaffold`).

Guarantees: a tool's command names only its own parameters and never runs through a shell; a
scaffold's extra environment cannot override what dockyard sets for it (SCAFFOLD_ENV_NAMES).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from dockyard.config.section import Section

ToolKind = Literal["command", "shell", "read_file", "write_file", "submit"]
# Tool kinds that can change the session's files (a multi-turn SWE trial is scored by its edits).
FILE_CHANGING_TOOLS = frozenset({"command", "shell", "write_file"})
# The parameters of the built-in tool kinds (all strings); a command tool declares its own.
BUILTIN_TOOL_PARAMETERS: dict[str, tuple[str, ...]] = {
    "shell": ("command",),
    "read_file": ("path",),
    "write_file": ("path", "content"),
    "submit": ("answer",),
}


class ToolConfig(Section):
    """One tool of the built-in scaffold (dockyard/agents/tools.py): a built-in kind, or a command."""

    name: str = Field(
        pattern=r"^[a-z_][a-z0-9_]{0,63}$",
        description=(
            "The name the model calls it by: lowercase letters, digits and `_`, starting with a letter or `_`."
        ),
    )
    kind: ToolKind = Field(
        "command",
        description=(
            "`command`: run `command` in the session's work folder; `shell`: run the `command` "
            "argument with `sh -c` in the session; `read_file` (`path`) / `write_file` (`path`, "
            "`content`): a file of the session's work folder; `submit` (`answer`): ends the trial, "
            "the answer is scored."
        ),
    )
    description: str = Field("", max_length=1024, description="What the model is told the tool does.")
    parameters: dict[str, Literal["string", "integer", "number", "boolean"]] = Field(
        default_factory=dict,
        description=(
            "`command` tools: parameter name → JSON type (`string`, `integer`, `number`, `boolean`); "
            "all are required. Built-in kinds have fixed string parameters and take none here."
        ),
    )
    command: list[str] | None = Field(
        None,
        description=(
            "`command` tools: the argv, run in the session's work folder, in which `{name}` is "
            "replaced by that argument (never through a shell); every `{name}` must be a parameter."
        ),
    )

    @model_validator(mode="after")
    def _consistent(self) -> ToolConfig:
        if self.kind == "command":
            if not self.command:
                raise ValueError(f"tool {self.name!r}: a command tool needs `command` (an argv list)")
            used = {name for item in self.command for name in re.findall(r"{([a-z_][a-z0-9_]*)}", item)}
            if unknown := sorted(used - set(self.parameters)):
                raise ValueError(f"tool {self.name!r}: command uses {unknown}, which are not among its parameters")
        elif self.command is not None or self.parameters:
            raise ValueError(f"tool {self.name!r}: a {self.kind} tool takes no command or parameters")
        return self

    @property
    def parameter_types(self) -> dict[str, str]:
        if self.kind == "command":
            return dict(self.parameters)
        return dict.fromkeys(BUILTIN_TOOL_PARAMETERS[self.kind], "string")


# Set for every external scaffold's command (docs/agents.md#external-scaffolds); env cannot override them.
SCAFFOLD_ENV_NAMES = (
    "OPENAI_BASE_URL",
    "OPENAI_API_BASE",
    "OPENAI_API_KEY",
    "ANTHROPIC_BASE_URL",
    "ANTHROPIC_API_KEY",
    "DOCKYARD_MODEL",
    "DOCKYARD_TASK",
    "DOCKYARD_MAX_TURNS",
    "DOCKYARD_MAX_SECONDS",
    "DOCKYARD_MAX_NEW_TOKENS",
    "HOME",
)


class ScaffoldConfig(Section):
    """An external agent program run per trial in its sandbox session, instead of the built-in loop."""

    command: str = Field(
        min_length=1,
        max_length=16384,
        description=(
            "Shell line run in the session's work folder (`sh -c`), with the trial's variables set: "
            "`OPENAI_BASE_URL` / `OPENAI_API_BASE` (`<route>/v1`), `ANTHROPIC_BASE_URL`, "
            "`OPENAI_API_KEY` = `ANTHROPIC_API_KEY` (the trial's endpoint session key), "
            "`DOCKYARD_MODEL`, `DOCKYARD_TASK` (the prompt), `DOCKYARD_MAX_TURNS`, "
            "`DOCKYARD_MAX_SECONDS`, `DOCKYARD_MAX_NEW_TOKENS`."
        ),
    )
    package: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._\-\[\],]*\s*(?:[=<>!~]=?[^\s;]+)?$",
        description=(
            "pip requirement the command comes from (`mini-swe-agent==2.4.6`): the sandbox installs "
            "it into the session's image (an environment image built once from its wheelhouse with "
            "`--network none`, plus a SWE instance's own requirements); `null`: the sandbox image has "
            "the command already."
        ),
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Extra variables of the command: the scaffold's own settings. Names are `A-Z 0-9 _`; the "
            "variables above and `HOME` cannot be overridden."
        ),
    )
    answer_file: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9._-][A-Za-z0-9._/-]{0,254}$",
        description=(
            "Envs that score an answer (all but `swe`, `terminal_bench` and `gdpval`, which score the "
            "state the scaffold leaves): the work-folder file whose text is the trial's answer, read "
            "once the scaffold has exited; the prompt tells the scaffold to write its answer there "
            "([agents.md](agents.md#what-an-external-scaffold-is-told)). Required for those envs; "
            "a file that is missing then is the empty answer."
        ),
    )

    max_error_fraction: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        allow_inf_nan=False,
        description=(
            "The job fails when more than this fraction of a step's worth of training trials "
            "(`num_prompts_per_step` × `num_generations_per_prompt`) are scaffold errors (a non-zero "
            "exit, the time limit, unreadable output, no model call), naming the scaffold and its last "
            "error; below it each is a masked trial, counted in `scaffold_errors`. `1.0`: never."
        ),
    )

    @model_validator(mode="after")
    def _env_names(self) -> ScaffoldConfig:
        for name in self.env:
            if not re.fullmatch(r"[A-Z_][A-Z0-9_]{0,127}", name):
                raise ValueError(f"env.scaffold.env: {name!r} is not a variable name (A-Z 0-9 _)")
            if name in SCAFFOLD_ENV_NAMES:
                raise ValueError(f"env.scaffold.env: {name} is set by dockyard (the trial's endpoint and budget)")
        if self.answer_file and ".." in self.answer_file.split("/"):
            raise ValueError("env.scaffold.answer_file: a path inside the work folder, without '..'")
        return self
