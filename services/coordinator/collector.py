"""The rollout collector: task → group of completions → sandbox verdicts → rewards → buffer.

    Task ─Generate(n) on ONE ready replica of the fleet─> completions (token ids, logprobs, weight version)
         (the prompt text, or its conversation rendered by the rollout's chat template: task.messages, or the
          prompt as a user message with data.chat_template; the rollout's prompt ids are what is trained on)
         ─env.score each on the least loaded sandbox worker (RunTests or ScorePatch, per env.name)─> verdicts
         ─reward_functions (env.reward: built-ins, user functions run by the sandbox, a weighted sum)─> raw rewards
         ─rewards.shape_rewards (integrity, invalid action, overlong, scaling)─> Group ─put─> buffer
    with a data plane, the replica stages the token arrays there itself (GenerateRequest.staging): the reply,
    and so the Group, carry metadata only, and the put commits the replica's staged key
    with env.tools set, the n samples are agent trials instead (services/coordinator/agent_trials.py), each
    scored by its own answer; the rest of the path is the same.
    a group's start tells the sandbox workers what the job will use, in the background
    (services/coordinator/session_warmer.py): agent trials' sessions started ahead, a task set's images made

Routing (services/coordinator/fleet.py): a group goes whole to one replica
(sticky per group id, least loaded when assigned) that holds the job's policy
at `routing.required_version` (sync mode: the current version; None: any
synced version); when none is ready, `routing.admit()` brings replicas that
joined to that version (services/coordinator/weight_sync.py). When that call
fails with UNAVAILABLE / DEADLINE_EXCEEDED / CANCELLED (PEER_LOST), or the
replica expires while it runs, the replica is taken out of routing until it
heartbeats again and the group (same id) is generated again
on another ready replica, at most `max_regenerations` times (counted). A
scoring call that fails with UNAVAILABLE / RESOURCE_EXHAUSTED / DEADLINE is
tried on another worker, at most `max_scoring_attempts` workers (retries
counted); with no worker alive it waits for one to come back (up to the fleet
wait timeout), and when none can score it, its verdict is ERROR. A group with
more than `max_invalid_fraction` of its trajectories invalid is generated
again (at most `max_regenerations` times, counted in regenerated_groups), and
after that raises GroupUnscorable: it is never trained on the few that scored.
An external scaffold's failures (scaffold errors, services/coordinator/scaffold_errors.py) are masked
trials that do not count as invalid here: a group is not generated again for them (the scaffold would
most likely fail again); a group with no valid trial left raises GroupUnscorable at once (counted as
failed, left out, its first error in groups.jsonl). Every scaffold error's output tail goes to samples.

Guarantees: an infrastructure failure (sandbox ERROR, an unreachable or
overloaded sandbox) becomes an invalid trajectory, masked out of every group
statistic, never a fake zero reward; a request the sandbox refuses as invalid
(a config asking for limits beyond its ceilings) fails the job instead; a
group is put whole, once, under the id its producer gave it
(services/coordinator/producer.py), so a retried put is a no-op; a full or
unreachable buffer is waited out by JobBuffer.put; every finished group's
outcome (put, duplicate, dropped_stale, dropped_uniform) is reported through
`on_group`; with dynamic sampling, `deliver` drops groups whose valid rewards
are all equal (counted), and the producer draws further tasks.

Why over 400 lines: generation, scoring, group assembly and validation share one set of
semaphores, retry counters and the generation timeline; split apart, they would reach into each
other's state.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import grpc
import structlog

from dockyard.agents.external import is_scaffold_error
from dockyard.algorithms.malformed import unclosed_thinking
from dockyard.api.common.v1 import common_pb2
from dockyard.api.rollout.v1 import rollout_pb2
from dockyard.api.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from dockyard.config import MasterConfig, SamplingConfig
from dockyard.experience import single_turn
from dockyard.rpc.errors import InvalidArgument
from dockyard.rpc.retry import OVERLOADED, PEER_LOST
from dockyard.tasks.envs import environment, judge_for
from dockyard.tasks.task import Task
from services.coordinator.agent_trials import AgentTrials
from services.coordinator.fleet import Fleet, Member, NoReplica
from services.coordinator.group_errors import GroupUnscorable
from services.coordinator.job_buffer import JobBuffer, StagedPayloadGone
from services.coordinator.reward_functions import REWARD_ERROR_PREFIX, RewardFunctions
from services.coordinator.rewards import has_signal, reward_of, sampled_tokens, shape_rewards
from services.coordinator.samples import SampleReservoir
from services.coordinator.session_warmer import SessionWarmer
from services.coordinator.staged_payloads import StagedPayloads

# Sandbox failures that another worker may not have: try the call there.
SCORING_RETRIABLE = PEER_LOST | OVERLOADED
# The job's own request is wrong (limits, task set), not the sandbox: fail the job.
SCORING_REFUSED = frozenset(
    {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION}
)

log = structlog.get_logger()
T = TypeVar("T")


def sampling_params(sampling: SamplingConfig, seed: int | None = None) -> common_pb2.SamplingParams:
    params = common_pb2.SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        max_new_tokens=sampling.max_new_tokens,
        stop=sampling.stop_strings,
        ignore_eos=sampling.ignore_eos,
    )
    if seed is not None:
        params.seed = seed
    return params


@dataclass
class CollectStats:
    groups: int = 0
    trajectories: int = 0
    invalid: int = 0
    dropped_uniform: int = 0
    dropped_stale: int = 0
    verdicts: dict[str, int] = field(default_factory=dict)
    integrity_violations: int = 0  # verdicts flagged for touching protected (test) files
    generated_tokens: int = 0
    failed: int = 0
    uniform: int = 0  # groups put whose valid rewards were all equal (no learning signal)
    invalid_actions: int = 0  # trajectories with a malformed action (grpo.invalid_action_penalty applies)
    reward_function_errors: int = 0  # trajectories a reward function failed on (ERROR, masked)


@dataclass(frozen=True)
class CollectionCounters:
    """What the collector counted since the job started: groups (and agent trials) generated again after
    a lost replica or too many invalid trajectories, scoring calls retried on another sandbox worker, and
    an external scaffold's failed training trials (None without one)."""

    regenerated_groups: int
    sandbox_retries: int
    scaffold_errors: int | None = None


