"""The coordinator's side of agent trials' staged parts (real redis-server): a group whose parts cannot be
assembled is made again and its leftover parts deleted; a group made again after a lost trial deletes the
parts its finished trials staged; a trial the endpoint could not stage is staged from here. A group whose
parts never assemble, or that carries a trial the buffer refuses, is one unscorable group (the producer
counts it and the job goes on), never an error that ends the job."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import redis

from dockyard.agents.scaffold import TrialLost
from dockyard.api.buffer.v1 import buffer_pb2
from dockyard.api.common.v1 import common_pb2
from dockyard.config import load_config
from dockyard.experience import payload as packed
from dockyard.experience.agent_trial import stage_part
from dockyard.experience.data_plane import DataPlane
from dockyard.tasks.task import Task
from services.coordinator.agent_trials import AgentTrials
from services.coordinator.fleet import Fleet
from services.coordinator.group_errors import GroupUnscorable
from services.coordinator.job_buffer import StagedPayload
from services.coordinator.staged_payloads import StagedPayloads
from services.coordinator.trials import Trial
from tests.conftest import REPO_ROOT
from tests.unit.test_experience_agent_trial import trajectory

JOB = "job-1"
TASK = Task(task_id="t0", prompt="f?", tests=(), solution="")


async def connected(url: str) -> DataPlane:
    limits = buffer_pb2.GetDataPlaneResponse(
        redis_url=url, key_prefix="dockyard:buffer", staging_ttl_seconds=60, max_trajectory_tokens=65536
    )
    plane = await DataPlane.connect(limits)
    assert plane is not None
    return plane


async def staged_trial(plane: DataPlane, seed: int) -> Trial:
    """A trial as the endpoint leaves it: metadata here, its tokens a part in Redis."""
    tokens = trajectory(seed, 2)
    key, size = await stage_part(plane, JOB, tokens)
    metadata = packed.split(common_pb2.Group(trajectories=[tokens]))[0].trajectories[0]
    return Trial(metadata, part=StagedPayload(key, size))


class Agent:
    """AgentTrials.group over trials made by `make(attempt)`."""

    def __init__(self, make) -> None:
        self.make, self.attempts, self.regenerated_groups = make, 0, 0

    async def group(self, task, group_id, seed, n, sampling) -> list[Trial]:
        self.attempts += 1
        return await self.make(self.attempts)


def test_parts_that_cannot_be_assembled_make_the_group_again_and_leave_nothing(redis_server: str) -> None:
    client = redis.Redis.from_url(redis_server)
    client.flushdb()

    async def go() -> None:
        plane = await connected(redis_server)
        buffer = SimpleNamespace(data_plane=plane, job_id=JOB, sent_bytes={"staged": 0})
        first: list[Trial] = []

        async def make(attempt: int) -> list[Trial]:
            if attempt == 1:
                first.extend([await staged_trial(plane, 10 + i) for i in range(3)])
                client.delete(first[1].part.key)  # expired before the group's last trial ended
                return list(first)
            # The endpoint could not stage trial 2: its tokens came here.
            return [await staged_trial(plane, 20), await staged_trial(plane, 21), Trial(trajectory(22, 2))]

        agent = Agent(make)
        staged = StagedPayloads(buffer)
        trials, payload = await staged.agent_trials(agent, TASK, "g", 0, 3, None, 2)
        assert (agent.attempts, agent.regenerated_groups) == (2, 1)
        assert not any(client.exists(t.part.key) for t in first)  # the first attempt's leftovers are deleted
        assert [k.decode() for k in client.keys()] == [payload.key]
        # The group's payload is the three trials' tokens in order, the carried one staged from here.
        assert client.get(payload.key) == packed.pack([trajectory(20 + i, 2) for i in range(3)])
        assert buffer.sent_bytes["staged"] == len(packed.pack([trajectory(22, 2)]))
        assert not packed.has_tokens(trials[2].trajectory) and all(t.part is None for t in trials)
        assert staged.received()["endpoint_staged"] == sum(t.part.size for t in first) + sum(
            len(packed.pack([trajectory(20 + i, 2)])) for i in range(2)
        )
        await plane.close()

    asyncio.run(go())


def test_a_lost_trial_deletes_the_parts_its_group_had_staged(redis_server: str) -> None:
    client = redis.Redis.from_url(redis_server)
    client.flushdb()

    async def go() -> None:
        plane = await connected(redis_server)
        config = load_config(REPO_ROOT / "examples" / "configs" / "tiny_agent.yaml", ["policy.bootstrap=null"])
        agent = AgentTrials(
            JOB,
            config,
            Fleet(60.0),
            None,
            None,
            endpoint_address="127.0.0.1:9",
            token="token",
            max_regenerations=1,
            wait_timeout=1.0,
            plane=lambda: plane,
        )
        made: list[Trial] = []

        async def trial(task, trajectory_id, seed, sampling, stage=False) -> Trial:
            assert stage  # a training trial stages its tokens
            index = int(trajectory_id.rsplit("/", 1)[1])
            if len(made) < 2 and index == 2:
                await asyncio.sleep(0.05)  # the others finish first
                raise TrialLost("the replica died")
            made.append(await staged_trial(plane, len(made)))
            return made[-1]

        agent.trial = trial
        trials = await agent.group(TASK, "g", 0, 3, config.policy.generation)
        assert agent.regenerated_groups == 1 and len(made) == 5
        assert not any(client.exists(t.part.key) for t in made[:2])  # the lost group's parts
        assert all(client.exists(t.part.key) for t in trials)  # the group made again keeps its own
        await plane.close()

    asyncio.run(go())


def test_parts_that_never_assemble_end_as_one_unscorable_group(redis_server: str) -> None:
    client = redis.Redis.from_url(redis_server)
    client.flushdb()

    async def go() -> None:
        plane = await connected(redis_server)
        buffer = SimpleNamespace(data_plane=plane, job_id=JOB, sent_bytes={"staged": 0})

        async def make(attempt: int) -> list[Trial]:
            trials = [await staged_trial(plane, 10 * attempt + i) for i in range(2)]
            client.delete(trials[0].part.key)  # expired every time
            return trials

        agent = Agent(make)
        with pytest.raises(GroupUnscorable, match="could not be assembled in 3 attempts") as failed:
            await StagedPayloads(buffer).agent_trials(agent, TASK, "g", 0, 2, None, 2)
        assert "PartGone" in failed.value.first
        assert (agent.attempts, agent.regenerated_groups) == (3, 2)
        assert client.keys() == []  # every attempt's parts deleted
        await plane.close()

    asyncio.run(go())


def test_a_carried_trial_the_buffer_refuses_is_an_unscorable_group(redis_server: str) -> None:
    client = redis.Redis.from_url(redis_server)
    client.flushdb()

    async def go() -> None:
        plane = await connected(redis_server)
        buffer = SimpleNamespace(data_plane=plane, job_id=JOB, sent_bytes={"staged": 0})
        refused = trajectory(1, 1)
        long = 65_537  # past the data plane's max_trajectory_tokens: the buffer's check refuses it
        refused.completion_token_ids.extend([7] * long)
        refused.completion_logprobs.extend([-1.0] * long)
        refused.completion_loss_mask.extend([1] * long)

        async def make(attempt: int) -> list[Trial]:
            return [await staged_trial(plane, 0), Trial(refused)]

        agent = Agent(make)
        with pytest.raises(GroupUnscorable, match="the buffer refuses a trial"):
            await StagedPayloads(buffer).agent_trials(agent, TASK, "g", 0, 2, None, 2)
        assert agent.attempts == 1  # no regeneration makes a refused trial acceptable
        assert client.keys() == []
        await plane.close()

    asyncio.run(go())
