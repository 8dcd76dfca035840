"""Continuous batching for the torch engine: one scheduler thread drives one decode batch.

    submit(request) ──queue──> scheduler thread, between two decode steps:
        drop cancelled requests' rows ──> admit: prefill each prompt once (queued prompts of one length
        in one pass), copy its KV into free slots, sample each row's first token
        ──> one decode step over every row (kv_slots.DecodeStep)
        ──> a row leaves at eos / stop string / max_new_tokens ──> a request resolves when its last row
        left ──> a streaming request that did not resolve hears of each row's new token
    with a prefix cache (services/rollout/prefix_cache.py): a leaving row's KV is kept by its token ids, and
        a prompt prefills only what follows the longest kept prefix it shares

Guarantees: requests join and leave the running batch between decode steps, each row with its own
decoding parameters, random stream (services/rollout/sampling.py), stop rules and weight versions; at
most `slots` rows decode at once, the rest of a request waits (first come, first served) and joins as
rows leave. A streaming request's `on_tokens` hears of every sampled token of its rows, step by step,
but those of the step that resolves it (its result carries them). Weights change only between decode
steps, through `gate`: with in-flight updates a waiting update lands after the current step (each row
records the version of every token); without them no new request joins while an update waits, and the
update lands once the batch has drained, so every completion of a result comes from one version. A
cancelled request's rows leave at the next step boundary, the others go on, and its future gets
GenerationCancelled. An error in a step fails the requests in the batch, not the scheduler. All model
work, and CUDA graph capture and replay, run in the scheduler thread. Sampled tokens feed the next step
on the device; the host reads each step's tokens once, and writes the rows' starts only when a row
joined or left or the batch moved. With a recorder (a mixture-of-experts policy), every forward's
expert ids are kept: a request's `prompt_routing` has one row per prompt position (a reused prefix's
rows from the prefix cache, the rest from its prefill; each row keeps the one it joined from), a row's
`routing` one per sampled token that a decode step ran (all but the last), each routed by the weights
of the step that ran it; a kept prefix cache entry holds the rows of its ids.

Why over 400 lines: admission, prefill, decode, finishing and the prefix cache's and routing's bookkeeping
all act on one batch's state (slots, columns, rows) between two steps; split apart they would share that
state through each other's fields.
"""

from __future__ import annotations

import contextlib
import heapq
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog
import torch
from transformers.cache_utils import DynamicCache

from dockyard.models.routing import RoutingRecorder, as_numpy, routers
from services.rollout.decoding import DecodingParams
from services.rollout.engine import GenerationCancelled, TopLogprobs
from services.rollout.kv_slots import DecodeStep, SlotCache, length_for
from services.rollout.prefix_cache import PrefixCache, PrefixStats
from services.rollout.sampling import StopStrings, sample
from services.rollout.weight_gate import WeightGate

log = structlog.get_logger()


@dataclass(eq=False)
class Row:
    """One completion being generated."""

    params: DecodingParams
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)  # per token, when params.top_logprobs > 0
    versions: set[int] = field(default_factory=set)
    routing: list[np.ndarray] = field(default_factory=list)  # per decoded position: [moe_layers, k] expert ids
    prompt_routing: np.ndarray | None = None  # its request's prompt routing as of the prefill it joined from
    finish_reason: str = ""
    start: int = 0  # cache column of its first prompt token
    index: int = 0  # its completion's place in the request's result


@dataclass(eq=False)
class Request:
    """One generate call: `rows` completions of `prompt_ids`; `future` gets `resolve(request)` or an exception."""

    prompt_ids: list[int]
    rows: list[Row]
    stops: StopStrings | None
    cancel: threading.Event
    resolve: Callable[[Request], Any]
    # Streaming: called in the scheduler thread with the rows that just got a token, before any leaves.
    on_tokens: Callable[[list[Row]], None] | None = None
    future: Future = field(default_factory=Future)
    admitted: int = 0
    live: int = 0  # rows in the batch
    steps: int = 0  # decode steps its rows took part in
    # (weight version, KV of one prefill pass, this prompt's row in it, its last logits (1, vocab))
    prefill: tuple[int, DynamicCache, int, torch.Tensor] | None = None
    prompt_routing: np.ndarray | None = None  # [prompt positions, moe_layers, k], with the prefill's version

    @property
    def cancelled(self) -> bool:
        return self.cancel.is_set() or self.future.cancelled()


