"""A docker session's command that ends non-zero: its own failure while the container runs, an
infrastructure error once the container is gone, including when the engine is slow to say so; a
time limit's kill that fired as the command ended is over before the session's next command can start;
an exec's stdin is its end token, its stdin size and its stdin, ended only once both streams brought the
end line (so the engine cannot drop output still in flight); without the end lines, the engine's exit code."""

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
    result = session.exec_raw(["true"], b"", limits)
    returned = time.monotonic()
    assert result.timed_out
    assert api.kill_done_at is not None and api.kill_done_at <= returned


class HandshakeApi:
    """An engine whose exec never exits by itself: it says what the exec's stdin was, and is never asked for
    an exit code when the end lines came."""

    def __init__(self, sock) -> None:
        self.socket = sock
        self.argv: list[str] = []
        self.inspected = False

    def exec_create(self, container_id: str, argv, stdin: bool = False, **_) -> dict:
        self.argv, self.stdin = argv, stdin
        return {"Id": "command"}

    def exec_start(self, exec_id: str, socket: bool = False):
        return self.socket

    def exec_inspect(self, exec_id: str) -> dict:
        self.inspected = True
        return {"ExitCode": 7}


class HandshakeSocket:
    def __init__(self) -> None:
        self._sock = self
        self.written = b""
        self.events: list[str] = []

    def sendall(self, data: bytes) -> None:
        self.written += data

    def shutdown(self, how: int) -> None:
        self.events.append("stdin ended")

    def close(self) -> None: ...

    def token(self) -> bytes:
        deadline = time.monotonic() + 5
        while b"\n" not in self.written:
            assert time.monotonic() < deadline, "the header never came"
            time.sleep(0.01)
        return self.written.split(b" ")[0]


def _session(api) -> DockerSession:
    return DockerSession(SimpleNamespace(client=SimpleNamespace(api=api), user="1000"), "c0ffee")  # type: ignore[arg-type]


LIMITS = ResourceLimits(timeout_seconds=30, memory_mb=256, cpu_seconds=10, max_output_bytes=1024)


def test_stdin_ends_only_after_both_end_lines_and_the_line_gives_the_exit_code(monkeypatch) -> None:
    import docker.utils.socket

    sock = HandshakeSocket()

    def frames(_, tty=False):
        token = sock.token()
        yield 1, b"hello "
        yield 1, b"world\n" + token + b" 3 1\n"
        sock.events.append("stdout ended")
        yield 2, b"warn\n" + token[:5]  # the line split across frames
        sock.events.append("stderr still open")
        yield 2, token[5:] + b" 3 1\n"
        sock.events.append("engine closed")

    monkeypatch.setattr(docker.utils.socket, "frames_iter", frames)
    api = HandshakeApi(sock)
    result = _session(api).exec_raw(["cat"], b"data", LIMITS, command=True)
    assert api.stdin and api.argv[:2] == ["sh", "-c"] and api.argv[-1] == "cat"
    token = sock.token()
    assert len(token) == 32 and token not in b" ".join(a.encode() for a in api.argv)
    assert sock.written == token + b" 4\ndata"
    assert sock.events == ["stdout ended", "stderr still open", "stdin ended", "engine closed"]
    assert (bytes(result.out.data), bytes(result.err.data)) == (b"hello world\n", b"warn\n")
    assert (result.code, result.disk_full, result.end) == (3, True, (3, True))
    assert not api.inspected


def test_without_the_end_lines_the_output_that_came_and_the_engines_exit_code(monkeypatch) -> None:
    import docker.utils.socket

    sock = HandshakeSocket()

    def frames(_, tty=False):
        token = sock.token()
        yield 1, b"partial " + token[:4]  # held back as a possible end line, then given as output
        yield 2, b"oops\n" + token + b" 0 0\n"  # stderr's line alone does not end stdin

    monkeypatch.setattr(docker.utils.socket, "frames_iter", frames)
    api = HandshakeApi(sock)
    result = _session(api).exec_raw(["true"], b"", LIMITS)
    assert sock.written == sock.token() + b" 0\n"
    assert sock.events == []
    assert bytes(result.out.data) == b"partial " + sock.token()[:4]
    assert bytes(result.err.data) == b"oops\n"
    assert (result.code, result.end) == (7, None) and api.inspected
