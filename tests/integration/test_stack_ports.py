"""A port drawn free and taken by another process before its service binds it does not fail the stack.

`dockyard run` and `dockyard up` without set ports draw free ports, then start the services; another
process (a second run, a test worker, any client's outgoing connection) can take a drawn port in between.
LocalStack draws again and starts over, up to BIND_ATTEMPTS times; a port set by the user is never redrawn.
A service counts as up only when the port that answers is its own: a gRPC server that took the port answers
health checks too, while the service itself fails to bind and exits.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

import dockyard.stack
from dockyard.stack import LocalStack

pytestmark = pytest.mark.slow


@contextmanager
def listening_socket() -> Iterator[int]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


@contextmanager
def serving_health() -> Iterator[int]:
    """Another program's gRPC server on a free port, its health service SERVING (gRPC's default options)."""
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port
    finally:
        server.stop(None)


@pytest.mark.parametrize("taker", [listening_socket, serving_health], ids=["socket", "grpc-health"])
def test_a_drawn_port_taken_before_the_bind_is_drawn_again(tmp_path: Path, monkeypatch, taker) -> None:
    with taker() as port:
        drawn_again(tmp_path, monkeypatch, port)


def drawn_again(tmp_path: Path, monkeypatch, port: int) -> None:
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
