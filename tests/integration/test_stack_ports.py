"""A port drawn free and taken by another process before its service binds it does not fail the stack.

`dockyard run` and `dockyard up` without set ports draw free ports, then start the services; another
process (a second run, a test worker, any client's outgoing connection) can take a drawn port in between.
LocalStack draws again and starts over, up to BIND_ATTEMPTS times; a port set by the user is never redrawn.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

import dockyard.stack
from dockyard.stack import LocalStack

pytestmark = pytest.mark.slow


def test_a_drawn_port_taken_before_the_bind_is_drawn_again(tmp_path: Path, monkeypatch) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    real = dockyard.stack._free_port
    draws = iter([port])
    # The first draw hands out the port another process holds; later draws are real.
    monkeypatch.setattr(dockyard.stack, "_free_port", lambda: next(draws, None) or real())
    stack = LocalStack(tmp_path / "logs", free_ports=True)
    [victim] = [name for name, drawn in stack.ports.items() if drawn == port]
    try:
        stack.start()
        assert stack.ports[victim] != port and not stack.dead()
        assert "cannot bind" in (tmp_path / "logs" / f"{victim}.log").read_text()  # the first try's refusal
    finally:
        stack.stop()
        taken.close()
