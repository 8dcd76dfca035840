"""What the end-to-end recipe runs share: one policy folder, warm-started by whichever run comes first,
and `run_tiny_recipe`, which runs the shipped tiny recipe as `make run` does.

`dockyard run` warm-starts the recipe's policy only when `policy.model_name` does not exist yet
and never writes to it afterwards (checkpoints go to the run folder), so the second recipe run of
the session (the vLLM one after the torch one) trains from the same warm start without paying
for it again; run alone, each still makes its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

# The console script `make run` calls, installed beside the interpreter running the tests.
DOCKYARD = Path(sys.executable).parent / "dockyard"
# The gain in validation pass rate a tiny-recipe run must show: a clear one, not a measured figure.
MIN_GAIN = 0.15


@pytest.fixture(scope="session")
def tiny_policy_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-policy") / "model"


def run_tiny_recipe(tmp_path: Path, model: Path, *overrides: str, timeout: float) -> list[dict]:
    """`dockyard run --prepare` of examples/configs/tiny_expr.yaml with `overrides`, its outputs under
    `tmp_path`; asserts it SUCCEEDED and gives its metrics.jsonl records."""
    runs = tmp_path / "runs"
    result = subprocess.run(
        [
            str(DOCKYARD),
            "run",
            "--prepare",
            "examples/configs/tiny_expr.yaml",
            f"policy.model_name={model}",
            f"logger.log_dir={runs}",
            *overrides,
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [run_dir] = [p for p in runs.iterdir() if p.name != "logs"]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
