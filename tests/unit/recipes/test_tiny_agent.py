"""Agent warm start: trials tokenized as the endpoint records them, an imperfect demonstrator, a loadable folder."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dockyard.agents.tool_formats import parse
from dockyard.models.tokenizer import build_char_tokenizer
from dockyard.recipes.tiny_agent import (
    AGENT_MODEL,
    demonstration,
    trial_tokens,
    warm_start_agent,
)
from dockyard.recipes.tiny_expr import WARM_START_META, pad_rows
from dockyard.tasks.expr import AGENT_TOOLS, agent_answer, f_output, make_agent_tasks, pool_size
from services.endpoint.rendering import Renderer
from services.endpoint.sessions import Sampled, SessionStore
from tests.conftest import REPO_ROOT
from tests.unit.recipes.scoring import passes_all

TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
}


def _recorded(renderer: Renderer, messages: list[dict], tools: list[dict]) -> dict:
    """The endpoint's session trajectory when the policy writes each call of `messages` as rendered."""
    session = SessionStore(1, 60, 16).open("trial")
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        plan = session.plan(renderer, messages[:turn], tools)
        prompt = renderer.render(messages[:turn], tools, generation_prompt=True)
        full = renderer.render(messages[: turn + 1], tools, generation_prompt=False)
        ids = renderer.encode(full[len(prompt) : -len("\n")]) + [renderer.eos_token_id]
        sampled = Sampled(ids, [-1.0] * len(ids), renderer.decode(ids), "eos", message)
        session.record(plan, [sampled], 0, [0])
    trajectory = session.trajectory()
    assert len(trajectory["segments"]) == 1 and trajectory["splits"] == {}
    return trajectory["segments"][0]


@pytest.mark.parametrize("shortcut", [True, False])
def test_trial_tokens_equal_what_the_endpoint_session_records(shortcut):
    tok = build_char_tokenizer()
    renderer = Renderer(tok)
    for task in make_agent_tasks("train", 3, seed=4):
        messages = demonstration(task, shortcut)
        ids, mask = trial_tokens(tok, messages, AGENT_TOOLS)
        segment = _recorded(renderer, messages, AGENT_TOOLS)
        assert ids == segment["token_ids"] and mask == segment["loss_mask"]


def test_trial_tokens_train_exactly_the_calls_the_endpoint_parses():
    tok = build_char_tokenizer()
    task = make_agent_tasks("validation", 1)[0]
    messages = demonstration(task, shortcut=False)
    ids, mask = trial_tokens(tok, messages, AGENT_TOOLS)
    assert tok.unk_token_id not in ids
    # Split the masked tokens into the assistant turns: each ends with eos and parses as one call.
    written, turns = [], []
    for i, m in zip(ids, mask, strict=True):
        if m:
            written.append(i)
            if i == tok.eos_token_id:
                turns.append(tok.decode(written[:-1]))
                written = []
    assert not written
    parsed = [parse("hermes", text, AGENT_TOOLS) for text in turns]
    assert [[(c["function"]["name"], c["function"]["arguments"]) for c in p.tool_calls] for p in parsed] == [
        [("f", {"x": 0})],
        [("f", {"x": 1})],
        [("f", {"x": 2})],
        [],
    ]
    assert parsed[-1].content == f"f(x)={task.solution}"  # the answer: a reply without a tool call
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.startswith("tools: f(x)\nuser: find f(x).\nassistant: <tool_call>")
    assert f"</tool_call><eos>\ntool: {f_output(task.solution, [0, 1])}\nassistant: <tool_call>" in text
    assert text.endswith(f"tool: {f_output(task.solution, [0, 1, 2])}\nassistant: f(x)={task.solution}<eos>")


def test_trial_tokens_refuse_a_conversation_that_does_not_end_with_the_policy():
    tok = build_char_tokenizer()
    messages = demonstration(make_agent_tasks("train", 1)[0], shortcut=True)
    with pytest.raises(ValueError, match="end with an assistant turn"):
        trial_tokens(tok, messages[:-1], AGENT_TOOLS)
    with pytest.raises(ValueError, match="start with a prompt"):
        trial_tokens(tok, messages[1:2], AGENT_TOOLS)
    with pytest.raises(ValueError, match="followed by"):
        trial_tokens(tok, [*messages, messages[-1]], AGENT_TOOLS)


