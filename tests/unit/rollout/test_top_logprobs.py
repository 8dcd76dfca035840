"""top_logprobs through the rollout servicer and the torch engine built from a tiny job config.

Each reported alternative is checked against a direct recomputation: one forward pass of prompt +
completion, log_softmax(logits / T) at each step (plain log_softmax at T = 0), before truncation.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from torch.overrides import TorchFunctionMode

from dockyard.api.common.v1 import common_pb2
from dockyard.api.rollout.v1 import rollout_pb2
from dockyard.rpc.errors import InvalidArgument
from services.rollout.decoding import DecodingParams
from services.rollout.sampling import sample
from services.rollout.servicer import RolloutServicer
from services.rollout.settings import RolloutSettings

JOB = "job-top-logprobs"
CONFIG_YAML = """
policy:
  model: {model_type: qwen2, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 2,
          num_key_value_heads: 1, intermediate_size: 64, max_position_embeddings: 256}
  train_global_batch_size: 4
  train_micro_batch_size: 2
  generation: {temperature: 1.0, max_new_tokens: 5}
grpo: {num_prompts_per_step: 2, num_generations_per_prompt: 2}
"""
PROMPT = "1+2="


class Context:
    def cancelled(self) -> bool:
        return False

    def time_remaining(self) -> float:
        return 60.0


@pytest.fixture(scope="module")
def served():
    """(servicer, event loop) with the tiny policy loaded; every test drives that one loop."""
    torch.set_num_threads(1)
    loop = asyncio.new_event_loop()

    async def start() -> RolloutServicer:  # built on its loop: the servicer's channels belong to it
        servicer = RolloutServicer(RolloutSettings())
        await servicer.LoadPolicy(rollout_pb2.LoadPolicyRequest(job_id=JOB, config_yaml=CONFIG_YAML), None)
        return servicer

    servicer = loop.run_until_complete(start())
    yield servicer, loop
    loop.run_until_complete(servicer.close())
    loop.close()


def generate(served, top_logprobs: int, n: int = 3, **sampling) -> rollout_pb2.GenerateResponse:
    servicer, loop = served
    params = common_pb2.SamplingParams(**{"max_new_tokens": 10, "ignore_eos": True, "seed": 3, **sampling})
    request = rollout_pb2.GenerateRequest(
        job_id=JOB, prompt=PROMPT, num_samples=n, sampling=params, top_logprobs=top_logprobs
    )
    return loop.run_until_complete(servicer.Generate(request, Context()))


def step_logprobs(served, prompt_ids: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of every step of the completion (rows: steps), from one forward pass."""
    model = served[0].engines[JOB].model
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + tokens])).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.7, "top_k": 4, "top_p": 0.8},  # truncation must not reach the alternatives
        {"temperature": 0.5, "top_p": 1.0},
        {"temperature": 0.0, "top_p": 1.0},
    ],
    ids=["truncated", "plain", "greedy"],
)
def test_alternatives_follow_the_law_of_the_sampled_logprobs(served, sampling: dict) -> None:
    k = 5
    reply = generate(served, k, **sampling)
    temperature = sampling["temperature"]
    sampled_among_them = 0
    for c in reply.completions:
        assert len(c.top_logprobs) == len(c.token_ids) == 10
        law = step_logprobs(served, list(reply.prompt_token_ids), list(c.token_ids), temperature)
        for t, (token, logprob, top) in enumerate(zip(c.token_ids, c.logprobs, c.top_logprobs, strict=True)):
            values, ids = list(top.logprobs), list(top.token_ids)
            assert len(values) == len(ids) == k and len(set(ids)) == k
            assert values == sorted(values, reverse=True)
            # The k largest of the recomputed distribution, each at the token it names.
            torch.testing.assert_close(torch.tensor(values), law[t].topk(k).values, atol=1e-5, rtol=0)
            torch.testing.assert_close(torch.tensor(values), law[t][ids], atol=1e-5, rtol=0)
            assert values[0] >= logprob - 1e-6
            if temperature == 0:
                assert ids[0] == token and values[0] == pytest.approx(logprob, abs=1e-6)
            if token in ids:
                sampled_among_them += 1
                assert values[ids.index(token)] == pytest.approx(logprob, abs=1e-6)
            else:
                assert logprob <= values[-1] + 1e-6
    assert sampled_among_them > 0


def test_no_alternatives_unless_asked(served) -> None:
    reply = generate(served, 0, temperature=1.0, top_p=1.0)
    assert all(len(c.token_ids) == 10 and not c.top_logprobs for c in reply.completions)


def test_the_default_path_runs_no_extra_tensor_operation() -> None:
    """Asking none adds nothing to a step (no top-k over the vocabulary); asking k adds exactly that."""
    logits = torch.randn(3, 50)

    def calls(k: int) -> tuple[list[str], object]:
        params = [DecodingParams(temperature=1.0, top_k=5, top_logprobs=k)] * 3
        with Recording() as seen:
            drawn = sample(logits, params, [torch.Generator().manual_seed(0)] * 3)
        return [name for name in seen.names if name != "__get__"], drawn  # attribute reads (.shape) are no work

    plain, drawn = calls(0)
    assert drawn.top is None and "topk" not in plain
    asked, drawn = calls(4)
    assert drawn.top is not None and asked == [*plain, "topk"]


class Recording(TorchFunctionMode):
    """The torch functions and tensor methods called inside it, by name, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


def test_rows_of_one_batch_get_each_their_own_count(served) -> None:
    """Requests asking different counts share decode steps: each row is cut to its own k (none for 0)."""
    servicer, loop = served

    async def together():
        def request(k: int) -> rollout_pb2.GenerateRequest:
            params = common_pb2.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=12, ignore_eos=True)
            return rollout_pb2.GenerateRequest(
                job_id=JOB, prompt=PROMPT, num_samples=2, sampling=params, top_logprobs=k
            )

        return await asyncio.gather(*(servicer.Generate(request(k), Context()) for k in (0, 2, 7)))

    none, two, seven = loop.run_until_complete(together())
    assert all(not c.top_logprobs for c in none.completions)
    for reply, k in ((two, 2), (seven, 7)):
        for c in reply.completions:
            assert len(c.top_logprobs) == 12 and all(len(top.token_ids) == k for top in c.top_logprobs)
    assert servicer.engines[JOB].batch_stats.largest_batch >= 4


def test_the_most_alternatives_openai_allows(served) -> None:
    reply = generate(served, 20, n=1, temperature=1.0, top_p=1.0)
    assert all(len(top.logprobs) == 20 for top in reply.completions[0].top_logprobs)


@pytest.mark.parametrize("bad", [-1, 21, 1000])
def test_a_count_outside_0_to_20_is_invalid_argument_naming_the_field(served, bad: int) -> None:
    with pytest.raises(InvalidArgument, match=rf"^top_logprobs: must be in \[0, 20\].*got {bad}"):
        generate(served, bad, temperature=1.0)
