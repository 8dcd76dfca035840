"""Multi-turn trajectories in the trainer: the loss mask, segments, one advantage per trajectory."""

from __future__ import annotations

import pytest
import torch

from dockyard.api.common.v1 import common_pb2
from dockyard.config import load_config_text
from dockyard.experience.trainable import BatchError, validate_groups
from services.trainer.batch import build_batch
from services.trainer.experience import Sample, Segment, TrainingGroup
from services.trainer.minibatches import trajectory_advantages
from services.trainer.policy import PolicyTrainer
from services.trainer.requests import training_group
from tests.unit.trainer.test_policy import CONFIG


@pytest.fixture
def policy() -> PolicyTrainer:
    return PolicyTrainer(load_config_text(CONFIG))


def _sample(i: int, reward: float, mask=None, later=(), logprobs=None) -> Sample:
    completion = [5, 6, 7, 8, 9]
    return Sample(
        trajectory_id=f"g/{i}",
        prompt_ids=[1, 2, 3],
        completion_ids=completion,
        generation_logprobs=logprobs or [-1.0] * len(completion),
        reward=reward,
        valid=True,
        loss_mask=mask,
        later_segments=list(later),
    )


def test_only_sampled_tokens_are_in_the_token_mask_and_context_logprobs_are_dropped() -> None:
    mask = [1, 1, 0, 0, 1]  # two sampled tokens, a tool's two tokens, one sampled token
    sample = _sample(0, 1.0, mask, logprobs=[-0.5, -0.5, -9.0, -9.0, -0.5])
    batch = build_batch([TrainingGroup("g", [sample])], pad_token_id=0)
    row = batch.token_mask[0]
    targets = batch.input_ids[0, 1:][row.bool()].tolist()
    assert targets == [5, 6, 9]
    assert batch.generation_logprobs[0][~row.bool()].abs().sum() == 0
    assert batch.generation_logprobs[0][row.bool()].tolist() == [-0.5, -0.5, -0.5]


def test_each_segment_is_a_row_and_a_trajectory_counts_once_in_its_group() -> None:
    later = [Segment([4, 4], [6, 7], [-1.0, -1.0], [1, 1]), Segment([4], [8], [-1.0], None)]
    split = TrainingGroup("g", [_sample(0, 1.0, later=later), _sample(1, 0.0), _sample(2, 0.0)])
    whole = TrainingGroup("g", [_sample(0, 1.0), _sample(1, 0.0), _sample(2, 0.0)])
    batch = build_batch([split], pad_token_id=0)
    assert len(batch) == 5
    assert batch.sample_index.tolist() == [0, 0, 0, 1, 2]
    assert batch.first_segment.tolist() == [True, False, False, True, True]
    cfg = load_config_text(CONFIG).grpo
    got = trajectory_advantages(batch, cfg)
    want = trajectory_advantages(build_batch([whole], pad_token_id=0), cfg).tolist()
    # The split trajectory's segments all carry the advantage it has when whole; the others are unchanged.
    assert got.tolist() == pytest.approx([want[0]] * 3 + [want[1], want[2]])
    assert want[0] > 0 > want[1]