class ReplicaLost(Exception):
    """The replica serving a Generate expired (no heartbeat) while the call ran."""


class Routing(Protocol):
    """Which replicas may generate (services/coordinator/weight_sync.py implements it)."""

    required_version: int | None

    async def admit(self) -> None:
        """Bring replicas that joined to the current version."""


class Collector:
    def __init__(
        self,
        job_id: str,
        config: MasterConfig,
        fleet: Fleet,
        buffer: JobBuffer | None,
        routing: Routing,
        *,
        max_generations: int,
        max_scoring: int,
        generate_timeout: float,
        max_regenerations: int = 3,
        max_scoring_attempts: int = 3,
        max_invalid_fraction: float = 0.5,
        wait_timeout: float = 120.0,
        on_group: Callable[..., None] = lambda *_: None,  # (group id, outcome, weight version[, error])
        endpoint_address: str = "",
        endpoint_token: str = "",
        task_ids: Sequence[str] = (),  # the job's training tasks (a task set's images are made ahead)
    ) -> None:
        self.job_id = job_id
        self.config = config
        self.fleet, self.buffer, self.routing = fleet, buffer, routing
        self._generations = asyncio.Semaphore(max_generations)
        self._scoring = asyncio.Semaphore(max_scoring)
        self._generate_timeout = generate_timeout
        self._max_regenerations = max_regenerations
        self._max_scoring_attempts = max_scoring_attempts
        self._max_invalid_fraction = max_invalid_fraction
        self._wait_timeout = wait_timeout
        # Called with (group id, outcome, weight version) for every group the collector finished.
        self._on_group = on_group
        self.regenerated_groups = 0
        self.sandbox_retries = 0
        self._staged = StagedPayloads(buffer)  # made groups whose payload a replica staged, until their put
        # One record per Generate (replica, group, start/end since the job started, version, tokens).
        self.timeline: list[dict] = []
        # A few of the groups put, for people to read (samples.jsonl and the trackers' tables).
        self.samples = SampleReservoir(config.logger.num_samples_per_step, config.grpo.seed)
        # Passing agent trials' conversations since the runner last wrote them (trials.jsonl).
        self.trials: list[dict] = []
        self._started = time.monotonic()
        self.env = environment(config, judge_for(config, job_id, endpoint_address, endpoint_token))
        limits = config.env.sandbox
        self._limits = sandbox_pb2.Limits(
            timeout_seconds=limits.timeout_seconds,
            memory_mb=limits.memory_mb,
            cpu_seconds=limits.cpu_seconds,
            max_output_bytes=limits.max_output_bytes,
        )
        self.rewards = RewardFunctions(config.env, self._limits, self.on_sandbox)
        # Sandbox sessions started ahead and the images of the job's tasks made ahead, per worker.
        self.warmer = SessionWarmer.for_job(job_id, fleet, config, self._limits, task_ids)
        # Multi-turn agent trials (env.tools set) instead of one Generate per group.
        self.agent: AgentTrials | None = None
        if config.env.agentic:
            self.agent = AgentTrials(
                job_id,
                config,
                fleet,
                self.score,
                self._limits,
                endpoint_address=endpoint_address,
                token=endpoint_token,
                max_regenerations=max_regenerations,
                wait_timeout=wait_timeout,
                plane=lambda: buffer.data_plane,
            )

    def counters(self) -> CollectionCounters:
        """The job's running totals (agent trials' regenerations included); callers take differences."""
        agent = self.agent.regenerated_groups if self.agent is not None else 0
        errors = self.agent.scaffold_errors if self.agent is not None else None
        return CollectionCounters(
            self.regenerated_groups + agent, self.sandbox_retries, errors.total if errors is not None else None
        )

    def received(self) -> dict[str, int]:
        """A copy of the payload bytes replicas sent here: token arrays in Generate replies (arrays) and the
        payloads they staged in the data plane instead (rollout_staged, bytes this process never held)."""
        return self._staged.received()

    async def endpoint_routing(self) -> dict | None:
        """The policy endpoint's routing snapshot (AgentTrials.routing); None without agent trials or an answer."""
        return await self.agent.routing() if self.agent is not None else None

    def take_trial_stats(self) -> list[dict[str, float | str]]:
        """Each agent trial's figures (turns, tokens, finish reason...) since the last call; [] without agents."""
        return self.agent.take_stats() if self.agent is not None else []

    async def close(self) -> None:
        """Release what the job's sandbox workers prepared for it, and close the agent trials' endpoint clients."""
        await self.warmer.release()
        if self.agent is not None:
            await self.agent.close()

    def take_timeline(self) -> list[dict]:
        """The Generate records since the last call."""
        timeline, self.timeline = self.timeline, []
        return timeline

    def record_outcome(self, group_id: str, outcome: str, weight_version: int, error: str = "") -> None:
        """Report a group's outcome decided outside the collector (a producer's failed group, and why)."""
        if error:
            self._on_group(group_id, outcome, weight_version, error)
        else:
            self._on_group(group_id, outcome, weight_version)

    async def score(self, task: Task, completion_text: str, request_id: str) -> common_pb2.Verdict:
        """The verdict of one completion; ERROR (invalid, masked) when no sandbox worker could score it."""
        verdict = await self.on_sandbox(
            lambda stub: self.env.score(stub, task, completion_text, request_id, self._limits), task.task_id
        )
        if isinstance(verdict, str):
            return common_pb2.Verdict(status=common_pb2.VERDICT_STATUS_ERROR, error_message=verdict)
        return verdict

    async def on_sandbox(
        self, call: Callable[[sandbox_pb2_grpc.SandboxServiceStub], Awaitable[T]], task_id: str
    ) -> T | str:
        """call(stub) on the least loaded sandbox worker, tried on others when one is lost or full; the error
        text when none could. With no worker alive, waits up to the fleet wait timeout for one to come back."""
        async with self._scoring:
            tried: set[str] = set()
            error = "no sandbox worker is alive"
            deadline = time.monotonic() + self._wait_timeout
            for attempt in range(self._max_scoring_attempts):
                worker = self.fleet.pick_sandbox(exclude=frozenset(tried)) or await self._sandbox_back(deadline)
                if worker is None:
                    error += f" (waited {self._wait_timeout:.0f}s)"
                    break
                if attempt:
                    self.sandbox_retries += 1
                try:
                    with self.fleet.calling(worker):
                        return await call(worker.stub)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() in SCORING_REFUSED:
                        raise RuntimeError(f"the sandbox refused the job's request: {exc.details()}") from None
                    if exc.code() in PEER_LOST:
                        self.fleet.mark_failed(worker)
                    tried.add(worker.name)
                    error = f"sandbox {worker.name}: {exc.code().name}: {exc.details()}"
                    log.warning("scoring failed", task=task_id, worker=worker.name, code=exc.code().name)
                    if exc.code() not in SCORING_RETRIABLE:
                        break
            return error

    async def _sandbox_back(self, deadline: float) -> Member | None:
        """A usable worker, tried before or not, once one is (it heartbeats again); None at the deadline."""
        while True:
            worker = self.fleet.pick_sandbox()
            if worker is not None or time.monotonic() > deadline:
                return worker
            await self.fleet.changed(1.0)

    async def generate(
        self,
        task: Task,
        n: int,
        sampling: SamplingConfig,
        request_id: str,
        seed: int | None = None,
        staging: rollout_pb2.PayloadStaging | None = None,
    ) -> rollout_pb2.GenerateResponse:
        """One Generate of the whole group on one ready replica; generated again elsewhere if it is lost.
        With `staging`, the replica stages the token arrays in the buffer's data plane when it can."""
        request = rollout_pb2.GenerateRequest(
            job_id=self.job_id,
            request_id=request_id,
            num_samples=n,
            sampling=sampling_params(sampling, seed),
            staging=staging,
            return_routing=self.config.policy.records_routing,
        )
        # A conversation is rendered by the rollout's chat template; the rendered ids come back in
        # prompt_token_ids, which the trajectory carries: the trainer trains on exactly what was generated from.
        messages = task.messages or ((("user", task.prompt),) if self.config.data.chat_template else ())
        if messages:
            request.messages.extend(rollout_pb2.ChatMessage(role=r, content=c) for r, c in messages)
        else:
            request.prompt = task.prompt
        async with self._generations:
            for attempt in range(self._max_regenerations + 1):
                replica = await self._ready_replica(request_id)
                start = time.monotonic()
                try:
                    with self.fleet.calling(replica):
                        reply = await self._generate_on(replica, request)
                except (grpc.aio.AioRpcError, ReplicaLost) as exc:
                    code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
                    if code is not None and code not in PEER_LOST:
                        raise
                    self.fleet.mark_failed(replica)
                    if attempt == self._max_regenerations:
                        raise
                    self.regenerated_groups += 1
                    log.warning(
                        "replica lost; generating the group again",
                        group=request_id,
                        replica=replica.name,
                        error=code.name if code else "expired",
                    )
                    continue
                end = time.monotonic()
                self.timeline.append(
                    {
                        "replica": replica.name,
                        "group_id": request_id,
                        "start": start - self._started,
                        "end": end - self._started,
                        "weight_version": reply.weight_version,
                        "tokens": sum(c.num_tokens or len(c.token_ids) for c in reply.completions),
                        "attempt": attempt,
                    }
                )
                return reply
        raise AssertionError("unreachable")

    async def _ready_replica(self, group_id: str) -> Member:
        deadline = time.monotonic() + self._wait_timeout
        while True:
            version = self.routing.required_version
            replica = self.fleet.pick_replica(self.job_id, group_id, version)
            if replica is not None:
                return replica
            await self.routing.admit()
            replica = self.fleet.pick_replica(self.job_id, group_id, self.routing.required_version)
            if replica is not None:
                return replica
            if time.monotonic() > deadline:
                raise NoReplica(
                    f"no rollout replica ready at weight version {version} "
                    f"within {self._wait_timeout:.0f}s (fleet: {[m.name for m in self.fleet.alive('rollout')]})"
                )
            await self.fleet.changed(1.0)

    async def _generate_on(self, replica: Member, request: rollout_pb2.GenerateRequest) -> rollout_pb2.GenerateResponse:
        """The Generate call, abandoned (ReplicaLost) if the replica stops being usable meanwhile."""
        call = asyncio.ensure_future(replica.stub.Generate(request, timeout=self._generate_timeout))
        try:
            while True:
                done, _ = await asyncio.wait({call}, timeout=0.5)
                if done:
                    return call.result()
                if not self.fleet.usable(replica):
                    raise ReplicaLost(replica.name)
        finally:
            if not call.done():
                call.cancel()
                await asyncio.gather(call, return_exceptions=True)

    async def make_group(self, task: Task, group_id: str, seed: int) -> common_pb2.Group:
        """A scored group; generated again (at most max_regenerations times, counted) while more than
        max_invalid_fraction of its trajectories failed in the sandbox, then GroupUnscorable."""
        try:
            return await self._make_group(task, group_id, seed)
        except Exception:
            await self._staged.discard(group_id)  # no group to put
            raise
        except BaseException:
            self._staged.forget(group_id)  # cancelled: nothing more is awaited, the staged key expires
            raise

    async def _make_group(self, task: Task, group_id: str, seed: int) -> common_pb2.Group:
        for attempt in range(self._max_regenerations + 1):
            group = await self._make_group_once(task, group_id, seed)
            scaffold_errors = [t for t in group.trajectories if is_scaffold_error(t)]
            invalid = sum(not t.valid for t in group.trajectories) - len(scaffold_errors)
            if invalid <= self._max_invalid_fraction * len(group.trajectories):
                if scaffold_errors and not any(t.valid for t in group.trajectories):
                    first = scaffold_errors[0]
                    raise GroupUnscorable(
                        f"group {group_id}: no trial is left to learn from: {len(scaffold_errors)} of "
                        f"{len(group.trajectories)} were scaffold errors ({first.verdict.error_message[:300]})",
                        first=f"{first.trajectory_id}: {first.verdict.error_message}"[:1000],
                    )
                return group
            if attempt < self._max_regenerations:
                self.regenerated_groups += 1
                log.warning(
                    "most of a group failed in the sandbox; generating it again", group=group_id, invalid=invalid
                )
        failed = [t for t in group.trajectories if not t.valid]
        errors = {t.verdict.error_message for t in failed}
        first = f"{failed[0].trajectory_id}: {failed[0].verdict.error_message or 'no error message'}"
        raise GroupUnscorable(
            f"group {group_id}: {invalid} of {len(group.trajectories)} trajectories failed in the sandbox in each of "
            f"{self._max_regenerations + 1} attempts ({'; '.join(sorted(errors))[:500]})",
            first=first[:1000],
        )

    async def _make_group_once(self, task: Task, group_id: str, seed: int) -> common_pb2.Group:
        n = self.config.grpo.num_generations_per_prompt
        self.warmer.on_group(task.task_id)
        if self.agent is not None:
            sampling, retries = self.config.policy.generation, self._max_regenerations
            trials, payload = await self._staged.agent_trials(self.agent, task, group_id, seed, n, sampling, retries)
            # Held at once, so that make_group's discard deletes it if anything below raises.
            await self._staged.hold(group_id, payload, task, seed)
            for trial in trials:
                if trial.scaffold_error:
                    trajectory = trial.trajectory
                    error = trajectory.verdict.error_message
                    self.samples.scaffold_error(
                        group_id, task.prompt, trajectory.trajectory_id, error, trial.output_tail
                    )
            group = await self._group(task, group_id, [t.trajectory for t in trials])
            self._keep_passing(group, trials)
            return group
        plane = self.buffer.data_plane
        # With a data plane the replica stages the token arrays itself: only metadata comes back here.
        staging = rollout_pb2.PayloadStaging(data_plane=plane.advertised, group_id=group_id) if plane else None
        reply = await self.generate(task, n, self.config.policy.generation, group_id, seed, staging)
        self._staged.received(reply)
        verdicts = await asyncio.gather(
            *(self.score(task, c.text, single_turn.trajectory_id(group_id, i)) for i, c in enumerate(reply.completions))
        )
        trajectories = single_turn.reply_trajectories(group_id, reply)
        for trajectory, completion, verdict in zip(trajectories, reply.completions, verdicts, strict=True):
            trajectory.completion_text = completion.text
            trajectory.weight_version = reply.weight_version
            trajectory.verdict.CopyFrom(verdict)
            trajectory.finish_reason = completion.finish_reason
            trajectory.invalid_actions = int(unclosed_thinking(completion.text))
        group = await self._group(task, group_id, trajectories)
        await self._staged.keep(group_id, reply, task, seed)
        self._keep_passing_completions(group)
        return group

    def _keep_passing_completions(self, group: common_pb2.Group) -> None:
        """A single-turn group's passing completions, whole, for trials.jsonl (logger.save_trials)."""
        if not self.config.logger.save_trials:
            return
        for t in group.trajectories:
            if t.valid and t.verdict.status == common_pb2.VERDICT_STATUS_PASSED:
                self.trials.append(
                    {
                        "group_id": group.group_id,
                        "trajectory_id": t.trajectory_id,
                        "task_id": group.task_id,
                        "reward": t.reward,
                        "weight_version": t.weight_version,
                        "prompt": group.prompt,
                        "completion": t.completion_text,
                    }
                )

    def _keep_passing(self, group: common_pb2.Group, trials: list) -> None:
        """The passing trials' conversations, for trials.jsonl (logger.save_trials); rewards as shaped."""
        if not self.config.logger.save_trials:
            return
        for trajectory, trial in zip(group.trajectories, trials, strict=True):
            if (
                trajectory.valid
                and trajectory.verdict.status == common_pb2.VERDICT_STATUS_PASSED
                and trial.conversation
            ):
                self.trials.append(
                    {
                        "group_id": group.group_id,
                        "trajectory_id": trajectory.trajectory_id,
                        "task_id": group.task_id,
                        "reward": trajectory.reward,
                        "weight_version": trajectory.weight_version,
                        "segments": trial.conversation,
                    }
                )

    def take_trials(self) -> list[dict]:
        """The passing trials kept since the last call (agent trials, and single-turn completions)."""
        trials, self.trials = self.trials, []
        return trials

    async def _group(self, task: Task, group_id: str, trajectories: list[common_pb2.Trajectory]) -> common_pb2.Group:
        """Scored trajectories (verdicts set) as a group: rewards from the verdicts, then shaping."""
        await self.rewards.assign(task, trajectories)
        # A trial that failed before its first turn has no version of its own: it takes the group's. A
        # completion whose arrays the rollout staged has none here, but its count (sampled_tokens).
        generated = [bool(t.prompt_token_ids or t.sampled_tokens) for t in trajectories]
        versions = [t.weight_version for t, g in zip(trajectories, generated, strict=True) if g]
        oldest = min(versions, default=self.routing.required_version or 0)
        for t, g in zip(trajectories, generated, strict=True):
            if not g:
                t.weight_version = oldest
        shape_rewards(trajectories, self.config.grpo)
        return common_pb2.Group(
            group_id=group_id,
            job_id=self.job_id,
            task_id=task.task_id,
            prompt=task.prompt,
            weight_version=oldest,
            trajectories=trajectories,
        )

    async def deliver(self, group: common_pb2.Group, stats: CollectStats, expired: int = 0) -> bool:
        """Put one finished group into the buffer (or drop it), counting it in `stats`; True if it is held.
        A group whose rollout-staged payload expired before its put is made again and delivered (at most
        max_regenerations times, counted; `expired` counts them), since its bytes never reached this side."""
        signal = has_signal(group)
        if self.config.grpo.dynamic_sampling.enabled and not signal:
            await self._staged.discard(group.group_id)
            stats.dropped_uniform += 1
            self._on_group(group.group_id, "dropped_uniform", group.weight_version)
            return False
        staged = self._staged.take(group.group_id)
        try:
            reply = await self.buffer.put(group, staged=staged.payload if staged else None)
        except StagedPayloadGone as exc:
            if expired >= self._max_regenerations:  # a failed group, as on any other transport
                log.warning("a staged payload kept expiring before its put; the group is dropped", error=str(exc))
                stats.failed += 1
                self._on_group(group.group_id, "failed", group.weight_version)
                return False
            self.regenerated_groups += 1
            log.warning("a staged payload expired before its put; generating the group again", error=str(exc))
            again = await self.make_group(staged.task, group.group_id, staged.seed)
            return await self.deliver(again, stats, expired + 1)
        except (grpc.aio.AioRpcError, InvalidArgument) as exc:
            if isinstance(exc, grpc.aio.AioRpcError) and exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
                raise
            # A group the trainer could not train on (refused by the buffer, or by the data plane's writer
            # before staging it): counted as failed, the job goes on without it.
            error = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            log.warning("the buffer refused a group", group=group.group_id, error=error)
            if staged is not None:  # the buffer left the replica's staged payload where it was
                await self.buffer.discard(staged.payload)
            stats.failed += 1
            self._on_group(group.group_id, "refused", group.weight_version)
            return False
        outcome = "duplicate" if reply.duplicate else "dropped_stale" if reply.dropped_stale else "put"
        self._on_group(group.group_id, outcome, group.weight_version)
        if outcome != "put":
            stats.dropped_stale += reply.dropped_stale
            return False
        stats.groups += 1
        stats.uniform += not signal
        self.samples.offer(group)
        for t in group.trajectories:
            stats.trajectories += 1
            stats.integrity_violations += t.verdict.integrity_violation
            stats.invalid_actions += t.invalid_actions > 0
            stats.reward_function_errors += t.verdict.error_message.startswith(REWARD_ERROR_PREFIX)
            stats.invalid += not t.valid
            stats.generated_tokens += sampled_tokens(t)
            name = common_pb2.VerdictStatus.Name(t.verdict.status).removeprefix("VERDICT_STATUS_").lower()
            stats.verdicts[name] = stats.verdicts.get(name, 0) + 1
        return True

    async def validate(self, tasks: Sequence[Task], version: int) -> dict[str, float]:
        """Greedy decoding of each validation task; pass rate = tasks whose every test passes (and that
        touched no protected test file: a flagged verdict counts as a failure with no reward)."""
        greedy = self.config.policy.generation.model_copy(update={"temperature": 0.0})

        async def one(i: int, task: Task) -> tuple[bool, float, bool]:
            request_id = f"{self.job_id}/val-v{version}/{i}"
            if self.agent is not None:
                verdict = (await self.agent.validation_trial(task, request_id, greedy)).verdict
            else:
                reply = await self.generate(task, 1, greedy, request_id)
                verdict = await self.score(task, reply.completions[0].text, request_id)
            reward, valid = reward_of(verdict, "pass_fraction")
            if verdict.integrity_violation:  # it touched the tests: no pass, as in training
                return False, 0.0, valid
            return verdict.status == common_pb2.VERDICT_STATUS_PASSED, reward, valid

        results = await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks)))
        valid = [r for r in results if r[2]]
        return {
            "pass_rate": sum(r[0] for r in valid) / max(len(valid), 1),
            "test_pass_fraction": sum(r[1] for r in valid) / max(len(valid), 1),
            "num_tasks": float(len(tasks)),
            "invalid": float(len(results) - len(valid)),
        }
