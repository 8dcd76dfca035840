"""The V4-style recipe's wiring in `make test`: `bench/v4_recipe.py --smoke` runs every pass as a real job.

Per-domain SFT and GRPO (the teachers), their passing trials exported, the student's SFT on the mixture,
then on-policy distillation from each teacher and the student measured on both domains: a few steps per
pass on one LocalStack, so it checks that the passes hand over to each other, not that they learn (the
measured recipe is the bench's full run; its figures are in docs/algorithms.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

# Eight jobs in a row (SFT, GRPO, export, distillation, each a few steps), each starting its services and
# loading models: past the default 600 s on 2 cores.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def test_every_pass_of_the_recipe_runs_and_hands_over(tmp_path: Path) -> None:
    work = tmp_path / "v4"
    done = subprocess.run(
        [sys.executable, "bench/v4_recipe.py", "--smoke", "--work", str(work)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=1100,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    teachers = json.loads((work / "teachers.json").read_text())
    assert set(teachers) == {"expr", "programs"}
    for domain in teachers.values():  # each teacher is a model folder a later job loaded
        assert (Path(domain["model"]) / "config.json").is_file()
    assert (work / "student-demos.jsonl").stat().st_size > 0  # both domains' demonstrations, mixed
    lines = done.stdout.splitlines()
    assert any(line.startswith("expr ") and "student" in line for line in lines)
    assert any(line.startswith("programs ") and "student" in line for line in lines)
    assert lines[-1].startswith("min_ratio: ")
