"""Ctrl-C during `dockyard run` stops every service it started (no orphan process) and says what it
left: the job's state, its run folder, its last checkpoint (none here) and the command that goes on.
A Ctrl-C while the sandbox scores leaves no process of the run either: no service, no bwrap, nothing
the scored code started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.integration.test_tiny_recipe import alive_services

pytestmark = pytest.mark.slow


def test_sigint_during_a_run_leaves_no_service_behind(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "dockyard.cli",
        "run",
        "examples/configs/tiny_expr.yaml",
        "policy.model_name=null",
        "policy.bootstrap=null",
        "grpo.max_num_steps=1000",
        f"logger.log_dir={tmp_path}",
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 120
    output = []
    for line in proc.stdout:
        output.append(line)
        if "submitted" in line:
            break
        assert time.monotonic() < deadline, "".join(output)
    assert len(alive_services(tmp_path)) == 5, "the five services should be running now"
    time.sleep(2)
    proc.send_signal(signal.SIGINT)  # the CLI alone, not its process group
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, "".join(output) + rest
    assert "stopping services" in rest
    # What it leaves and how to go on: the job's state, its run folder, no checkpoint yet, the command.
    job_id = next(line.split()[1] for line in output if line.startswith("job ") and "submitted" in line)
    assert f"job {job_id} was RUNNING at step" in rest, rest
    assert f"run folder: {tmp_path / job_id}" in rest
    assert "last checkpoint: none" in rest and "start again" in rest and "checkpointing.save_period=10" in rest
    assert alive_services(tmp_path) == []


# A reward function that starts a long program in a session of its own, then waits for it: while it
# runs, the sandbox holds bwrap, its namespace and that program for each sample being scored.
SLOW_REWARD = """
import subprocess, time

def score(task, completion, verdict):
    subprocess.Popen(["/bin/sh", "-c", "sleep 300; exit  # MARK"], start_new_session=True)
    time.sleep(300)
    return 0.0
"""


def run_processes(mark: str, work_root: Path) -> list[str]:
    """Processes of the run: the services and the sandbox guard (their environment holds DOCKYARD_TEST_RUN=mark),
    bwrap (its command line holds the sandbox work root) and the scored code's program (its command line, mark)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue  # gone meanwhile, or not a process
        if not cmdline:
            continue  # a zombie: dead, waiting for its parent
        if f"DOCKYARD_TEST_RUN={mark}".encode() in environ or mark.encode() in cmdline:
            found.append(cmdline.replace(b"\0", b" ").decode(errors="replace")[:120])
        elif str(work_root).encode() in cmdline:
            found.append(cmdline.replace(b"\0", b" ").decode(errors="replace")[:120])
    return found


def test_ctrl_c_while_the_sandbox_scores_leaves_no_process_of_the_run(tmp_path: Path) -> None:
    mark = f"run{uuid.uuid4().hex}"
    reward = tmp_path / "slow_reward.py"
    reward.write_text(SLOW_REWARD.replace("MARK", mark))
    work_root = tmp_path / "sandbox-work"
    work_root.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "dockyard.cli",
        "run",
        "examples/configs/tiny_expr.yaml",
        "policy.model_name=null",
        "policy.bootstrap=null",
        "grpo.max_num_steps=1000",
        f"logger.log_dir={tmp_path / 'runs'}",
        f"env.reward={reward}:score",
        "grpo.val_at_start=false",  # the first step scores at once
        "grpo.num_prompts_per_step=2",
    ]
    env = {
        **os.environ,
        "DOCKYARD_TEST_RUN": mark,
        "DOCKYARD_SANDBOX_BACKEND": "local",
        "DOCKYARD_SANDBOX_WORK_ROOT": str(work_root),
    }
    # A session of its own: the Ctrl-C below goes to its process group, as a terminal's does.
    proc = subprocess.Popen(
        cmd,
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        output = []
        for line in proc.stdout:
            output.append(line)
            if "submitted" in line:
                break
        deadline = time.monotonic() + 60
        while not any(mark in p and "sleep" in p for p in run_processes(mark, work_root)):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(output)
            time.sleep(0.2)
        before = run_processes(mark, work_root)
        assert any("bwrap" in p for p in before) and any("services.sandbox" in p for p in before), before
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the CLI and its services
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 130, "".join(output) + rest
        deadline = time.monotonic() + 5  # the kernel tears a killed namespace down on its own time
        while (left := run_processes(mark, work_root)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert left == [], f"{len(before)} processes of the run before the interrupt; left after it: {left}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
