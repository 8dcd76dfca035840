"""Multi-turn SWE end to end: `dockyard run examples/configs/grpo_swe.yaml` on CPU, on a task set the task
builder made from toolz's sdist (two instances, bugs injected, tests held out).

- The smoke: the shipped config with a tiny random model and the torch engine, shortened to one step:
  the agent loop runs in sandbox sessions, the sessions' diffs are scored, and the trainer takes the step.
- The scripted agent: every process is real (coordinator, trainer, buffer, sandbox on the local backend,
  policy endpoint, rollout service), but the rollout engine is the SGLang stand-in scripted with the
  replies (tests/fixtures/sglang_stand_in): the "model" writes the gold patch with write_file, applies
  it with shell and calls submit, all as tool calls the endpoint parses from its tokens. On one
  instance it also appends a line to a test file. The first instance's trials are resolved
  (reward 1); the second's pass the tests too but are flagged (integrity) and earn nothing, in
  training and in validation.

The sandbox is the local backend; with DOCKYARD_SANDBOX_BACKEND=docker (and DOCKYARD_SANDBOX_IMAGE) in
the environment, `dockyard run` starts a docker-backed one instead and the same assertions hold.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from dockyard.models import build_random_model
from dockyard.models.tokenizer import BOS, CHAT_TEMPLATE, EOS, PAD, SPECIAL_TOKENS, UNK
from tests.conftest import REPO_ROOT, TOOLZ_TASK_SET, require_tool

pytestmark = pytest.mark.slow

STAND_IN = REPO_ROOT / "tests" / "fixtures" / "sglang_stand_in"
CONFIG = "examples/configs/grpo_swe.yaml"
TINY = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}


def cpu_overrides(task_root: Path, runs: Path) -> list[str]:
    """The GPU recipe on one CPU machine: one short step, no checkpoint."""
    task_set = task_root / TOOLZ_TASK_SET
    return [
        "policy.dtype=float32",
        "policy.activation_checkpointing=false",
        "policy.max_tokens_per_micro_batch=null",
        "policy.train_micro_batch_size=4",
        "policy.optimizer.warmup_steps=0",
        "policy.generation.vllm_cfg={}",
        "cluster.device=cpu",
        "cluster.weight_sync_backend=gloo",
        "grpo.max_num_steps=1",
        "grpo.num_generations_per_prompt=2",
        "grpo.max_concurrent_trials=4",
        "grpo.max_trial_seconds=120",
        "env.sandbox.timeout_seconds=60",
        "env.sandbox.cpu_seconds=60",
        "env.sandbox.memory_mb=2048",
        f"data.train.path={task_set}",
        "data.train.size=2",  # the two instances, each drawn once in the first epoch
        f"data.validation.path={task_set}",
        "data.validation.size=2",
        f"logger.log_dir={runs}",
        "logger.plot=false",
        "checkpointing.enabled=false",
    ]


def dockyard_run(overrides: list[str], env: dict[str, str] | None = None) -> list[dict]:
    """`dockyard run CONFIG OVERRIDES` from the repository root; the run's metrics records."""
    result = subprocess.run(
        [sys.executable, "-m", "dockyard.cli", "run", "--prepare", CONFIG, *overrides],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    log_dir = Path(next(o.split("=", 1)[1] for o in overrides if o.startswith("logger.log_dir=")))
    [run_dir] = [p for p in log_dir.iterdir() if p.name != "logs"]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_smoke_the_shipped_config_runs_scores_and_trains_on_cpu(toolz_task_root, tmp_path):
    require_tool("/usr/bin/bwrap", "bubblewrap")
    tiny = {**TINY, "max_position_embeddings": 1024}
    overrides = cpu_overrides(toolz_task_root, tmp_path / "runs") + [
        "policy.model_name=null",
        f"policy.model={json.dumps(tiny)}",
        "policy.generation.backend=torch",
        "policy.generation.max_new_tokens=16",
        "grpo.num_prompts_per_step=1",
        "grpo.max_rollout_turns=2",
        "grpo.max_trial_tokens=1024",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
    ]
    records = dockyard_run(overrides)
    [train] = [r for r in records if r["kind"] == "train"]
    # Two trials, each scored from its session's diff: a random policy changes nothing (an empty diff,
    # PATCH_FAILED) or breaks a file (FAILED); either is a reward of 0 that counts, never an error.
    assert train["agent_trials"] == 2 and train["num_trajectories"] == 2
    assert train["invalid_trajectories"] == 0
    assert train.get("verdict_patch_failed", 0) + train.get("verdict_failed", 0) == 2, train
    assert train["agent_turns_mean"] >= 1 and train["reward_mean"] == 0.0


# -- the scripted agent -----------------------------------------------------------------------------


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte (the 256 byte-level characters), so any text round-trips exactly, with the
    character tokenizer's chat template (Hermes-style <tool_call> blocks)."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in pre_tokenizers.ByteLevel.alphabet():
        vocab.setdefault(char, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated"),
        ]
    )
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, eos_token=EOS, bos_token=BOS, unk_token=UNK,
        clean_up_tokenization_spaces=False,
    )  # fmt: skip
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def scripted_model(folder: Path) -> Path:
    tokenizer = byte_tokenizer()
    ids = {k: getattr(tokenizer, k) for k in ("pad_token_id", "eos_token_id", "bos_token_id")}
    model = build_random_model({**TINY, "max_position_embeddings": 4096}, len(tokenizer), seed=0, **ids)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def call(name: str, **arguments: str) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def script(instances: list[dict]) -> dict:
    """Per instance (told apart by its problem statement): type the gold patch into a file, apply it,
    (second instance: also edit a test file), submit."""
    scripts = []
    for i, inst in enumerate(instances):
        apply = "git apply fix.patch && rm fix.patch"
        if i == 1:
            apply += " && echo '# an agent was here' >> toolz/tests/test_dicttoolz.py"
        replies = [
            "I will write the fix as a patch." + call("write_file", path="fix.patch", content=inst["patch"]),
            call("shell", command=f"{apply} && git status --short"),
            call("submit", answer="fixed"),
        ]
        scripts.append({"when": inst["problem_statement"], "replies": replies})
    return {"turn_marker": "assistant: ", "scripts": scripts}


