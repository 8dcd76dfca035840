"""The asynchronous producer keeps at most max_trajectory_age_steps steps' groups ahead of the
trainer (held in the buffer plus in flight), and one step's groups in flight; it goes on as soon
as the trainer takes groups. A real AsyncProducer with a scripted collector and buffer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from dockyard.api.buffer.v1 import buffer_pb2
from dockyard.config import load_config
from services.coordinator import producer as producer_module
from services.coordinator.job_buffer import JobBuffer
from services.coordinator.producer import AsyncProducer, GroupIds
from services.coordinator.task_stream import TaskStream, load_tasks
from tests.conftest import REPO_ROOT

PROMPTS = 4


class Buffer:
    def __init__(self) -> None:
        self.held = 0

    async def GetStats(self, request, timeout=None):
        return buffer_pb2.GetStatsResponse(held=self.held)


class Collector:
    """Makes a group in a moment and counts what is being generated and what is held."""

    def __init__(self, buffer: Buffer) -> None:
        self.buffer, self.generating = buffer, 0
        self.peak = {"ahead": 0, "in_flight": 0}

    async def make_group(self, task, group_id, seed):
        self.generating += 1
        self.peak["ahead"] = max(self.peak["ahead"], self.buffer.held + self.generating)
        self.peak["in_flight"] = max(self.peak["in_flight"], self.generating)
        await asyncio.sleep(0.002)
        return group_id

    async def deliver(self, group, stats):
        self.buffer.held += 1
        self.generating -= 1
        return True


@pytest.mark.parametrize("max_age", [1, 2])
async def test_the_producer_stays_within_the_age_bound_ahead_of_the_trainer(tmp_path: Path, monkeypatch, max_age):
    monkeypatch.setattr(producer_module, "PRODUCER_POLL_SECONDS", 0.005)
    config = load_config(
        REPO_ROOT / "examples" / "configs" / "tiny_expr.yaml",
        [
            "grpo.async_grpo.enabled=true",
            "loss_fn.is_correction=tis",
            "loss_fn.is_max=2",
            f"grpo.num_prompts_per_step={PROMPTS}",
            f"grpo.max_trajectory_age_steps={max_age}",
        ],
    )
    buffer = Buffer()
    collector = Collector(buffer)
    ids = GroupIds("job", config.grpo.seed)
    tasks = TaskStream(load_tasks(config, "train"), config.grpo.seed)
    producer = AsyncProducer(collector, JobBuffer(buffer, "job"), tasks, ids, config.grpo, patience=60.0)
    producer.start()
    try:
        for _ in range(5):  # the trainer takes a step's groups whenever they are there
            while buffer.held < PROMPTS:
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.05)  # long enough for a producer without a bound to run far ahead
            assert buffer.held == PROMPTS * max_age, "the producer did not fill the room it has"
            buffer.held -= PROMPTS
    finally:
        await producer.stop()
    assert collector.peak == {"ahead": PROMPTS * max_age, "in_flight": PROMPTS}
    assert ids.next_index >= PROMPTS * (max_age + 4)


class SlowPutCollector(Collector):
    """Its put reaches the buffer, then the reply takes a while: a stop arrives in between."""

    def __init__(self, buffer: Buffer) -> None:
        super().__init__(buffer)
        self.reached, self.outcomes = asyncio.Event(), []

    async def deliver(self, group, stats):
        self.buffer.held += 1  # the buffer counted it
        self.reached.set()
        await asyncio.sleep(0.2)  # the reply on its way back
        self.outcomes.append(group)  # what the collector writes to groups.jsonl on the reply
        return True


async def test_a_stop_lets_a_put_under_way_finish_and_record_its_outcome() -> None:
    config = load_config(REPO_ROOT / "examples" / "configs" / "tiny_expr.yaml", ["grpo.num_prompts_per_step=1"])
    buffer = Buffer()
    collector = SlowPutCollector(buffer)
    tasks = TaskStream(load_tasks(config, "train"), config.grpo.seed)
    producer = AsyncProducer(collector, JobBuffer(buffer, "job"), tasks, GroupIds("job", 0), config.grpo, patience=60)
    producer.start()
    await collector.reached.wait()
    await producer.stop()  # while the put is under way
    # Every group the buffer counted has its outcome: the books of a stopped job add up.
    assert buffer.held >= 1 and len(collector.outcomes) == buffer.held
