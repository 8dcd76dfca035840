"""listens_on: a port counts as a process's only when it or a descendant holds it in LISTEN state."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from dockyard.rpc.ports import listens_on

HOLDER = (  # listens on a free port, prints it, waits for its stdin to close
    "import socket, sys; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
    "print(s.getsockname()[1], flush=True); sys.stdin.read()"
)


def test_a_bound_socket_counts_only_once_it_listens() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        assert listens_on(os.getpid(), port) is False
        held.listen()
        assert listens_on(os.getpid(), port) is True


def test_a_childs_port_is_its_parents_and_not_a_strangers() -> None:
    child = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    stranger = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        port = int(child.stdout.readline())
        assert listens_on(child.pid, port) is True
        assert listens_on(os.getpid(), port) is True  # a launcher's worker serves for it
        assert listens_on(stranger.pid, port) is False
    finally:
        for proc in (child, stranger):
            proc.kill()
            proc.wait()
