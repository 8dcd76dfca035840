"""Generate starts no work for a caller that has gone, nor for a prompt beyond the model's context,
and stops the work of a caller whose deadline passes while it runs."""

from __future__ import annotations

import asyncio

import pytest

from dockyard.api.rollout.v1 import rollout_pb2
from dockyard.config import load_config_text
from dockyard.rpc.errors import DeadlineExceeded, InvalidArgument
from services.rollout.servicer import RolloutServicer
from services.rollout.settings import RolloutSettings

CONFIG = "policy: {model: {model_type: qwen2}, train_global_batch_size: 64, generation: {max_new_tokens: 4}}\n"


class CharTokenizer:
    def __call__(self, text: str) -> dict:
        return {"input_ids": [ord(c) for c in text]}


class Engine:
    """Counts generations; a context of 16 tokens."""

    context_tokens = 16
    tokenizer = CharTokenizer()

    def __init__(self) -> None:
        self.generations = 0

    async def generate(self, prompt, num_samples, decoding):
        self.generations += 1
        raise AssertionError("no generation should start")


class Context:
    def __init__(self, cancelled: bool = False, remaining: float | None = None) -> None:
        self._cancelled, self._remaining = cancelled, remaining

    def cancelled(self) -> bool:
        return self._cancelled

    def time_remaining(self) -> float | None:
        return self._remaining


@pytest.fixture
async def servicer():
    servicer = RolloutServicer(RolloutSettings())
    servicer.engines["job"], servicer.configs["job"] = Engine(), load_config_text(CONFIG)
    yield servicer
    await servicer.close()


@pytest.mark.parametrize("context", [Context(cancelled=True), Context(remaining=0.0), Context(remaining=-3.0)])
async def test_a_caller_that_has_gone_starts_no_generation(servicer, context: Context) -> None:
    with pytest.raises(DeadlineExceeded, match="gave up"):
        await servicer.Generate(rollout_pb2.GenerateRequest(job_id="job", prompt="1+2=", num_samples=1), context)
    assert servicer.engines["job"].generations == 0
    assert servicer.in_flight == 0


async def test_a_prompt_beyond_the_context_is_refused_before_generation(servicer) -> None:
    request = rollout_pb2.GenerateRequest(job_id="job", prompt="x" * 13, num_samples=1)
    with pytest.raises(InvalidArgument, match="13 tokens; with max_new_tokens 4 that exceeds .* context of 16"):
        await servicer.Generate(request, Context(remaining=30.0))
    assert servicer.engines["job"].generations == 0


class EndlessEngine(Engine):
    """A generation that runs until it is cancelled, and records that it was."""

    def __init__(self) -> None:
        super().__init__()
        self.cancelled = asyncio.Event()

    async def generate(self, prompt, num_samples, decoding):
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


async def test_a_deadline_that_passes_during_generation_cancels_it(servicer) -> None:
    engine = servicer.engines["job"] = EndlessEngine()
    request = rollout_pb2.GenerateRequest(job_id="job", prompt="1+2=", num_samples=1)
    # The outer bound only keeps a regression from hanging the suite.
    with pytest.raises(DeadlineExceeded, match="deadline passed during generation"):
        await asyncio.wait_for(servicer.Generate(request, Context(remaining=0.05)), timeout=120)
    assert engine.cancelled.is_set()
    assert servicer.in_flight == 0
