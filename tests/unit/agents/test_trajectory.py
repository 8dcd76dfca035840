"""An endpoint session's recording as Trajectory token fields: segments, masks, the token budget, the message."""

from __future__ import annotations

from dockyard.agents.trajectory import trajectory_message, trial_tokens
from dockyard.api.common.v1 import common_pb2


def _segment(prompt: list[int], turns: list[tuple[list[int], list[int]]], version: int = 3) -> dict:
    """A recorded segment: the prompt, then (sampled ids, context ids that follow) per turn."""
    ids, mask, logprobs, versions = list(prompt), [0] * len(prompt), [0.0] * len(prompt), [-1] * len(prompt)
    for sampled, context in turns:
        ids += sampled + context
        mask += [1] * len(sampled) + [0] * len(context)
        logprobs += [-0.5] * len(sampled) + [0.0] * len(context)
        versions += [version] * len(sampled) + [-1] * len(context)
    return {"token_ids": ids, "loss_mask": mask, "logprobs": logprobs, "weight_versions": versions}


def test_the_prompt_is_what_comes_before_the_first_sampled_token() -> None:
    recorded = {"segments": [_segment([1, 2, 3], [([4, 5], [6, 7]), ([8], [])])]}
    [seg] = trial_tokens(recorded, max_tokens=100).segments
    assert seg.prompt_ids == [1, 2, 3]
    assert seg.completion_ids == [4, 5, 6, 7, 8]
    assert seg.loss_mask == [1, 1, 0, 0, 1]
    assert seg.logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5]


def test_later_segments_and_the_oldest_version() -> None:
    recorded = {"segments": [_segment([1], [([2], [3])], version=4), _segment([9, 9], [([5], [])], version=5)]}
    tokens = trial_tokens(recorded, max_tokens=100)
    assert [s.prompt_ids for s in tokens.segments] == [[1], [9, 9]]
    assert tokens.weight_version == 4 and not tokens.truncated
    assert tokens.total_tokens == 6 and tokens.sampled_tokens == 2


def test_the_message_holds_the_first_segment_then_the_later_ones_and_the_given_fields() -> None:
    recorded = {"segments": [_segment([1], [([2], [3])], version=4), _segment([9, 9], [([5], [])], version=5)]}
    verdict = common_pb2.Verdict(status=common_pb2.VERDICT_STATUS_PASSED)
    message = trajectory_message(trial_tokens(recorded, max_tokens=100), trajectory_id="g/0", verdict=verdict)
    assert message.trajectory_id == "g/0" and message.verdict == verdict and message.weight_version == 4
    assert list(message.prompt_token_ids) == [1] and list(message.completion_token_ids) == [2, 3]
    assert list(message.completion_loss_mask) == [1, 0] and list(message.completion_logprobs) == [-0.5, 0.0]
    [later] = message.later_segments
    assert list(later.prompt_token_ids) == [9, 9] and list(later.completion_token_ids) == [5]
    assert list(later.completion_loss_mask) == [1] and list(later.completion_logprobs) == [-0.5]


def test_the_budget_cuts_the_trajectory_and_drops_what_lies_past_it() -> None:
    recorded = {"segments": [_segment([1, 2], [([3, 4], [5, 6]), ([7, 8], [])]), _segment([1], [([2], [])])]}
    tokens = trial_tokens(recorded, max_tokens=5)
    [seg] = tokens.segments
    assert seg.prompt_ids + seg.completion_ids == [1, 2, 3, 4, 5]
    assert seg.loss_mask == [1, 1, 0] and tokens.truncated and tokens.total_tokens == 5
    # A cut inside the prompt leaves nothing sampled: no segment at all.
    assert trial_tokens(recorded, max_tokens=2).segments == []


def test_the_budget_counts_a_prefix_later_segments_repeat_once() -> None:
    """A segment the scaffold's history edit opened repeats the earlier context: those tokens count once."""
    context = list(range(10, 60))
    first = _segment(context, [([1, 2], [3, 4])])
    second = _segment(context + [7], [([8, 9], [])])
    recorded = {"segments": [first, second]}
    unique = len(first["token_ids"]) + 3  # the second row adds 7, 8, 9 past the shared context
    tokens = trial_tokens(recorded, max_tokens=unique)
    assert not tokens.truncated and len(tokens.segments) == 2 and tokens.unique_tokens == unique
    assert tokens.total_tokens == len(first["token_ids"]) + len(second["token_ids"]) > unique
    # One token less: the second row is cut after its first sampled token, and nothing later is kept.
    third = _segment([99], [([5], [])])
    cut = trial_tokens({"segments": [first, second, third]}, max_tokens=unique - 1)
    assert cut.truncated and len(cut.segments) == 2 and cut.unique_tokens == unique - 1
    assert cut.segments[1].completion_ids == [8] and cut.segments[1].loss_mask == [1]


def test_a_row_never_outgrows_the_budget_whatever_the_sharing() -> None:
    recorded = {"segments": [_segment([1, 2, 3], [([4], [])]), _segment([1, 2, 3, 4, 5, 6], [([7], [])])]}
    tokens = trial_tokens(recorded, max_tokens=5)
    assert all(len(s.prompt_ids) + len(s.completion_ids) <= 5 for s in tokens.segments)
    assert tokens.truncated and tokens.unique_tokens == 5
