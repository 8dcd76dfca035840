"""Preflight: each check trips on what it guards, and says what to fix; a healthy config passes."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dockyard.config import load_config
from dockyard.launch_checks import docker_problem
from dockyard.preflight import (
    ERROR,
    OK,
    SKIP,
    WARN,
    Context,
    check_disk,
    check_docker,
    check_fp8,
    check_gpus,
    check_model,
    check_ports,
    check_redis,
    check_tokenizer_and_context,
    check_tool_call_format,
    context_problem,
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
    finding, *data = check_tokenizer_and_context(cfg, prepare=False)
    assert finding.check == "tokenizer" and finding.status == ERROR and str(folder) in finding.message
    assert [(f.check, f.status) for f in data] == [("data.train", OK), ("data.validation", OK)]  # still checked


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


def test_one_gpu_for_an_nccl_group_proposes_what_runs_on_one_gpu(monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "the one GPU")
    nccl = [*RANDOM_INIT, "cluster.device=cuda", "cluster.weight_sync_backend=nccl"]
    refused = check_gpus(load_config(TINY, nccl), local_services=True)
    assert refused.status == ERROR and "cluster.weight_sync_transport=colocated" in refused.message
    # What it proposes runs: the colocated transport forms no NCCL group (the backend setting aside).
    colocated = load_config(TINY, [*nccl, "cluster.weight_sync_transport=colocated"])
    assert check_gpus(colocated, local_services=True).status == OK
    # SGLang does not take the colocated transport (the config refuses the pair): not proposed then.
    sglang = check_gpus(load_config(TINY, [*nccl, "policy.generation.backend=sglang"]), local_services=True)
    assert sglang.status == ERROR and "colocated" not in sglang.message and "weight_sync_backend=gloo" in sglang.message


def test_no_docker_engine_is_one_line_with_the_fix() -> None:
    finding = check_docker({"DOCKYARD_SANDBOX_BACKEND": "docker", "DOCKER_HOST": "unix:///nonexistent/docker.sock"})
    assert finding.status == ERROR and "\n" not in finding.message
    assert "DOCKYARD_SANDBOX_BACKEND=local" in finding.message
    assert check_docker({}).status == SKIP


def test_the_sandbox_service_proposes_the_local_backend_only_for_jobs_that_need_no_container() -> None:
    # The service serves any job: its message names the jobs the local backend refuses, never a bare fix.
    said = docker_problem(ConnectionError("refused"), {}, any_job=True)
    assert "start the Docker daemon" in said and "DOCKER_SOCKET" in said
    assert "only a job that needs no container can use the local backend" in said
    assert "env.scaffold" in said and "terminal_bench" in said and "install packages" in said
    # A job known to need docker: the local backend is never proposed.
    needed = docker_problem(ConnectionError("refused"), {}, "env terminal_bench runs each task in its own image")
    assert "DOCKYARD_SANDBOX_BACKEND=local" not in needed and "cannot run it" in needed


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
    # The sandbox service's image has no config libraries; it imports docker_problem from dockyard.launch_checks.
    code = (
        "import sys, dockyard.launch_checks, dockyard.preflight; "
        "print(sorted(m for m in ('omegaconf', 'yaml', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert out.strip() == "[]"


def test_the_default_sandbox_image_is_the_one_the_sandbox_builds() -> None:
    # The library never imports services/, so preflight names the image itself; this keeps the two equal.
    from dockyard.preflight import _default_sandbox_image
    from services.sandbox.images import SANDBOX_IMAGE

    assert _default_sandbox_image() == SANDBOX_IMAGE


def test_a_missing_model_folder_hides_no_data_line(tmp_path: Path) -> None:
    cfg = load_config(TINY, [f"policy.model_name={tmp_path / 'nowhere'}", "policy.bootstrap=null"])
    found = by_check(check_tokenizer_and_context(cfg, prepare=False))
    assert found["tokenizer"].status == SKIP and found["context"].status == SKIP
    assert found["data.train"].status == OK and found["data.validation"].status == OK
    # With a bootstrap, the folder is checked as the warm start builds it, context included.
    built = by_check(check_tokenizer_and_context(load_config(TINY, [f"policy.model_name={tmp_path / 'x'}"]), False))
    assert {built[c].status for c in ("tokenizer", "data.train", "data.validation", "context")} == {OK}


def test_the_chat_template_check_says_ok_when_it_passes() -> None:
    cfg = load_config(TINY, [*RANDOM_INIT, "data.chat_template=true"])
    assert by_check(check_tokenizer_and_context(cfg, prepare=False))["chat template"].status == OK
    assert "chat template" not in by_check(check_tokenizer_and_context(load_config(TINY, RANDOM_INIT), False))


def test_the_context_fix_never_proposes_max_new_tokens_below_one() -> None:
    assert "lower max_new_tokens to 8 or less" in context_problem(120, 16, 128)
    for longest in (128, 300):
        message = context_problem(longest, 16, 128)
        assert "lower max_new_tokens" not in message and "shorter prompts" in message


def test_ports_propose_free_ones_only_where_unset_ports_are_free() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert "leave them unset for free ports" in check_ports({"coordinator": port}).message
        fixed = check_ports({"coordinator": port}, free_when_unset=False)  # dockyard up, run --default-ports
    assert fixed.status == ERROR and "free ports" not in fixed.message and "--<service>-port" in fixed.message


def test_preflight_reads_the_sandbox_backend_that_dockyard_run_sets(monkeypatch) -> None:
    monkeypatch.delenv("DOCKYARD_SANDBOX_BACKEND", raising=False)
    external = load_config(REPO / "examples" / "configs" / "tiny_agent_external.yaml", RANDOM_INIT)
    no_engine = Context(environ={"DOCKER_HOST": "unix:///nonexistent/docker.sock"})
    docker = by_check(preflight(external, no_engine))["docker"]
    assert docker.status == ERROR and "env.scaffold" in docker.message
    assert "DOCKYARD_SANDBOX_BACKEND=local" not in docker.message  # run refuses the local backend for it
    monkeypatch.setenv("DOCKYARD_SANDBOX_BACKEND", "local")
    refused = by_check(preflight(external, Context(environ={"DOCKYARD_SANDBOX_BACKEND": "local"})))["sandbox"]
    assert refused.status == ERROR and "DOCKYARD_SANDBOX_BACKEND=docker" in refused.message


def test_a_validation_file_smaller_than_its_size_is_validated_once_and_said(tmp_path: Path) -> None:
    from dockyard.tasks.envs import split_tasks

    data, train = tmp_path / "val.jsonl", tmp_path / "train.jsonl"
    rows = [
        {"id": f"v{i}", "question": f"def f{i}(): return {i}", "asserts": [f"assert f{i}() == {i}"]} for i in range(4)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train.write_text("".join(json.dumps({**r, "id": f"t{i}"}) + "\n" for i, r in enumerate(rows)))
    fields = "{id: id, prompt: question, tests: asserts}"
    cfg = load_config(
        TINY,
        [
            *RANDOM_INIT,
            "env.name=program_synthesis",
            "data.train.source=humaneval",
            "data.validation.source=humaneval",
            f"data.train.path={train}",
            f"data.validation.path={data}",  # a file of its own: taken whole, no hash split
            f"data.train.fields={fields}",
            f"data.validation.fields={fields}",
            "data.validation.size=64",
        ],
    )
    assert sorted(t.task_id for t in split_tasks(cfg, "validation")) == ["v0", "v1", "v2", "v3"]  # not 64
    line = by_check(check_tokenizer_and_context(cfg, prepare=False))["data.validation"]
    assert line.status == OK and "4 tasks" in line.message and "fewer than data.validation.size=64" in line.message


def test_a_tool_call_format_the_chat_template_does_not_render_is_an_error_naming_the_setting() -> None:
    cfg = load_config(AGENT, [*RANDOM_INIT, "policy.tool_call_format=mistral"])
    line = by_check(check_tokenizer_and_context(cfg, prepare=False))["tool calls"]
    assert line.status == ERROR and "policy.tool_call_format=mistral" in line.message
    assert "[TOOL_CALLS]" in line.message and "policy.tool_call_format=hermes" in line.message  # the fix
    found = by_check(check_tokenizer_and_context(load_config(AGENT, RANDOM_INIT), prepare=False))["tool calls"]
    assert (found.status, found.message) == (OK, "hermes: detected from the chat template (auto)")


def test_auto_that_detects_no_format_says_which_it_falls_back_to() -> None:
    from dockyard.models.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    line = check_tool_call_format(load_config(AGENT, RANDOM_INIT), tokenizer)
    assert line.status == OK and "falls back to hermes" in line.message and "policy.tool_call_format" in line.message
    assert check_tool_call_format(load_config(TINY, RANDOM_INIT), tokenizer) is None  # no tools: nothing to say
    explicit = check_tool_call_format(load_config(TINY, [*RANDOM_INIT, "policy.tool_call_format=harmony"]), tokenizer)
    assert explicit.status == ERROR and "policy.tool_call_format=harmony" in explicit.message


def test_fp8_rollouts_are_a_warning_where_they_were_not_measured_faster(monkeypatch) -> None:
    arch = "policy.model={model_type: qwen2, hidden_size: 896, num_hidden_layers: 24, intermediate_size: 4864}"
    fp8 = [*RANDOM_INIT, arch, "cluster.device=cuda", "policy.generation.precision=fp8"]
    assert check_fp8(load_config(TINY, RANDOM_INIT)).status == SKIP
    finding = check_fp8(load_config(TINY, fp8))
    assert finding.status == WARN and "0.4B parameters" in finding.message
    assert "not measured faster" in finding.message and "precision=auto" in finding.message
    # A size at or above one measured faster passes; below it, still the warning.
    monkeypatch.setattr("dockyard.preflight.FP8_MEASURED", {"fp8": ((300_000_000, 1.2),)})
    assert check_fp8(load_config(TINY, fp8)).status == OK
    # Each precision by its own figures: fp8_block has none here.
    block = [*fp8[:-1], "policy.generation.precision=fp8_block"]
    assert check_fp8(load_config(TINY, block)).status == WARN
    monkeypatch.setattr("dockyard.preflight.FP8_MEASURED", {"fp8": ((500_000_000, 1.2),)})
    assert check_fp8(load_config(TINY, fp8)).status == WARN
