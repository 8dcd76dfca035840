"""What an agent trial's prompt says about handing the work in: one home, chosen by the trial's scaffold.

    EnvConfig ──hand_in──> HandIn (None: one completion per sample, no trial)
    task's own prompt ──agent_prompt(env, prompt, HandIn)──> the prompt the scaffold gets
        built-in scaffold (env.tools): the config's own tools say how. A submit tool is named ("When you
            are done, call <its name>."); without one, envs scored from the state the agent leaves are
            told to end with a reply without a tool call, and answer envs keep their prompt as it is
            (the reply is the answer).
        external scaffold (env.scaffold): it has none of the built-in tools, so its prompt names none:
            envs scored from the state it leaves (STATE_SCORED_ENVS) say what is scored when its run
            ends (LEFT_STATE); every other env says to write the answer to env.scaffold.answer_file,
            the file dockyard reads once the scaffold has exited (dockyard/agents/external.py).
            expr_agent's prompt is expr.external_agent_prompt: the tiny model's characters, and how to
            read f without the built-in tool `f`.

Guarantees: an external scaffold's prompt never names a built-in tool (shell, read_file, write_file,
submit) beyond what the task's own text says, and always names how the work is handed in: the
answer file, or the end of its run (tests/unit/tasks/test_instructions.py checks every environment
of the registry). A built-in expr_agent trial without a submit tool keeps expr.AGENT_PROMPT exactly,
the prompt its warm start was trained on.
"""

from __future__ import annotations

from dataclasses import dataclass

from dockyard.config import STATE_SCORED_ENVS, EnvConfig
from dockyard.tasks import expr

# External scaffolds on envs scored from the state they leave: what is scored once their run ends.
LEFT_STATE = {
    "swe": "the repository's changes (its diff against this commit) are scored as they stand then, whatever "
    "your last message says",
    "terminal_bench": "the task's tests then check the state you leave in this machine",
    "gdpval": "the files you leave in your work folder are then checked",
}
assert set(LEFT_STATE) == set(STATE_SCORED_ENVS), "every state-scored env says what is scored"


@dataclass(frozen=True)
class HandIn:
    """How a trial's scaffold hands its work in."""

    external: bool
    submit_tool: str = ""  # built-in: the name of the config's submit tool ("": none)
    answer_file: str = ""  # external, envs scored by an answer: the work-folder file whose text is the answer


def hand_in(env: EnvConfig) -> HandIn | None:
    """How the config's trials hand their work in; None when a sample is one completion, not a trial."""
    if env.name == "verifiers":  # the environment gives each trial its row's own prompt, in the session
        return None
    if env.scaffold is not None:
        return HandIn(external=True, answer_file=env.scaffold.answer_file or "")
    if env.tools:
        return HandIn(external=False, submit_tool=next((t.name for t in env.tools if t.kind == "submit"), ""))
    return None


def agent_prompt(env: str, prompt: str, how: HandIn) -> str:
    """The prompt a trial's scaffold gets: the task's own `prompt` and how to hand the work in."""
    if how.external:
        return _external(env, prompt, how)
    if how.submit_tool:
        return f"{prompt.rstrip()}\n\nWhen you are done, call {how.submit_tool}.\n"
    if env in STATE_SCORED_ENVS:
        return f"{prompt.rstrip()}\n\nWhen you are done, reply without a tool call.\n"
    return prompt


def _external(env: str, prompt: str, how: HandIn) -> str:
    if env in STATE_SCORED_ENVS:
        return f"{prompt.rstrip()}\n\nWhen you are done, end your run: {LEFT_STATE[env]}.\n"
    if not how.answer_file:  # the launch rules refuse such a config (env.scaffold.answer_file)
        raise ValueError(f"env {env} scores an external scaffold's answer: env.scaffold.answer_file names no file")
    if env == "expr_agent":
        return expr.external_agent_prompt(how.answer_file)
    return (
        f"{prompt.rstrip()}\n\nWhen you are done, write your answer, in the form asked for above, to the file "
        f"{how.answer_file} in your working directory, then end your run: that file's text is the answer scored.\n"
    )
