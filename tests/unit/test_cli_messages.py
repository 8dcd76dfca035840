"""What the command line says to a newcomer: options in any order, a hint when no coordinator
answers, why a job failed in the list, what an existing policy folder is, what a run folder holds,
and what an interrupted run leaves and how to go on from it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from dockyard.api.coordinator.v1 import coordinator_pb2
from dockyard.cli.main import build_parser, parse_args, unreachable_hint
from dockyard.cli.prepare import prepare
from dockyard.cli.run import interrupted_lines, run_folder_line
from dockyard.cli.views import job_line
from dockyard.config import load_config
from tests.conftest import REPO_ROOT

TINY = str(REPO_ROOT / "examples" / "configs" / "tiny_expr.yaml")


def parse(*argv: str):
    return parse_args(build_parser(), list(argv))


def test_overrides_parse_after_the_flags_too() -> None:
    args = parse("run", TINY, "a.b=1", "--prepare", "c.d=2", "--rollout-replicas", "2", "+e.f=3")
    assert args.prepare and args.rollout_replicas == 2 and args.overrides == ["a.b=1", "c.d=2", "+e.f=3"]
    assert parse("preflight", TINY, "--remote", "x.y=1").overrides == ["x.y=1"]
    assert parse("submit", TINY, "--wait", "x.y=1").overrides == ["x.y=1"]


def test_stray_arguments_are_still_refused(capsys) -> None:
    with pytest.raises(SystemExit) as refused:
        parse("run", TINY, "--no-such-flag")
    assert refused.value.code == 2 and "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("status", "job-1", "k=v")  # status takes no overrides


def test_no_coordinator_gives_a_hint() -> None:
    hint = unreachable_hint(grpc.StatusCode.UNAVAILABLE, "127.0.0.1:50051")
    assert "127.0.0.1:50051" in hint and "dockyard up" in hint and "--coordinator" in hint
    assert unreachable_hint(grpc.StatusCode.NOT_FOUND, "127.0.0.1:50051") == ""


def test_the_job_list_says_why_a_job_failed() -> None:
    failed = coordinator_pb2.Job(
        job_id="job-1", state=coordinator_pb2.JOB_STATE_FAILED, message="collect step 1: no group reached the buffer"
    )
    assert "FAILED" in job_line(failed) and "why: collect step 1: no group reached" in job_line(failed)
    done = coordinator_pb2.Job(job_id="job-2", state=coordinator_pb2.JOB_STATE_SUCCEEDED, message="")
    assert "why" not in job_line(done)


def test_prepare_on_an_existing_folder_says_so_and_what_differs(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "policy"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    cfg = load_config(TINY, [f"policy.model_name={folder}", "policy.bootstrap.steps=7"])
    prepare(cfg)
    out = capsys.readouterr().out
    assert f"{folder} exists: kept as it is" in out and "note" not in out  # no record: nothing to compare
    meta = {"recipe": "tiny_expr", "steps": 300, "lr": cfg.policy.bootstrap.lr, "model": {"hidden_size": 1}}
    (folder / "warm_start.json").write_text(json.dumps(meta))
    prepare(cfg)
    note = capsys.readouterr().out
    assert "other settings than the config's bootstrap: steps: 300 -> 7" in note and "model.hidden_size: 1 ->" in note
    assert "lr" not in note.split("bootstrap:")[1]


def test_prepare_compares_the_demonstrated_families_and_spelling_of_an_environment_it_does_not_draw(
    tmp_path: Path, capsys
) -> None:
    # env verifiers: the environment's rows are not dockyard's, so the bootstrap names their families.
    folder = tmp_path / "policy"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    cfg = load_config("examples/configs/tiny_verifiers.yaml", [f"policy.model_name={folder}"])
    meta = {"recipe": "tiny_expr", "families": [], "answer": "reference"}
    (folder / "warm_start.json").write_text(json.dumps(meta))
    prepare(cfg)
    note = capsys.readouterr().out
    assert "families: [] -> ['x*x+b', 'a*x*x+b']" in note and "answer: 'reference' -> 'values'" in note


def test_the_last_line_names_what_the_run_folder_holds(tmp_path: Path) -> None:
    run = tmp_path / "job-1"
    for name in ("config.yaml", "metrics.jsonl", "groups.jsonl"):
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text("")
    (run / "checkpoints" / "step-2").mkdir(parents=True)
    (run / "tensorboard").mkdir()
    line = run_folder_line(run, run / "checkpoints")
    assert line == f"run folder: {run}  (config.yaml, metrics.jsonl, groups.jsonl, checkpoints/, tensorboard/)"
    (tmp_path / "shared").mkdir()
    assert run_folder_line(run, tmp_path / "shared").endswith(f"; checkpoints in {tmp_path / 'shared'}")


def test_an_interrupt_says_the_state_the_folder_the_checkpoint_and_how_to_go_on(tmp_path: Path) -> None:
    args = SimpleNamespace(config=TINY, overrides=["grpo.max_num_steps=30", "checkpointing.resume=true"])
    cfg = load_config(TINY, [f"logger.log_dir={tmp_path}", "grpo.max_num_steps=30"])
    job = coordinator_pb2.Job(job_id="job-1", state=coordinator_pb2.JOB_STATE_RUNNING, step=9, max_steps=30)
    lines = interrupted_lines(cfg, args, "job-1", job)
    assert lines[0].startswith("job job-1 was RUNNING at step 9/30")
    assert lines[1] == f"run folder: {tmp_path / 'job-1'}"
    assert "last checkpoint: none" in lines[2] and "save_period=0" in lines[2] and "9 step(s) done are lost" in lines[2]
    assert lines[3].endswith(f"{TINY} grpo.max_num_steps=30 checkpointing.save_period=10")
    step = tmp_path / "job-1" / "checkpoints" / "step-5"
    step.mkdir(parents=True)
    (tmp_path / "job-1" / "checkpoints" / "step-8").mkdir()  # incomplete: no checkpoint.json
    (step / "checkpoint.json").write_text("{}")
    lines = interrupted_lines(cfg, args, "job-1", job)
    assert lines[2] == f"last checkpoint: {step} (step 5)"
    resume = lines[3].removeprefix("resume from it: ").split()
    assert resume[:3] == ["dockyard", "run", TINY] and resume.count("checkpointing.resume=true") == 1
    assert f"checkpointing.checkpoint_dir={tmp_path / 'job-1' / 'checkpoints'}" in resume
    # What the command names loads: the resumed job reads the checkpoints of the interrupted one.
    resumed = load_config(TINY, [f"logger.log_dir={tmp_path}", *resume[3:]])
    assert resumed.checkpoint_folder("job-2") == tmp_path / "job-1" / "checkpoints"
    assert interrupted_lines(cfg, args, None, None) == ["no job was submitted yet: nothing to resume"]
