"""The torch engine's prefix cache: the KV of finished rows, kept by token ids, reused by later prompts.

    a row finishes ──keep(ids = prompt + sampled[:-1], its slot's KV columns, weight version)──> entries (LRU)
    a prompt arrives ──lookup: the entry sharing its longest prefix (same weight version)──>
        DynamicCache of that prefix ──prefill only the suffix──> the prompt's KV, as a full prefill gives it

Capacity is counted in token positions (`capacity_tokens`): the KV of the rows decoding now
(`live` tokens) and of the entries kept share it. Before a request's rows join, the least
recently used entries are evicted until the new rows fit beside the live ones (an eviction:
counted); an entry whose ids are a prefix of a newer one is dropped as superseded (not counted:
nothing is lost). Entries are copies, apart from the slotted decode cache, so the decode batch's
layout and shifts never touch them.

Guarantees:
- reuse only within one weight version: an entry records the version its KV came from, a row
  whose tokens or prompt came from another version (in-flight updates) is not kept, and the
  first request after a version change drops every entry (`invalidated`, not an eviction);
- at least the prompt's last token is always prefilled, so the next token's logits come from
  the model as they would without the cache; the KV of position i depends only on tokens <= i,
  so a reused prefix equals a fresh prefill of it up to floating-point rounding;
- an entry of a mixture-of-experts policy keeps the routing of its positions beside their KV
  (one row per id, as they were routed when first computed), and a reused prefix hands back its rows;
- `stats()` reports prefill tokens computed and saved, hits, evictions, entries and the
  pressure: (live + kept tokens) / capacity.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import DynamicCache


@dataclass(eq=False)
class Entry:
    ids: list[int]
    version: int
    keys: list[torch.Tensor]  # per layer (1, kv_heads, len(ids), head_dim)
    values: list[torch.Tensor]
    routing: Any = None  # [len(ids), moe_layers, k] expert ids (numpy) of a mixture-of-experts policy; else None


@dataclass
class PrefixStats:
    capacity_tokens: int = 0
    live_tokens: int = 0
    cached_tokens: int = 0
    cached_entries: int = 0
    prefill_tokens_computed: int = 0
    prefill_tokens_saved: int = 0
    lookups: int = 0
    hits: int = 0
    evictions: int = 0
    invalidated: int = 0

    @property
    def pressure(self) -> float:
        return (self.live_tokens + self.cached_tokens) / self.capacity_tokens if self.capacity_tokens else 0.0


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of a and b (slice comparisons run in C: O(log n) of them)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class PrefixCache:
    capacity_tokens: int
    entries: OrderedDict[int, Entry] = field(default_factory=OrderedDict)  # least recently used first
    counters: PrefixStats = field(default_factory=PrefixStats)
    version: int | None = None
    cached_tokens: int = 0  # positions held by the entries
    _next: int = 0

    def _drop(self, key: int) -> None:
        self.cached_tokens -= len(self.entries.pop(key).ids)

    def see_version(self, version: int) -> None:
        """Drop every entry when the weights changed since the entries were made."""
        if version != self.version:
            self.counters.invalidated += len(self.entries)
            self.entries.clear()
            self.cached_tokens = 0
            self.version = version

    def lookup(self, prompt: list[int], version: int) -> tuple[int, Entry | None]:
        """(tokens to reuse, entry): the longest shared prefix, leaving at least the last token to prefill."""
        self.see_version(version)
        self.counters.lookups += 1
        best, found = 0, None
        for key, entry in self.entries.items():
            n = common_prefix(entry.ids, prompt)
            if n > best:
                best, found = n, key
        best = min(best, len(prompt) - 1)
        if found is None or best < 1:
            return 0, None
        self.entries.move_to_end(found)
        self.counters.hits += 1
        return best, self.entries[found]

    def past_for(self, prompt: list[int], version: int) -> tuple[DynamicCache, int, Any]:
        """The KV to prefill `prompt` after (empty on a miss), how many of its tokens it covers and their
        routing (None on a miss or for a dense policy); counted."""
        reused, entry = self.lookup(prompt, version)
        past = self.prefix_kv(entry, reused) if entry is not None else DynamicCache()
        self.counted_prefill(len(prompt) - reused, reused)
        routing = entry.routing[:reused] if entry is not None and entry.routing is not None else None
        return past, reused, routing

    def keep_slot(
        self, cache: Any, slot: int, start: int, ids: list[int], version: int, live: int, routing: Any = None
    ) -> None:
        """Keep the KV of `ids`, in columns [start, start + len(ids)) of `slot` of a SlotCache (copied),
        with their routing (one row per id) for a mixture-of-experts policy."""
        cut = slice(start, start + len(ids))
        keys = [k[slot : slot + 1, :, cut].clone() for k in cache.keys]
        values = [v[slot : slot + 1, :, cut].clone() for v in cache.values]
        self.see_version(version)
        self.keep(ids, version, keys, values, live, routing)

    def prefix_kv(self, entry: Entry, n: int) -> DynamicCache:
        """A fresh DynamicCache holding the first n positions of `entry` (copies: the entry stays intact)."""
        cache = DynamicCache()
        for layer, (k, v) in enumerate(zip(entry.keys, entry.values, strict=True)):
            cache.update(k[:, :, :n].clone(), v[:, :, :n].clone(), layer)
        return cache

    def counted_prefill(self, computed: int, saved: int) -> None:
        self.counters.prefill_tokens_computed += computed
        self.counters.prefill_tokens_saved += saved

    def make_room(self, live: int, need: int) -> None:
        """Evict least recently used entries until `need` more tokens fit beside `live` and the rest."""
        while self.entries and live + need + self.cached_tokens > self.capacity_tokens:
            self._drop(next(iter(self.entries)))
            self.counters.evictions += 1

    def keep(
        self,
        ids: list[int],
        version: int,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        live: int,
        routing: Any = None,
    ) -> None:
        """Keep a finished row's KV (ids[i]'s KV at position i); entries it extends are superseded."""
        if version != self.version or not ids or len(ids) + live > self.capacity_tokens:
            return
        for key in [k for k, e in self.entries.items() if len(e.ids) <= len(ids) and ids[: len(e.ids)] == e.ids]:
            self._drop(key)
        self.make_room(live, len(ids))
        self.entries[self._next] = Entry(list(ids), version, keys, values, routing)
        self.cached_tokens += len(ids)
        self._next += 1

    def stats(self, live: int) -> PrefixStats:
        s = self.counters
        s.capacity_tokens, s.live_tokens = self.capacity_tokens, live
        s.cached_tokens, s.cached_entries = self.cached_tokens, len(self.entries)
        return PrefixStats(**vars(s))
