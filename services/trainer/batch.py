"""Experience (TrainingGroups, or supervised rows) → padded training tensors.

    [TrainingGroup[Sample(segments of (prompt ids, completion ids, gen logprobs, loss mask), reward, valid)]]
                                                                               ─build_batch─┐
    [(prompt ids, completion ids)]  (generation logprobs 0, reward 0, valid)  ───build_row_batch─┤
        ──> input_ids [B, L], attention_mask [B, L],            (one row per segment)        <┘
            token_mask / generation_logprobs [B, L-1]  (aligned with next-token logits)
            rewards, valid, group_ids, sample_index [B], first_segment [B]

Guarantees: position t of the [B, L-1] tensors scores token t+1 of the
sequence, so `log_softmax(logits[:, :-1])` gathered at `input_ids[:, 1:]`
lines up with token_mask and generation_logprobs; token_mask is 1 exactly on
the completion tokens the policy sampled (loss mask 1; every completion token
of a single-turn sample), never on prompt, tool-output or template tokens.
An invalid sample without tokens (an agent trial that failed before its
first turn) gets no row: it would be masked out of everything anyway.
Every row of a sample carries the sample's reward, validity and group, and
`sample_index` names the sample (in order; `first_segment` marks its first
row), so statistics over trajectories count each once; a batch is built
only from groups dockyard.experience.trainable's `validate_groups` accepted
(`validate_rows` for supervised rows): the rule lives there, once.
A segment's recorded routing (a mixture-of-experts policy's, [positions - 1, moe_layers, k]) lands in
`routing` [B, L, moe_layers, k] at the positions its tokens sit at; every other place (the last token,
padding, segments without routing) holds NOT_RECORDED, which replay leaves to the trainer's own router;
`routing` is None when no segment of the batch has any.
`minibatch_rows` cuts a step's rows into minibatches of whole groups, in
order, each with at least `size` trajectories but the last (`size` divides
the step in a valid config: exact).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dockyard.experience.trainable import hollow
from dockyard.models.routing import NOT_RECORDED
from services.trainer.experience import Row, Segment, TrainingGroup


@dataclass
class Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    token_mask: torch.Tensor
    generation_logprobs: torch.Tensor
    rewards: torch.Tensor
    valid: torch.Tensor
    group_ids: torch.Tensor
    sample_index: torch.Tensor  # [B]: the sample (trajectory) each row is a segment of, counted from 0
    first_segment: torch.Tensor  # [B] bool: the row is its sample's first segment
    routing: torch.Tensor | None = None  # [B, L, moe_layers, k] recorded expert ids, NOT_RECORDED elsewhere

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def slice(self, start: int, stop: int) -> Batch:
        return Batch(**{name: None if v is None else v[start:stop] for name, v in vars(self).items()})


def build_batch(groups: Sequence[TrainingGroup], pad_token_id: int) -> Batch:
    """One row per segment of the samples of `groups`, in order; group_ids index the groups."""
    group_index = {g.group_id: i for i, g in enumerate(groups)}
    samples = [(g, s) for g in groups for s in g.samples if not hollow(s)]
    rows, rewards, valid, group_ids, sample_index, first = [], [], [], [], [], []
    for number, (g, s) in enumerate(samples):
        for k, segment in enumerate(s.segments()):
            rows.append(segment)
            rewards.append(s.reward)
            valid.append(s.valid)
            group_ids.append(group_index[g.group_id])
            sample_index.append(number)
            first.append(k == 0)
    if not rows:
        raise ValueError("no trajectories to train on")
    return _layout(
        rows,
        pad_token_id,
        rewards=torch.tensor(rewards, dtype=torch.float32),
        valid=torch.tensor(valid, dtype=torch.bool),
        group_ids=torch.tensor(group_ids, dtype=torch.long),
        sample_index=torch.tensor(sample_index, dtype=torch.long),
        first_segment=torch.tensor(first, dtype=torch.bool),
    )


def minibatch_rows(groups: Sequence[TrainingGroup], size: int) -> list[slice]:
    """Row ranges of `build_batch(groups)`, one per minibatch: whole groups, about `size` trajectories each.

    A minibatch closes once it holds `size` trajectories (a failed trial without tokens counts,
    although it has no row); a minibatch without rows is dropped.
    """
    bounds: list[slice] = []
    start = row = trajectories = 0
    for g in groups:
        for s in g.samples:
            trajectories += 1
            if not hollow(s):
                row += 1 + len(s.later_segments)
        if trajectories >= size:
            bounds.append(slice(start, row))
            start, trajectories = row, 0
    if trajectories:
        bounds.append(slice(start, row))
    return [b for b in bounds if b.stop > b.start]


def build_row_batch(rows: Sequence[Row], pad_token_id: int) -> Batch:
    """Supervised rows as one group of valid, zero-reward samples with zero generation logprobs."""
    if not rows:
        raise ValueError("no rows to train on")
    n = len(rows)
    return _layout(
        [Segment(list(prompt), list(completion), [0.0] * len(completion)) for prompt, completion in rows],
        pad_token_id,
        rewards=torch.zeros(n, dtype=torch.float32),
        valid=torch.ones(n, dtype=torch.bool),
        group_ids=torch.zeros(n, dtype=torch.long),
        sample_index=torch.arange(n, dtype=torch.long),
        first_segment=torch.ones(n, dtype=torch.bool),
    )


def _layout(rows: list[Segment], pad_token_id: int, **per_row: torch.Tensor) -> Batch:
    """Segments right-padded to the longest; `per_row` holds the [B] tensors of Batch."""
    length = max(len(r.prompt_ids) + len(r.completion_ids) for r in rows)
    n = len(rows)
    input_ids = torch.full((n, length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, length), dtype=torch.long)
    token_mask = torch.zeros((n, length - 1), dtype=torch.float32)
    gen_logprobs = torch.zeros((n, length - 1), dtype=torch.float32)
    for row, r in enumerate(rows):
        ids = [*r.prompt_ids, *r.completion_ids]
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        # completion token j sits at sequence position len(prompt) + j and is
        # predicted by the logits at the position before it.
        start, stop = len(r.prompt_ids) - 1, len(r.prompt_ids) - 1 + len(r.completion_ids)
        mask = [1.0] * len(r.completion_ids) if r.loss_mask is None else [float(m) for m in r.loss_mask]
        token_mask[row, start:stop] = torch.tensor(mask, dtype=torch.float32)
        # Context tokens carry no generation logprob: 0 there, and the mask keeps them out of every use.
        logprobs = torch.tensor(list(r.generation_logprobs), dtype=torch.float32)
        gen_logprobs[row, start:stop] = logprobs * token_mask[row, start:stop]
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        token_mask=token_mask,
        generation_logprobs=gen_logprobs,
        routing=_routing(rows, length),
        **per_row,
    )


def _routing(rows: list[Segment], length: int) -> torch.Tensor | None:
    """The rows' recorded routing laid out like input_ids; None when no row has any."""
    routed = [r.routing for r in rows if getattr(r, "routing", None) is not None]
    if not routed:
        return None
    wide = any(a.dtype.itemsize > 1 for a in routed)  # uint16 ids: int32 holds every one
    out = torch.full(
        (len(rows), length, *routed[0].shape[1:]), NOT_RECORDED, dtype=torch.int32 if wide else torch.int16
    )
    for row, r in enumerate(rows):
        if getattr(r, "routing", None) is not None and len(r.routing):
            out[row, : len(r.routing)] = torch.from_numpy(np.asarray(r.routing).astype(np.int32))
    return out
