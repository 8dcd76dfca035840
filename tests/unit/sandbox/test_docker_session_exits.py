"""A docker session's command that ends non-zero: its own failure while the container runs, an
infrastructure error once the container is gone, including when the engine is slow to say so."""

from __future__ import annotations

from types import SimpleNamespace

from services.sandbox.docker_sessions import DockerSession, DockerSessionConfig


class SlowToStopApi:
    """inspect_container says Running for the first `running_for` calls, then stopped."""

    def __init__(self, running_for: int) -> None:
        self.running_for = running_for
        self.calls = 0

    def inspect_container(self, container_id: str) -> dict:
        self.calls += 1
        return {"State": {"Running": self.calls <= self.running_for}}


def session(api: SlowToStopApi) -> DockerSession:
    fields = dict(image="i", user="u", owner="o", cpus=1.0, pids_limit=64, max_file_bytes=1, max_disk_mb=1, tmp_mb=1)
    config = DockerSessionConfig(client=SimpleNamespace(api=api), work_root=None, **fields)
    return DockerSession(config, "c0ffee")


def test_a_killed_command_waits_for_the_engine_to_show_its_container_stopped() -> None:
    api = SlowToStopApi(running_for=3)
    assert session(api)._container_running(killed=True) is False
    assert api.calls == 4


def test_a_killed_command_in_a_live_container_is_the_commands_own_failure() -> None:
    api = SlowToStopApi(running_for=10**6)
    assert session(api)._container_running(killed=True) is True


def test_an_ordinary_failure_asks_the_engine_once() -> None:
    api = SlowToStopApi(running_for=1)
    assert session(api)._container_running(killed=False) is True
    assert api.calls == 1
