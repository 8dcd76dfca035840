"""SupervisedStep sizes its demonstrations before the job's lock and before any tokenizing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dockyard.api.trainer.v1 import trainer_pb2 as pb
from dockyard.rpc.errors import InvalidArgument
from services.trainer.requests import MAX_CHARS_PER_TOKEN, demonstration_pairs
from services.trainer.servicer import TrainerServicer


class Untouchable:
    """A tokenizer, lock and step that fail the test if anything reaches them."""

    def __call__(self, *args, **kwargs):
        raise AssertionError("tokenized before the demonstrations were sized")

    async def _supervised_step(self, *args, **kwargs):
        raise AssertionError("took the job's lock before the demonstrations were sized")


def _servicer(max_positions: int) -> SimpleNamespace:
    untouchable = Untouchable()
    policy = SimpleNamespace(max_positions=max_positions, tokenizer=untouchable)
    return SimpleNamespace(
        _job=lambda job_id: SimpleNamespace(policy=policy), _supervised_step=untouchable._supervised_step
    )


@pytest.mark.parametrize(
    ("demonstrations", "words"),
    [
        (
            [pb.Demonstration(prompt="p", completion="c" * (30 << 20))],
            ("demonstrations[0]", "16384", "before tokenizing"),
        ),
        ([pb.Demonstration(prompt="p", completion="c")] * 1_000_000, ("demonstrations", "65536")),
    ],
)
async def test_an_oversized_batch_is_refused_before_the_lock_and_the_tokenizer(demonstrations, words) -> None:
    request = pb.SupervisedStepRequest(job_id="job", step=1, demonstrations=demonstrations)
    with pytest.raises(InvalidArgument) as refused:
        await TrainerServicer.SupervisedStep(_servicer(256), request, None)
    for word in words:
        assert word in str(refused.value)


def test_the_bound_is_generous_at_the_edge() -> None:
    fits = pb.Demonstration(prompt="p", completion="c" * (256 * MAX_CHARS_PER_TOKEN - 1))
    assert demonstration_pairs([fits], 256) == [(fits.prompt, fits.completion)]
    with pytest.raises(InvalidArgument, match="demonstrations\\[0\\]"):
        demonstration_pairs([pb.Demonstration(prompt="pp", completion=fits.completion)], 256)