def test_demonstrator_shortcut_is_right_on_lines_and_wrong_on_curves():
    tasks = make_agent_tasks("train", pool_size("train"))
    for task in tasks:
        short, full = demonstration(task, shortcut=True), demonstration(task, shortcut=False)
        reads = [[m["tool_calls"][0]["function"]["arguments"]["x"] for m in t[1:-1:2]] for t in (short, full)]
        assert reads == [[0, 1], [0, 1, 2]]
        assert [m["content"] for m in full[2:-1:2]] == [f_output(task.solution, range(k)) for k in (1, 2, 3)]
        answers = [agent_answer(t[-1]["content"]) for t in (short, full)]
        assert "tool_calls" not in short[-1] and "tool_calls" not in full[-1]
        assert answers[1] == task.solution
        assert passes_all(answers[0], task) == ("x*x" not in task.solution)


@pytest.mark.parametrize(
    ("reads", "shortcut_reads", "shortcut_answer"),
    [((0,), (), "x"), ((0, 1), (1,), "x+{b}"), ((0, 1, 2), (2, 3), "x+{b}")],
)
def test_the_demonstrator_reads_the_configured_points_and_answers_the_line_through_its_shortcut(
    reads, shortcut_reads, shortcut_answer
):
    # On x+b, a line through two points, or of slope 1 through one, is the answer; reading none is `x`.
    for task in make_agent_tasks("train", 6, families=["x+b"]):
        short = demonstration(task, True, reads=reads, shortcut_reads=shortcut_reads)
        full = demonstration(task, False, reads=reads, shortcut_reads=shortcut_reads)
        got = [[m["tool_calls"][0]["function"]["arguments"]["x"] for m in t[1:-1:2]] for t in (short, full)]
        assert got == [list(shortcut_reads), list(reads)]
        assert agent_answer(full[-1]["content"]) == task.solution
        intercept = task.solution.removeprefix("x")  # "+3" or "-3"
        assert agent_answer(short[-1]["content"]) == shortcut_answer.replace("+{b}", intercept)


def test_answers_spelled_with_the_values_read_copy_them_and_are_exact_on_every_function():
    tasks = make_agent_tasks("train", pool_size("train"))
    for task in tasks:
        trial = demonstration(task, False, reads=(0, 1), shortcut_reads=(), answer="values")
        y0, y1 = (int(v) for v in f_output(task.solution, (0, 1)).replace("f(0)=", "").split(" f(1)="))
        shape = "x*x" if "x*x" in task.solution else "x"
        assert agent_answer(trial[-1]["content"]) == f"{y0}+{y1}*{shape}-{y0}*{shape}"
        assert passes_all(agent_answer(trial[-1]["content"]), task)
        # A shortcut that read f(0) and f(1) spells its line with them: right only on linear functions.
        short = demonstration(task, True, reads=(0, 1, 2), shortcut_reads=(0, 1), answer="values")
        assert agent_answer(short[-1]["content"]) == f"{y0}+{y1}*x-{y0}*x"
        assert passes_all(agent_answer(short[-1]["content"]), task) == (shape == "x")
    with pytest.raises(ValueError, match="reads f\\(0\\) and f\\(1\\)"):
        demonstration(tasks[0], False, reads=(0, 2), answer="values")
    with pytest.raises(ValueError, match="reference or values"):
        demonstration(tasks[0], False, answer="line")


def test_mini_format_demonstrations_read_the_configured_points():
    task = make_agent_tasks("validation", 1, families=["x+b"])[0]
    for shortcut, commands in ((False, ["python f.py 0"]), (True, [])):
        trial = demonstration(task, shortcut, "mini_swe_agent", reads=(0,), shortcut_reads=())
        calls = [m["tool_calls"][0]["function"]["arguments"]["command"] for m in trial if m.get("tool_calls")]
        assert calls[:-1] == commands
        answer = task.solution if not shortcut else "x"
        assert calls[-1].startswith(f"echo {answer} > answer.txt && ")


