"""The verifiers runner: one rollout of one row of a verifiers environment, run inside the trial's session.

    DOCKYARD_VERIFIERS_ENV = {"module", "args", "row"}  (env.verifiers, and the trial's row)
    import module; load_environment(**args) ──> a vf.Env (its .taskset) or a vf.Taskset
        task = the taskset's tasks[row % their number]   (the env's own rows, in load() order)
        tools = the @vf.tool methods of the task's and the taskset's toolsets, set up for this task
            (setup, setup_task), each toolset registered on an in-process MCP server (no transport)
    rollout: AsyncOpenAI(OPENAI_BASE_URL, OPENAI_API_KEY).chat.completions, model DOCKYARD_MODEL:
        [system_prompt] + prompt, then each reply; its tool calls run and answer as role "tool";
        the rollout ends on a reply without a tool call, after DOCKYARD_MAX_TURNS calls, or when the
        endpoint refuses a turn for the trial's budget (429, or a 400 generate_refused for a prompt past
        the context); any other refusal is the runner's failure (a scaffold error, masked)
    score: task.score(trace) (the task's @vf.reward / @vf.metric functions and judges that need no
        runtime) on a trace of the rollout's messages ──> sum of weighted rewards
    ──> DOCKYARD_VERIFIERS_RESULT (a JSON file in the work folder): {"reward", "rewards", "turns"}, or
        {"error": "the rubric ..."} when scoring raised, or gave no reward

Runs under the environment's own interpreter (the session image's /opt/venv), never dockyard's: it
imports nothing of dockyard, only the standard library, `verifiers` (which brings `openai` and `mcp`)
and the named module. Guarantees: the prompt is the row's, as the environment built it; every model
call goes through the one client, whose key binds it to the trial's endpoint session (the endpoint
records its exact tokens); sampling settings are the job's (none are sent: the endpoint would ignore
them); a failure before scoring (the module, load_environment, the endpoint) exits non-zero with its
traceback on stderr (a scaffold error, masked); a rubric that raises is written as an error, so its
trial is masked, never scored 0. Not covered: the environment's code is trusted, and runs in the same
process as the tools the policy calls (docs/environments.md says what scoring in the container means).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import sys
import traceback

# The endpoint's answers to a turn past the trial's budget: too many turns (429), or a prompt the engine
# refuses for its context (400, code generate_refused). Any other 400 is a request this runner got wrong.
BUDGET_REFUSALS = {429: None, 400: "generate_refused"}


class Trace:
    """What a verifiers rubric reads of a rollout: its messages; what it writes: rewards and metrics."""

    def __init__(self, messages: list[dict]) -> None:
        from pydantic import TypeAdapter
        from verifiers.v1.types import Messages

        self.messages = TypeAdapter(Messages).validate_python(messages)
        self.rewards: dict = {}
        self.metrics: dict = {}
        self.info: dict = {}

    @property
    def last_message(self):
        return self.messages[-1]

    def record_reward(self, name: str, value: float, weight: float = 1.0) -> None:
        from verifiers.v1.trace import Reward

        self.rewards[name] = Reward(score=float(value), weight=float(weight))

    def record_metric(self, name: str, value: float) -> None:
        self.metrics[name] = value

    def record_metrics(self, values) -> None:
        self.metrics.update(values)

    @property
    def reward(self) -> float:
        return sum(r.value for r in self.rewards.values() if r is not None)


def environment_tasks(spec: dict):
    """(taskset, the row's task) of the named environment."""
    module = importlib.import_module(spec["module"])
    env = module.load_environment(**spec.get("args", {}))
    taskset = getattr(env, "taskset", env)
    tasks = list(taskset)
    if not tasks:
        raise ValueError(f"{spec['module']}.load_environment(...) has no task")
    return taskset, tasks[spec["row"] % len(tasks)]


class Tools:
    """The task's tools as verifiers serves them: each toolset registered on its own in-process MCP server,
    advertised as <server>_<tool> (bare when the toolset's TOOL_PREFIX is None)."""

    def __init__(self) -> None:
        self.schemas: list[dict] = []
        self.dispatch: dict[str, tuple[object, str]] = {}  # advertised name -> (its server, its own name)

    @classmethod
    async def of(cls, taskset, task) -> Tools:
        from mcp.server.mcpserver import MCPServer

        tools = cls()
        for toolset in [*type(task).toolsets(task.config), *type(taskset).toolsets(taskset.config)]:
            await toolset.setup()
            await toolset.setup_task(task)
            server = MCPServer()
            toolset.register(server)
            prefix = toolset.server_name
            for tool in await server.list_tools():
                name = f"{prefix}_{tool.name}" if prefix else tool.name
                if name in tools.dispatch:
                    raise ValueError(f"two tools are named {name!r}")
                tools.dispatch[name] = (server, tool.name)
                function = {"name": name, "description": tool.description or "", "parameters": tool.input_schema}
                tools.schemas.append({"type": "function", "function": function})
        return tools

    async def call(self, name: str, arguments: dict) -> str:
        if name not in self.dispatch:
            raise ValueError(f"no tool is named {name!r}")
        server, raw = self.dispatch[name]
        result = await server.call_tool(raw, arguments)
        return "\n".join(getattr(block, "text", str(block)) for block in result.content)


def first_messages(task) -> list[dict]:
    data = task.data
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        return [*messages, {"role": "user", "content": data.prompt}]
    return [*messages, *(m.model_dump(exclude_none=True) for m in data.prompt or [])]


async def rollout(client, model: str, messages: list[dict], tools: Tools, max_turns: int, max_tokens: int) -> int:
    """The conversation, extended in place; the number of model calls made."""
    import openai

    turns = 0
    while turns < max_turns:
        try:
            reply = await client.chat.completions.create(
                model=model,
                messages=messages,
                max_tokens=max_tokens,
                **({"tools": tools.schemas} if tools.schemas else {}),
            )
        except openai.APIStatusError as exc:
            if exc.status_code in BUDGET_REFUSALS and BUDGET_REFUSALS[exc.status_code] in (None, exc.code):
                break  # the trial's budget: scored as it stands
            raise
        turns += 1
        message = reply.choices[0].message
        calls = message.tool_calls or []
        messages.append(
            {
                "role": "assistant",
                "content": message.content,
                **({"tool_calls": [c.model_dump(include={"id", "type", "function"}) for c in calls]} if calls else {}),
            }
        )
        if not calls:
            break
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": await _call(tools, call)})
    return turns


async def _call(tools: Tools, call) -> str:
    """A tool's text result; what went wrong, as text, when the call is not one the tools take."""
    try:
        return await tools.call(call.function.name, json.loads(call.function.arguments or "{}"))
    except Exception as exc:  # the policy's mistake (bad arguments, unknown tool) or the tool's: its reply
        return f"error: {exc}"


def trace_messages(messages: list[dict]) -> list[dict]:
    """The OpenAI messages in verifiers' own message types (tool calls flattened)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [
                {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                for c in m["tool_calls"]
            ]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


async def score(task, messages: list[dict]) -> dict:
    trace = Trace(trace_messages(messages))
    try:
        await task.score(trace)
    except Exception:
        return {"error": f"the rubric raised: {traceback.format_exc()[-1500:]}"}
    scored = {name: r.value for name, r in trace.rewards.items() if r is not None}
    if not scored:
        return {"error": "the rubric gave no reward (none of its rewards runs without a runtime)"}
    return {"reward": trace.reward, "rewards": scored, "metrics": trace.metrics}


async def main() -> None:
    from openai import AsyncOpenAI

    spec = json.loads(os.environ["DOCKYARD_VERIFIERS_ENV"])
    taskset, task = environment_tasks(spec)
    tools = await Tools.of(taskset, task)
    messages = first_messages(task)
    client = AsyncOpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY: the trial's endpoint session
    turns = await rollout(
        client,
        os.environ["DOCKYARD_MODEL"],
        messages,
        tools,
        int(os.environ["DOCKYARD_MAX_TURNS"]),
        int(os.environ["DOCKYARD_MAX_NEW_TOKENS"]),
    )
    result = {**await score(task, messages), "turns": turns}
    with open(os.environ["DOCKYARD_VERIFIERS_RESULT"], "w") as out:
        json.dump(result, out)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
