"""The whole loop across five real processes: `dockyard run` on a shortened tiny recipe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.slow

SHORT = [
    "grpo.max_num_steps=2",
    "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=4",
    "grpo.val_period=1",
    "data.validation.size=8",
    "policy.bootstrap.steps=30",
]


def alive_services(log_root: Path) -> list[str]:
    """Services started under log_root (their pids.json) that still run."""
    alive = []
    for pids in log_root.rglob("pids.json"):
        for name, pid in json.loads(pids.read_text()).items():
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                continue
            alive.append(f"{name} ({pid})")
    return alive


def dockyard_run(config: str, overrides: list[str]) -> subprocess.CompletedProcess:
    """`dockyard run CONFIG OVERRIDES` from the repository root; asserts that it succeeded."""
    result = subprocess.run(
        [sys.executable, "-m", "dockyard.cli", "run", "--prepare", config, *overrides],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_dockyard_run_trains_to_succeeded_and_writes_the_run_folder(tmp_path: Path) -> None:
    model_dir, runs = tmp_path / "model", tmp_path / "runs"
    # A TensorBoard tracker, and a weight-sync bound every sync breaks: the signature's whole path.
    watch = ["logger.tensorboard_enabled=true", "logger.signatures.window=1"]
    watch.append("logger.signatures.max_weight_sync_seconds=1e-9")
    overrides = [*SHORT, f"policy.model_name={model_dir}", f"logger.log_dir={runs}", *watch]
    result = dockyard_run("examples/configs/tiny_expr.yaml", overrides)
    assert "SUCCEEDED" in result.stdout
    # Every service left within the stop's grace, none SIGKILLed; the ports they served on were printed.
    assert "exited uncleanly" not in result.stderr, result.stderr[-2000:]
    assert "  coordinator  127.0.0.1:" in result.stdout and "preflight:" in result.stdout
    assert "warning: slow_weight_sync: weight sync took" in result.stdout

    [run_dir] = [p for p in runs.iterdir() if p.name != "logs"]
    assert (run_dir / "config.yaml").is_file()
    assert (run_dir / "curves.png").stat().st_size > 1000
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "validation"]
    assert [r["step"] for r in train] == [1, 2]
    assert [r["step"] for r in val] == [0, 1, 2]
    for r in train:
        assert r["num_trajectories"] == 8 and r["weight_version"] == r["step"]
        assert 0.0 <= r["reward_mean"] <= 1.0
    for r in val:
        assert r["num_tasks"] == 8 and 0.0 <= r["pass_rate"] <= 1.0
    assert [r["signature_slow_weight_sync"] for r in train] == [1.0, 1.0]
    for r in train:  # a window of one step: the flag is this step's uniform fraction against its bound
        assert r["signature_no_learning_signal"] == float(r["uniform_reward_groups"] / r["groups"] > 0.8)
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1] * 4 + [2] * 4  # logger.num_samples_per_step of the 8 trajectories
    assert all(s["prompt"].startswith("f(") and s["verdict"] in ("passed", "failed") for s in samples)
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2]
    assert [e.step for e in events.Scalars("val/pass_rate")] == [0, 1, 2]
    assert [e.value for e in events.Scalars("train/signature_slow_weight_sync")] == [1.0, 1.0]
    # The final checkpoint is a Hugging Face folder.
    model = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "step-2")
    assert model.num_parameters() > 0
    assert list(runs.glob("logs/*/pids.json")), "no pids.json written"
    assert alive_services(runs / "logs") == []


def test_a_stopped_job_resumes_from_its_latest_checkpoint(tmp_path: Path) -> None:
    model_dir, runs, ckpt = tmp_path / "model", tmp_path / "runs", tmp_path / "ckpt"
    common = [
        *SHORT,
        f"policy.model_name={model_dir}",
        f"logger.log_dir={runs}",
        "logger.plot=false",
        "grpo.val_at_start=false",
        f"checkpointing.checkpoint_dir={ckpt}",
        "checkpointing.save_period=1",
        "checkpointing.keep_top_k=1",
    ]

    def run(*extra: str) -> list[dict]:
        before = set(runs.iterdir()) if runs.exists() else set()
        dockyard_run("examples/configs/tiny_expr.yaml", [*common, *extra])
        [run_dir] = [p for p in set(runs.iterdir()) - before if p.name != "logs"]
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    first = run()
    assert [r["step"] for r in first if r["kind"] == "train"] == [1, 2]
    second = run("checkpointing.resume=true", "grpo.max_num_steps=3")
    [resume] = [r for r in second if r["kind"] == "resume"]
    # Two steps of two prompts were drawn before the stop; the resumed job goes on from there.
    assert (resume["step"], resume["tasks_drawn"]) == (2, 4)
    train = [r for r in second if r["kind"] == "train"]
    assert [(r["step"], r["weight_version"]) for r in train] == [(3, 3)]
    assert [r["step"] for r in second if r["kind"] == "validation"] == [3]
    # keep_top_k=1: the best validated checkpoint and the latest survive.
    kept = sorted(p.name for p in ckpt.iterdir() if not p.name.startswith("."))
    assert "step-3" in kept and len(kept) <= 2
    assert AutoModelForCausalLM.from_pretrained(ckpt / "step-3").num_parameters() > 0


def test_a_supervised_job_trains_validates_and_checkpoints(tmp_path: Path) -> None:
    runs, ckpt = tmp_path / "runs", tmp_path / "ckpt"
    overrides = [
        "sft.max_num_steps=3",
        "sft.batch_size=8",
        "sft.val_period=2",
        "data.validation.size=8",
        "checkpointing.save_period=2",
        f"checkpointing.checkpoint_dir={ckpt}",
        f"logger.log_dir={runs}",
        "logger.plot=false",
    ]
    dockyard_run("examples/configs/tiny_expr_sft.yaml", overrides)
    [run_dir] = [p for p in runs.iterdir() if p.name != "logs"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [(r["step"], r["weight_version"], r["num_trajectories"]) for r in train] == [(1, 1, 8), (2, 2, 8), (3, 3, 8)]
    assert train[-1]["loss"] < train[0]["loss"] and all(r["grad_norm"] > 0 for r in train)
    assert [r["step"] for r in records if r["kind"] == "validation"] == [2, 3]
    saved = json.loads((ckpt / "step-2" / "checkpoint.json").read_text())
    assert "pass_rate" in saved["metrics"]  # ranked by the validation of its step
    assert AutoModelForCausalLM.from_pretrained(ckpt / "step-3").num_parameters() > 0
