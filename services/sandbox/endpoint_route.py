"""The one network route of a session that runs an external scaffold: to the policy endpoint, nothing else.

    container (network none: only its own loopback)
      scaffold ──TCP──> 127.0.0.1:ENDPOINT_PORT  (PID 1: ROUTED_PID1_SOURCE, the reaper plus a forwarder)
                            ──unix socket──> /run/dockyard/endpoint.sock  (a read-only bind of one host folder)
    host (the sandbox service)
      EndpointRoute: unix server on that socket ──TCP──> endpoint_address (fixed when the session opens)

The container keeps `network_mode: none`: it has no interface but its loopback, so no address
(internet, host, another service, the Docker bridge) is routable from it. Its only way out is the
socket, and the host end of the socket opens connections to one address only, the policy endpoint
the session was opened for; what the container sends cannot choose another.

Guarantees: a work root too long for the socket's path is refused when a route is made (FailedPrecondition
naming DOCKYARD_SANDBOX_WORK_ROOT), never a bind error later; at most MAX_CONNECTIONS connections of a session
are forwarded at once (more are closed at once); the host folder holds only the socket, is mounted read-only,
and is removed with the session; closing the route ends its connections. Not covered: what the endpoint itself
accepts (its own auth and limits apply: the session's key binds calls to the trial's endpoint session).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile

import structlog

from dockyard.rpc.errors import FailedPrecondition

log = structlog.get_logger()

MOUNT = "/run/dockyard"  # where the socket's folder appears in the container
SOCKET_NAME = "endpoint.sock"
ENDPOINT_PORT = 8080  # on the container's own loopback
MAX_CONNECTIONS = 16
# sockaddr_un's sun_path holds 108 bytes on Linux, the terminating NUL included.
MAX_SOCKET_PATH_BYTES = 107
CHUNK = 64 * 1024

# What PID 1 of a session's container writes once the session may run commands.
READY = b"dockyard-session-ready"
# PID 1 of a routed session: reap orphans (as docker_session_start.REAPER_SOURCE) and forward
# 127.0.0.1:PORT to the socket. `kill -9 -1` after each command spares PID 1, so the route stays.
# It says READY only once it listens: a scaffold's first connection never meets a closed port.
ROUTED_PID1_SOURCE = rf"""
import asyncio, os, signal
async def pipe(reader, writer):
    try:
        while data := await reader.read({CHUNK}):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()
async def serve(reader, writer):
    try:
        up_reader, up_writer = await asyncio.open_unix_connection("{MOUNT}/{SOCKET_NAME}")
    except OSError:
        writer.close()
        return
    await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
def reap():
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass
async def main():
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    loop.add_signal_handler(signal.SIGCHLD, reap)
    loop.add_signal_handler(signal.SIGTERM, done.set_result, None)
    await asyncio.start_server(serve, "127.0.0.1", {ENDPOINT_PORT})
    os.write(1, b"{READY.decode()}\n")
    await done
asyncio.run(main())
"""


def endpoint_url() -> str:
    return f"http://127.0.0.1:{ENDPOINT_PORT}"


def socket_path_excess(work_root: str | None) -> int:
    """Bytes by which a route's socket path under `work_root` (None: the system temp) would exceed what a
    unix socket allows; 0 or less when every route fits. mkdtemp names the folder with 8 random characters."""
    folder = os.path.join(os.path.abspath(work_root or tempfile.gettempdir()), "dockyard-route-" + "x" * 8)
    return len(os.path.join(folder, SOCKET_NAME).encode()) - MAX_SOCKET_PATH_BYTES


def split_address(address: str) -> tuple[str, int]:
    """host:port (or [v6]:port) -> (host, port); ValueError when it is not one."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"endpoint_address {address[:80]!r} is not host:port")
    return host.strip("[]"), int(port)


class EndpointRoute:
    """The host end: a unix socket in its own folder, each connection forwarded to one address."""

    def __init__(self, address: str, work_root: str | None) -> None:
        if (excess := socket_path_excess(work_root)) > 0:
            raise FailedPrecondition(
                f"DOCKYARD_SANDBOX_WORK_ROOT ({work_root or tempfile.gettempdir()}) is {excess} bytes too long for "
                f"a routed session: its endpoint socket's path would exceed the {MAX_SOCKET_PATH_BYTES} bytes a "
                "unix socket allows; choose a shorter folder"
            )
        # address "": a route made ahead of its session (a warm container's, docker_warm.py); bind() names it.
        self._host, self._port = split_address(address) if address else ("", 0)
        self.folder = tempfile.mkdtemp(prefix="dockyard-route-", dir=work_root)
        os.chmod(self.folder, 0o755)
        self._server: asyncio.AbstractServer | None = None
        self._live: set[asyncio.Task] = set()

    def bind(self, address: str) -> None:
        """The one address of a route made ahead of its session, before start()."""
        self._host, self._port = split_address(address)

    async def start(self) -> None:
        if not self._port:
            raise RuntimeError("the route has no address: bind() it first")
        path = os.path.join(self.folder, SOCKET_NAME)
        self._server = await asyncio.start_unix_server(self._serve, path)
        os.chmod(path, 0o666)  # the container's non-root user connects

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if len(self._live) >= MAX_CONNECTIONS or task is None:
            writer.close()
            return
        self._live.add(task)
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(self._host, self._port), 10.0)
        except (TimeoutError, OSError) as exc:
            log.warning("the policy endpoint is not reachable from a session's route", error=str(exc))
            writer.close()
            self._live.discard(task)
            return
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            self._live.discard(task)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._live):
            task.cancel()
        await asyncio.gather(*self._live, return_exceptions=True)
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.folder, SOCKET_NAME))
        with contextlib.suppress(OSError):
            os.rmdir(self.folder)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()
