"""The scaffold's tools: schemas from env.tools, argument checks the model reads, argv substitution."""

from __future__ import annotations

import pytest

from dockyard.agents.session import CommandResult
from dockyard.agents.tools import Toolbox, schemas
from dockyard.config import EnvConfig, ToolConfig

TOOLS = [
    ToolConfig(name="f", parameters={"x": "integer"}, command=["python3", "f.py", "{x}"]),
    ToolConfig(name="sh", kind="shell"),
    ToolConfig(name="read", kind="read_file"),
    ToolConfig(name="write", kind="write_file"),
    ToolConfig(name="submit", kind="submit", description="the answer"),
]


class RecordingSession:
    """Stands for a sandbox session: records what the tools asked of it."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.files: dict[str, bytes] = {}

    async def run(self, argv=None, shell=None) -> CommandResult:
        self.calls.append(("run", argv, shell))
        return CommandResult(0 if argv else 3, "out\n", "", False)

    async def read_file(self, path: str, max_bytes: int = 0):
        return self.files[path][:max_bytes], len(self.files[path]) > max_bytes

    async def write_file(self, path: str, content: bytes) -> None:
        self.files[path] = content


def test_schemas_are_openai_function_tools() -> None:
    f, sh, _, write, submit = schemas(TOOLS)
    assert f == {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"x": {"type": "integer"}},
                "required": ["x"],
                "additionalProperties": False,
            },
        },
    }
    assert sh["function"]["parameters"]["required"] == ["command"]
    assert write["function"]["parameters"]["required"] == ["path", "content"]
    assert submit["function"]["description"] == "the answer"


async def test_calls_run_in_the_session_and_mistakes_come_back_as_text() -> None:
    session = RecordingSession()
    box = Toolbox(TOOLS, session, max_output_chars=20)
    assert (await box.call("f", '{"x": 3}')).text == "out"
    assert session.calls[-1] == ("run", ["python3", "f.py", "3"], None)
    shell = await box.call("sh", {"command": "ls; rm -rf x"})
    assert session.calls[-1] == ("run", None, "ls; rm -rf x") and shell.text == "out\n[exit code 3]"
    await box.call("write", {"path": "a.txt", "content": "hello world, and more"})
    assert session.files["a.txt"] == b"hello world, and more"
    assert (await box.call("read", {"path": "a.txt"})).text == "hello world, and mor\n[truncated]"
    done = await box.call("submit", {"answer": "2*x"})
    assert done.submitted == "2*x"
    calls = len(session.calls)
    for name, args, says in [
        ("g", {}, "no tool 'g'"),
        ("f", "{x: 3", "not JSON"),
        ("f", "[3]", "must be a JSON object"),
        ("f", "", "not JSON"),
        ("f", {}, "'x' is a required property"),
        ("f", {"x": "3"}, "arguments.x of f: '3' is not of type 'integer'"),
        ("f", {"x": True}, "arguments.x of f: True is not of type 'integer'"),
        ("f", {"x": 1, "y": 2}, "('y' was unexpected)"),
        ("write", {"path": "a.txt"}, "'content' is a required property"),
    ]:
        result = await box.call(name, args)
        assert result.text.startswith("error: ") and says in result.text and result.submitted is None
    assert len(session.calls) == calls  # no mistaken call reached the sandbox


@pytest.mark.parametrize(
    "tool, message",
    [
        ({"name": "f", "parameters": {"x": "integer"}}, "needs `command`"),
        ({"name": "f", "command": ["echo", "{y}"]}, "uses ['y']"),
        ({"name": "s", "kind": "submit", "parameters": {"a": "string"}}, "takes no command or parameters"),
        ({"name": "Bad-Name", "kind": "submit"}, "String should match pattern"),
    ],
)
def test_bad_tool_configs_are_refused(tool: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("`", ".")):
        ToolConfig(**tool)


def test_an_agent_has_at_most_one_submit_tool_and_distinct_names() -> None:
    with pytest.raises(ValueError, match="at most one tool of kind submit"):
        EnvConfig(tools=[{"name": "s", "kind": "submit"}, {"name": "t", "kind": "submit"}])
    assert EnvConfig(tools=[{"name": "sh", "kind": "shell"}]).agentic  # it answers in text instead
    with pytest.raises(ValueError, match="names must differ"):
        EnvConfig(tools=[{"name": "s", "kind": "submit"}, {"name": "s", "kind": "shell"}])
    assert EnvConfig(tools=[{"name": "s", "kind": "submit"}]).agentic and not EnvConfig().agentic