def test_context_tokens_get_no_gradient(policy: PolicyTrainer) -> None:
    """Masked tokens after the last sampled one are context for nothing: the gradient is that of the
    trajectory cut after its sampled tokens, whatever generation logprobs the masked ones carry."""

    def grads(*samples: Sample) -> torch.Tensor:
        policy.accumulate_gradients([TrainingGroup("g", list(samples))])
        return torch.cat([p.grad.flatten() for p in policy.model.parameters() if p.grad is not None]).clone()

    masked = grads(_sample(0, 1.0, [1, 1, 0, 0, 0], logprobs=[-1.0, -1.0, -0.01, -7.0, -3.0]), _sample(1, 0.0))
    cut = _sample(0, 1.0)
    cut.completion_ids, cut.generation_logprobs = [5, 6], [-1.0, -1.0]
    whole = grads(cut, _sample(1, 0.0))
    assert whole.abs().sum() > 0
    torch.testing.assert_close(masked, whole)
    # Not a vacuous match: training on the same tokens unmasked gives another gradient.
    assert not torch.allclose(grads(_sample(0, 1.0), _sample(1, 0.0)), whole)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: setattr(s, "loss_mask", [1, 0]), "2 completion_loss_mask values for 5"),
        (lambda s: setattr(s, "loss_mask", [1, 0, 3, 1, 1]), "completion_loss_mask holds 3"),
        (lambda s: s.later_segments.append(Segment([], [5], [-1.0])), "later_segments[0]: empty prompt_token_ids"),
        (lambda s: s.later_segments.append(Segment([1], [5, 6], [-1.0])), "later_segments[0]: 1 completion_logprobs"),
        (lambda s: s.later_segments.append(Segment([1], [500], [-1.0])), "later_segments[0]: token id 500"),
    ],
)
def test_bad_segments_are_refused_naming_the_segment(edit, message: str) -> None:
    sample = _sample(0, 1.0)
    edit(sample)
    with pytest.raises(BatchError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate_groups([TrainingGroup("g", [sample])], vocab_size=100, max_length=64)


def test_a_trajectory_with_no_sampled_token_left_is_an_empty_batch() -> None:
    with pytest.raises(BatchError, match="no trajectory has a sampled completion token"):
        validate_groups([TrainingGroup("g", [_sample(0, 1.0, [0, 0, 0, 0, 0])])], vocab_size=100, max_length=64)


def test_the_wire_trajectory_becomes_segments_with_masks() -> None:
    group = common_pb2.Group(
        group_id="g",
        trajectories=[
            common_pb2.Trajectory(
                trajectory_id="g/0",
                prompt_token_ids=[1],
                completion_token_ids=[2, 3],
                completion_logprobs=[-0.5, 0.0],
                completion_loss_mask=[1, 0],
                later_segments=[
                    common_pb2.Segment(prompt_token_ids=[4], completion_token_ids=[5], completion_logprobs=[-0.1])
                ],
                reward=1.0,
                valid=True,
            ),
            common_pb2.Trajectory(
                trajectory_id="g/1", prompt_token_ids=[1], completion_token_ids=[2], completion_logprobs=[-0.5]
            ),
        ],
    )
    first, single = training_group(group).samples
    assert first.loss_mask == [1, 0]
    assert first.later_segments == [Segment([4], [5], [pytest.approx(-0.1)], None)]
    assert single.loss_mask is None and single.later_segments == []


def test_a_failed_trial_without_tokens_gets_no_row_and_leaves_the_others_alone() -> None:
    hollow = Sample("g/2", [], [], [], reward=0.0, valid=False)
    group = TrainingGroup("g", [_sample(0, 1.0), _sample(1, 0.0), hollow])
    validate_groups([group], vocab_size=100, max_length=64)
    batch = build_batch([group], pad_token_id=0)
    assert len(batch) == 2 and batch.sample_index.tolist() == [0, 1]
    # A valid sample without tokens is still refused.
    with pytest.raises(BatchError, match="empty prompt_token_ids"):
        validate_groups([TrainingGroup("g", [Sample("g/0", [], [], [], 1.0, True)])], vocab_size=100, max_length=64)


def test_a_segments_tokens_pay_the_kl_of_the_later_segments_of_their_trajectory() -> None:
    later = [Segment([4, 4], [6, 7], [-1.0, -1.0], [1, 1])]
    group = TrainingGroup("g", [_sample(0, 1.0, later=later), _sample(1, 0.0), _sample(2, 0.5)])
    batch = build_batch([group], pad_token_id=0)
    grpo = load_config_text(CONFIG, ["grpo.adv_estimator.name=reinforce++"]).grpo
    grpo.adv_estimator.kl_in_reward = 0.5
    kl = torch.where(batch.token_mask.bool(), 0.1, 0.0)
    got = trajectory_advantages(batch, grpo, kl)
    # By hand: each token's return is r − β·(the KL of this and every later token of its trajectory).
    returns = {}
    for row in range(len(batch)):
        tokens = batch.token_mask[row].nonzero().flatten().tolist()
        after = sum(
            int(batch.token_mask[r].sum())
            for r in range(row + 1, len(batch))
            if batch.sample_index[r] == batch.sample_index[row]
        )
        for k, t in enumerate(tokens):
            returns[row, t] = float(batch.rewards[row]) - 0.5 * 0.1 * (len(tokens) - k + after)
    values = torch.tensor(list(returns.values()))
    mean, std = values.mean(), values.std(unbiased=False)
    for (row, t), g in returns.items():
        assert float(got[row, t]) == pytest.approx(float((g - mean) / (std + 1e-6)), abs=1e-5)
    assert batch.sample_index.tolist()[:2] == [0, 0]  # the first trajectory has two rows
