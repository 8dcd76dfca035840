"""The five services as local processes on loopback: what `dockyard up` and `dockyard run` start.

    buffer, sandbox (or sandbox-1..M), rollout (or rollout-1..N), trainer, coordinator
    [endpoint]  the policy endpoint (HTTP, default port 8000), with endpoint=True (`dockyard up` sets it,
                and `dockyard run` for a config with agent trials); the coordinator is told its address
    [dashboard] the coordinator's web dashboard (HTTP, default port 8080), with dashboard=True: the
                coordinator is told its port (DOCKYARD_COORDINATOR_DASHBOARD_PORT)

Rollout replicas and sandbox workers register with the coordinator themselves
(DOCKYARD_<SVC>_COORDINATOR_ADDRESS); with N > 1 (M > 1) each process is named
`rollout-<i>` (`sandbox-<i>`), which is also its name in the fleet.

    a service's port: `ports[svc]` (dockyard up's flags) > DOCKYARD_<SVC>_PORT (the environment)
                      > a free port (free_ports=True, and every process of a service run N > 1 times)
                      > the default (50051-50055)
    a port set for a service run N > 1 times is the first of N consecutive ports (rollout-<i>: port + i - 1)

The service token: `dockyard run` and `dockyard up` call `ensure_service_token` before starting the
stack, so a stack never runs without one (the policy endpoint signs session keys with it and refuses
to start without it): unless DOCKYARD_AUTH_TOKEN(_FILE) is set, a new random one is written to
`<folder>/service-token` (mode 0600, never printed) and DOCKYARD_AUTH_TOKEN_FILE names it for every
child and for the command's own clients.

Guarantees: every child is in the parent's care: it gets SIGTERM when the
parent process dies (PARENT_PID_ENV asks the service to watch for that itself,
whichever thread of the parent started it), `stop()` SIGTERMs all children and
SIGKILLs any that outlive the grace period, so no service is left orphaned;
each child's log goes to its own file, and `pids.json` beside the logs names
every child's pid. Each child is told the port it serves on and its peers'
addresses (a peer address already set in the environment is kept); ports
that collide, or a port that is no port, are a ValueError naming the setting.
A service counts as up when its address answers and (where /proc tells) its
own process listens on the port, never on another server's answer.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import MutableMapping
from pathlib import Path

from dockyard.rpc.client import wait_until_serving
from dockyard.rpc.launch import PARENT_PID_ENV
from dockyard.rpc.ports import DEFAULT_PORTS, listens_on

SERVICES = ("buffer", "sandbox", "rollout", "trainer", "coordinator")
# The HTTP policy endpoint (services/endpoint): started after the coordinator, checked over HTTP.
ENDPOINT = "endpoint"
ENDPOINT_DEFAULT_PORT = 8000  # services.endpoint.settings.DEFAULT_PORT (the library never imports services/)
# The coordinator's read-only web dashboard (HTTP, in the coordinator process), with dashboard=True.
DASHBOARD = "dashboard"
DASHBOARD_DEFAULT_PORT = 8080
DASHBOARD_PORT_ENV = "DOCKYARD_COORDINATOR_DASHBOARD_PORT"


# Where `dockyard run` / `dockyard up` keep the token they create (in the stack's log folder).
SERVICE_TOKEN_FILE = "service-token"
TOKEN_VARIABLES = ("DOCKYARD_AUTH_TOKEN", "DOCKYARD_AUTH_TOKEN_FILE")


def create_service_token(folder: Path) -> Path:
    """A new random service token (256 bits, URL-safe) in `folder`/service-token, readable by its owner
    only: written to a 0600 file made beside it, then moved over any older one (a new stack, a new token)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / SERVICE_TOKEN_FILE
    fd, temporary = tempfile.mkstemp(dir=folder, prefix=f".{SERVICE_TOKEN_FILE}-")  # mode 0600
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(secrets.token_urlsafe(32) + "\n")
    os.replace(temporary, path)
    return path


def ensure_service_token(folder: Path, environ: MutableMapping[str, str] = os.environ) -> Path | None:
    """The token file created for a stack in `folder` when `environ` sets no token (DOCKYARD_AUTH_TOKEN_FILE
    then names it there, so children and this process's clients use it); None when one is set already."""
    if any(environ.get(name) for name in TOKEN_VARIABLES):
        return None
    path = create_service_token(folder)
    environ["DOCKYARD_AUTH_TOKEN_FILE"] = str(path.resolve())
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _instances(service: str, count: int) -> list[str]:
    if count < 1:
        raise ValueError(f"a stack needs at least one {service} process, not {count}")
    return [service] if count == 1 else [f"{service}-{i}" for i in range(1, count + 1)]


