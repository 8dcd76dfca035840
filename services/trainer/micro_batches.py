"""A rank's share of the global batch, cut into micro-batches under a row and a token budget.

    Batch [B rows] ─sort by length (longest first, ties by position)─> rows dealt round-robin to ranks
        ─> this rank's rows ─┬─ padded: consecutive rows while ≤ max_rows rows and
                             │          rows × the first (longest) row's length ≤ max_tokens
                             └─ packed: first fit into rows of ≤ max_tokens tokens, position
                                        ids restarting per sequence, no attention mask, the
                                        sequences' bounds (Segments) for the varlen attention
        ─> [MicroBatch]

Guarantees: every row of the batch lands in exactly one micro-batch of exactly
one rank, and the split depends only on the batch, the budgets, the rank and
the world size (every rank computes the same deal). A row longer than the
token budget runs alone. In a packed row no position predicts the next
sequence's first token (it is masked out), and no padding is computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.trainer.batch import Batch
from services.trainer.packed_attention import Segments


@dataclass
class MicroBatch:
    """Rows for one forward/backward: padded rows, or packed rows with restarting position ids."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None  # None for packed rows: the position ids delimit the sequences
    position_ids: torch.Tensor | None
    token_mask: torch.Tensor
    generation_logprobs: torch.Tensor
    advantages: torch.Tensor  # per token
    num_sequences: int
    routing: torch.Tensor | None = None  # [rows, L, moe_layers, k] recorded expert ids (batch.py), or None
    rows: tuple[int, ...] = ()  # the batch rows it holds, in order (one per padded row)
    segments: Segments | None = None  # packed rows: where each sequence starts (packed_attention.py)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel()) if self.attention_mask is None else int(self.attention_mask.sum())

    @property
    def loss_tokens(self) -> float:
        """Tokens the loss counts (token_mask's sum), read before the tensors leave the host."""
        return float(self.token_mask.sum())

    @property
    def loss_sequences(self) -> float:
        """Sequences with at least one loss token."""
        return float((self.token_mask.sum(-1) > 0).sum())

    def to(self, device: str) -> MicroBatch:
        moved = {k: v.to(device) if isinstance(v, torch.Tensor | Segments) else v for k, v in vars(self).items()}
        return MicroBatch(**moved)


def plan(
    batch: Batch,
    advantages: torch.Tensor,
    *,
    rank: int,
    world: int,
    max_rows: int,
    max_tokens: int | None,
    packing: bool,
) -> list[MicroBatch]:
    """This rank's micro-batches; `advantages` holds one value per row of `batch`, or one per token
    ([rows, L-1], aligned with `batch.token_mask`)."""
    lengths = batch.attention_mask.sum(-1).tolist()
    # Longest first, ties by position: deterministic, and rows of a micro-batch have similar lengths.
    order = sorted(range(len(batch)), key=lambda i: (-lengths[i], i))
    mine = order[rank::world]
    if packing:
        return [_packed(batch, advantages, rows, lengths) for rows in _first_fit(mine, lengths, max_tokens)]
    bins: list[list[int]] = []
    for i in mine:
        if bins:
            rows = bins[-1]
            width = lengths[rows[0]]  # rows are sorted, the first is the longest
            fits = max_tokens is None or (len(rows) + 1) * width <= max_tokens
            if fits and len(rows) < max_rows:
                rows.append(i)
                continue
        bins.append([i])
    return [_padded(batch, advantages, rows, lengths) for rows in bins]


def _first_fit(rows: list[int], lengths: list[int], max_tokens: int | None) -> list[list[int]]:
    """Each row into the first bin it fits in, in the given (longest-first) order."""
    bins: list[list[int]] = []
    space: list[int] = []
    for i in rows:
        for b, free in enumerate(space):
            if lengths[i] <= free:
                bins[b].append(i)
                space[b] -= lengths[i]
                break
        else:
            bins.append([i])
            space.append(max(max_tokens or 0, lengths[i]) - lengths[i])
    return bins


def _padded(batch: Batch, advantages: torch.Tensor, rows: list[int], lengths: list[int]) -> MicroBatch:
    width = max(lengths[i] for i in rows)
    index = torch.tensor(rows)
    mask = batch.token_mask[index, : width - 1]
    return MicroBatch(
        batch.input_ids[index, :width],
        batch.attention_mask[index, :width],
        None,
        mask,
        batch.generation_logprobs[index, : width - 1],
        _row_advantages(advantages, index, width - 1).expand_as(mask).contiguous(),
        len(rows),
        None if batch.routing is None else batch.routing[index, :width],
        tuple(rows),
    )


def _row_advantages(advantages: torch.Tensor, index: torch.Tensor, width: int) -> torch.Tensor:
    """The rows' advantages: [rows, 1] of per-row values, or [rows, width] of per-token ones."""
    return advantages[index, :width] if advantages.dim() == 2 else advantages[index, None]


def _packed(batch: Batch, advantages: torch.Tensor, rows: list[int], lengths: list[int]) -> MicroBatch:
    ids, pos, mask, gen, adv, routing = [], [], [], [], [], []
    for i in rows:
        n = lengths[i]
        ids.append(batch.input_ids[i, :n])
        if batch.routing is not None:
            routing.append(batch.routing[i, :n])
        pos.append(torch.arange(n))
        # Position n-1 of a segment would predict the next segment's first token: masked out.
        mask.append(torch.cat([batch.token_mask[i, : n - 1], torch.zeros(1)]))
        gen.append(torch.cat([batch.generation_logprobs[i, : n - 1], torch.zeros(1)]))
        if advantages.dim() == 2:  # per token; the position that would predict the next segment gets 0
            adv.append(torch.cat([advantages[i, : n - 1], torch.zeros(1)]))
        else:
            adv.append(torch.full((n,), float(advantages[i])))
    return MicroBatch(
        torch.cat(ids)[None],
        None,
        torch.cat(pos)[None],
        torch.cat(mask)[None, :-1],
        torch.cat(gen)[None, :-1],
        torch.cat(adv)[None, :-1],
        len(rows),
        torch.cat(routing)[None] if routing else None,
        tuple(rows),
        Segments.of([lengths[i] for i in rows]),
    )
