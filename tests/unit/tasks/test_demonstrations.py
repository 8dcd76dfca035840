"""Demonstration datasets: prompt/completion and chat records, one pair per assistant turn, errors with line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dockyard.config import PolicyConfig
from dockyard.models.tokenizer import build_char_tokenizer
from dockyard.tasks.demonstrations import batch_at, export_best_trials, load_demonstrations

POLICY = PolicyConfig(model={"model_type": "llama"})


def _write(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_prompt_completion_records_are_pairs(tmp_path: Path) -> None:
    path = _write(tmp_path / "d.jsonl", [{"prompt": "f(x)=", "completion": "x+1"}, {"prompt": "a", "completion": "b"}])
    assert load_demonstrations(path, POLICY) == [("f(x)=", "x+1"), ("a", "b")]


def test_a_chat_trains_each_assistant_turn_once_after_its_rendered_context(tmp_path: Path) -> None:
    messages = [
        {"role": "user", "content": "find f"},
        {"role": "assistant", "content": "call f(1)"},
        {"role": "tool", "content": "3"},
        {"role": "assistant", "content": "answer: 2*x+1"},
    ]
    pairs = load_demonstrations(_write(tmp_path / "chat.jsonl", [{"messages": messages}]), POLICY)
    tokenizer = build_char_tokenizer()
    render = tokenizer.apply_chat_template
    assert [c for _, c in pairs] == ["call f(1)", "answer: 2*x+1"]
    assert pairs[0][0] == render(messages[:1], add_generation_prompt=True, tokenize=False)
    assert pairs[1][0] == render(messages[:3], add_generation_prompt=True, tokenize=False)
    # tool output and user text are context only: they never appear in a completion
    assert not any("3" == c or "find" in c for _, c in pairs)


@pytest.mark.parametrize(
    ("record", "words"),
    [
        ("not json", "d.jsonl:2: not JSON"),
        ({"prompt": "x"}, "d.jsonl:2: a demonstration is"),
        ({"prompt": "x", "completion": ""}, "d.jsonl:2: empty completion"),
        ({"messages": [{"role": "assistant", "content": "hi"}]}, "d.jsonl:2: messages need a prompt"),
        ({"messages": "hello"}, "d.jsonl:2: messages is a list"),
    ],
)
def test_bad_records_name_the_file_and_line(tmp_path: Path, record, words) -> None:
    path = _write(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}, record])
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        load_demonstrations(path, POLICY)


def test_missing_file_names_the_config_key(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="sft.dataset"):
        load_demonstrations(tmp_path / "none.jsonl", POLICY)


def test_batches_cover_every_pair_once_per_epoch_and_repeat_for_a_step() -> None:
    pairs = [(str(i), str(i)) for i in range(10)]
    epoch = [p for step in range(1, 6) for p in batch_at(pairs, step, 2, seed=3)]
    assert sorted(epoch) == sorted(pairs) and epoch != pairs
    assert batch_at(pairs, 4, 2, seed=3) == batch_at(pairs, 4, 2, seed=3)
    assert len(batch_at(pairs, 6, 4, seed=3)) == 4  # across the epoch boundary


def test_export_keeps_each_passing_whole_trial_once(tmp_path: Path) -> None:
    # Every passing trial, whole and once, from trials.jsonl; samples.jsonl keeps a few completions per step
    # (cut at 4000 characters): never the export's source.
    _write(tmp_path / "samples.jsonl", [{"step": 1, "prompt": "p9", "completion": "sampled", "reward": 1.0}])
    long = "x" * 5000
    rows = [
        {"step": 1, "trajectory_id": "a/0", "prompt": "p1", "completion": "good", "reward": 1.0},
        {"step": 2, "trajectory_id": "b/0", "prompt": "p1", "completion": "good", "reward": 1.0},
        {"step": 2, "trajectory_id": "b/1", "prompt": "p2", "completion": "half", "reward": 0.5},
        {"step": 3, "trajectory_id": "c/0", "prompt": "p3", "completion": long, "reward": 1.0},
    ]
    _write(tmp_path / "trials.jsonl", rows)
    out = tmp_path / "best.jsonl"
    assert export_best_trials(tmp_path, out, 1.0) == 2
    assert load_demonstrations(out, POLICY) == [("p1", "good"), ("p3", long)]
    with pytest.raises(ValueError, match="exists: name a new file"):  # as `export hf`, never overwritten
        export_best_trials(tmp_path, out, 0.5)
    assert export_best_trials(tmp_path, tmp_path / "half.jsonl", 0.5) == 3
    with pytest.raises(ValueError, match="trials.jsonl"):
        export_best_trials(tmp_path / "nowhere", tmp_path / "none.jsonl", 1.0)


def test_an_agent_runs_passing_trials_export_as_chats_with_their_tools(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("env:\n  tools: [{name: run}]\n")
    out = tmp_path / "trials-sft.jsonl"
    with pytest.raises(ValueError, match="trials.jsonl"):  # an agent run reads its trials, not its samples
        export_best_trials(tmp_path, out, 1.0)
    tools = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]
    call = {"type": "function", "function": {"name": "run", "arguments": {"cmd": "ls"}}}
    first = [
        {"role": "user", "content": "list the files"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "a.py"},
        {"role": "assistant", "content": "a.py"},
    ]
    second = [{"role": "user", "content": "summary so far"}, {"role": "assistant", "content": "done"}]
    rows = [
        {"step": 1, "trajectory_id": "g/0", "reward": 1.0, "segments": [{"messages": first, "tools": tools}]},
        {"step": 1, "trajectory_id": "g/1", "reward": 1.0, "segments": [{"messages": first, "tools": tools}]},
        {"step": 2, "trajectory_id": "h/0", "reward": 0.6, "segments": [{"messages": second, "tools": None}]},
    ]
    _write(tmp_path / "trials.jsonl", rows)
    assert export_best_trials(tmp_path, out, 1.0) == 1  # one conversation, however many trials had it
    assert [json.loads(line) for line in out.read_text().splitlines()] == [{"messages": first, "tools": tools}]
    out.unlink()
    assert export_best_trials(tmp_path, out, 0.5) == 2
    # What the export wrote is an sft.dataset: each assistant turn after its context, rendered with the tools.
    pairs = load_demonstrations(out, POLICY)
    render = build_char_tokenizer().apply_chat_template
    # The tool call is trained as the template writes it; the tool's output is context only.
    assert [c for _, c in pairs] == [
        '<tool_call>{"name": "run", "arguments": {"cmd": "ls"}}</tool_call>',
        "a.py",
        "done",
    ]
    assert pairs[0][0] == render(first[:1], tools=tools, add_generation_prompt=True, tokenize=False)
    assert pairs[0][0].startswith("tools: run()")  # the conversation's tools are rendered
    assert pairs[1][0] == render(first[:3], tools=tools, add_generation_prompt=True, tokenize=False)
    assert pairs[2][0] == render(second[:1], add_generation_prompt=True, tokenize=False)


def test_tools_that_are_not_a_list_of_schemas_are_refused_with_the_line(tmp_path: Path) -> None:
    record = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "tools": "run"}
    with pytest.raises(ValueError, match=r"t\.jsonl:1: tools is a list of tool schemas"):
        load_demonstrations(_write(tmp_path / "t.jsonl", [record]), POLICY)


def test_a_run_that_keeps_trials_and_passed_none_exports_nothing(tmp_path: Path) -> None:
    # A run folder with its config and metrics but no trials.jsonl: no trial passed (a teacher scoring 0 in
    # a smoke run); the export is an empty file, not a refusal. With logger.save_trials off it is refused.
    (tmp_path / "config.yaml").write_text("logger: {save_trials: true}\nenv: {}\n")
    _write(tmp_path / "metrics.jsonl", [{"kind": "train", "step": 1}])
    assert export_best_trials(tmp_path, tmp_path / "none.jsonl", 1.0) == 0
    assert (tmp_path / "none.jsonl").read_text() == ""
    (tmp_path / "config.yaml").write_text("logger: {save_trials: false}\nenv: {}\n")
    with pytest.raises(ValueError, match="save_trials"):
        export_best_trials(tmp_path, tmp_path / "off.jsonl", 1.0)
