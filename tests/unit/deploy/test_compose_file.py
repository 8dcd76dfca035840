"""What deploy/compose/compose.yaml and its GPU override promise, read from the files themselves.

The e2e test (tests/e2e/test_compose.py) runs the stack; these checks need no Docker and catch
an edit that breaks a promise: the Docker socket only in the sandbox, a health check on every
long-running service and health-gated start order, the Redis and Docker backends, the sandbox
work folder at the same path on both sides, one published port, images that build.sh makes,
GPU reservations for trainer and rollout only.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[3]
COMPOSE = ROOT / "deploy" / "compose"
LONG_RUNNING = {"redis", "buffer", "sandbox", "trainer", "rollout", "coordinator", "endpoint"}


def load(name: str) -> dict:
    return yaml.safe_load((COMPOSE / name).read_text())["services"]


def default(value: str) -> str:
    """A ${VAR:-default} string with its defaults filled in."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


def fleets() -> dict:
    spec = importlib.util.spec_from_file_location("fleet", ROOT / "deploy" / "images" / "fleet.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FLEETS


def test_only_the_sandbox_has_the_docker_socket() -> None:
    services = load("compose.yaml")
    assert set(services) == LONG_RUNNING | {"submit"}
    with_socket = {
        name
        for name, service in services.items()
        for volume in service.get("volumes", [])
        if isinstance(volume, str) and volume.endswith(":/var/run/docker.sock")
    }
    assert with_socket == {"sandbox"}


def test_health_checks_gate_the_start_order() -> None:
    services = load("compose.yaml")
    for name in LONG_RUNNING:
        assert services[name]["healthcheck"]["test"][0] == "CMD", name
    for name, service in services.items():
        for peer, condition in service.get("depends_on", {}).items():
            assert condition == {"condition": "service_healthy"}, (name, peer)
    assert set(services["coordinator"]["depends_on"]) == {"trainer", "rollout", "buffer", "sandbox"}
    assert set(services["submit"]["depends_on"]) == {"coordinator"}
    assert "--wait" in services["submit"]["command"]


def test_backends_volumes_and_the_sandbox_work_folder() -> None:
    services = load("compose.yaml")
    assert services["buffer"]["environment"]["DOCKYARD_BUFFER_BACKEND"] == "redis"
    assert services["buffer"]["environment"]["DOCKYARD_BUFFER_REDIS_URL"].startswith("redis://redis:6379")
    assert "redis-data:/data" in services["redis"]["volumes"]
    sandbox = services["sandbox"]
    assert sandbox["environment"]["DOCKYARD_SANDBOX_BACKEND"] == "docker"
    work_root = default(sandbox["environment"]["DOCKYARD_SANDBOX_WORK_ROOT"])
    binds = [v for v in sandbox["volumes"] if isinstance(v, dict) and v["type"] == "bind"]
    assert [(default(b["source"]), default(b["target"])) for b in binds] == [(work_root, work_root)]
    for name in ("coordinator", "trainer", "rollout", "submit"):
        assert "data:/data" in services[name]["volumes"], name
    # The issue-8 registration settings are already set (ignored by services that do not register).
    assert sandbox["environment"]["DOCKYARD_SANDBOX_ADVERTISE_ADDRESS"] == "sandbox:50055"
    assert services["rollout"]["environment"]["DOCKYARD_ROLLOUT_ADVERTISE_ADDRESS"] == "rollout:50053"


def test_one_published_port_and_images_build_sh_makes() -> None:
    services = load("compose.yaml")
    # The coordinator's gRPC port and dashboard, and the policy endpoint's HTTP port, all on loopback only.
    assert [name for name, service in services.items() if "ports" in service] == ["coordinator", "endpoint"]
    assert default(services["coordinator"]["ports"][0]) == "127.0.0.1:50051:50051"
    assert default(services["coordinator"]["ports"][1]) == "127.0.0.1:8080:8080"
    assert services["coordinator"]["environment"]["DOCKYARD_COORDINATOR_DASHBOARD_PORT"] == 8080
    assert default(services["endpoint"]["ports"][0]) == "127.0.0.1:8000:8000"
    built = {f"dockyard/{name}:latest" for name in fleets()}
    for name, service in services.items():
        assert service["image"] in built, name
        assert service["pull_policy"] == "never", name


def test_gpu_override_reserves_gpus_for_trainer_and_rollout() -> None:
    services = load("compose.gpu.yaml")
    assert set(services) == {"trainer", "rollout"}
    for name, service in services.items():
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"], name
        assert service["environment"][f"DOCKYARD_{name.upper()}_DEVICE"] == "cuda"


def test_run_folders_stay_in_the_data_volume() -> None:
    coordinator = load("compose.yaml")["coordinator"]
    root = coordinator["environment"]["DOCKYARD_COORDINATOR_RUN_ROOT"]
    assert f"data:{root}" in coordinator["volumes"], coordinator["volumes"]
