"""Retries, declared once: which status codes are transient, the backoff, and who retries what.

    a call fails ─code in TRANSIENT?─ no ──> the caller's error (never retried)
                        │ yes
                        ├─ method in CHANNEL_RETRIED ──> the channel retries it (a short outage, unseen by the caller)
                        └─ method in CALLER_RETRIED ───> the caller retries it with `retry()` under its own budget
                                                         (an outage as long as a service restart)

Guarantees: only idempotent methods (calling twice has the effect of calling
once, or the server answers a repeat with the first reply) are ever retried,
and each of them by exactly one layer: CHANNEL_RETRIED and CALLER_RETRIED
never share a method, so no call is retried by the channel inside a caller's
retry loop. Every wait between attempts follows one Backoff (exponential,
capped), and a caller's retry loop ends at its budget with the last error.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import TypeVar

import grpc
import structlog

log = structlog.get_logger()
T = TypeVar("T")

# A peer that is restarting, briefly unreachable or too slow this once: asking again may succeed.
TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# A call to a fleet member that ended so means the member is gone: it leaves routing until it heartbeats.
PEER_LOST = TRANSIENT | {grpc.StatusCode.CANCELLED}
# The peer is alive but full (a buffer at capacity, a sandbox's queue): wait, or go to another peer.
OVERLOADED = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED})


@dataclass(frozen=True)
class Backoff:
    """Exponential waits between attempts: initial, initial * multiplier, ..., at most `maximum`."""

    initial: float = 0.2
    multiplier: float = 2.0
    maximum: float = 2.0

    def delay(self, attempt: int) -> float:
        """The wait after failed attempt `attempt` (1-based)."""
        return min(self.initial * self.multiplier ** (attempt - 1), self.maximum)


# The channel's retries: a few quick attempts, only on UNAVAILABLE (the call never reached a server
# that could act on it); DEADLINE_EXCEEDED is the caller's budget and ends the call.
CHANNEL_BACKOFF = Backoff(initial=0.2, multiplier=2.0, maximum=2.0)
CHANNEL_ATTEMPTS = 4
# The callers' retries: waits long enough to outlast a restarting service without spinning.
CALLER_BACKOFF = Backoff(initial=0.1, multiplier=2.0, maximum=5.0)

# Idempotent methods that the channel retries for every caller.
CHANNEL_RETRIED: dict[str, tuple[str, ...]] = {
    "dockyard.coordinator.v1.CoordinatorService": ("GetJob", "ListJobs", "GetWeightSyncGroup", "ListMembers"),
    "dockyard.rollout.v1.RolloutService": ("LoadPolicy", "GetEngineInfo"),
    "dockyard.buffer.v1.BufferService": ("GetStats", "GetDataPlane"),
    "dockyard.sandbox.v1.SandboxService": ("Execute", "RunTests", "Reward"),
}
# Idempotent methods whose callers retry them with `retry()`, because an outage of a whole restart
# must be waited out (or a full buffer backed off from): PutGroup(Stream) is idempotent by group id, OpenJob
# and AckGroups by their nature (the trainer retries a trained step's ack until it lands); the trainer
# answers a repeated TrainStep with the reply of the step it took, reloads nothing on a repeated
# LoadPolicy, and a repeated SaveCheckpoint rewrites the same step atomically.
CALLER_RETRIED: dict[str, tuple[str, ...]] = {
    "dockyard.buffer.v1.BufferService": ("PutGroup", "PutGroupStream", "OpenJob", "AckGroups"),
    "dockyard.trainer.v1.TrainerService": ("LoadPolicy", "TrainStep", "SaveCheckpoint"),
}


def channel_service_config(service: str | None) -> str:
    """The gRPC service config that makes a channel to `service` retry its CHANNEL_RETRIED methods."""
    names = [{"service": service, "method": method} for method in CHANNEL_RETRIED.get(service or "", ())]
    if not names:
        return json.dumps({})
    policy = {
        "maxAttempts": CHANNEL_ATTEMPTS,
        "initialBackoff": f"{CHANNEL_BACKOFF.initial}s",
        "maxBackoff": f"{CHANNEL_BACKOFF.maximum}s",
        "backoffMultiplier": CHANNEL_BACKOFF.multiplier,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    return json.dumps({"methodConfig": [{"name": names, "retryPolicy": policy}]})


def is_transient(error: BaseException, codes: Collection[grpc.StatusCode] = TRANSIENT) -> bool:
    """Whether `error` is an RPC error whose code is in `codes`."""
    return isinstance(error, grpc.aio.AioRpcError) and error.code() in codes


async def retry(
    call: Callable[[], Awaitable[T]],
    *,
    what: str,
    budget_seconds: float,
    codes: Collection[grpc.StatusCode] = TRANSIENT,
    backoff: Backoff = CALLER_BACKOFF,
) -> T:
    """`call()` until it succeeds, or fails with a code outside `codes`, or `budget_seconds` have
    passed (the last error is raised). For CALLER_RETRIED methods only."""
    deadline = time.monotonic() + budget_seconds
    attempt = 0
    while True:
        attempt += 1
        try:
            return await call()
        except grpc.aio.AioRpcError as exc:
            delay = backoff.delay(attempt)
            if exc.code() not in codes or time.monotonic() + delay > deadline:
                raise
            log.info("call failed; retrying", call=what, code=exc.code().name, seconds=delay, error=exc.details())
        await asyncio.sleep(delay)
