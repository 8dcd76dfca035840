"""Preflight: each check trips on what it guards, and says what to fix; a healthy config passes."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dockyard.config import load_config
from dockyard.preflight import (
    ERROR,
    OK,
    SKIP,
    check_disk,
    check_docker,
    check_gpus,
    check_model,
    check_ports,
    check_redis,
    check_tokenizer_and_context,
    preflight,
)
from tests.conftest import missing

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "configs" / "tiny_expr.yaml"
AGENT = REPO / "examples" / "configs" / "tiny_agent.yaml"
RANDOM_INIT = ["policy.model_name=null", "policy.bootstrap=null"]


def by_check(findings):
    return {f.check: f for f in findings}


def test_a_healthy_config_passes_every_check(tmp_path: Path) -> None:
    cfg = load_config(TINY, [*RANDOM_INIT, f"logger.log_dir={tmp_path}"])
    findings = preflight(cfg)
    assert [f for f in findings if f.status == ERROR] == []
    assert {"model", "tokenizer", "data.train", "data.validation", "context", "disk"} <= {
        f.check for f in findings if f.status == OK
    }


def test_a_missing_model_folder_is_an_error_unless_the_bootstrap_is_asked_for(tmp_path: Path) -> None:
    typo = tmp_path / "tiny-expr-stf"
    cfg = load_config(TINY, [f"policy.model_name={typo}"])
    refused = check_model(cfg, prepare=False)
    assert refused.status == ERROR and "dockyard prepare" in refused.message and str(typo) in refused.message
    assert check_model(cfg, prepare=True).status == OK
    no_bootstrap = load_config(TINY, [f"policy.model_name={typo}", "policy.bootstrap=null"])
    assert check_model(no_bootstrap, prepare=True).status == ERROR
    assert not typo.exists()  # preflight never writes


def test_a_tokenizer_that_does_not_load_is_named(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 128}))
    (folder / "tokenizer.json").write_text("{not json")
    cfg = load_config(TINY, [f"policy.model_name={folder}"])
    [finding] = check_tokenizer_and_context(cfg, prepare=False)
    assert finding.check == "tokenizer" and finding.status == ERROR and str(folder) in finding.message


def test_a_dataset_record_without_a_field_names_the_file_the_line_and_the_field(tmp_path: Path) -> None:
    data = tmp_path / "problems.jsonl"
    good = {"task_id": "t/0", "prompt": "def f(x):\n", "entry_point": "f", "test": "def check(c): pass"}
    bad = {k: v for k, v in good.items() if k != "entry_point"} | {"task_id": "t/1"}
    data.write_text(json.dumps(good) + "\n\n" + json.dumps(bad) + "\n")
    cfg = load_config(
        TINY,
        [
            *RANDOM_INIT,
            "env.name=program_synthesis",
            "data.train.source=humaneval",
            "data.validation.source=humaneval",
            f"data.train.path={data}",
            f"data.validation.path={data}",
        ],
    )
    found = by_check(check_tokenizer_and_context(cfg, prepare=False))
    assert found["data.train"].status == ERROR
    assert f"{data}:3: missing field 'entry_point'" in found["data.train"].message


def test_a_prompt_plus_new_tokens_past_the_context_is_refused_with_the_fix() -> None:
    cfg = load_config(TINY, [*RANDOM_INIT, "policy.generation.max_new_tokens=120"])
    context = by_check(check_tokenizer_and_context(cfg, prepare=False))["context"]
    assert context.status == ERROR
    assert "128 positions" in context.message and "lower max_new_tokens to" in context.message


def test_an_agent_trial_longer_than_the_context_is_refused() -> None:
    cfg = load_config(AGENT, [*RANDOM_INIT, "grpo.max_trial_tokens=4096"])
    context = by_check(check_tokenizer_and_context(cfg, prepare=False))["context"]
    assert context.status == ERROR and "grpo.max_trial_tokens" in context.message


def test_cuda_without_a_gpu_is_refused() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the no-GPU error cannot trip here")
    cfg = load_config(TINY, [*RANDOM_INIT, "cluster.device=cuda"])
    finding = check_gpus(cfg, local_services=True)
    assert finding.status == ERROR and "cluster.device=cpu" in finding.message
    assert check_gpus(load_config(TINY, RANDOM_INIT), local_services=True).status == SKIP


def test_no_docker_engine_is_one_line_with_the_fix() -> None:
    finding = check_docker({"DOCKYARD_SANDBOX_BACKEND": "docker", "DOCKER_HOST": "unix:///nonexistent/docker.sock"})
    assert finding.status == ERROR and "\n" not in finding.message
    assert "DOCKYARD_SANDBOX_BACKEND=local" in finding.message
    assert check_docker({}).status == SKIP


def test_a_missing_sandbox_image_says_how_to_build_it() -> None:
    import docker

    try:
        docker.from_env(timeout=5).ping()
    except Exception:
        missing("no Docker engine answers")
    finding = check_docker({"DOCKYARD_SANDBOX_BACKEND": "docker", "DOCKYARD_SANDBOX_IMAGE": "dockyard/no-such:image"})
    assert finding.status == ERROR and "deploy/images/build.sh" in finding.message


def test_redis_that_does_not_answer_is_an_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    env = {"DOCKYARD_BUFFER_BACKEND": "redis", "DOCKYARD_BUFFER_REDIS_URL": f"redis://:secret@127.0.0.1:{port}/0"}
    finding = check_redis(env)
    assert finding.status == ERROR and "start redis-server" in finding.message and "secret" not in finding.message
    assert check_redis({"DOCKYARD_BUFFER_BACKEND": "redis"}).status == ERROR
    assert check_redis({}).status == SKIP


def test_a_port_in_use_is_named() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        finding = check_ports({"coordinator": port})
    assert finding.status == ERROR and f"{port} (coordinator)" in finding.message
    assert check_ports({"coordinator": port}).status == OK


def test_checkpoints_that_cannot_fit_the_disk_are_refused(tmp_path: Path) -> None:
    huge = [
        "policy.model.hidden_size=65536",
        "policy.model.intermediate_size=262144",
        "policy.model.num_hidden_layers=96",
    ]
    cfg = load_config(TINY, [*RANDOM_INIT, *huge, f"logger.log_dir={tmp_path}"])
    finding = check_disk(cfg)
    assert finding.status == ERROR and "GiB free" in finding.message
    assert check_disk(load_config(TINY, [*RANDOM_INIT, f"logger.log_dir={tmp_path}"])).status == OK


def test_dockyard_run_stops_at_preflight_before_any_service_starts(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "dockyard.cli",
            "run",
            str(TINY),
            f"policy.model_name={tmp_path / 'typo'}",
            f"logger.log_dir={tmp_path / 'runs'}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "error  model" in result.stdout and "dockyard prepare" in result.stdout
    assert "starting services" not in result.stdout
    assert not (tmp_path / "runs" / "logs").exists() and not (tmp_path / "typo").exists()


def test_the_docker_message_imports_nothing_the_sandbox_image_lacks() -> None:
    # The sandbox service's image has no config libraries; it imports docker_problem from here.
    code = (
        "import sys, dockyard.preflight; print(sorted(m for m in ('omegaconf', 'yaml', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert out.strip() == "[]"


def test_the_default_sandbox_image_is_the_one_the_sandbox_builds() -> None:
    # The library never imports services/, so preflight names the image itself; this keeps the two equal.
    from dockyard.preflight import _default_sandbox_image
    from services.sandbox.images import SANDBOX_IMAGE

    assert _default_sandbox_image() == SANDBOX_IMAGE
