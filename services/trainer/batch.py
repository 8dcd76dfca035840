"""Experience (TrainingGroups, or supervised rows) → padded training tensors.

    [TrainingGroup[Sample(prompt ids, completion ids, gen logprobs, reward, valid)]]  ─build_batch─┐
    [(prompt ids, completion ids)]  (generation logprobs 0, reward 0, valid)  ───build_row_batch─┤
        ──> input_ids [B, L], attention_mask [B, L],                                            <┘
            token_mask / generation_logprobs [B, L-1]  (aligned with next-token logits)
            rewards, valid, group_ids [B]

Guarantees: position t of the [B, L-1] tensors scores token t+1 of the
sequence, so `log_softmax(logits[:, :-1])` gathered at `input_ids[:, 1:]`
lines up with token_mask and generation_logprobs; only completion tokens are
in token_mask. `validate_groups` rejects, before any tensor is built, every
batch the trainer cannot learn from (no trajectories, no completion tokens,
a logprob count that differs from the token count, a non-finite reward or
logprob, a token id outside the vocabulary, a sequence longer than the
model's positions), naming the group and trajectory; it raises BatchError.
`validate_rows` applies the same checks to supervised (prompt, completion) rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.trainer.experience import Row, TrainingGroup


class BatchError(ValueError):
    """A batch the trainer refuses; nothing is trained on it."""


def validate_groups(groups: Sequence[TrainingGroup], vocab_size: int, max_length: int | None) -> None:
    # The messages use the wire's field names: the caller put the trajectories under those.
    if not groups or not any(g.samples for g in groups):
        raise BatchError("empty batch: no trajectories to train on")
    completion_tokens = 0
    for g in groups:
        for i, s in enumerate(g.samples):
            where = f"group {g.group_id!r} trajectories[{i}] ({s.trajectory_id!r})"
            if not s.prompt_ids:
                raise BatchError(f"{where}: empty prompt_token_ids")
            if len(s.generation_logprobs) != len(s.completion_ids):
                raise BatchError(
                    f"{where}: {len(s.generation_logprobs)} completion_logprobs for "
                    f"{len(s.completion_ids)} completion_token_ids"
                )
            if not math.isfinite(s.reward):
                raise BatchError(f"{where}: reward is {s.reward}, not a finite number")
            if not all(math.isfinite(x) for x in s.generation_logprobs):
                raise BatchError(f"{where}: completion_logprobs hold a non-finite value")
            _check_ids(where, [*s.prompt_ids, *s.completion_ids], vocab_size, max_length)
            completion_tokens += len(s.completion_ids)
    if completion_tokens == 0:
        raise BatchError("empty batch: no trajectory has a completion token")


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


@dataclass
class Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    token_mask: torch.Tensor
    generation_logprobs: torch.Tensor
    rewards: torch.Tensor
    valid: torch.Tensor
    group_ids: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def slice(self, start: int, stop: int) -> Batch:
        return Batch(**{name: value[start:stop] for name, value in vars(self).items()})


def build_batch(groups: Sequence[TrainingGroup], pad_token_id: int) -> Batch:
    """The samples of `groups` in order; group_ids index the groups (samples sharing an id share one)."""
    samples = [(g, s) for g in groups for s in g.samples]
    if not samples:
        raise ValueError("no trajectories to train on")
    group_index = {g.group_id: i for i, g in enumerate(groups)}
    return _layout(
        [(s.prompt_ids, s.completion_ids, s.generation_logprobs) for _, s in samples],
        pad_token_id,
        rewards=torch.tensor([s.reward for _, s in samples], dtype=torch.float32),
        valid=torch.tensor([s.valid for _, s in samples], dtype=torch.bool),
        group_ids=torch.tensor([group_index[g.group_id] for g, _ in samples], dtype=torch.long),
    )


def build_row_batch(rows: Sequence[Row], pad_token_id: int) -> Batch:
    """Supervised rows as one group of valid, zero-reward samples with zero generation logprobs."""
    if not rows:
        raise ValueError("no rows to train on")
    n = len(rows)
    return _layout(
        [(prompt, completion, [0.0] * len(completion)) for prompt, completion in rows],
        pad_token_id,
        rewards=torch.zeros(n, dtype=torch.float32),
        valid=torch.ones(n, dtype=torch.bool),
        group_ids=torch.zeros(n, dtype=torch.long),
    )


def _layout(
    rows: list[tuple[Sequence[int], Sequence[int], Sequence[float]]],
    pad_token_id: int,
    rewards: torch.Tensor,
    valid: torch.Tensor,
    group_ids: torch.Tensor,
) -> Batch:
    """(prompt ids, completion ids, generation logprobs) rows, right-padded to the longest."""
    length = max(len(prompt) + len(completion) for prompt, completion, _ in rows)
    n = len(rows)
    input_ids = torch.full((n, length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, length), dtype=torch.long)
    token_mask = torch.zeros((n, length - 1), dtype=torch.float32)
    gen_logprobs = torch.zeros((n, length - 1), dtype=torch.float32)
    for row, (prompt, completion, logprobs) in enumerate(rows):
        ids = [*prompt, *completion]
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        # completion token j sits at sequence position len(prompt) + j and is
        # predicted by the logits at the position before it.
        start, stop = len(prompt) - 1, len(prompt) - 1 + len(completion)
        token_mask[row, start:stop] = 1.0
        gen_logprobs[row, start:stop] = torch.tensor(list(logprobs), dtype=torch.float32)
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        token_mask=token_mask,
        generation_logprobs=gen_logprobs,
        rewards=rewards,
        valid=valid,
        group_ids=group_ids,
    )