def _run(out_dir, steps=30, seed=0, **kwargs):
    return warm_start_agent(out_dir, model=TINY, steps=steps, lr=3e-3, batch_size=4, seed=seed, num_threads=1, **kwargs)


def _trial_loss(path) -> float:
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    rows = []
    for i, task in enumerate(make_agent_tasks("validation", 8)):
        ids, mask = trial_tokens(tok, demonstration(task, shortcut=i % 2 == 0), AGENT_TOOLS)
        rows.append((ids, [t if m else -100 for t, m in zip(ids, mask, strict=True)]))
    with torch.no_grad():
        return float(model(**pad_rows(rows, tok.pad_token_id)).loss)


def test_warm_start_agent_writes_a_loadable_folder_that_learned_trials(tmp_path):
    losses: list[float] = []
    out = _run(tmp_path / "ws", progress=lambda step, loss: losses.append(loss))
    assert len(losses) == 30
    meta = json.loads((out / WARM_START_META).read_text())
    assert meta["recipe"] == "tiny_agent" and meta["final_loss"] < meta["first_loss"]
    assert meta["longest_trial_tokens"] <= meta["model"]["max_position_embeddings"]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.max_position_embeddings == AGENT_MODEL["max_position_embeddings"]
    assert model.generation_config.eos_token_id == AutoTokenizer.from_pretrained(out).eos_token_id
    assert [p.name for p in tmp_path.iterdir()] == ["ws"]
    # Held-out trials: far below the untrained model's loss (the first step's, on training trials).
    assert _trial_loss(out) < meta["first_loss"] - 1.0


def test_warm_start_agent_refuses_a_model_too_short_for_a_trial_and_bad_rates(tmp_path):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        warm_start_agent(
            tmp_path / "ws", model={**TINY, "max_position_embeddings": 128}, steps=1, lr=1e-3, batch_size=2, seed=0
        )
    with pytest.raises(ValueError, match="shortcut_rate"):
        _run(tmp_path / "ws", steps=1, shortcut_rate=1.5)
    assert list(tmp_path.iterdir()) == []


def _prepare_tiny_agent(out, *overrides: str) -> None:
    """`dockyard prepare` of the tiny recipe switched to a two-step agent warm start into `out`."""
    from dockyard.cli.prepare import prepare
    from dockyard.config import load_config

    small = ["policy.model.hidden_size=32", "policy.model.max_position_embeddings=512"]
    boot = ["policy.bootstrap.recipe=tiny_agent", "policy.bootstrap.steps=2", "policy.bootstrap.batch_size=2"]
    config = REPO_ROOT / "examples" / "configs" / "tiny_expr.yaml"
    prepare(load_config(config, [f"policy.model_name={out}", *small, *boot, *overrides]))


def test_bootstrap_recipe_tiny_agent_runs_the_agent_warm_start(tmp_path):
    out = tmp_path / "policy"
    _prepare_tiny_agent(out)
    meta = json.loads((out / WARM_START_META).read_text())
    assert meta["recipe"] == "tiny_agent" and meta["steps"] == 2 and meta["model"]["hidden_size"] == 32
    assert meta["families"] == [] and meta["reads"] == [0, 1, 2] and meta["shortcut_reads"] == [0, 1]


def test_bootstrap_demonstrates_the_jobs_training_families_and_reads_and_names_a_changed_one(tmp_path, capsys):
    out = tmp_path / "policy"
    overrides = ["policy.bootstrap.reads=[0]", "policy.bootstrap.shortcut_reads=[]", "data.train.families=[x+b]"]
    _prepare_tiny_agent(out, *overrides)
    meta = json.loads((out / WARM_START_META).read_text())
    assert (meta["families"], meta["reads"], meta["shortcut_reads"]) == (["x+b"], [0], [])
    capsys.readouterr()
    _prepare_tiny_agent(out, *overrides, "data.train.families=[]")
    assert "families: ['x+b'] -> []" in capsys.readouterr().out
