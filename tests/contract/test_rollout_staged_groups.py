"""The coordinator's side of rollout-staged payloads, against a real buffer process on a real redis-server.

The replica here answers Generate as services/rollout/servicer.py does (it stages with the same
dockyard.experience.single_turn.stage when told to, else returns the arrays), so the collector and
JobBuffer are exercised as in a job: a staged group is committed by PutGroup(metadata, key) with no
token array passing through the coordinator, and the trainer leases exactly the arrays generated; a
group whose staged payload expired before its put is generated again (one that keeps expiring is one failed
group); one dropped (uniform rewards),
made again (its sandbox failed) or refused by the buffer has its staged payload deleted; without a data plane the arrays
come back and the payload goes through the buffer service, as before.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import redis

from dockyard.api.buffer.v1 import buffer_pb2_grpc
from dockyard.api.common.v1 import common_pb2
from dockyard.api.rollout.v1 import rollout_pb2
from dockyard.config import load_config_text
from dockyard.experience import single_turn
from dockyard.experience.data_plane import DataPlane
from dockyard.rpc.client import connect
from dockyard.tasks.task import Task
from services.coordinator.collector import Collector, CollectStats
from services.coordinator.fleet import Fleet
from services.coordinator.job_buffer import JobBuffer
from services.trainer.consumer import BufferConsumer
from services.trainer.ledger import TrainedLedger
from services.trainer.requests import training_group

JOB = "job-1"
CONFIG = (
    "policy: {model: {model_type: qwen2}, train_global_batch_size: 8}\n"
    "grpo: {num_prompts_per_step: 2, num_generations_per_prompt: 4, dynamic_sampling: {enabled: true}}\n"
)
TASK = Task(task_id="t0", prompt="1+2=", tests=(), solution="3")
NO_TRIALS = {"trial_arrays": 0, "endpoint_staged": 0}  # a single-turn job has no agent trial


class Replica:
    """Generate as a rollout replica answers it: fresh arrays per call, staged when the request says where."""

    def __init__(self) -> None:
        self.calls: list[rollout_pb2.GenerateResponse] = []  # every reply, with its arrays (for the test)
        self.keys: list[str] = []
        self.sizes: list[int] = []
        self._rng = random.Random(0)
        self._plane: DataPlane | None = None
        self.text_chars = 1  # each completion's text is its index, zero-padded to this many characters

    async def generate(self, task, n, sampling, request_id, seed=None, staging=None) -> rollout_pb2.GenerateResponse:
        prompt = [self._rng.randrange(1000) for _ in range(5)]
        completions = []
        for i in range(n):
            ids = [self._rng.randrange(1000) for _ in range(3 + i)]
            logprobs = [-self._rng.random() for _ in ids]
            completions.append(
                rollout_pb2.Completion(
                    token_ids=ids,
                    logprobs=logprobs,
                    num_tokens=len(ids),
                    text=str(i).zfill(self.text_chars),
                    finish_reason="eos",
                )
            )
        whole = rollout_pb2.GenerateResponse(prompt_token_ids=prompt, completions=completions, weight_version=0)
        self.calls.append(whole)
        if staging is None:
            return whole
        self._plane = self._plane or await DataPlane.connect(staging.data_plane)
        key, size = await single_turn.stage(self._plane, JOB, staging.group_id, prompt, completions)
        self.keys.append(key)
        self.sizes.append(size)
        reply = rollout_pb2.GenerateResponse(weight_version=0, payload_key=key, payload_bytes=size)
        for c in completions:
            reply.completions.add(num_tokens=c.num_tokens, text=c.text, finish_reason=c.finish_reason)
        return reply

    async def close(self) -> None:
        if self._plane is not None:
            await self._plane.close()


async def score(task, text: str, trajectory_id: str) -> common_pb2.Verdict:
    # Different rewards within the group: every group has a learning signal.
    return common_pb2.Verdict(status=common_pb2.VERDICT_STATUS_PASSED, tests_passed=int(text), tests_total=4)


async def uniform(task, text: str, trajectory_id: str) -> common_pb2.Verdict:
    return common_pb2.Verdict(status=common_pb2.VERDICT_STATUS_PASSED, tests_passed=4, tests_total=4)


async def sandbox_down(task, text: str, trajectory_id: str) -> common_pb2.Verdict:
    return common_pb2.Verdict(status=common_pb2.VERDICT_STATUS_ERROR, error_message="no sandbox")


def expected(metadata: common_pb2.Group, generated: rollout_pb2.GenerateResponse) -> common_pb2.Group:
    """The group as the coordinator would have put it had the arrays come back: metadata plus those arrays."""
    whole = common_pb2.Group()
    whole.CopyFrom(metadata)
    arrays = single_turn.token_trajectories(metadata.group_id, generated.prompt_token_ids, generated.completions)
    for trajectory, tokens in zip(whole.trajectories, arrays, strict=True):
        trajectory.MergeFrom(tokens)
        trajectory.sampled_tokens = 0
    return whole


async def test_rollout_staged_groups_are_committed_regenerated_when_expired_and_streamed_without_a_plane(
    start_service, redis_server: str, tmp_path
) -> None:
    client = redis.Redis.from_url(redis_server)
    client.flushdb()
    # Groups of at most 10 KiB: a group whose texts pass that is refused by the buffer, not by the replica.
    env = {"DOCKYARD_BUFFER_BACKEND": "redis", "DOCKYARD_BUFFER_REDIS_URL": redis_server}
    buffer = start_service("buffer", env | {"DOCKYARD_BUFFER_MAX_GROUP_MB": str(10 / 1024)})
    replica = Replica()
    async with connect(buffer.address, default_timeout=30) as channel:
        stub = buffer_pb2_grpc.BufferServiceStub(channel)
        job_buffer = JobBuffer(stub, JOB, max_groups=8, max_age_steps=4)
        await job_buffer.open()
        assert job_buffer.data_plane is not None
        outcomes: dict[str, str] = {}
        collector = Collector(
            JOB,
            load_config_text(CONFIG),
            Fleet(60.0),
            job_buffer,
            routing=SimpleNamespace(required_version=0),  # the collector reads only the version here
            max_generations=1,
            max_scoring=1,
            generate_timeout=10.0,
            on_group=lambda group_id, outcome, _: outcomes.__setitem__(group_id, outcome),
        )
        collector.generate, collector.score = replica.generate, score
        stats = CollectStats()

        # Staged by the replica: the group is metadata only here, and committed by its key.
        first = await collector.make_group(TASK, f"{JOB}/s1/g0", 1)
        assert all(not t.prompt_token_ids and not t.completion_token_ids for t in first.trajectories)
        assert [t.sampled_tokens for t in first.trajectories] == [3, 4, 5, 6]
        assert await collector.deliver(first, stats)
        assert collector.received() == {"arrays": 0, "rollout_staged": replica.sizes[0]} | NO_TRIALS
        assert job_buffer.sent() == {
            "metadata": first.ByteSize(),
            "payload": 0,
            "staged": 0,
            "rollout_staged": replica.sizes[0],
        }
        assert stats.generated_tokens == 3 + 4 + 5 + 6  # counted from the metadata's sampled_tokens
        assert client.exists(replica.keys[0]) == 0  # taken over by the buffer

        # The staged payload expired (scoring outlasted its TTL) before the put: the group is made again.
        second = await collector.make_group(TASK, f"{JOB}/s1/g1", 2)
        client.delete(replica.keys[1])
        assert await collector.deliver(second, stats)
        assert (len(replica.calls), collector.regenerated_groups) == (3, 1)
        assert outcomes == {f"{JOB}/s1/g0": "put", f"{JOB}/s1/g1": "put"}

        consumer = BufferConsumer(stub, "trainer-0", JOB, TrainedLedger(tmp_path), ack_timeout=10)
        lease = await consumer.lease(0, 2)
        leased = {g.group_id: g for g in lease.groups}
        assert sorted(leased) == [f"{JOB}/s1/g0", f"{JOB}/s1/g1"]
        for group_id, generated in ((f"{JOB}/s1/g0", replica.calls[0]), (f"{JOB}/s1/g1", replica.calls[2])):
            got = leased[group_id]
            assert training_group(got.group, got.payload) == training_group(expected(got.group, generated))

        # A group dropped for uniform rewards: its staged payload is deleted now, not left to expire.
        collector.score = uniform
        dropped = await collector.make_group(TASK, f"{JOB}/s1/g3", 4)
        assert client.exists(replica.keys[3]) == 1
        assert not await collector.deliver(dropped, stats)
        assert client.exists(replica.keys[3]) == 0 and stats.dropped_uniform == 1

        # A group made again because the sandbox failed it: the first attempt's payload is deleted.
        scores = iter([sandbox_down] * 4 + [score] * 4)
        collector.score = lambda *args: next(scores)(*args)
        again = await collector.make_group(TASK, f"{JOB}/s1/g4", 5)
        assert (client.exists(replica.keys[4]), client.exists(replica.keys[5])) == (0, 1)
        assert await collector.deliver(again, stats)
        collector.score = score

        # A group the buffer refuses (its metadata's texts pass the size limit): its staged payload is deleted.
        replica.text_chars = 3000
        refused = await collector.make_group(TASK, f"{JOB}/s1/g5", 6)
        assert client.exists(replica.keys[6]) == 1
        assert not await collector.deliver(refused, stats)
        assert outcomes[f"{JOB}/s1/g5"] == "refused" and client.exists(replica.keys[6]) == 0
        replica.text_chars = 1

        # A staged payload that expires before every put, the regenerations' too: one failed group, the job goes on.
        async def expiring(*args, **kwargs):
            reply = await replica.generate(*args, **kwargs)
            client.delete(replica.keys[-1])
            return reply

        collector.generate, regenerated, failed = expiring, collector.regenerated_groups, stats.failed
        lost = await collector.make_group(TASK, f"{JOB}/s1/g6", 7)
        assert not await collector.deliver(lost, stats)
        assert (collector.regenerated_groups - regenerated, stats.failed - failed) == (3, 1)
        assert outcomes[f"{JOB}/s1/g6"] == "failed"
        collector.generate = replica.generate

        # Without a data plane, the replica is not asked to stage: arrays here, the payload through the service.
        await job_buffer.close_plane()
        third = await collector.make_group(TASK, f"{JOB}/s1/g2", 3)
        assert len(replica.calls) == 12 and len(replica.keys) == 11
        assert await collector.deliver(third, stats)
        generated = replica.calls[11]
        arrays = 4 * (len(generated.prompt_token_ids) + 2 * sum(len(c.token_ids) for c in generated.completions))
        assert collector.received() == {"arrays": arrays, "rollout_staged": sum(replica.sizes)} | NO_TRIALS
        # The expired stage was sent once and never committed; the regenerated one was.
        sent = job_buffer.sent()
        assert sent["rollout_staged"] == replica.sizes[0] + replica.sizes[2] + replica.sizes[5]
        assert sent["payload"] > 0 and sent["staged"] == 0
    await replica.close()
