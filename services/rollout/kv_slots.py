"""A slotted, preallocated KV cache and the decode step over it (eager, or captured CUDA graphs).

    slot s (one batch row):   [ stale | prompt of row s | its new tokens | free ... ]
                                       ^ start[s]                        ^ column: every row writes here this step
                              [<------------- span: the columns a step reads ------------->]

Layout: per layer, keys and values of shape (slots, kv_heads, length, head_dim), allocated once
and grown (by doubling, content kept) only when a request needs more columns. All rows write
their next token at one shared `column`; a row joins with its prompt's KV copied right-aligned
under that column, so rows of different lengths share the batch like left-padded sequences. Each
row attends to columns [start, column] (a 4-D additive mask; position = column - start), so the
stale columns before its start are never read. A step reads only the first `span` columns, the
smallest multiple of SPAN_STEP past `column` (capped at the length), so its cost follows the
live prefix, not the allocation. Why this layout: the step has fixed shapes and fixed tensor
addresses per span (a CUDA graph per span replays it as is), a join costs only a copy of the new
row's prompt KV, and a leave costs nothing. The price: the columns left of each start are wasted;
when `column` reaches the end the scheduler shifts the batch left by the smallest start, and a
prompt longer than `column` shifts it right (`SlotCache.shift`, a copy outside the graph).

Attention: a decode step's single query per row is grouped over its KV head (the query heads of
one KV head act as that head's queries), so grouped-query models attend without copying K/V per
query head (transformers' SDPA path repeats K/V whenever a mask is given). It runs through
torch's scaled_dot_product_attention, registered as a transformers attention function and
switched on only for the decode step's forward pass; prefills run on the model's own attention.

Guarantees: a decode step reads and writes only tensors allocated here (plus the model's
parameters, read in place), so the graphs captured by `DecodeStep` stay valid across weight
loads that copy into the live parameters; an inactive slot attends only to its own column, so
no slot ever computes over uninitialised or non-finite values; models with sliding-window layers
get a second mask cut to their window. The step's result does not depend on the span beyond
floating-point rounding: columns past `column` are masked out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import structlog
import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

MIN_LENGTH = 64
SPAN_STEP = 64  # spans are multiples of this: at most length / SPAN_STEP graphs per allocation
GROUPED_ATTENTION = "dockyard_grouped_decode"

log = structlog.get_logger()


def grouped_decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of one query token per row: query heads grouped over their KV head, K/V read once.

    Query head h uses KV head h // (heads / kv_heads), as transformers' repeat_kv pairs them.
    Anything but a single-query call goes to transformers' SDPA attention.
    """
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    if q_len != 1 or heads % kv_heads:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(batch, 1, heads, dim), None


AttentionInterface.register(GROUPED_ATTENTION, grouped_decode_attention)


@contextlib.contextmanager
def attention_implementation(config: Any, name: str | None) -> Iterator[None]:
    """The model's attention implementation set to `name` (None: unchanged) for the duration."""
    if name is None:
        yield
        return
    saved = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = saved


class SlotCache(Cache):
    """KV of `slots` rows × `length` columns per layer; the model writes each step at `column`."""

    def __init__(self, slots: int, device: torch.device) -> None:
        super().__init__(layers=[])
        self.slots, self.length, self.device = slots, 0, device
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.column = torch.zeros(1, dtype=torch.long, device=device)  # where this step's token goes
        self.rows = slots  # rows of the running forward pass (the first `rows` slots)
        self.span = 0  # columns the running forward pass attends over (the first `span`)

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
        span = self.span or self.length
        return keys[:, :, :span], values[:, :, :span]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.length

    @property
    def is_compileable(self) -> bool:
        return True

    def load_prompt(self, slots: list[int], prefill: DynamicCache, column: int, row: int = 0) -> None:
        """Copy row `row` of a prefill's KV into each of `slots`, right-aligned to end just before `column`."""
        index = torch.tensor(slots, device=self.device)
        for i, layer in enumerate(prefill.layers):
            n = layer.keys.shape[2]
            self.keys[i][index, :, column - n : column] = layer.keys[row]
            self.values[i][index, :, column - n : column] = layer.values[row]

    def shift(self, by: int) -> None:
        """Move every slot's columns left (by > 0) or right (by < 0); what moves out of range is dropped."""
        for t in self.keys + self.values:
            if by > 0:
                t[:, :, : self.length - by].copy_(t[:, :, by:].clone())
            else:
                t[:, :, -by:].copy_(t[:, :, : self.length + by].clone())