@dataclass
class BatchStats:
    """What the scheduler did, for tests and logs."""

    steps: int = 0  # decode steps run
    largest_batch: int = 0  # most rows in one decode step
    rows_joined: int = 0
    rows_joined_running: int = 0  # rows that joined while other requests' rows were decoding
    # Per cancelled request (the latest 256): decode steps it took part in.
    cancelled_steps: deque[int] = field(default_factory=lambda: deque(maxlen=256))
    shifts: int = 0  # moves of the whole batch within the cache (a long prompt joined, or the end reached)


class DecodeBatch:
    """The decode batch of one engine; `submit` from any thread, the rest runs in its scheduler thread."""

    def __init__(
        self,
        model: Any,
        *,
        slots: int,
        device: torch.device,
        pad_token_id: int,
        eos_token_ids: list[int],
        graphs: bool,
        compile: bool = False,
        gate: WeightGate,
        weight_version: Callable[[], int],
        in_flight: bool,
        prefix_cache_tokens: int = 0,
    ) -> None:
        self.model, self.device, self.gate = model, device, gate
        self.prefix = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens else None
        # Written by the scheduler after each cycle, read by any thread (one reference: no lock).
        self.prefix_stats = PrefixStats(capacity_tokens=prefix_cache_tokens)
        self.eos = frozenset(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.weight_version, self.in_flight = weight_version, in_flight
        self.cache = SlotCache(slots, device)
        self.step = DecodeStep(model, self.cache, pad_token_id, graphs, compile)
        # A mixture-of-experts policy: each forward's expert ids (eager forwards only: MoE never runs graphs).
        self.recorder = RoutingRecorder(model) if routers(model) else None
        self.stats = BatchStats()
        self.column = 0  # the cache column the next decode step writes
        self._starts_dirty = False  # a row joined or the batch moved: the step's starts need writing
        self._free = list(range(slots))  # a heap: the lowest free slot first
        self._active: dict[int, tuple[Request, Row]] = {}  # slot -> its row
        self._queue: deque[Request] = deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._recapture = False

    def submit(self, request: Request) -> Future:
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._queue.append(request)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dockyard-decode", daemon=True)
                self._thread.start()
            self._cv.notify()
        return request.future

    def wake(self) -> None:
        """A request was cancelled: the scheduler handles it even when idle."""
        with self._cv:
            self._cv.notify()

    def drop_graph(self) -> None:
        """Parameters were replaced (not copied into): the next step captures a new graph."""
        self._recapture = True

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()

    # -- the scheduler thread ---------------------------------------------

    def _run(self) -> None:
        holding = False
        with torch.inference_mode():
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: self._closed or self._queue or self._active)
                    if self._closed:
                        break
                if not holding:
                    self.gate.enter()
                    holding = True
                try:
                    self._cycle()
                except Exception as exc:  # a failed step fails the requests in the batch, not the engine
                    log.exception("decode step failed", rows=len(self._active))
                    self._fail_active(exc)
                if self.in_flight or not self._active:
                    self.gate.exit()
                    holding = False
        if holding:
            self.gate.exit()
        self._fail_all(RuntimeError("the engine is closed"))

    def _cycle(self) -> None:
        if self._recapture:
            self.step.drop_graph()
            self._recapture = False
        self._drop_cancelled()
        self._admit()
        if self._active:
            self._decode()
        if self.prefix is not None:
            self.prefix_stats = self.prefix.stats(self._live_tokens())

    def _live_tokens(self) -> int:
        return sum(len(r.prompt_ids) + len(row.tokens) for r, row in self._active.values())

    def _drop_cancelled(self) -> None:
        with self._cv:
            gone = [r for r in self._queue if r.cancelled]
            for request in gone:
                self._queue.remove(request)
        gone += [r for r in {id(r): r for r, _ in self._active.values()}.values() if r.cancelled and r not in gone]
        for request in gone:
            for slot in [s for s, (r, _) in self._active.items() if r is request]:
                self._leave(slot)
            self.stats.cancelled_steps.append(request.steps)
            log.info("generation cancelled", decode_steps=request.steps)
            _settle(request.future, exc=GenerationCancelled(request.steps))

    def _admit(self) -> None:
        while self._free:
            with self._cv:
                if not self._queue:
                    return
                request = self._queue[0]
            if request.admitted == 0 and not self.in_flight and self.gate.waiting:
                return  # the update waiting gets the weights once the batch drains
            try:
                if request.prefill is None or request.prefill[0] != self.weight_version():
                    self._prefill_together(request)
                self._admit_rows(request)
            except Exception as exc:  # e.g. a prompt the model cannot take: this request fails alone
                log.exception("admitting a request failed")
                request.admitted = len(request.rows)
                for slot in [s for s, (r, _) in self._active.items() if r is request]:
                    self._leave(slot)
                _settle(request.future, exc=exc)
            if request.admitted == len(request.rows):
                with self._cv:
                    self._queue.popleft()

    def _prefill(self, requests: list[Request]) -> None:
        """One forward pass over the prompts of `requests`, all of one length (no padding)."""
        version = self.weight_version()
        past, reused = DynamicCache(), 0
        reused_routing = None
        if self.prefix is not None and len(requests) == 1:
            past, reused, reused_routing = self.prefix.past_for(requests[0].prompt_ids, version)
        ids = torch.tensor([r.prompt_ids[reused:] for r in requests], dtype=torch.long, device=self.device)
        with self._recording() as layers:
            out = self.model(input_ids=ids, past_key_values=past, use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1].float()
        routing = self._routed(layers)
        for i, request in enumerate(requests):
            request.prefill = (version, out.past_key_values, i, logits[i : i + 1])
            if routing is not None:
                rows = routing.reshape(len(requests), ids.shape[1], *routing.shape[1:])[i]
                request.prompt_routing = rows if reused_routing is None else np.concatenate([reused_routing, rows])

    def _prefill_together(self, first: Request) -> None:
        """Prefill `first` with the requests queued right behind it whose prompts have its length and
        whose rows fit in the free slots too, in one forward pass; if that pass fails, each request
        is prefilled alone (so a prompt the model cannot take fails its own request only). With the
        prefix cache on, each prompt is prefilled alone, after the prefix it shares with a kept row."""
        if self.prefix is not None:
            return
        group, rows = [], 0
        with self._cv:
            for request in self._queue:
                rows += len(request.rows) - request.admitted
                if len(request.prompt_ids) != len(first.prompt_ids) or request.cancelled or rows > len(self._free):
                    break
                group.append(request)
        if len(group) > 1:
            try:
                self._prefill(group)
            except Exception:
                log.warning("prefilling queued requests together failed: each is prefilled alone", exc_info=True)

    def _admit_rows(self, request: Request) -> None:
        version = self.weight_version()
        if request.prefill is None or request.prefill[0] != version:
            self._prefill([request])
        assert request.prefill is not None
        _, kv, index, logits = request.prefill
        prompt_len = len(request.prompt_ids)
        need = prompt_len + max(r.params.max_new_tokens for r in request.rows)
        if need > self.cache.length:
            self.cache.allocate(kv, length_for(need))
        if self.column < prompt_len:  # the prompt must fit left of the column: shift the batch right
            if self._active:
                self._shift(self.column - prompt_len)
            else:
                self.column = prompt_len
        running = bool(self._active)
        if self.prefix is not None:  # the joining rows' prompts need room beside the live rows
            self.prefix.make_room(self._live_tokens(), prompt_len * min(len(self._free), len(request.rows)))
        joined: list[tuple[int, Row]] = []
        while request.admitted < len(request.rows) and self._free:
            row = request.rows[request.admitted]
            request.admitted += 1
            row.start = self.column - prompt_len
            row.prompt_routing = request.prompt_routing
            joined.append((heapq.heappop(self._free), row))
        self.cache.load_prompt([slot for slot, _ in joined], kv, self.column, index)
        params = [r.params for _, r in joined]
        drawn = sample(logits.expand(len(joined), -1), params, [r.generator for _, r in joined])
        self._feed([slot for slot, _ in joined], drawn.tokens)
        self._starts_dirty = True
        tokens, logprobs, tops = drawn.tokens.tolist(), drawn.logprobs.tolist(), drawn.top_lists(params)
        self.stats.rows_joined += len(joined)
        if running:
            self.stats.rows_joined_running += len(joined)
        for (slot, row), token, logprob, top in zip(joined, tokens, logprobs, tops, strict=True):
            self._active[slot] = (request, row)
            request.live += 1
            self._append(row, token, logprob, top, version)
        self._finish_rows([(s, request, r) for s, r in joined])
        self._report([(request, row) for _, row in joined])

    def _decode(self) -> None:
        if self.column == self.cache.length:  # full: drop the columns no row reads any more
            self._shift(min(row.start for _, row in self._active.values()))
        if self._starts_dirty:  # only joins, leaves and shifts change them; idle slots see only themselves
            slots = self.cache.slots
            starts, active = [0] * slots, [False] * slots
            for slot, (_, row) in self._active.items():
                starts[slot], active[slot] = row.start, True
            self.step.starts.copy_(torch.tensor(starts))
            self.step.active.copy_(torch.tensor(active))
            self._starts_dirty = False
        self.cache.column.fill_(self.column)
        order = sorted(self._active)
        with self._recording() as layers:
            logits = self.step.run(order[-1] + 1, self.column)
        routing = self._routed(layers)
        self.column += 1
        version = self.weight_version()
        rows = [self._active[s] for s in order]
        if order[-1] + 1 != len(order):  # gaps between the slots in use
            logits = logits[torch.tensor(order, device=logits.device)]
        params = [row.params for _, row in rows]
        drawn = sample(logits, params, [row.generator for _, row in rows])
        self._feed(order, drawn.tokens)
        new, logprobs, tops = drawn.tokens.tolist(), drawn.logprobs.tolist(), drawn.top_lists(params)
        self.stats.steps += 1
        self.stats.largest_batch = max(self.stats.largest_batch, len(order))
        for request in {id(r): r for r, _ in rows}.values():
            request.steps += 1
        for (_, row), token, logprob, top in zip(rows, new, logprobs, tops, strict=True):
            self._append(row, token, logprob, top, version)
        if routing is not None:  # the step ran each row's last token: its position's experts
            for slot, (_, row) in zip(order, rows, strict=True):
                row.routing.append(routing[slot])
        self._finish_rows([(s, r, row) for s, (r, row) in zip(order, rows, strict=True)])
        self._report(rows)

    def _recording(self) -> contextlib.AbstractContextManager[list[torch.Tensor] | None]:
        return self.recorder.recording() if self.recorder is not None else contextlib.nullcontext()

    def _routed(self, layers: list[torch.Tensor] | None) -> np.ndarray | None:
        """A forward's [tokens, moe_layers, k] expert ids on the host; None for a dense policy."""
        if self.recorder is None or layers is None:
            return None
        stacked = self.recorder.stacked(layers)
        assert stacked is not None and self.recorder.shape is not None
        return as_numpy(stacked, self.recorder.shape)

    def _feed(self, slots: list[int], tokens: torch.Tensor) -> None:
        """The next step's input tokens of `slots`, written on the device (no round trip through the host)."""
        if slots == list(range(slots[0], slots[0] + len(slots))):
            self.step.tokens[slots[0] : slots[0] + len(slots), 0].copy_(tokens)
        else:
            self.step.tokens[torch.tensor(slots, device=self.device), 0] = tokens

    def _report(self, rows: list[tuple[Request, Row]]) -> None:
        """Streaming requests hear of their rows' new tokens (one call per request per step), but those the
        step resolved: their results carry the tokens, with nothing ahead of them to hand on."""
        streamed: dict[int, tuple[Request, list[Row]]] = {}
        for request, row in rows:
            if request.on_tokens is not None and not request.future.done():
                streamed.setdefault(id(request), (request, []))[1].append(row)
        for request, got in streamed.values():
            request.on_tokens(got)  # type: ignore[misc]

    def _append(self, row: Row, token: int, logprob: float, top: TopLogprobs | None, version: int) -> None:
        row.tokens.append(token)
        row.logprobs.append(logprob)
        if top is not None:
            row.top_logprobs.append(top)
        row.versions.add(version)

    def _finish_rows(self, rows: list[tuple[int, Request, Row]]) -> None:
        """Rows that just got a token: eos, then stop strings, then length; finished rows leave."""
        stop_checks: dict[int, list[tuple[int, Request, Row]]] = {}
        for slot, request, row in rows:
            if not row.params.ignore_eos and row.tokens[-1] in self.eos:
                row.finish_reason = "eos"
            elif request.stops is not None:
                stop_checks.setdefault(id(request), []).append((slot, request, row))
        for group in stop_checks.values():
            hits = group[0][1].stops.hits([row.tokens for _, _, row in group])  # type: ignore[union-attr]
            for (_, _, row), hit in zip(group, hits, strict=True):
                row.finish_reason = "stop" if hit else ""
        for slot, request, row in rows:
            if not row.finish_reason and len(row.tokens) >= row.params.max_new_tokens:
                row.finish_reason = "length"
            if row.finish_reason:
                if self.prefix is not None:
                    self._keep(slot, request, row)
                self._leave(slot)
                if request.live == 0 and request.admitted == len(request.rows):
                    self._resolve(request)

    def _keep(self, slot: int, request: Request, row: Row) -> None:
        """Give a finished row's KV (prompt and sampled tokens but the last: columns [start, column)) to the
        prefix cache, unless any of it came from other weights than the current ones."""
        version = self.weight_version()
        assert self.prefix is not None and request.prefill is not None
        ids = [*request.prompt_ids, *row.tokens[:-1]]
        if row.versions != {version} or request.prefill[0] != version or self.column - row.start != len(ids):
            return
        live = self._live_tokens() - len(ids) - 1
        routing = None
        if row.prompt_routing is not None:
            routing = np.concatenate([row.prompt_routing, *(r[None] for r in row.routing)])
        self.prefix.keep_slot(self.cache, slot, row.start, ids, version, live, routing)

    def _leave(self, slot: int) -> None:
        request, _ = self._active.pop(slot)
        request.live -= 1
        heapq.heappush(self._free, slot)
        self._starts_dirty = True
        if not self._active:
            self.column = 0  # an empty batch starts over at the left edge

    def _shift(self, by: int) -> None:
        """Move the batch left (by > 0) or right (by < 0) in the cache."""
        self.cache.shift(by)
        self.stats.shifts += 1
        self._starts_dirty = True
        self.column -= by
        for _, row in self._active.values():
            row.start -= by

    def _resolve(self, request: Request) -> None:
        if self.prefix is not None:  # the caller may read the counters as soon as its result is in
            self.prefix_stats = self.prefix.stats(self._live_tokens())
        try:
            _settle(request.future, result=request.resolve(request))
        except Exception as exc:
            _settle(request.future, exc=exc)

    def _fail_active(self, exc: BaseException) -> None:
        failed = {id(r): r for r, _ in self._active.values()}
        for slot in list(self._active):
            self._leave(slot)
        with self._cv:
            for request in failed.values():
                if request in self._queue:  # partly admitted
                    self._queue.remove(request)
        self.step.drop_graph()  # the step may have stopped mid-capture
        for request in failed.values():
            _settle(request.future, exc=exc)

    def _fail_all(self, exc: BaseException) -> None:
        self._fail_active(exc)
        with self._cv:
            queued = list(self._queue)
            self._queue.clear()
        for request in queued:
            _settle(request.future, exc=exc)


def _settle(future: Future, result: Any = None, exc: BaseException | None = None) -> None:
    """Resolve `future` unless its caller cancelled it already."""
    with contextlib.suppress(InvalidStateError):
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
