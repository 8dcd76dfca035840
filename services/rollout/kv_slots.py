"""A slotted, preallocated KV cache and the decode step over it (eager, or a captured CUDA graph).

    slot s (one batch row):   [ stale | prompt of row s | its new tokens | free ... ]
                                       ^ start[s]                        ^ column: every row writes here this step

Layout: per layer, keys and values of shape (slots, kv_heads, length, head_dim), allocated once
and grown (by doubling, content kept) only when a request needs more columns. All rows write
their next token at one shared `column`; a row joins with its prompt's KV copied right-aligned
under that column, so rows of different lengths share the batch like left-padded sequences. Each
row attends to columns [start, column] (a 4-D additive mask; position = column - start), so the
stale columns before its start are never read. Why this layout: the step has fixed shapes and
fixed tensor addresses (a CUDA graph replays it as is), a join costs only a copy of the new row's
prompt KV, and a leave costs nothing. The price: the columns left of each start are wasted; when
`column` reaches the end the scheduler shifts the batch left by the smallest start, and a prompt
longer than `column` shifts it right (`SlotCache.shift`, a copy outside the graph).

Guarantees: a decode step reads and writes only tensors allocated here (plus the model's
parameters, read in place), so the graph captured by `DecodeStep` stays valid across weight
loads that copy into the live parameters; an inactive slot attends only to its own column, so
no slot ever computes over uninitialised or non-finite values; models with sliding-window layers
get a second mask cut to their window.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache

MIN_LENGTH = 64


class SlotCache(Cache):
    """KV of `slots` rows × `length` columns per layer; the model writes each step at `column`."""

    def __init__(self, slots: int, device: torch.device) -> None:
        super().__init__(layers=[])
        self.slots, self.length, self.device = slots, 0, device
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.column = torch.zeros(1, dtype=torch.long, device=device)  # where this step's token goes
        self.rows = slots  # rows of the running forward pass (the first `rows` slots)

    def __len__(self) -> int:
        return len(self.keys)

    def allocate(self, like: DynamicCache, length: int) -> None:
        """(Re)allocate for `length` columns with the per-layer shapes of a prefill cache, keeping content."""
        old_k, old_v, old_len = self.keys, self.values, self.length
        self.keys, self.values = [], []
        for layer in like.layers:
            for store, src in ((self.keys, layer.keys), (self.values, layer.values)):
                _, heads, _, dim = src.shape
                store.append(torch.zeros(self.slots, heads, length, dim, dtype=src.dtype, device=self.device))
        for new, old in zip(self.keys + self.values, old_k + old_v, strict=False):
            new[:, :, :old_len].copy_(old)
        self.length = length

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer_idx][: self.rows], self.values[layer_idx][: self.rows]
        keys.index_copy_(2, self.column, key_states)
        values.index_copy_(2, self.column, value_states)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.length

    @property
    def is_compileable(self) -> bool:
        return True

    def load_prompt(self, slot: int, prefill: DynamicCache, column: int) -> None:
        """Copy a one-row prefill's KV into `slot`, right-aligned to end just before `column`."""
        for i, layer in enumerate(prefill.layers):
            n = layer.keys.shape[2]
            self.keys[i][slot, :, column - n : column].copy_(layer.keys[0])
            self.values[i][slot, :, column - n : column].copy_(layer.values[0])

    def shift(self, by: int) -> None:
        """Move every slot's columns left (by > 0) or right (by < 0); what moves out of range is dropped."""
        for t in self.keys + self.values:
            if by > 0:
                t[:, :, : self.length - by].copy_(t[:, :, by:].clone())
            else:
                t[:, :, -by:].copy_(t[:, :, : self.length + by].clone())


class DecodeStep:
    """One decode step for every slot: logits of each slot's next token, eager or replayed from a CUDA graph.

    Inputs are written into static buffers (`tokens`, `starts`, `cache.column`) before `run`; on
    CUDA with `graphs`, the step is captured once per cache allocation, in the calling thread (the
    scheduler's, which also replays it), and replays run over all slots. Eager runs cover only the
    first `rows` slots (the scheduler fills slots lowest first).
    """

    def __init__(self, model: Any, cache: SlotCache, pad_token_id: int, graphs: bool) -> None:
        self.model, self.cache = model, cache
        self.graphs = graphs and cache.device.type == "cuda"
        slots, device = cache.slots, cache.device
        self.tokens = torch.full((slots, 1), pad_token_id, dtype=torch.long, device=device)
        self.starts = torch.zeros(slots, dtype=torch.long, device=device)
        config = model.config
        types = set(getattr(config, "layer_types", None) or ["full_attention"])
        if not types <= {"full_attention", "sliding_attention"}:
            raise ValueError(f"the torch engine's batch serves full and sliding attention, not {sorted(types)}")
        self.window = getattr(config, "sliding_window", None) if "sliding_attention" in types else None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # the graph's output buffer
        self.captured_length = 0
        self.replays = 0

    def _forward(self, rows: int) -> torch.Tensor:
        cache = self.cache
        cache.rows = rows
        cols = torch.arange(cache.length, device=cache.device)[None, :]
        starts = self.starts[:rows, None]
        dtype = self.model.dtype
        visible = (cols >= starts) & (cols <= cache.column)
        lowest = torch.finfo(dtype).min  # additive: 0 where visible (eager and sdpa attention both add it)
        mask = (~visible)[:, None, None, :].to(dtype) * lowest
        masks: Any = mask
        if self.window is not None:
            near = visible & (cols > cache.column - self.window)
            masks = {"full_attention": mask, "sliding_attention": (~near)[:, None, None, :].to(dtype) * lowest}
        out = self.model(
            input_ids=self.tokens[:rows],
            attention_mask=masks,
            position_ids=cache.column - starts,
            past_key_values=cache,
            use_cache=True,
        )
        return out.logits[:, -1]

    def run(self, rows: int) -> torch.Tensor:
        """(rows, vocab) logits; a graph replay's rows are all slots (take the first `rows`)."""
        if not self.graphs:
            return self._forward(rows).float()
        if self.graph is None or self.captured_length != self.cache.length:
            self._capture()
        assert self.graph is not None and self.logits is not None
        self.graph.replay()
        self.replays += 1
        return self.logits[:rows].float()

    def drop_graph(self) -> None:
        self.graph, self.logits = None, None

    def _capture(self) -> None:
        # Warm-up and capture write one column of every slot; point them at a stale column and
        # restore the live one, so the captured kernels touch no KV a row reads.
        cache, live = self.cache, self.cache.column.clone()
        saved = [t[:, :, -1].clone() for t in cache.keys + cache.values]
        cache.column.fill_(cache.length - 1)
        self.drop_graph()
        side = torch.cuda.Stream(device=cache.device)
        side.wait_stream(torch.cuda.current_stream(cache.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(cache.slots)
        torch.cuda.current_stream(cache.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.logits = self._forward(cache.slots)
        self.graph, self.captured_length = graph, cache.length
        for t, s in zip(cache.keys + cache.values, saved, strict=True):
            t[:, :, -1].copy_(s)
        cache.column.copy_(live)


def length_for(tokens: int) -> int:
    """Columns to allocate for a row of `tokens` prompt + new tokens: a power of two, at least MIN_LENGTH."""
    length = MIN_LENGTH
    while length < tokens:
        length *= 2
    return length