def span_for(column: int, length: int) -> int:
    """Columns a step writing `column` reads: the next multiple of SPAN_STEP past it, at most `length`."""
    return min(length, (column // SPAN_STEP + 1) * SPAN_STEP)


class DecodeStep:
    """One decode step for every slot: logits of each slot's next token, eager or replayed from a CUDA graph.

    Inputs live in static buffers written before `run`: `tokens`, `starts`, `active` (an inactive
    slot attends only to its own column) and `cache.column`. On CUDA with `graphs`, the step is
    captured once per (cache allocation, span), in the calling thread (the scheduler's, which
    also replays it); the graphs share one memory pool (they never run at once) and write one
    float32 logits buffer. With `compile` too, what is captured is the step compiled by
    torch.compile (inductor fuses the many small kernels a decode step is made of); the first
    capture compiles (tens of seconds for a large model), a second span recompiles once with the
    span symbolic, and a step that fails to compile is captured uncompiled. Replays run over all
    slots; eager runs cover only the first `rows` slots (the scheduler fills slots lowest first).
    """

    def __init__(self, model: Any, cache: SlotCache, pad_token_id: int, graphs: bool, compile: bool = False) -> None:
        self.model, self.cache = model, cache
        self.graphs = graphs and cache.device.type == "cuda"
        slots, device = cache.slots, cache.device
        self.tokens = torch.full((slots, 1), pad_token_id, dtype=torch.long, device=device)
        self.starts = torch.zeros(slots, dtype=torch.long, device=device)
        self.active = torch.zeros(slots, dtype=torch.bool, device=device)
        config = model.config
        types = set(getattr(config, "layer_types", None) or ["full_attention"])
        if not types <= {"full_attention", "sliding_attention"}:
            raise ValueError(f"the torch engine's batch serves full and sliding attention, not {sorted(types)}")
        self.window = getattr(config, "sliding_window", None) if "sliding_attention" in types else None
        self.dtype = model.dtype
        # Grouped decode attention where the stock one is plain SDPA or eager attention; a model
        # with logit soft-capping or attention sinks keeps its own.
        plain = config._attn_implementation in ("sdpa", "eager") and not getattr(config, "attn_logit_softcapping", None)
        sinks = any(hasattr(m, "sinks") for m in model.modules())
        self.attention = GROUPED_ATTENTION if plain and not sinks else None
        self._step = torch.compile(self._model_step) if compile and self.graphs else self._model_step
        self.compiled = self._step is not self._model_step
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}  # span -> its graph
        self._pool: Any = None
        self.logits: torch.Tensor | None = None  # the graphs' output buffer, (slots, vocab) float32
        self.captured_length = 0
        self.replays = 0

    def _forward(self, rows: int, span: int) -> torch.Tensor:
        self.cache.rows, self.cache.span = rows, span
        with attention_implementation(self.model.config, self.attention):
            return self._step(rows, span)

    def _model_step(self, rows: int, span: int) -> torch.Tensor:
        cache, dtype = self.cache, self.dtype
        cols = torch.arange(span, device=cache.device)[None, :]
        starts = torch.where(self.active[:rows], self.starts[:rows], cache.column)[:, None]
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
            logits_to_keep=1,
        )
        return out.logits[:, -1]

    def run(self, rows: int, column: int) -> torch.Tensor:
        """(rows, vocab) float32 logits of the step writing `column` (already in `cache.column`)."""
        span = span_for(column, self.cache.length)
        if not self.graphs:
            return self._forward(rows, span).float()
        if self.captured_length != self.cache.length:
            self.drop_graph()
        graph = self._graphs.get(span)
        if graph is None:
            graph = self._capture(span)
        graph.replay()
        self.replays += 1
        assert self.logits is not None
        return self.logits[:rows]

    def drop_graph(self) -> None:
        self._graphs.clear()
        self._pool = None

    def _warm_up(self, span: int) -> torch.Tensor:
        device = self.cache.device
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                out = self._forward(self.cache.slots, span)
        torch.cuda.current_stream(device).wait_stream(side)
        return out

    def _capture(self, span: int) -> torch.cuda.CUDAGraph:
        # Warm-up and capture write one column of every slot; point them at the last column and
        # restore it and the live one, so the captured kernels touch no KV a row reads.
        cache, live = self.cache, self.cache.column.clone()
        saved = [t[:, :, -1].clone() for t in cache.keys + cache.values]
        cache.column.fill_(cache.length - 1)
        try:
            out = self._warm_up(span)
        except Exception:
            if not self.compiled:
                raise
            log.warning("compiling the decode step failed: it runs uncompiled", exc_info=True)
            self._step, self.compiled = self._model_step, False
            out = self._warm_up(span)
        if self.logits is None or self.logits.shape != out.shape:
            self.logits = torch.empty(out.shape, dtype=torch.float32, device=cache.device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self.logits.copy_(self._forward(cache.slots, span))
        self._graphs[span] = graph
        self.captured_length = cache.length
        for t, s in zip(cache.keys + cache.values, saved, strict=True):
            t[:, :, -1].copy_(s)
        cache.column.copy_(live)
        return graph


def length_for(tokens: int) -> int:
    """Columns to allocate for a row of `tokens` prompt + new tokens: a power of two, at least MIN_LENGTH."""
    length = MIN_LENGTH
    while length < tokens:
        length *= 2
    return length
