"""GRPO on your own dataset and reward: a JSONL of prompt + tests rows, a validation file of its own, chat-templated
prompts, and a reward function of the user's (a file) that runs in the sandbox."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.test_tiny_recipe import dockyard_run

pytestmark = pytest.mark.slow

# Within the tiny model's character set; the tests are asserts, one test each.
TRAIN = [
    {"id": f"add-{k}", "question": f"def add{k}(x): return x+{k}", "asserts": [f"assert add{k}(1) == {1 + k}"]}
    for k in range(6)
]
VALIDATION = [
    {"id": "sq", "question": "def sq(x): return x*x", "asserts": ["assert sq(3) == 9", "assert sq(0) == 0"]},
    {"id": "neg", "question": "def neg(x): return -x", "asserts": ["assert neg(2) == -2"]},
    {"id": "one", "question": "def one(): return 1", "asserts": "assert one() == 1\n"},
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# The user's reward: half for a verdict at all, half by the tests; it reads the task the dataset gave.
REWARD = """
def score(task, completion, verdict):
    assert task["tests"], "the task's tests reach the function"
    return 0.5 + 0.5 * verdict["tests_passed"] / max(verdict["tests_total"], 1)
"""


def test_grpo_trains_on_a_user_jsonl_and_validates_on_the_user_validation_file(tmp_path: Path) -> None:
    train, val = write_jsonl(tmp_path / "train.jsonl", TRAIN), write_jsonl(tmp_path / "val.jsonl", VALIDATION)
    (tmp_path / "my_reward.py").write_text(REWARD)
    runs = tmp_path / "runs"
    fields = "{id: id, prompt: question, tests: asserts}"
    overrides = [
        "policy.model_name=null",  # random init with the character tokenizer (it has a chat template)
        "policy.bootstrap=null",
        "env.name=program_synthesis",
        "data.train.source=humaneval",
        "data.validation.source=humaneval",
        f"data.train.path={train}",
        f"data.validation.path={val}",
        f"data.train.fields={fields}",
        f"data.validation.fields={fields}",
        "data.train.size=6",
        "data.validation.size=3",
        "data.chat_template=true",
        f"env.reward={tmp_path / 'my_reward.py'}:score",
        "policy.generation.max_new_tokens=12",
        "policy.generation.stop_strings=[]",
        "grpo.max_num_steps=2",
        "grpo.num_prompts_per_step=2",
        "grpo.num_generations_per_prompt=4",
        "grpo.val_at_start=false",
        f"logger.log_dir={runs}",
        "logger.plot=false",
        "checkpointing.enabled=false",
    ]
    result = dockyard_run("examples/configs/own_dataset.yaml", overrides)  # the shipped starting point
    assert "SUCCEEDED" in result.stdout
    last = result.stdout.strip().splitlines()[-1]  # the run folder and what it holds
    assert last.startswith("run folder: ") and "metrics.jsonl" in last and "groups.jsonl" in last
    [run_dir] = [p for p in runs.iterdir() if p.name != "logs"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train_steps] == [1, 2]
    assert all(r["num_trajectories"] == 8 and r["invalid_trajectories"] == 0 for r in train_steps), train_steps
    [validation] = [r for r in records if r["kind"] == "validation"]
    assert validation["num_tasks"] == 3  # the whole validation file, no hash split
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["prompt"] in {r["question"] for r in TRAIN} for s in samples)
    assert all(s["verdict"] in ("passed", "failed") for s in samples)  # scored by the sandbox, not ERROR
    # The user's function made every reward (a built-in one gives 0 to a failed test, never 0.5).
    assert all(0.5 <= s["reward"] <= 1.0 for s in samples), samples
    assert all(s["reward"] < 1.0 for s in samples if s["verdict"] == "failed")
    assert all(r["reward_function_errors"] == 0 for r in train_steps)
