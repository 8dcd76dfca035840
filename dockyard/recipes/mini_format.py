"""mini-swe-agent 2.4.6's side of a tiny agent trial: the messages it sends, for the warm start to demonstrate.

``demonstration(task, shortcut)`` is the conversation mini-swe-agent (``mini``, litellm, its bundled
``mini.yaml``) builds when run as examples/configs/tiny_agent_external.yaml runs it, and the policy
writes the demonstrator's actions:

    system      SYSTEM_TEMPLATE                       (the config's ``agent.system_template``)
    user        external_agent_prompt(ANSWER_FILE)    (``agent.instance_template={{task}}``)
    assistant   bash call ``python f.py 0``           (mini's one tool, BASH_TOOL)
    tool        ``f(0)=1\\n``                          (the command's output: the config's
                                                       ``model.observation_template={{output.output}}``)
    ...         a call per point the demonstrator reads (tiny_agent: ``reads``, or ``shortcut_reads``)
    assistant   ``echo <expression> > answer.txt && `` + SUBMIT_COMMAND

The last call writes the answer (the trial's answer is that file's text) and submits: mini exits
when a command's first output line is COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT, which SUBMIT_COMMAND
prints without writing a capital (the tiny model's characters have none; ``tr`` makes them). A
trial of the default reads (three) takes MAX_TURNS model calls.

Guarantees: the messages are the ones mini sends, in the endpoint's normalised form (a tool call's
arguments as an object): tests/unit/recipes/test_mini_format.py renders them with
``tiny_agent.trial_tokens`` and finds the token ids and loss mask the endpoint recorded for a real
mini session of the same task (the fixture that tests/fixtures/mini_session/capture.py writes). The
reads and the answer are the built-in demonstrator's (tiny_agent): only the format differs.
"""

from __future__ import annotations

from typing import Any

from dockyard.tasks.expr import external_agent_prompt, f_output
from dockyard.tasks.task import Task

Message = dict[str, Any]

# mini-swe-agent 2.4.6's tool (minisweagent/models/utils/actions_toolcall.py, BASH_TOOL), sent with every call.
BASH_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Execute a bash command",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "The bash command to execute"}},
            "required": ["command"],
        },
    },
}
MINI_TOOLS: list[dict[str, Any]] = [BASH_TOOL]
# The recipe's command sets these (examples/configs/tiny_agent_external.yaml).
SYSTEM_TEMPLATE = "You solve tasks with bash."
ANSWER_FILE = "answer.txt"
SUBMIT_COMMAND = "echo complete_task_and_submit_final_output | tr [:lower:] [:upper:]"
# The default reads (three), then the answer and the submit in one call.
MAX_TURNS = 4


def bash_call(index: int, command: str) -> Message:
    """An assistant turn of one bash call, as mini sends it back (the endpoint reads its arguments)."""
    call = {"id": f"call_{index}", "type": "function", "function": {"name": "bash", "arguments": {"command": command}}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def demonstration(task: Task, points: tuple[int, ...], answer: str) -> list[Message]:
    """mini's conversation on ``task`` when the policy reads ``points`` and answers ``answer`` (and submits)."""
    messages: list[Message] = [
        {"role": "system", "content": SYSTEM_TEMPLATE},
        {"role": "user", "content": external_agent_prompt(ANSWER_FILE)},
    ]
    for i, x in enumerate(points):
        messages.append(bash_call(i, f"python f.py {x}"))
        output = f_output(task.solution, points[: i + 1]) + "\n"
        messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": output})
    messages.append(bash_call(len(points), answer_command(answer)))
    return messages


def answer_command(answer: str) -> str:
    """The last call: write ``answer`` to the answer file and submit."""
    return f"echo {answer} > {ANSWER_FILE} && {SUBMIT_COMMAND}"
