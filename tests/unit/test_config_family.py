"""The shipped config family: each file states the machines it is written for, and passes preflight here.

On this CPU machine a GPU recipe's preflight prints its stated hardware skip (cluster.target_hardware)
for what lives on those machines, and still checks what ships with the project (task files, fields).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dockyard.config import load_config
from dockyard.preflight import ERROR, SKIP, Context, preflight

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "examples" / "configs").glob("*.yaml"))


def _header(path: Path) -> str:
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return "\n".join(lines)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_each_config_names_the_machines_it_is_written_for(path: Path) -> None:
    assert "written for" in _header(path).lower(), f"{path.name}: the header comment names no topology/hardware"
    config = load_config(path, strict=True)
    if config.cluster.device == "cuda":
        # A GPU recipe says which machines, so preflight elsewhere can state its skip.
        assert config.cluster.target_hardware, f"{path.name}: a cuda config sets cluster.target_hardware"


# Passes 2 and 3 of the V4-style recipe start from the folders of the passes before them (runs/v4/...,
# written by bench/v4_recipe.py, which runs the recipe end to end); until those ran, preflight names them.
RECIPE_PASSES = {"v4_expr.yaml", "v4_programs.yaml", "v4_consolidation.yaml"}
# Their sandbox runs on the docker backend (an external scaffold, terminal_bench's task images), as
# `dockyard run` sets it: preflight checks the engine and the image wherever it runs.
DOCKER_BACKEND = {"tiny_agent_external.yaml", "grpo_swe_external.yaml", "grpo_terminal_bench.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_each_config_passes_preflight_or_states_its_hardware_skip(path: Path, monkeypatch) -> None:
    monkeypatch.chdir(REPO)  # relative paths in the shipped configs are from the repository root
    config = load_config(path, strict=True)
    findings = preflight(config, Context(prepare=config.policy.bootstrap is not None, environ={}))
    errors = [f for f in findings if f.status == ERROR]
    if path.name in RECIPE_PASSES:
        # The data lines are shown beside a missing folder: a file of the earlier passes is named too.
        named = ("model", "teacher", "data.train", "data.validation")
        assert all(f.check in named and "runs/v4/" in f.message for f in errors), errors
        assert errors or (REPO / "runs" / "v4").is_dir(), "without runs/v4 preflight must name the folders it needs"
        assert "bench/v4_recipe.py" in _header(path)
        return
    if path.name in DOCKER_BACKEND:
        docker = next(f for f in findings if f.check == "docker")
        assert docker.status != SKIP, "preflight reads the backend `dockyard run` sets for this config"
        errors = [f for f in errors if f is not docker]
    assert not errors, f"{path.name}: {findings}"
    gpus = next(f for f in findings if f.check == "gpus")
    if config.cluster.device == "cuda":
        assert gpus.status == SKIP and config.cluster.target_hardware in gpus.message
        # Skips are only for what lives on those machines: shipped task files are still read.
        for split in ("train", "validation"):
            dataset = getattr(config.data, split)
            if dataset.path and (REPO / dataset.path).exists():
                assert next(f for f in findings if f.check == f"data.{split}").status != SKIP


def test_without_a_statement_of_its_hardware_a_gpu_config_fails_here() -> None:
    config = load_config(
        REPO / "examples" / "configs" / "grpo_terminal_bench.yaml",
        ["cluster.target_hardware=null"],
        strict=True,
    )
    findings = {f.check: f for f in preflight(config, Context(environ={}))}
    assert findings["gpus"].status == ERROR and "no CUDA device" in findings["gpus"].message
    assert findings["model"].status == ERROR  # the policy folder is not here and nothing says where it lives


def test_the_preflight_command_prints_the_stated_skip() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dockyard.cli", "preflight", "examples/configs/grpo_terminal_bench.yaml"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "written for 1 node, 2 GPUs" in result.stdout
    assert "ok     data.train" in result.stdout  # the shipped terminal tasks are read and checked
