"""What a trainer step learns from, as plain Python: GRPO groups of samples and SFT demonstration rows.

    buffer Group (proto) ──servicer──> TrainingGroup(group id, [Sample(trajectory id, prompt ids,
                                        completion ids, generation logprobs, reward, valid,
                                        weight version, loss mask, later segments)])
    Demonstration(prompt, completion) ──demonstration_rows──> (prompt ids, completion ids + eos)

Guarantees: these types hold only lists, numbers and strings, so they pickle
(rank 0 hands them to the other ranks as they are) and need no protobuf;
a multi-turn sample is one or more segments (`Sample.segments()`), each
its own token sequence, whose loss mask marks the tokens the policy sampled
(None: all of them); the reward belongs to the sample, not to a segment;
`demonstration_rows` tokenises without special tokens and ends every
completion with the end-of-sequence token; `staleness_metrics` counts every
sample once, by its age in optimizer steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# One supervised row: (prompt ids, completion ids).
Row = tuple[Sequence[int], Sequence[int]]


@dataclass
class Segment:
    """One token sequence of a trajectory: prompt (context), then completion tokens."""

    prompt_ids: list[int]
    completion_ids: list[int]
    generation_logprobs: list[float]  # one per completion token; 0.0 where the mask is 0
    loss_mask: list[int] | None = None  # 1: sampled by the policy, 0: context; None: all sampled
    # A mixture-of-experts policy's recorded routing: [len(prompt_ids) + len(completion_ids) - 1, moe_layers, k]
    # expert ids (numpy) of every position but the last; None: not recorded.
    routing: Any = None


@dataclass
class Sample:
    """One trajectory: a prompt, the completion the rollout sampled, its logprobs and its reward.

    A multi-turn trajectory's completion interleaves sampled tokens (loss mask 1) with tool output
    and template tokens (0); when the scaffold edited its history it has later segments too.
    """

    trajectory_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    generation_logprobs: list[float]  # one per completion token, from the generating policy
    reward: float
    valid: bool  # False: an infrastructure failure, no learning signal
    weight_version: int = 0  # the policy version that generated it (the oldest, over turns)
    loss_mask: list[int] | None = None  # of the completion tokens; None: every one was sampled
    later_segments: list[Segment] = field(default_factory=list)
    routing: Any = None  # the first segment's routing (Segment.routing)

    def segments(self) -> list[Segment]:
        """The first segment (the fields above), then the later ones."""
        first = Segment(self.prompt_ids, self.completion_ids, self.generation_logprobs, self.loss_mask, self.routing)
        return [first, *self.later_segments]


@dataclass
class TrainingGroup:
    """Samples of one prompt: their advantages are computed against each other."""

    group_id: str
    samples: list[Sample] = field(default_factory=list)


def demonstration_rows(tokenizer: Any, demonstrations: Sequence[tuple[str, str]]) -> list[Row]:
    """(prompt text, completion text) pairs → token rows; each completion ends with end-of-sequence."""
    rows = []
    for prompt, completion in demonstrations:
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((prompt_ids, completion_ids))
    return rows


def staleness_metrics(groups: Sequence[TrainingGroup], trainer_version: int) -> dict[str, float]:
    """Histogram of the trained samples' age (trainer version − generating version), with mean and max."""
    ages = [trainer_version - s.weight_version for g in groups for s in g.samples]
    metrics = {f"staleness_{age}": float(ages.count(age)) for age in sorted(set(ages))}
    metrics["staleness_mean"] = sum(ages) / max(len(ages), 1)
    metrics["staleness_max"] = float(max(ages, default=0))
    return metrics
