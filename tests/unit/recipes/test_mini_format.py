"""The mini-swe-agent warm start demonstrates exactly what the endpoint records for a real mini session.

tests/fixtures/mini_session/session.json is the endpoint's trajectory of mini-swe-agent 2.4.6, unchanged,
run with examples/configs/tiny_agent_external.yaml's command on one task while the policy wrote the
demonstrator's calls. Regenerate it (Docker) after a change to the recipe's command, mini's version, the
chat template or the recorder:

    python tests/fixtures/mini_session/capture.py
"""

from __future__ import annotations

import json

from dockyard.models.tokenizer import build_char_tokenizer
from dockyard.recipes import mini_format
from dockyard.recipes.tiny_agent import SCAFFOLD_TOOLS, demonstrated_answer, demonstration, trial_tokens
from dockyard.tasks.expr import make_agent_tasks
from tests.conftest import REPO_ROOT

SESSION = json.loads((REPO_ROOT / "tests" / "fixtures" / "mini_session" / "session.json").read_text())


def _without_ids(messages: list[dict]) -> list[dict]:
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if k != "tool_call_id"}
        if m.get("tool_calls"):
            m["tool_calls"] = [{k: v for k, v in c.items() if k != "id"} for c in m["tool_calls"]]
        out.append(m)
    return out


def test_the_warm_start_renders_a_real_mini_session_token_for_token() -> None:
    spec = SESSION["task"]
    task = make_agent_tasks(spec["split"], spec["index"] + 1, seed=spec["seed"])[spec["index"]]
    [segment] = SESSION["trajectory"]["segments"]  # one segment: mini's history only ever grew
    messages = demonstration(task, spec["shortcut"], "mini_swe_agent")
    # The same conversation mini sent (tool-call ids are mini's own and never rendered), the same tool.
    assert _without_ids(segment["messages"]) == _without_ids(messages)
    assert segment["tools"] == SCAFFOLD_TOOLS["mini_swe_agent"] == [mini_format.BASH_TOOL]
    ids, mask = trial_tokens(build_char_tokenizer(), messages, SCAFFOLD_TOOLS["mini_swe_agent"])
    assert ids == segment["token_ids"]
    assert mask == segment["loss_mask"]
    # mini ran every demonstrated call: four turns, the answer in its file, and it submitted (no call left).
    assert SESSION["trajectory"]["turns"] == len(segment["turns"]) == mini_format.MAX_TURNS
    assert SESSION["answer_file"].strip() == demonstrated_answer(task, spec["shortcut"])[1] == task.solution


def test_the_shortcut_demonstration_reads_two_points_and_writes_their_line() -> None:
    task = next(t for t in make_agent_tasks("train", 40, seed=0) if "x*x" in t.solution)
    messages = demonstration(task, True, "mini_swe_agent")
    commands = [m["tool_calls"][0]["function"]["arguments"]["command"] for m in messages if m["role"] == "assistant"]
    points, answer = demonstrated_answer(task, True)
    assert commands == ["python f.py 0", "python f.py 1", f"echo {answer} > answer.txt && {mini_format.SUBMIT_COMMAND}"]
    assert answer != task.solution and points == (0, 1)
    # Every character the policy writes is one of the tiny model's (no <unk> in a trained token).
    tokenizer = build_char_tokenizer()
    ids, mask = trial_tokens(tokenizer, messages, SCAFFOLD_TOOLS["mini_swe_agent"])
    assert tokenizer.unk_token_id not in [i for i, m in zip(ids, mask, strict=True) if m]
