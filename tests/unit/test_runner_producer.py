"""The asynchronous producer keeps at most max_trajectory_age_steps steps' groups ahead of the
trainer (held in the buffer plus in flight), and one step's groups in flight; it goes on as soon
as the trainer takes groups. A real JobRunner with a scripted collector and buffer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from dockyard.api.buffer.v1 import buffer_pb2
from dockyard.config import load_config
from services.coordinator import runner as runner_module
from services.coordinator.fleet import Fleet
from services.coordinator.jobs import JobRecord
from services.coordinator.runner import JobRunner, Stubs
from services.coordinator.settings import CoordinatorSettings
from tests.conftest import REPO_ROOT

PROMPTS = 4


class Buffer:
    def __init__(self) -> None:
        self.held = 0

    async def GetStats(self, request, timeout=None):
        return buffer_pb2.GetStatsResponse(held=self.held)


@pytest.mark.parametrize("max_age", [1, 2])
async def test_the_producer_stays_within_the_age_bound_ahead_of_the_trainer(tmp_path: Path, monkeypatch, max_age):
    monkeypatch.setattr(runner_module, "PRODUCER_POLL_SECONDS", 0.005)
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
    record = JobRecord("job", config, config.resolved_yaml(), str(tmp_path / "run"))
    buffer = Buffer()
    runner = JobRunner(record, Stubs(trainer=None, buffer=buffer, fleet=Fleet(60.0)), CoordinatorSettings())
    generating, peak = 0, {"ahead": 0, "in_flight": 0}

    async def make_group(task, group_id, seed):
        nonlocal generating
        generating += 1
        peak["ahead"] = max(peak["ahead"], buffer.held + generating)
        peak["in_flight"] = max(peak["in_flight"], generating)
        await asyncio.sleep(0.002)
        return group_id

    async def deliver(group, stats):
        nonlocal generating
        buffer.held += 1
        generating -= 1
        return True

    runner.collector.make_group = make_group
    runner.collector.deliver = deliver
    producer = asyncio.create_task(runner._produce())
    try:
        for _ in range(5):  # the trainer takes a step's groups whenever they are there
            while buffer.held < PROMPTS:
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.05)  # long enough for a producer without a bound to run far ahead
            assert buffer.held == PROMPTS * max_age, "the producer did not fill the room it has"
            buffer.held -= PROMPTS
    finally:
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
    assert peak == {"ahead": PROMPTS * max_age, "in_flight": PROMPTS}
    assert runner._group_index >= PROMPTS * (max_age + 4)
