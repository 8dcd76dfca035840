"""One job's rollout replicas: waiting for them, loading the policy on them, moving weights to them.

    wait_for_fleet ─> load_replicas (LoadPolicy on each replica not yet loaded in its incarnation)
    sync(v): drop replicas that fail health checks ─> weight-sync group := exactly the loaded replicas
             ─> PushWeights ‖ ReceiveWeights(v) on each ─> checksums agree ─> replicas routed to at v
    admit(): when no replica can generate, replicas that joined are loaded and synced to the current version

Guarantees: every replica that took part in a sync holds exactly the trainer's weights (the
checksums must agree); a replica that registers later is loaded and joins the next sync (or `admit`
syncs it at once when no replica is ready), and only then gets work. Every replica of a sync attempt
that failed gets no work of the job until a later sync succeeds on it: its receive may have stopped
part-way (the replica refuses to generate meanwhile too, services/rollout/weight_receiver.py; one whose
own receive failed is out of routing from that moment, not from the end of the sync's other calls), nor
does one whose checksum differs or that received another version than it was asked for. With
no replica alive a sync waits for one to come back, up to the fleet wait timeout. A sync that failed
on the weight-sync group (UNAVAILABLE) because replicas died is tried once more without them (at
most SYNC_ATTEMPTS in all). One whose trainer side failed with every replica alive asks the trainer
for the policy again (LoadPolicy waits out a trainer that is still coming back) and is tried once
more if the trainer still holds the version; otherwise, or when PushWeights answers NOT_FOUND,
TrainerRestarted. `required_version` is what generation must use: the synced version in sync mode
(on-policy), None (any synced version) in async mode.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import structlog

from dockyard.api.rollout.v1 import rollout_pb2
from dockyard.rpc.client import channel_health
from dockyard.rpc.retry import TRANSIENT
from services.coordinator.fleet import ROLLOUT, SANDBOX, Fleet, Member, NoReplica
from services.coordinator.trainer_client import TrainerClient, TrainerRestarted
from services.coordinator.weight_sync_groups import WeightSyncGroups

log = structlog.get_logger()

# A weight sync that failed on the weight-sync group is tried this many times in all.
SYNC_ATTEMPTS = 2


class WeightSync:
    def __init__(
        self,
        job_id: str,
        config_yaml: str,
        fleet: Fleet,
        trainer: TrainerClient,
        groups: WeightSyncGroups | None,
        *,
        timeout: float,
        on_policy: bool,
        wait_timeout: float = 120.0,
    ) -> None:
        self.job_id, self._config_yaml = job_id, config_yaml
        self.fleet, self.trainer, self.groups = fleet, trainer, groups
        self._timeout = timeout
        self._wait_timeout = wait_timeout  # how long a sync waits for a replica to come back
        self._on_policy = on_policy
        self._lock = asyncio.Lock()
        # Replicas whose LoadPolicy for this job succeeded, by name -> fleet incarnation.
        self._loaded: dict[str, int] = {}
        # The fleet incarnation of each replica when it last joined the job's weight-sync group.
        self._incarnations: dict[str, int] = {}
        self.version = 0  # the last version synced to replicas
        self.required_version: int | None = None

    async def wait_for_fleet(self, timeout: float, phase: Callable[[str], None]) -> None:
        """Until at least one rollout replica and one sandbox worker are alive, or RuntimeError after `timeout`."""
        deadline = time.monotonic() + timeout
        for kind, what in ((ROLLOUT, "rollout replicas"), (SANDBOX, "sandbox workers")):
            while not self.fleet.alive(kind):
                phase(f"waiting for {what}")
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"no {kind} member registered with the coordinator within {timeout:.0f}s: start {what} "
                        f"with DOCKYARD_{kind.upper()}_COORDINATOR_ADDRESS pointing at this coordinator"
                    )
                await self.fleet.changed(1.0)

    async def load_replicas(self, replicas: list[Member]) -> list[Member]:
        """LoadPolicy on each replica not yet loaded (in this incarnation); those that answered."""
        todo = [m for m in replicas if self._loaded.get(m.name) != m.incarnation]
        request = rollout_pb2.LoadPolicyRequest(job_id=self.job_id, config_yaml=self._config_yaml)
        replies = await asyncio.gather(
            *(m.stub.LoadPolicy(request, timeout=self._timeout) for m in todo), return_exceptions=True
        )
        for member, reply in zip(todo, replies, strict=True):
            if isinstance(reply, grpc.aio.AioRpcError) and reply.code() not in TRANSIENT:
                raise reply  # the replica refuses the job (bad config, missing model): fail it
            if isinstance(reply, BaseException):
                log.warning("replica did not load the policy", replica=member.name, error=str(reply))
                self.fleet.mark_failed(member)
                continue
            self._loaded[member.name] = member.incarnation
            log.info("replica loaded", replica=member.name)
        return [m for m in replicas if self._loaded.get(m.name) == m.incarnation]

    async def unload_replicas(self) -> None:
        """UnloadPolicy on every replica that loaded the job; a replica that already forgot it is fine."""
        request = rollout_pb2.UnloadPolicyRequest(job_id=self.job_id)
        loaded = [m for m in self.fleet.members(ROLLOUT) if m.name in self._loaded]
        results = await asyncio.gather(
            *(m.stub.UnloadPolicy(request, timeout=30) for m in loaded), return_exceptions=True
        )
        for result in results:
            if isinstance(result, grpc.aio.AioRpcError) and result.code() != grpc.StatusCode.NOT_FOUND:
                log.warning("unload failed", code=result.code().name, error=result.details())

    def reform_group(self) -> None:
        """A new epoch of the job's weight-sync group: the old group's store died with the trainer."""
        if self.groups is not None and self.job_id in self.groups:
            self.groups.reform(self.job_id)

    async def admit(self) -> None:
        """Bring replicas that joined to the current version now (when none is ready to generate)."""
        if self._lock.locked():
            return
        version = self.version
        waiting = [m for m in self.fleet.alive(ROLLOUT) if m.versions.get(self.job_id) != version]
        if waiting:
            log.info("syncing replicas that joined", replicas=[m.name for m in waiting], version=version)
            try:
                await self.sync(version, only=waiting)
            except (grpc.aio.AioRpcError, NoReplica, TrainerRestarted) as exc:
                # A trainer restart is found and recovered by the step loop's next trainer call.
                log.warning("replicas could not join yet", error=str(exc))

    async def sync(self, version: int, only: list[Member] | None = None) -> float:
        """Push `version` once from the trainer and receive it on every alive replica (or `only` these)
        at once, the weight-sync group formed with exactly those replicas; the transfer's seconds.
        With no replica alive, waits up to the fleet wait timeout for one to come back."""
        async with self._lock:
            for attempt in range(1, SYNC_ATTEMPTS + 1):
                replicas = await self._receivers(version, only)
                self._form_group(replicas)
                request = rollout_pb2.ReceiveWeightsRequest(job_id=self.job_id, weight_version=version)
                # Every call runs to its end (return_exceptions) so a retry never overlaps a stale one.
                pushed, *received = await asyncio.gather(
                    self.trainer.push_weights(),
                    *(self._receive(m, request) for m in replicas),
                    return_exceptions=True,
                )
                failures = [r for r in (pushed, *received) if isinstance(r, BaseException)]
                if not failures:
                    break
                for member in replicas:  # a receive cut short leaves weights part old, part new
                    self.fleet.unsync(member, self.job_id)
                retriable = await self._retriable(version, pushed, failures, replicas)
                if attempt == SYNC_ATTEMPTS or not retriable:
                    raise failures[0]
                log.warning("weight sync failed; trying again", version=version, error=str(failures[0]))
            self._verify(version, pushed, replicas, received)
            self.version = version
            self.required_version = version if self._on_policy else None
            return max([pushed.seconds, *(reply.seconds for reply in received)])

    async def _receive(self, member: Member, request: rollout_pb2.ReceiveWeightsRequest):
        """One replica's ReceiveWeights; a failed one takes the replica out of routing at once, not when the
        sync's other calls end (the trainer's push may wait out its timeout meanwhile): its weights may be part
        old, part new, and it refuses to generate until a receive succeeds (weight_receiver.py), so work sent
        there meanwhile would only use up its group's regenerations."""
        try:
            return await member.stub.ReceiveWeights(request, timeout=self._timeout)
        except BaseException:
            self.fleet.unsync(member, self.job_id)
            raise

    def _form_group(self, replicas: list[Member]) -> None:
        """The weight-sync group of exactly `replicas`: a new epoch when its members change, and also
        when a member restarted under the same name (the old epoch's peer is a dead process)."""
        if self.groups is None or self.job_id not in self.groups:
            return
        incarnations = {m.name: m.incarnation for m in replicas}
        if any(self._incarnations.get(name, seen) != seen for name, seen in incarnations.items()):
            self.groups.reform(self.job_id)
        self.groups.set_replicas(self.job_id, [m.name for m in replicas])
        self._incarnations.update(incarnations)

    async def _receivers(self, version: int, only: list[Member] | None) -> list[Member]:
        """The loaded, healthy replicas to sync; with none (and no `only`), those that come back in time."""
        deadline = time.monotonic() + self._wait_timeout
        while True:
            candidates = [m for m in (only or self.fleet.alive(ROLLOUT)) if self.fleet.usable(m)]
            # A replica that died since its last call would hold the whole group up to its timeout.
            await self._drop_dead(candidates)
            replicas = await self.load_replicas([m for m in candidates if self.fleet.usable(m)])
            if replicas:
                return replicas
            if only is not None or time.monotonic() > deadline:
                raise NoReplica(
                    f"no rollout replica alive to receive weight version {version}"
                    + ("" if only is not None else f" within {self._wait_timeout:.0f}s")
                )
            log.warning("no rollout replica alive; waiting for one", version=version)
            await self.fleet.changed(1.0)

    def _verify(self, version: int, pushed, replicas: list[Member], received: list) -> None:
        """Fail on any checksum that differs; route to the replicas at `version` when that is what they hold."""
        # An asynchronous trainer may have stepped before the push of a join: those replicas hold
        # weights of another version than asked, and wait for the next sync instead of generating.
        labelled = pushed.weight_version == version
        if not labelled:
            log.warning("the trainer pushed another version; replicas join at the next sync", asked=version)
        corrupt = []
        for member, reply in zip(replicas, received, strict=True):
            if pushed.checksum != reply.checksum or reply.weight_version != version:
                corrupt.append(
                    f"trainer sent {pushed.checksum[:12]}, replica {member.name} holds "
                    f"{reply.checksum[:12]} at version {reply.weight_version}"
                )
                self.fleet.unsync(member, self.job_id)
            elif labelled:
                self.fleet.set_version(member, self.job_id, version)
            else:  # it holds the trainer's newer weights under the label it was asked for
                self.fleet.unsync(member, self.job_id)
        if corrupt:
            raise RuntimeError(f"weight sync of version {version} is corrupt: {'; '.join(corrupt)}")

    async def _retriable(self, version: int, pushed, failures: list[BaseException], replicas: list[Member]) -> bool:
        """After a failed sync: whether to try again (replicas that died are dropped first), or
        TrainerRestarted when the trainer lost the policy."""
        if isinstance(pushed, grpc.aio.AioRpcError) and pushed.code() == grpc.StatusCode.NOT_FOUND:
            raise TrainerRestarted(f"PushWeights: {pushed.details()}") from pushed
        dropped = await self._drop_dead(replicas)
        if isinstance(pushed, BaseException) and not dropped:
            # Every replica is alive, so the trainer's side failed: it may have died mid-sync. Ask it
            # again (LoadPolicy waits out a trainer that is still coming back).
            held = (await self.trainer.load(resume=True)).weight_version
            if held != version:
                detail = pushed.details() if isinstance(pushed, grpc.aio.AioRpcError) else str(pushed)
                raise TrainerRestarted(
                    f"PushWeights failed with every replica alive ({detail}); the trainer now holds "
                    f"version {held}, not {version}"
                ) from pushed
            return True  # it kept the policy: the group broke for another reason
        return all(isinstance(f, grpc.aio.AioRpcError) and f.code() == grpc.StatusCode.UNAVAILABLE for f in failures)

    async def _drop_dead(self, replicas: list[Member]) -> int:
        """Replicas that no longer answer health checks leave routing and the group; how many did."""
        statuses = await asyncio.gather(*(channel_health(m.channel, timeout=2.0) for m in replicas))
        dropped = 0
        for member, status in zip(replicas, statuses, strict=True):
            if status != "SERVING":
                log.warning("replica dropped from the weight sync", replica=member.name, status=status)
                self.fleet.mark_failed(member)
                dropped += 1
        return dropped
