"""`dockyard up` takes each service's port from its flag, else DOCKYARD_<SVC>_PORT, else the
default; `dockyard submit/status/cancel` dial --coordinator, else DOCKYARD_CLI_COORDINATOR_ADDRESS."""

from __future__ import annotations

import itertools
import socket
from concurrent import futures

import grpc
import pytest

import dockyard.stack
from dockyard.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from dockyard.cli.common import EXIT_USAGE
from dockyard.cli.main import main
from dockyard.preflight import ERROR, OK, check_ports
from dockyard.stack import LocalStack
from tests.conftest import free_port

COORDINATOR_ENV = "DOCKYARD_CLI_COORDINATOR_ADDRESS"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for service in ("COORDINATOR", "TRAINER", "ROLLOUT", "BUFFER", "SANDBOX"):
        monkeypatch.delenv(f"DOCKYARD_{service}_PORT", raising=False)
    monkeypatch.delenv(COORDINATOR_ENV, raising=False)


def test_ports_come_from_the_flags_then_the_environment_then_the_defaults(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("DOCKYARD_TRAINER_PORT", "6102")
    monkeypatch.setenv("DOCKYARD_BUFFER_PORT", "6104")
    stack = LocalStack(tmp_path, ports={"buffer": 7104, "coordinator": 7101, "sandbox": None})
    assert stack.ports == {"buffer": 7104, "sandbox": 50055, "rollout": 50053, "trainer": 6102, "coordinator": 7101}
    # Each service serves on its port, and its peers dial it there.
    assert stack._env("trainer")["DOCKYARD_TRAINER_PORT"] == "6102"
    assert stack._env("coordinator")["DOCKYARD_COORDINATOR_TRAINER_ADDRESS"] == "127.0.0.1:6102"
    assert stack._env("trainer")["DOCKYARD_TRAINER_BUFFER_ADDRESS"] == "127.0.0.1:7104"
    assert stack._env("rollout")["DOCKYARD_ROLLOUT_COORDINATOR_ADDRESS"] == "127.0.0.1:7101"


def test_a_set_port_holds_with_free_ports_and_starts_the_replicas_consecutive_ports(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("DOCKYARD_COORDINATOR_PORT", "6201")
    stack = LocalStack(tmp_path, free_ports=True, rollout_replicas=3, ports={"rollout": 6300})
    assert stack.ports["coordinator"] == 6201
    assert [stack.ports[f"rollout-{i}"] for i in (1, 2, 3)] == [6300, 6301, 6302]
    assert stack.ports["trainer"] not in (50052, 6201)  # unset: a free port


def test_free_ports_never_repeat_one_drawn_or_set_already(monkeypatch, tmp_path) -> None:
    # The OS may hand the same free port out twice, or one a service has set.
    probes = iter([6400, 6400, 6401, 6500, 6402, 6403, 6404, 6405])
    monkeypatch.setattr(dockyard.stack, "_free_port", lambda: next(probes))
    stack = LocalStack(tmp_path, free_ports=True, ports={"coordinator": 6500})
    assert stack.ports["coordinator"] == 6500
    assert len(set(stack.ports.values())) == len(stack.ports), stack.ports
    assert sorted(p for n, p in stack.ports.items() if n != "coordinator") == [6400, 6401, 6402, 6403]


def test_preflight_checks_the_set_ports_and_not_the_drawn_ones(monkeypatch, tmp_path) -> None:
    # Another process takes a drawn port right after the draw: start() draws it again, so it fails nothing.
    with socket.socket() as held, socket.socket() as set_held:
        held.bind(("127.0.0.1", 0))
        set_held.bind(("127.0.0.1", 0))
        busy, set_busy = held.getsockname()[1], set_held.getsockname()[1]
        probes = itertools.chain([busy], itertools.count(6601))
        monkeypatch.setattr(dockyard.stack, "_free_port", lambda: next(probes))
        stack = LocalStack(tmp_path, free_ports=True, rollout_replicas=2, ports={"coordinator": 6600})
        assert busy in stack.ports.values()
        assert stack.set_ports == {"coordinator": 6600}
        assert check_ports(stack.set_ports).status == OK
        # A busy port the user set is still refused ahead of the start, by name.
        stack = LocalStack(tmp_path, free_ports=True, ports={"coordinator": set_busy})
        finding = check_ports(stack.set_ports)
        assert finding.status == ERROR and f"{set_busy} (coordinator)" in finding.message
    # dockyard up (no free ports): the replicas' ports are drawn, the other services' defaults are set.
    stack = LocalStack(tmp_path, rollout_replicas=2)
    assert stack.set_ports == {"buffer": 50054, "sandbox": 50055, "trainer": 50052, "coordinator": 50051}


def test_an_unusable_port_setting_is_named(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("DOCKYARD_SANDBOX_PORT", "fifty")
    with pytest.raises(ValueError, match="DOCKYARD_SANDBOX_PORT is 'fifty'"):
        LocalStack(tmp_path)
    monkeypatch.setenv("DOCKYARD_SANDBOX_PORT", "6301")
    with pytest.raises(ValueError, match=r"share a port: {6301: \['sandbox', 'rollout'\]}"):
        LocalStack(tmp_path, ports={"rollout": 6301})
    with pytest.raises(ValueError, match="the trainer port is 70000"):
        LocalStack(tmp_path, ports={"trainer": 70000})


def test_up_with_an_unusable_port_exits_2_naming_it(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setenv("DOCKYARD_TRAINER_PORT", "-3")
    with pytest.raises(SystemExit) as exited:
        main(["up", "--log-dir", str(tmp_path)])
    assert exited.value.code == EXIT_USAGE
    assert "DOCKYARD_TRAINER_PORT is '-3'" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing was started


class FakeCoordinator(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """Answers status and cancel with a job named after the server, so the test sees which one was dialled."""

    def __init__(self, name: str) -> None:
        self.name = name

    def _job(self, job_id: str) -> coordinator_pb2.Job:
        return coordinator_pb2.Job(
            job_id=job_id, state=coordinator_pb2.JOB_STATE_RUNNING, max_steps=4, phase="training"
        )

    def ListJobs(self, request, context):
        return coordinator_pb2.ListJobsResponse(jobs=[self._job(f"job-of-{self.name}")])

    def ListMembers(self, request, context):
        return coordinator_pb2.ListMembersResponse()

    def CancelJob(self, request, context):
        return coordinator_pb2.CancelJobResponse(job=self._job(f"{request.job_id}-cancelled-by-{self.name}"))


@pytest.fixture
def coordinators():
    """Two fake coordinators on free ports: {name: address}."""
    servers, addresses = [], {}
    for name in ("env", "flag"):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(FakeCoordinator(name), server)
        port = free_port()
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        servers.append(server)
        addresses[name] = f"127.0.0.1:{port}"
    yield addresses
    for server in servers:
        server.stop(0)


def test_status_and_cancel_dial_the_coordinator_of_the_flag_else_the_environment(
    monkeypatch, coordinators, capsys
) -> None:
    monkeypatch.setenv(COORDINATOR_ENV, coordinators["env"])
    assert main(["status"]) == 0
    assert "job-of-env  RUNNING" in capsys.readouterr().out
    assert main(["status", "--coordinator", coordinators["flag"]]) == 0
    assert "job-of-flag  RUNNING" in capsys.readouterr().out
    assert main(["cancel", "j1"]) == 0
    assert "j1-cancelled-by-env" in capsys.readouterr().out


def test_help_names_the_settings(capsys) -> None:
    for command in (["up", "--help"], ["status", "--help"]):
        with pytest.raises(SystemExit):
            main(command)
    out = capsys.readouterr().out
    assert "$DOCKYARD_TRAINER_PORT" in out and "--trainer-port" in out
    assert f"${COORDINATOR_ENV}" in out
