"""What an agent trial's prompt says about handing the work in (dockyard/tasks/instructions.py).

Every environment of the registry (the env names EnvConfig accepts) is rendered for an external scaffold
through the loader a job uses (`split_tasks`): no name of a built-in tool (the kinds the built-in Toolbox
carries out: BUILTIN_TOOL_PARAMETERS) reaches the prompt beyond what the task's own text says, and the
prompt names how that scaffold hands its work in (the answer file, or the end of its run). An external
scaffold on an env scored by an answer needs its answer file; the built-in scaffold's prompts name the
config's own submit tool.
"""

from __future__ import annotations

import json
import re
import typing
from collections import Counter
from pathlib import Path

import pytest

from dockyard.config import BUILTIN_TOOL_PARAMETERS, ENV_SOURCES, STATE_SCORED_ENVS, ConfigError, EnvConfig, load_config
from dockyard.models.tokenizer import CHARSET, build_char_tokenizer
from dockyard.tasks import expr, instructions
from dockyard.tasks.envs import Environment, sandbox_env, split_tasks
from tests.conftest import REPO_ROOT

EXTERNAL = REPO_ROOT / "examples" / "configs" / "tiny_agent_external.yaml"
TASKS = REPO_ROOT / "examples" / "tasks"
# Every env the config accepts: a new one is covered (or fails here) without editing this test.
ENV_NAMES = typing.get_args(EnvConfig.model_fields["name"].annotation)
BUILT_IN_TOOLS = tuple(BUILTIN_TOOL_PARAMETERS)  # shell, read_file, write_file, submit


def task_paths(source: str, tmp_path: Path) -> tuple[str | None, str | None]:
    """(train, validation) data paths of a task source; (None, None) for the generated or bundled ones."""
    if source == "swe":
        for split in ("swe-train", "swe-val"):
            (tmp_path / split).mkdir()
            row = {"instance_id": split, "repo": "pypi/x", "problem_statement": "mean() of [] raises"}
            (tmp_path / split / "instances.jsonl").write_text(json.dumps(row) + "\n")
        return str(tmp_path / "swe-train"), str(tmp_path / "swe-val")
    if source == "qa":
        return str(TASKS / "qa" / "train.jsonl"), str(TASKS / "qa" / "validation.jsonl")
    folders = {"terminal_bench": "terminal", "gdpval": "gdpval", "osworld": "osworld"}
    if source in folders:
        return (str(TASKS / folders[source]),) * 2
    return None, None


def external_config(env: str, tmp_path: Path, *extra: str):
    """tiny_agent_external.yaml (mini-swe-agent, answer_file answer.txt) moved to `env`."""
    source = ENV_SOURCES[env]
    overrides = [f"env.name={env}", f"data.train.source={source}", f"data.validation.source={source}"]
    overrides += [
        "data.train.size=8",
        "data.validation.size=4",
        "data.train.families=[]",
        "data.validation.families=[]",
    ]
    train, validation = task_paths(source, tmp_path)
    if train:
        overrides += [f"data.train.path={train}", f"data.validation.path={validation}"]
    if env == "osworld":
        overrides.append("policy.generation.allow_multimodal_inputs=true")
    return load_config(EXTERNAL, [*overrides, *extra])


def tool_names(text: str) -> Counter:
    return Counter(n for n in BUILT_IN_TOOLS for _ in re.finditer(rf"(?<![A-Za-z0-9_]){n}(?![A-Za-z0-9_])", text))


@pytest.mark.parametrize("env", ENV_NAMES)
def test_an_external_scaffolds_prompt_names_no_built_in_tool_and_says_how_to_hand_in(env, tmp_path):
    if env == "verifiers":  # its scaffold is dockyard's runner, which gives each trial the row's own prompt
        with pytest.raises(ConfigError, match="env.verifiers names the environment of env.name verifiers"):
            external_config(env, tmp_path)
        tasks = split_tasks(load_config(REPO_ROOT / "examples" / "configs" / "tiny_verifiers.yaml"), "train")
        assert tasks and not any(tool_names(t.prompt) or "When you are done" in t.prompt for t in tasks)
        return
    config = external_config(env, tmp_path)
    if env == "osworld":  # desktop trials: no provider, so no trial of any scaffold runs (docs/osworld.md)
        with pytest.raises(ValueError, match="desktop"):
            sandbox_env(config)
        return
    rendered = split_tasks(config, "train")
    # The task's own text, as the env loads it for one completion (no scaffold, no hand-in words).
    own = {t.task_id: t.prompt for t in Environment(env).load("train", config.data.train, config.data.validation)}
    assert rendered and {t.task_id for t in rendered} <= set(own)
    for task in rendered:
        extra = tool_names(task.prompt) - tool_names(own[task.task_id])
        assert not extra, f"{env}: the external scaffold's prompt names built-in tools {dict(extra)}:\n{task.prompt}"
        if env in STATE_SCORED_ENVS:
            assert "When you are done, end your run" in task.prompt, task.prompt
        else:
            answer_file = re.escape(config.env.scaffold.answer_file)
            assert re.search(rf"\bwrite .* to (the file )?{answer_file}\b", task.prompt), task.prompt


def test_an_answer_env_refuses_an_external_scaffold_without_an_answer_file(tmp_path):
    with pytest.raises(ConfigError, match="env.scaffold.answer_file: env expr_agent scores the answer"):
        load_config(EXTERNAL, ["env.scaffold.answer_file=null"])
    # The state-scored envs need none: what the scaffold leaves is scored.
    for env in STATE_SCORED_ENVS:
        (tmp_path / env).mkdir()
        config = external_config(env, tmp_path / env, "env.scaffold.answer_file=null")
        assert config.env.scaffold is not None and config.env.scaffold.answer_file is None


def test_the_tiny_external_prompt_is_the_tiny_models_characters_and_shows_no_point():
    tok = build_char_tokenizer()
    prompts = {t.prompt for t in split_tasks(load_config(EXTERNAL), "train")}
    assert prompts == {expr.external_agent_prompt("answer.txt")}
    [prompt] = prompts
    assert set(prompt) <= set(CHARSET) and not any(ch.isdigit() for ch in prompt)
    assert len(tok(prompt, add_special_tokens=False)["input_ids"]) == len(prompt)
    assert "python f.py <x>" in prompt and prompt.endswith("to answer.txt.")


def test_built_in_prompts_name_the_configs_own_submit_tool(tmp_path):
    shell, submit = {"name": "sh", "kind": "shell"}, {"name": "done", "kind": "submit"}
    swe = instructions.hand_in(EnvConfig(name="swe", tools=[shell, submit]))
    prompt = instructions.agent_prompt("swe", "Fix it.", swe)
    assert prompt.endswith("When you are done, call done.\n") and not tool_names(prompt)
    plain = instructions.agent_prompt("swe", "Fix it.", instructions.hand_in(EnvConfig(name="swe", tools=[shell])))
    assert plain.endswith("When you are done, reply without a tool call.\n")
    # An answer env without a submit tool keeps its prompt: the reply is the answer.
    tiny = load_config(REPO_ROOT / "examples" / "configs" / "tiny_agent.yaml")
    assert {t.prompt for t in split_tasks(tiny, "train")} == {expr.AGENT_PROMPT}
    assert instructions.hand_in(EnvConfig()) is None  # one completion per sample: no trial, no hand-in
