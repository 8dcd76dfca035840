"""A docker session's command that ends non-zero: its own failure while the container runs, an
infrastructure error once the container is gone, including when the engine is slow to say so; a
time limit's kill that fired as the command ended is over before the session's next command can start;
and a command's stdin is attached only when it has some."""

from __future__ import annotations

import time
from types import SimpleNamespace

from services.sandbox.backend import ResourceLimits
from services.sandbox.docker_sessions import KILL_ALL, DockerSession, container_running


class SlowToStopApi:
    """inspect_container says Running for the first `running_for` calls, then stopped."""

    def __init__(self, running_for: int) -> None:
        self.running_for = running_for
        self.calls = 0

    def inspect_container(self, container_id: str) -> dict:
        self.calls += 1
        return {"State": {"Running": self.calls <= self.running_for}}


def test_a_killed_command_waits_for_the_engine_to_show_its_container_stopped() -> None:
    api = SlowToStopApi(running_for=3)
    assert container_running(api, "c0ffee", killed=True) is False
    assert api.calls == 4


def test_a_killed_command_in_a_live_container_is_the_commands_own_failure() -> None:
    api = SlowToStopApi(running_for=10**6)
    assert container_running(api, "c0ffee", killed=True) is True


def test_an_ordinary_failure_asks_the_engine_once() -> None:
    api = SlowToStopApi(running_for=1)
    assert container_running(api, "c0ffee", killed=False) is True
    assert api.calls == 1


class SlowKillApi:
    """A command that ends just as its time limit fires, and an engine slow to run the kill that follows."""

    def __init__(self) -> None:
        self.kill_done_at: float | None = None

    def exec_create(self, container_id: str, argv, **_) -> dict:
        return {"Id": "kill" if argv == KILL_ALL else "command"}

    def exec_start(self, exec_id: str, socket: bool = False):
        if exec_id == "kill":
            time.sleep(0.5)  # the engine takes its time to run `kill -9 -1`
            self.kill_done_at = time.monotonic()
            return b""
        return EndedSocket()

    def exec_inspect(self, exec_id: str) -> dict:
        return {"ExitCode": 0}


class EndedSocket:
    """The command's output stream: it ends after 0.2 s, as the 0.1 s time limit's kill has just begun."""

    def __init__(self) -> None:
        self._sock = self

    def sendall(self, data: bytes) -> None: ...

    def shutdown(self, how: int) -> None: ...

    def close(self) -> None: ...


def test_a_kill_that_fired_as_the_command_ended_is_over_before_the_next_command_can_start(monkeypatch) -> None:
    import docker.utils.socket

    def frames(sock, tty=False):
        time.sleep(0.2)
        return iter(())

    monkeypatch.setattr(docker.utils.socket, "frames_iter", frames)
    api = SlowKillApi()
    config = SimpleNamespace(client=SimpleNamespace(api=api), user="1000")
    session = DockerSession(config, "c0ffee")  # type: ignore[arg-type]
    limits = ResourceLimits(timeout_seconds=0.1, memory_mb=256, cpu_seconds=10, max_output_bytes=1024)
    *_, timed_out = session.exec_raw(["true"], b"", limits)
    returned = time.monotonic()
    assert timed_out
    assert api.kill_done_at is not None and api.kill_done_at <= returned


class RecordingApi:
    """Records each exec's stdin flag and what was written to its connection."""

    def __init__(self) -> None:
        self.stdin_flags: list[bool] = []
        self.socket = RecordingSocket()

    def exec_create(self, container_id: str, argv, stdin: bool = False, **_) -> dict:
        self.stdin_flags.append(stdin)
        return {"Id": "command"}

    def exec_start(self, exec_id: str, socket: bool = False):
        return self.socket

    def exec_inspect(self, exec_id: str) -> dict:
        return {"ExitCode": 0}


class RecordingSocket:
    def __init__(self) -> None:
        self._sock = self
        self.written: list[bytes | str] = []

    def sendall(self, data: bytes) -> None:
        self.written.append(data)

    def shutdown(self, how: int) -> None:
        self.written.append("half-closed")

    def close(self) -> None: ...


def test_stdin_is_attached_only_when_the_command_has_some(monkeypatch) -> None:
    import docker.utils.socket

    def frames(sock, tty=False):
        time.sleep(0.1)  # the feeder, if any, has written by the time the output ends
        return iter(())

    monkeypatch.setattr(docker.utils.socket, "frames_iter", frames)
    api = RecordingApi()
    session = DockerSession(SimpleNamespace(client=SimpleNamespace(api=api), user="1000"), "c0ffee")  # type: ignore[arg-type]
    limits = ResourceLimits(timeout_seconds=30, memory_mb=256, cpu_seconds=10, max_output_bytes=1024)
    session.exec_raw(["true"], b"", limits)
    assert api.stdin_flags == [False] and api.socket.written == []
    session.exec_raw(["cat"], b"data", limits)
    assert api.stdin_flags == [False, True] and api.socket.written == [b"data", "half-closed"]