def _port_variable(service: str) -> str:
    return f"DOCKYARD_{service.upper()}_PORT"


def _set_port(service: str, given: dict[str, int], env: dict[str, str], variable: str | None = None) -> int:
    """The port set for `service` (flag, then environment), or 0 when none is; 0 anywhere means unset."""
    variable = variable or _port_variable(service)
    if given.get(service):
        value, origin = given[service], f"the {service} port"
    else:
        value, origin = env.get(variable, "").strip() or "0", variable
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ValueError(f"{origin} is {value!r}: give a port, 1-65535 (or 0 for the default)")
    return port


async def _http_ready(address: str, timeout: float) -> None:
    """Wait until the endpoint's GET /health answers 200."""
    import httpx

    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=2.0) as client:
        while True:
            try:
                if (await client.get(f"http://{address}/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the endpoint at {address} did not answer /health within {timeout} s")
            await asyncio.sleep(0.2)


# How many times start() draws free ports again when one was taken before its service bound it.
BIND_ATTEMPTS = 3
# What a service's log says when its port is in use (the gRPC services' BindError; uvicorn's).
_PORT_TAKEN = ("cannot bind", "address already in use")


class _PortTaken(RuntimeError):
    """A service could not bind the port drawn for it: another process took it after the draw."""


class LocalStack:
    def __init__(
        self,
        log_dir: Path,
        *,
        free_ports: bool = False,
        extra_env: dict[str, str] | None = None,
        service_env: dict[str, dict[str, str]] | None = None,
        rollout_replicas: int = 1,
        sandbox_workers: int = 1,
        ports: dict[str, int] | None = None,
        endpoint: bool = False,
        dashboard: bool = False,
    ) -> None:
        """`ports`: service -> port of its (first) process, over DOCKYARD_<SVC>_PORT of the environment."""
        self.log_dir = log_dir
        counts = {"rollout": rollout_replicas, "sandbox": sandbox_workers}
        # Process name -> service; in start order.
        self.kinds = {name: s for s in SERVICES for name in _instances(s, counts.get(s, 1))}
        if endpoint:
            self.kinds[ENDPOINT] = ENDPOINT
        self.extra_env = extra_env or {}
        self.dashboard = dashboard
        self._given, self._free_ports = ports or {}, free_ports
        self.ports = self._ports(self._given, free_ports)
        # Per service (or per process, e.g. "rollout-2"), on top of extra_env: e.g. CUDA_VISIBLE_DEVICES
        # to put trainer and rollout on two GPUs.
        self.service_env = service_env or {}
        self.procs: dict[str, subprocess.Popen] = {}

    def _ports(self, given: dict[str, int], free_ports: bool) -> dict[str, int]:
        env = {**os.environ, **self.extra_env}
        ports: dict[str, int] = {}
        drawn: list[str] = []  # names that get a free port, drawn once every set port is known
        for service in (*SERVICES, ENDPOINT):
            names = [name for name, kind in self.kinds.items() if kind == service]
            if not names:  # the endpoint, when not asked for: its port setting is not read
                continue
            base = _set_port(service, given, env)
            for i, name in enumerate(names):
                if base:
                    ports[name] = base + i
                elif free_ports or name != service:
                    drawn.append(name)
                else:
                    ports[name] = DEFAULT_PORTS.get(service, ENDPOINT_DEFAULT_PORT)
        if self.dashboard:
            if base := _set_port(DASHBOARD, given, env, DASHBOARD_PORT_ENV):
                ports[DASHBOARD] = base
            elif free_ports:
                drawn.append(DASHBOARD)
            else:
                ports[DASHBOARD] = DASHBOARD_DEFAULT_PORT
        self._drawn = set(drawn)
        for name in drawn:
            # The OS may hand out one free port twice (each probe closes its socket), or one set above.
            while (port := _free_port()) in ports.values():
                pass
            ports[name] = port
        if max(ports.values()) > 65535:
            raise ValueError(f"ports run past 65535: {ports}")
        clashes = {p: [n for n, q in ports.items() if q == p] for p, k in Counter(ports.values()).items() if k > 1}
        if clashes:
            raise ValueError(f"services would share a port: {clashes}; give each its own")
        return ports

    @property
    def set_ports(self) -> dict[str, int]:
        """The ports set by flag, environment or default: the ones a busy port fails. A drawn port taken
        before its service binds it is drawn again at start(), so checking it ahead would only race."""
        return {name: port for name, port in self.ports.items() if name not in self._drawn}

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def _env(self, name: str) -> dict[str, str]:
        kind = self.kinds[name]
        prefix = f"DOCKYARD_{kind.upper()}_"
        env = {
            **os.environ,
            **self.extra_env,
            **self.service_env.get(kind, {}),
            **(self.service_env.get(name, {}) if name != kind else {}),
            f"{prefix}PORT": str(self.ports[name]),
            PARENT_PID_ENV: str(os.getpid()),
        }
        if kind == "rollout":
            env[f"{prefix}REPLICA_NAME"] = name
        if kind == "sandbox":
            env[f"{prefix}NAME"] = name
            # One user's machine: the projects a job names (./my_env) are the ones beside its config.
            env.setdefault(f"{prefix}PROJECT_ROOT", os.getcwd())
        # Each service reads only the peer addresses it needs (one process per fixed service).
        for peer in SERVICES:
            if peer != kind and peer in self.ports:
                env.setdefault(f"{prefix}{peer.upper()}_ADDRESS", self.address(peer))
        if kind == "coordinator" and ENDPOINT in self.ports:  # agent trials call the policy endpoint
            env.setdefault(f"{prefix}ENDPOINT_ADDRESS", self.address(ENDPOINT))
        if kind == "coordinator" and DASHBOARD in self.ports:
            env[DASHBOARD_PORT_ENV] = str(self.ports[DASHBOARD])
        return env

    def _spawn(self, name: str) -> None:
        with open(self.log_dir / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", f"services.{self.kinds[name]}"],
                env=self._env(name),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        (self.log_dir / "pids.json").write_text(json.dumps({n: p.pid for n, p in self.procs.items()}))

    def start(self, timeout: float = 120.0) -> None:
        """Start every process and wait until each serves. A port drawn free can be taken by another
        process between the draw and the service's bind: then every drawn port is drawn again and the
        stack starts over (peers learn each other's addresses at spawn), up to BIND_ATTEMPTS times."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for attempt in range(1, BIND_ATTEMPTS + 1):
            for name in self.kinds:
                self._spawn(name)
            try:
                asyncio.run(self._wait(tuple(self.kinds), timeout))
                return
            except _PortTaken as exc:
                self.stop()
                if attempt == BIND_ATTEMPTS:
                    raise RuntimeError(f"{exc}; drawn {BIND_ATTEMPTS} times, taken each time") from None
                self.ports = self._ports(self._given, self._free_ports)
            except BaseException:
                self.stop()
                raise

    def kill(self, name: str) -> None:
        """SIGKILL one service, as a crash would: no drain, no cleanup."""
        proc = self.procs[name]
        proc.kill()
        proc.wait()

    def restart(self, name: str, timeout: float = 120.0) -> None:
        """Start a service that died (or was killed) again, on the same port, and wait until it serves."""
        if self.procs[name].poll() is None:
            raise RuntimeError(f"{name} is still running; kill it first")
        self._spawn(name)
        asyncio.run(self._wait((name,), timeout))

    async def _wait(self, names, timeout: float) -> None:
        async def one(name: str) -> None:
            ready = _http_ready if self.kinds[name] == ENDPOINT else wait_until_serving
            proc, deadline = self.procs[name], time.monotonic() + timeout
            task = asyncio.ensure_future(ready(self.address(name), timeout))
            while True:
                if proc.poll() is not None:
                    task.cancel()
                    tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                    message = f"{name} exited with code {proc.returncode}:\n{tail}"
                    if name in self._drawn and any(sign in tail.lower() for sign in _PORT_TAKEN):
                        raise _PortTaken(message)
                    raise RuntimeError(message)
                # Up when its address answers and the port is its own: a server that took the port before
                # this process could bind it answers too, while this one fails to bind and exits.
                if task.done():
                    task.result()
                    if listens_on(proc.pid, self.ports[name]) is not False:
                        return
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{name}: {self.address(name)} answers, but not from this process")
                await asyncio.sleep(0.1)

        await asyncio.gather(*(one(name) for name in names))

    def dead(self) -> list[str]:
        return [name for name, proc in self.procs.items() if proc.poll() is not None]

    def stop(self, grace: float = 15.0) -> dict[str, int]:
        # The coordinator first, so no job drives services that are going away.
        for name in reversed(list(self.kinds)):
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return {name: proc.returncode for name, proc in self.procs.items()}
