"""What the end-to-end recipe runs share: warm-started policy folders, made once and kept, and
`run_recipe`, which runs a shipped recipe as `make run` does.

`dockyard run` warm-starts the recipe's policy only when `policy.model_name` does not exist yet
and never writes to it afterwards (checkpoints go to the run folder), so every recipe run that
needs the same warm start trains from one folder: `warm_policy` makes it with `dockyard prepare`
(the code `dockyard run --prepare` calls) under `.cache/test-models/`, keyed by the recipe file and
the hash of the code that builds and trains it. The first test to need it builds it while the others
(on any xdist worker) wait on its lock; a later `make test` in the same clone reuses it until the
recipe or the code changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock

from tests.conftest import REPO_ROOT

# The console script `make run` calls, installed beside the interpreter running the tests.
DOCKYARD = Path(sys.executable).parent / "dockyard"
# The gain in validation pass rate a tiny-recipe run must show: a clear one, not a measured figure.
MIN_GAIN = 0.15


# What a warm start depends on besides the recipe file: the model, tokenizer and task builders and the SFT step.
WARM_START_CODE = ("dockyard", "services/trainer")
WARM_CACHE = REPO_ROOT / ".cache" / "test-models"


def _warm_start_key(config: Path) -> str:
    digest = hashlib.sha256(config.read_bytes())
    for top in WARM_START_CODE:
        for path in sorted((REPO_ROOT / top).rglob("*.py")):
            digest.update(str(path.relative_to(REPO_ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def warm_policy(config: str) -> Path:
    """The policy folder `config`'s bootstrap makes, built once (`dockyard prepare`) and shared."""
    path = REPO_ROOT / config
    folder = WARM_CACHE / f"{path.stem}-{_warm_start_key(path)}"
    WARM_CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{folder}.lock"):
        if not folder.is_dir():
            building = folder.with_name(folder.name + ".building")
            shutil.rmtree(building, ignore_errors=True)
            done = subprocess.run(
                [str(DOCKYARD), "prepare", config, f"policy.model_name={building}"],
                cwd=REPO_ROOT,
                capture_output=True,
                text=True,
                timeout=1500,  # the external agent recipe's 600 steps: about 7 min alone, up to 15 beside heavy tests
                stdin=subprocess.DEVNULL,
            )
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
            building.rename(folder)  # whole or absent: a killed build is never taken for a warm start
    return folder


@pytest.fixture(scope="session")
def scaffold_image(docker_sandbox_image: str) -> str:
    """The external recipe's session image (the sandbox image plus its scaffold package), built from the
    wheelhouse (--network none) as the sandbox would build it on the first trial; built here so a job's
    first trial does not wait."""
    import docker
    import yaml

    from services.sandbox.images import ensure_env_image

    config = REPO_ROOT / "examples" / "configs" / "tiny_agent_external.yaml"
    package = yaml.safe_load(config.read_text())["env"]["scaffold"]["package"]
    return ensure_env_image(docker.from_env(timeout=900), docker_sandbox_image, [package])


@pytest.fixture(scope="session")
def verifiers_image(docker_sandbox_image: str) -> str:
    """The tiny verifiers recipe's session image (the sandbox image plus verifiers and the example
    environment's wheel), built as the sandbox would build it on the first trial, so no trial waits."""
    import docker

    from dockyard.config import load_config
    from services.sandbox.images import ensure_env_image

    config = load_config(REPO_ROOT / "examples" / "configs" / "tiny_verifiers.yaml")
    assert config.env.verifiers is not None
    requirements = list(config.env.verifiers.requirements)
    return ensure_env_image(docker.from_env(timeout=900), docker_sandbox_image, requirements)


@pytest.fixture(scope="session")
def tiny_policy_folder() -> Path:
    return warm_policy("examples/configs/tiny_expr.yaml")


def run_recipe(
    config: str, tmp_path: Path, model: Path, *overrides: str, timeout: float, env: dict[str, str] | None = None
) -> list[dict]:
    """`dockyard run --prepare config` with `overrides` (and `env` added to the environment), its outputs
    under `tmp_path`; asserts it SUCCEEDED and gives its metrics.jsonl records."""
    runs = tmp_path / "runs"
    result = subprocess.run(
        [str(DOCKYARD), "run", "--prepare", config, f"policy.model_name={model}", f"logger.log_dir={runs}", *overrides],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **env} if env else None,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [run_dir] = [p for p in runs.iterdir() if p.name != "logs"]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_tiny_recipe(tmp_path: Path, model: Path, *overrides: str, timeout: float) -> list[dict]:
    """examples/configs/tiny_expr.yaml through run_recipe."""
    return run_recipe("examples/configs/tiny_expr.yaml", tmp_path, model, *overrides, timeout=timeout)
