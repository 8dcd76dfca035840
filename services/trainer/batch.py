"""Experience (proto groups) → padded training tensors.

    Group[Trajectory(prompt ids, completion ids, gen logprobs, reward, valid)]
        ──> input_ids [B, L], attention_mask [B, L],
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

from dockyard.api.common.v1 import common_pb2


class BatchError(ValueError):
    """A batch the trainer refuses; nothing is trained on it."""


def validate_groups(groups: Sequence[common_pb2.Group], vocab_size: int, max_length: int | None) -> None:
    if not groups or not any(g.trajectories for g in groups):
        raise BatchError("empty batch: no trajectories to train on")
    completion_tokens = 0
    for g in groups:
        for i, t in enumerate(g.trajectories):
            where = f"group {g.group_id!r} trajectories[{i}] ({t.trajectory_id!r})"
            if not t.prompt_token_ids:
                raise BatchError(f"{where}: empty prompt_token_ids")
            if len(t.completion_logprobs) != len(t.completion_token_ids):
                raise BatchError(
                    f"{where}: {len(t.completion_logprobs)} completion_logprobs for "
                    f"{len(t.completion_token_ids)} completion_token_ids"
                )
            if not math.isfinite(t.reward):
                raise BatchError(f"{where}: reward is {t.reward}, not a finite number")
            if not all(math.isfinite(x) for x in t.completion_logprobs):
                raise BatchError(f"{where}: completion_logprobs hold a non-finite value")
            _check_ids(where, [*t.prompt_token_ids, *t.completion_token_ids], vocab_size, max_length)
            completion_tokens += len(t.completion_token_ids)
    if completion_tokens == 0:
        raise BatchError("empty batch: no trajectory has a completion token")


def validate_rows(rows: Sequence[tuple[Sequence[int], Sequence[int]]], vocab_size: int, max_length: int | None) -> None:
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


def build_batch(groups: Sequence[common_pb2.Group], pad_token_id: int) -> Batch:
    rows = [(g, t) for g in groups for t in g.trajectories]
    if not rows:
        raise ValueError("no trajectories to train on")
    length = max(len(t.prompt_token_ids) + len(t.completion_token_ids) for _, t in rows)
    n = len(rows)
    input_ids = torch.full((n, length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, length), dtype=torch.long)
    token_mask = torch.zeros((n, length - 1), dtype=torch.float32)
    gen_logprobs = torch.zeros((n, length - 1), dtype=torch.float32)
    group_index = {g.group_id: i for i, g in enumerate(groups)}
    for row, (_, traj) in enumerate(rows):
        prompt, completion = list(traj.prompt_token_ids), list(traj.completion_token_ids)
        ids = prompt + completion
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        # completion token j sits at sequence position len(prompt) + j and is
        # predicted by the logits at the position before it.
        start, stop = len(prompt) - 1, len(prompt) - 1 + len(completion)
        token_mask[row, start:stop] = 1.0
        gen_logprobs[row, start:stop] = torch.tensor(list(traj.completion_logprobs), dtype=torch.float32)
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        token_mask=token_mask,
        generation_logprobs=gen_logprobs,
        rewards=torch.tensor([t.reward for _, t in rows], dtype=torch.float32),
        valid=torch.tensor([t.valid for _, t in rows], dtype=torch.bool),
        group_ids=torch.tensor([group_index[g.group_id] for g, _ in rows], dtype=torch.long),
    )
