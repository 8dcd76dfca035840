"""The rollout collector: task → group of completions → sandbox verdicts → rewards → buffer.

    Task ─rollout.Generate(n)─> completions (token ids, logprobs, weight version)
         ─env.score each (RunTests or ScorePatch, per env.name)─> verdicts ─reward_of─> raw rewards
         ─integrity zeroing, shaping (overlong, scaling)─> Group ─buffer.PutGroup─> buffer

Guarantees: an infrastructure failure (sandbox ERROR, an unreachable or
overloaded sandbox) becomes an invalid trajectory, masked out of every group
statistic, never a fake zero reward; a request the sandbox refuses as invalid
(a config asking for limits beyond its ceilings) fails the job instead, and so
does a step in which every trajectory failed, since it could teach nothing; a
group is put whole, once, with a stable id (`<job>/s<step>/g<index>` in
synchronous mode, `<job>/g<index>` in asynchronous mode, `<job>/r<run>/...`
after a trainer restart), so a retried put is a no-op; a full or unreachable
buffer (RESOURCE_EXHAUSTED, UNAVAILABLE) is waited out with backoff; every
finished group's outcome (put, duplicate, dropped_stale, dropped_uniform) is
reported through `on_group`; with dynamic sampling, groups whose valid rewards are all equal are
dropped (counted) and refilled from further tasks.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import grpc
import structlog
import torch

from dockyard.algorithms import apply_integrity, dynamic_sampling_mask, overlong_penalty, scale_rewards
from dockyard.buffer.v1 import buffer_pb2, buffer_pb2_grpc
from dockyard.common.v1 import common_pb2
from dockyard.config import MasterConfig, SamplingConfig
from dockyard.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from dockyard.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from dockyard.tasks.envs import environment
from dockyard.tasks.expr import Task

log = structlog.get_logger()


def reward_of(verdict: common_pb2.Verdict, kind: str) -> tuple[float, bool]:
    """(reward, valid) of a verdict; ERROR is an infrastructure failure, not a zero."""
    if verdict.status == common_pb2.VERDICT_STATUS_ERROR:
        return 0.0, False
    if kind == "all_pass":
        return float(verdict.status == common_pb2.VERDICT_STATUS_PASSED), True
    if verdict.tests_total == 0:
        return 0.0, True
    return verdict.tests_passed / verdict.tests_total, True


def sampling_params(sampling: SamplingConfig, seed: int | None = None) -> common_pb2.SamplingParams:
    params = common_pb2.SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        max_new_tokens=sampling.max_new_tokens,
        stop=sampling.stop_strings,
    )
    if seed is not None:
        params.seed = seed
    return params


class TaskStream:
    """Endless, seeded, epoch-shuffled stream of training tasks."""

    def __init__(self, tasks: Sequence[Task], seed: int) -> None:
        self._tasks = list(tasks)
        self._rng = random.Random(seed)

    def __iter__(self) -> Iterator[Task]:
        while True:
            order = self._tasks[:]
            self._rng.shuffle(order)
            yield from order


def load_tasks(config: MasterConfig, split: str) -> list[Task]:
    dataset = config.data.train if split == "train" else config.data.validation
    return environment(config).load(split, dataset)


@dataclass
class CollectStats:
    groups: int = 0
    trajectories: int = 0
    invalid: int = 0
    dropped_uniform: int = 0
    dropped_stale: int = 0
    verdicts: dict[str, int] = field(default_factory=dict)
    generated_tokens: int = 0
    failed: int = 0


class Collector:
    def __init__(
        self,
        job_id: str,
        config: MasterConfig,
        rollout: rollout_pb2_grpc.RolloutServiceStub,
        sandbox: sandbox_pb2_grpc.SandboxServiceStub,
        buffer: buffer_pb2_grpc.BufferServiceStub,
        *,
        max_generations: int,
        max_scoring: int,
        generate_timeout: float,
    ) -> None:
        self.job_id = job_id
        self.config = config
        self.rollout, self.sandbox, self.buffer = rollout, sandbox, buffer
        self._generations = asyncio.Semaphore(max_generations)
        self._scoring = asyncio.Semaphore(max_scoring)
        self._generate_timeout = generate_timeout
        self.env = environment(config)
        self.tasks = iter(TaskStream(load_tasks(config, "train"), config.grpo.seed))
        # Group ids start with this; a job that went on after a trainer restart adds a run number,
        # so the groups of the resumed run never collide with the acked ids of the lost one.
        self.id_prefix = job_id
        # Called with (group id, outcome, weight version) for every group the collector finished.
        self.on_group: Callable[[str, str, int], None] = lambda *_: None
        limits = config.env.sandbox
        self._limits = sandbox_pb2.Limits(
            timeout_seconds=limits.timeout_seconds,
            memory_mb=limits.memory_mb,
            cpu_seconds=limits.cpu_seconds,
            max_output_bytes=limits.max_output_bytes,
        )

    async def score(self, task: Task, completion_text: str, request_id: str) -> common_pb2.Verdict:
        async with self._scoring:
            try:
                return await self.env.score(self.sandbox, task, completion_text, request_id, self._limits)
            except grpc.aio.AioRpcError as exc:
                # The job's own request is wrong (limits, task set), not the sandbox: fail the job.
                if exc.code() in (
                    grpc.StatusCode.INVALID_ARGUMENT,
                    grpc.StatusCode.NOT_FOUND,
                    grpc.StatusCode.FAILED_PRECONDITION,
                ):
                    raise RuntimeError(f"the sandbox refused the job's request: {exc.details()}") from None
                log.warning("scoring failed", task=task.task_id, code=exc.code().name, error=exc.details())
                return common_pb2.Verdict(
                    status=common_pb2.VERDICT_STATUS_ERROR, error_message=f"sandbox: {exc.code().name}: {exc.details()}"
                )

    async def generate(
        self, task: Task, n: int, sampling: SamplingConfig, request_id: str, seed: int | None = None
    ) -> rollout_pb2.GenerateResponse:
        async with self._generations:
            return await self.rollout.Generate(
                rollout_pb2.GenerateRequest(
                    job_id=self.job_id,
                    request_id=request_id,
                    prompt=task.prompt,
                    num_samples=n,
                    sampling=sampling_params(sampling, seed),
                ),
                timeout=self._generate_timeout,
            )

    async def make_group(self, task: Task, group_id: str, seed: int) -> common_pb2.Group:
        n = self.config.grpo.num_generations_per_prompt
        reply = await self.generate(task, n, self.config.policy.generation, group_id, seed)
        verdicts = await asyncio.gather(
            *(self.score(task, c.text, f"{group_id}/{i}") for i, c in enumerate(reply.completions))
        )
        trajectories = []
        for i, (completion, verdict) in enumerate(zip(reply.completions, verdicts, strict=True)):
            reward, valid = reward_of(verdict, self.config.env.reward)
            trajectories.append(
                common_pb2.Trajectory(
                    trajectory_id=f"{group_id}/{i}",
                    prompt_token_ids=reply.prompt_token_ids,
                    completion_token_ids=completion.token_ids,
                    completion_logprobs=completion.logprobs,
                    completion_text=completion.text,
                    weight_version=reply.weight_version,
                    reward=reward,
                    valid=valid,
                    verdict=verdict,
                    finish_reason=completion.finish_reason,
                )
            )
        self._shape(trajectories)
        return common_pb2.Group(
            group_id=group_id,
            job_id=self.job_id,
            task_id=task.task_id,
            prompt=task.prompt,
            weight_version=reply.weight_version,
            trajectories=trajectories,
        )

    def _shape(self, trajectories: list[common_pb2.Trajectory]) -> None:
        grpo = self.config.grpo
        rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float64)
        # Before any penalty: a patch that touched protected (test) files earns nothing for passing.
        rewards = apply_integrity(rewards, torch.tensor([t.verdict.integrity_violation for t in trajectories]))
        if grpo.reward_shaping.enabled:
            shaping = grpo.reward_shaping
            lengths = torch.tensor([len(t.completion_token_ids) for t in trajectories])
            rewards = rewards + overlong_penalty(
                lengths, shaping.max_response_length, shaping.overlong_buffer_length, shaping.overlong_penalty
            )
        if grpo.reward_scaling.enabled:
            s = grpo.reward_scaling
            rewards = scale_rewards(rewards, s.source_min, s.source_max, s.target_min, s.target_max)
        for t, r in zip(trajectories, rewards.tolist(), strict=True):
            if t.valid:
                t.reward = r

    async def collect_step(self, step: int) -> CollectStats:
        """Put num_prompts_per_step whole groups for `step` into the buffer."""
        grpo = self.config.grpo
        stats = CollectStats()
        wanted = grpo.num_prompts_per_step
        rounds = 1 + (grpo.dynamic_sampling.max_refills if grpo.dynamic_sampling.enabled else 0)
        index = 0
        for _ in range(rounds):
            missing = wanted - stats.groups
            if missing <= 0:
                break
            batch = []
            for _ in range(missing):
                seed = grpo.seed * 1_000_003 + step * 1009 + index
                batch.append((next(self.tasks), f"{self.id_prefix}/s{step}/g{index}", seed))
                index += 1
            groups = await asyncio.gather(*(self.make_group(task, gid, seed) for task, gid, seed in batch))
            for group in groups:
                await self.deliver(group, stats)
        if stats.groups == 0:
            raise RuntimeError(
                f"step {step}: no group reached the buffer in {rounds} round(s): "
                f"{stats.dropped_uniform} had uniform rewards, {stats.dropped_stale} were stale on arrival"
            )
        if stats.invalid == stats.trajectories:
            raise RuntimeError(f"step {step}: every trajectory failed in the sandbox (verdicts: {stats.verdicts})")
        return stats

    async def deliver(self, group: common_pb2.Group, stats: CollectStats) -> bool:
        """Put one finished group into the buffer (or drop it), counting it in `stats`; True if it is held."""
        if self.config.grpo.dynamic_sampling.enabled and not _has_signal(group):
            stats.dropped_uniform += 1
            self.on_group(group.group_id, "dropped_uniform", group.weight_version)
            return False
        reply = await put_with_backoff(self.buffer, group)
        outcome = "duplicate" if reply.duplicate else "dropped_stale" if reply.dropped_stale else "put"
        self.on_group(group.group_id, outcome, group.weight_version)
        if outcome != "put":
            stats.dropped_stale += reply.dropped_stale
            return False
        stats.groups += 1
        for t in group.trajectories:
            stats.trajectories += 1
            stats.invalid += not t.valid
            stats.generated_tokens += len(t.completion_token_ids)
            name = common_pb2.VerdictStatus.Name(t.verdict.status).removeprefix("VERDICT_STATUS_").lower()
            stats.verdicts[name] = stats.verdicts.get(name, 0) + 1
        return True

    async def validate(self, tasks: Sequence[Task], version: int) -> dict[str, float]:
        """Greedy decoding of each validation task; pass rate = tasks whose every test passes."""
        greedy = self.config.policy.generation.model_copy(update={"temperature": 0.0})

        async def one(i: int, task: Task) -> tuple[bool, float, bool]:
            reply = await self.generate(task, 1, greedy, f"{self.job_id}/val-v{version}/{i}")
            verdict = await self.score(task, reply.completions[0].text, f"{self.job_id}/val-v{version}/{i}")
            reward, valid = reward_of(verdict, "pass_fraction")
            return verdict.status == common_pb2.VERDICT_STATUS_PASSED, reward, valid

        results = await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks)))
        valid = [r for r in results if r[2]]
        return {
            "pass_rate": sum(r[0] for r in valid) / max(len(valid), 1),
            "test_pass_fraction": sum(r[1] for r in valid) / max(len(valid), 1),
            "num_tasks": float(len(tasks)),
            "invalid": float(len(results) - len(valid)),
        }


# Put errors waited out: a full buffer, and a buffer that is down (restarting; puts are idempotent).
_RETRIED_PUT = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


async def put_with_backoff(
    buffer: buffer_pb2_grpc.BufferServiceStub, group: common_pb2.Group, max_wait: float = 600.0
) -> buffer_pb2.PutGroupResponse:
    """PutGroup, waiting with exponential backoff while the buffer is full or unreachable."""
    delay, waited = 0.1, 0.0
    while True:
        try:
            return await buffer.PutGroup(buffer_pb2.PutGroupRequest(group=group), timeout=30)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in _RETRIED_PUT or waited >= max_wait:
                raise
            reason = "full" if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else "unavailable"
        log.info("buffer " + reason + ", backing off", seconds=delay)
        await asyncio.sleep(delay)
        waited += delay
        delay = min(delay * 2, 5.0)


def _has_signal(group: common_pb2.Group) -> bool:
    rewards = torch.tensor([t.reward for t in group.trajectories])
    valid = torch.tensor([t.valid for t in group.trajectories])
    return bool(dynamic_sampling_mask(rewards, torch.zeros(len(rewards), dtype=torch.long), valid).all())
