"""Ctrl-C during `dockyard run` stops every service it started (no orphan process) and says what it
left: the job's state, its run folder, its last checkpoint (none here) and the command that goes on."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
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