def test_a_scripted_agent_solves_a_built_instance_and_one_that_edits_tests_is_flagged(toolz_task_root, tmp_path):
    require_tool("/usr/bin/bwrap", "bubblewrap")
    task_set = toolz_task_root / TOOLZ_TASK_SET
    instances = [json.loads(line) for line in (task_set / "instances.jsonl").read_text().splitlines()]
    assert len(instances) == 2 and instances[0]["problem_statement"] != instances[1]["problem_statement"]
    script_file = tmp_path / "script.json"
    script_file.write_text(json.dumps(script(instances)))
    sglang_cfg = {"enable_deterministic_inference": True, "stand_in_script": str(script_file)}
    overrides = cpu_overrides(toolz_task_root, tmp_path / "runs") + [
        f"policy.model_name={scripted_model(tmp_path / 'model')}",
        "policy.generation.backend=sglang",
        f"policy.generation.sglang_cfg={json.dumps(sglang_cfg)}",
        "policy.generation.max_new_tokens=1024",
        "grpo.num_prompts_per_step=2",  # both instances
        "grpo.max_rollout_turns=5",
        "grpo.max_trial_tokens=4096",
        "grpo.val_at_start=false",
        "grpo.val_at_end=true",
    ]
    records = dockyard_run(overrides, {"PYTHONPATH": os.pathsep.join([str(STAND_IN), str(REPO_ROOT)])})
    [train] = [r for r in records if r["kind"] == "train"]
    # Four trials, three tool calls each, all parsed from the tokens and carried out in the session;
    # every diff applies and passes the held-out tests; the two that touched a test file are flagged.
    assert (train["agent_trials"], train["agent_finish_submit"], train["agent_turns_mean"]) == (4, 4, 3), train
    assert (train["verdict_passed"], train["integrity_violations"], train["invalid_trajectories"]) == (4, 2, 0)
    # Rewards (all_pass): 1 for each resolved trial, 0 for each flagged one, in both groups.
    assert train["reward_mean"] == 0.5
    [validation] = [r for r in records if r["kind"] == "validation"]
    # Greedy validation over both instances: the flagged one does not count as passed.
    assert (validation["pass_rate"], validation["invalid"]) == (0.5, 0), validation
