"""A fleet member's side of registration: register, heartbeat, unregister.

    start ──RegisterMember(kind, name, address)──> every heartbeat_seconds: Heartbeat(name, load)
            Heartbeat NOT_FOUND (expired, or a restarted coordinator) ──> RegisterMember again
            coordinator unreachable ──> retried quietly, a warning at most every `warn_every` s
    stop  ──UnregisterMember (best effort)

Guarantees: nothing here ever raises into the service: a coordinator that is
down, slow or refusing only delays registration; the loop runs as one
background task of the service's event loop and ends with `stop()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import grpc
import structlog

from dockyard.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from dockyard.rpc.client import connect, wait_until_serving
from dockyard.rpc.settings import DEFAULT_PORTS

log = structlog.get_logger()

# load() -> (load, running, queued)
LoadFn = Callable[[], tuple[int, int, int]]
KINDS = {"rollout": coordinator_pb2.MEMBER_KIND_ROLLOUT, "sandbox": coordinator_pb2.MEMBER_KIND_SANDBOX}


class Membership:
    def __init__(
        self,
        coordinator_address: str,
        kind: str,
        name: str,
        address: str,
        heartbeat_seconds: float,
        load: LoadFn,
        *,
        warn_every: float = 30.0,
        serving_address: str | None = None,
        pressure: Callable[[], float] | None = None,
    ) -> None:
        self.kind, self.name, self.address = kind, name, address
        self._pressure = pressure  # a rollout replica's KV pressure, reported with each heartbeat
        self.heartbeat_seconds = heartbeat_seconds
        self._load = load
        self._warn_every = warn_every
        self._last_warning = -float("inf")
        # A restarted coordinator is found within about one heartbeat, not after gRPC's long backoff.
        self._channel = connect(
            coordinator_address,
            service="dockyard.coordinator.v1.CoordinatorService",
            max_reconnect_backoff=heartbeat_seconds,
        )
        self._stub = coordinator_pb2_grpc.CoordinatorServiceStub(self._channel)
        self._serving_address = serving_address
        self._task: asyncio.Task | None = None
        self.registered = False
        self.registrations = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        if self._serving_address is not None:
            # Register only once this service answers: the coordinator may call it at once.
            with contextlib.suppress(TimeoutError):
                await wait_until_serving(self._serving_address, timeout=120.0)
        while True:
            try:
                await self._beat()
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND and self.registered:
                    log.info("the coordinator does not know this member; registering again", member=self.name)
                    self.registered = False
                    continue
                self._warn(f"{exc.code().name}: {exc.details()}")
            except Exception as exc:  # never let the loop die
                self._warn(f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(self.heartbeat_seconds)

    async def _beat(self) -> None:
        timeout = max(self.heartbeat_seconds, 1.0)
        if not self.registered:
            await self._stub.RegisterMember(
                coordinator_pb2.RegisterMemberRequest(kind=KINDS[self.kind], name=self.name, address=self.address),
                timeout=timeout,
            )
            self.registered = True
            self.registrations += 1
            log.info("registered with the coordinator", member=self.name, address=self.address)
            return
        load, running, queued = self._load()
        await self._stub.Heartbeat(
            coordinator_pb2.HeartbeatRequest(
                name=self.name,
                load=load,
                running=running,
                queued=queued,
                kv_pressure=self._pressure() if self._pressure is not None else 0.0,
            ),
            timeout=timeout,
        )

    def _warn(self, error: str) -> None:
        now = time.monotonic()
        if now - self._last_warning >= self._warn_every:
            self._last_warning = now
            log.warning("coordinator not reached; will keep trying", member=self.name, error=error)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.registered:
            with contextlib.suppress(Exception):
                await self._stub.UnregisterMember(coordinator_pb2.UnregisterMemberRequest(name=self.name), timeout=1.0)
        await self._channel.close()


def membership_for(
    settings, kind: str, name: str, load: LoadFn, pressure: Callable[[], float] | None = None
) -> Membership | None:
    """The Membership a service's settings ask for (coordinator_address, advertise_address,
    heartbeat_seconds); None when coordinator_address is empty (a standalone service)."""
    if not settings.coordinator_address:
        return None
    port = settings.port or DEFAULT_PORTS[kind]
    return Membership(
        settings.coordinator_address,
        kind,
        name,
        settings.advertise_address or f"127.0.0.1:{port}",
        settings.heartbeat_seconds,
        load,
        serving_address=f"127.0.0.1:{port}",
        pressure=pressure,
    )
