"""The one rule of what a trainer step can learn from, checked once before any tensor is built.

    [group(group_id, [sample(trajectory_id, reward, valid, segments())])] ─validate_groups─> None | BatchError
                                                                        ─checked_groups──> CheckedGroups
    [(prompt ids, completion ids)] ─validate_rows─> None | BatchError
                                   ─checked_rows──> CheckedRows

Guarantees: `validate_groups` rejects every batch the trainer cannot learn
from (no trajectories, no sampled token, a logprob or loss-mask count that
differs from the token count, a mask value other than 0/1, a non-finite
reward or logprob, a token id outside the vocabulary, a segment longer than
the model's positions, recorded routing that is not one row per position but
the last), naming the group, trajectory and segment; it raises
BatchError. An invalid sample without tokens (`hollow`: an agent trial that
failed before its first turn) is left out of the checks: it gets no row.
`validate_rows` applies the same checks to supervised (prompt, completion)
rows. `checked_groups` (`checked_rows`) validates and returns the groups as
CheckedGroups (CheckedRows), a tuple that says so wherever it travels
(pickled to other ranks included), so a later step on the same path
(services/trainer/minibatches.py `prepare_step`, the policies' `sft_step`)
does not check them again.

The groups are duck-typed (services/trainer/experience.py holds the types):
the library never imports a service. The buffer's checks of a protobuf Group
(services/buffer/validation.py, dockyard/experience/checks.py) are the same
rules minus the vocabulary, on the wire's types, at the buffer's boundary.

Imports: the standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

# One supervised row: (prompt ids, completion ids).
Row = tuple[Sequence[int], Sequence[int]]


class BatchError(ValueError):
    """A batch the trainer refuses; nothing is trained on it."""


class SegmentLike(Protocol):
    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    generation_logprobs: Sequence[float]
    loss_mask: Sequence[int] | None


class SampleLike(Protocol):
    trajectory_id: str
    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    reward: float
    valid: bool
    later_segments: Sequence[SegmentLike]

    def segments(self) -> Sequence[SegmentLike]: ...


class GroupLike(Protocol):
    group_id: str
    samples: Sequence[SampleLike]


class CheckedGroups(tuple):
    """Groups that passed `validate_groups` (made only by `checked_groups`)."""


def checked_groups(groups: Sequence[GroupLike], vocab_size: int, max_length: int | None) -> CheckedGroups:
    """`groups` validated (BatchError if not), marked so that no later step checks them again."""
    validate_groups(groups, vocab_size, max_length)
    return CheckedGroups(groups)


class CheckedRows(tuple):
    """Supervised rows that passed `validate_rows` (made only by `checked_rows`)."""


def checked_rows(rows: Sequence[Row], vocab_size: int, max_length: int | None) -> CheckedRows:
    """`rows` validated (BatchError if not), marked so that no later step checks them again."""
    validate_rows(rows, vocab_size, max_length)
    return CheckedRows(rows)


def validate_groups(groups: Sequence[GroupLike], vocab_size: int, max_length: int | None) -> None:
    # The messages use the wire's field names: the caller put the trajectories under those.
    if not groups or not any(g.samples for g in groups):
        raise BatchError("empty batch: no trajectories to train on")
    sampled_tokens = 0
    for g in groups:
        for i, s in enumerate(g.samples):
            where = f"group {g.group_id!r} trajectories[{i}] ({s.trajectory_id!r})"
            if not math.isfinite(s.reward):
                raise BatchError(f"{where}: reward is {s.reward}, not a finite number")
            if hollow(s):
                continue  # a failed agent trial: no tokens, and no row in the batch
            for k, segment in enumerate(s.segments()):
                at = where if k == 0 else f"{where} later_segments[{k - 1}]"
                sampled_tokens += _check_segment(at, segment, vocab_size, max_length)
    if sampled_tokens == 0:
        raise BatchError("empty batch: no trajectory has a sampled completion token")


def hollow(sample: SampleLike) -> bool:
    """An invalid sample with no tokens at all (an agent trial that failed before any turn)."""
    return not sample.valid and not sample.prompt_ids and not sample.completion_ids and not sample.later_segments


def _check_segment(where: str, segment: SegmentLike, vocab_size: int, max_length: int | None) -> int:
    """Raise BatchError for a segment the trainer cannot use; else its number of sampled tokens."""
    if not segment.prompt_ids:
        raise BatchError(f"{where}: empty prompt_token_ids")
    count = len(segment.completion_ids)
    if len(segment.generation_logprobs) != count:
        got = len(segment.generation_logprobs)
        raise BatchError(f"{where}: {got} completion_logprobs for {count} completion_token_ids")
    mask = segment.loss_mask
    if mask is not None:
        if len(mask) != count:
            raise BatchError(f"{where}: {len(mask)} completion_loss_mask values for {count} completion_token_ids")
        if any(m not in (0, 1) for m in mask):
            raise BatchError(f"{where}: completion_loss_mask holds {next(m for m in mask if m not in (0, 1))}; 0 or 1")
    if not all(math.isfinite(x) for x in segment.generation_logprobs):
        raise BatchError(f"{where}: completion_logprobs hold a non-finite value")
    _check_ids(where, [*segment.prompt_ids, *segment.completion_ids], vocab_size, max_length)
    routing = getattr(segment, "routing", None)
    positions = len(segment.prompt_ids) + count - 1
    if routing is not None and len(routing) != positions:
        need = f"its tokens need {positions} (all but the last)"
        raise BatchError(f"{where}: routing of {len(routing)} positions; {need}")
    return count if mask is None else sum(mask)


def validate_rows(rows: Sequence[Row], vocab_size: int, max_length: int | None) -> None:
    """validate_groups for supervised (prompt ids, completion ids) rows, named demonstrations[i]."""
    if not rows:
        raise BatchError("empty batch: no demonstrations to train on")
    for i, (prompt, completion) in enumerate(rows):
        if not prompt:
            raise BatchError(f"demonstrations[{i}]: empty prompt_token_ids")
        _check_ids(f"demonstrations[{i}]", [*prompt, *completion], vocab_size, max_length)
    if not any(completion for _, completion in rows):
        raise BatchError("empty batch: no demonstration has a completion token")


def _check_ids(where: str, ids: list[int], vocab_size: int, max_length: int | None) -> None:
    bad = [x for x in ids if not 0 <= x < vocab_size]
    if bad:
        raise BatchError(f"{where}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if max_length is not None and len(ids) > max_length:
        raise BatchError(f"{where}: {len(ids)} tokens exceed the model's {max_length} positions")
