"""A streamed reply's live text: token ids as the rollout samples them in, content a client may see now out.

    GenerateStream deltas ──LiveTurn.tokens──> per completion: IncrementalDecoder (ids -> text, an
        incomplete UTF-8 tail held) ──Holdback(markers)──> Text events, as they come
    the finished turn (Served: parsed exactly as a non-streamed reply) ──Holdback.finish──> the last Text
        of each completion (the rest of its content, the rest of its tokens), then Served

Guarantees: the text released for a completion is always a prefix of the content its finished reply
has (the content the non-streamed reply would have), so the stream's content, once `finish` added
the rest, equals it; `finish` raises StreamDiverged rather than send content that breaks this. What
the finished reply could still drop or move is held back: from the first full marker on, everything
(a marker opens a tool call, or is a stop string, which the reply cuts off); a tail that could be the
start of a marker; with call markers, whitespace at both ends (a format may strip it around calls),
so a reply that starts with whitespace shows nothing before the end. `markers` is any set of strings
(calls, stops, reasoning tags). A completion's Text events carry every token once, in order (their
`tokens` and `logprobs` concatenated are the completion's), so logprobs stream as content does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from services.endpoint.tool_parsers import call_markers

_INCOMPLETE = "\ufffd"  # what decoding shows for bytes of a character that has not fully arrived


class StreamDiverged(RuntimeError):
    """The text a stream released is not a prefix of the finished reply's content (a bug, never sent on)."""


class IncrementalDecoder:
    """Ids in, the new text out: decodes a short window of recent ids rather than the whole completion."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._window = 0  # where the decoded window starts: ids before it are released and settled
        self._released = 0  # ids whose text was released

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, ids: list[int]) -> str:
        """The text `ids` add; "" while it ends in an incomplete character (or the window decodes ambiguously)."""
        self.ids.extend(ids)
        before = self._decode(self.ids[self._window : self._released])
        after = self._decode(self.ids[self._window :])
        if after.endswith(_INCOMPLETE) or not after.startswith(before):
            return ""
        self._window, self._released = self._released, len(self.ids)
        return after[len(before) :]


class Holdback:
    """Text in, the part of it that no ending can take back out (`released` so far)."""

    def __init__(self, markers: tuple[str, ...] | None, strip: bool = False) -> None:
        self.markers = tuple(m for m in markers or () if m)
        self.strip = strip
        self.text = ""
        self.released = ""
        self.blocked = markers is None  # no text may show before the end

    def push(self, text: str) -> str:
        self.text += text
        if self.blocked:
            return ""
        if self.strip and self.text[:1].isspace():  # the reply may lose it, or keep it: not known before the end
            self.blocked = True
            return ""
        cut = len(self.text)
        start = max(0, len(self.released) - max((len(m) for m in self.markers), default=0))
        hits = [i for m in self.markers if (i := self.text.find(m, start)) >= 0]
        if hits:
            cut, self.blocked = min(hits), True
        else:
            cut -= self._partial_marker(self.text)
        if self.strip:
            cut = len(self.text[:cut].rstrip())
        delta = self.text[len(self.released) : cut]
        self.released += delta
        return delta

    def _partial_marker(self, text: str) -> int:
        """Length of the longest end of `text` that is a proper start of a marker."""
        for k in range(min(len(text), max((len(m) for m in self.markers), default=1) - 1), 0, -1):
            if any(m.startswith(text[-k:]) for m in self.markers):
                return k
        return 0

    def finish(self, content: str) -> str:
        """The rest of the finished reply's `content`; StreamDiverged if what was released does not begin it."""
        if not content.startswith(self.released):
            raise StreamDiverged(f"released {self.released!r}, but the reply's content is {content!r}")
        rest = content[len(self.released) :]
        self.released = content
        return rest


def held_markers(parser: str, tools: list[dict] | None, stops: list[str]) -> tuple[tuple[str, ...] | None, bool]:
    """What a reply holds back: the call markers of its format (with tools) and its stop strings; and whether
    whitespace at its ends is held too (a call format may strip it). None: nothing shows before the end."""
    calls = call_markers(parser) if tools else ()
    if calls is None:
        return None, False
    return (*calls, *stops), bool(calls)


@dataclass
class Text:
    """Content of completion `index` a client may see now, and the tokens received since its last Text."""

    index: int
    text: str
    tokens: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass
class LiveTurn:
    """What a turn tells its streamed reply while it runs: the reply's headers' law, then tokens as they come."""

    law: Any = None  # the turn's TurnSampling, set before anything generates
    prompt_tokens: int = 0
    renderer: Any = None  # the job's Renderer: decodes the tokens
    markers: tuple[str, ...] | None = ()  # what the reply holds back (held_markers)
    strip: bool = False
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # (index, ids, logprobs), then None: the end
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def start(self, law: Any, prompt_tokens: int, renderer: Any, parser: str, tools: list | None, stops: list) -> None:
        """The turn is about to generate: its law, prompt size, tokenizer, and its format's markers."""
        self.law, self.prompt_tokens, self.renderer = law, prompt_tokens, renderer
        self.markers, self.strip = held_markers(parser, tools, stops)

    def tokens(self, index: int, ids: list[int], logprobs: list[float]) -> None:
        self.queue.put_nowait((index, ids, logprobs))
        self.arrived.set()

    def run(self, turn: Any) -> asyncio.Task:
        """The turn (a take_turn coroutine given `live=self`) as a task whose end is queued after its tokens."""
        task = asyncio.ensure_future(turn)
        task.add_done_callback(lambda _: self.queue.put_nowait(None))
        return task

    async def first(self, task: asyncio.Task) -> None:
        """Wait for the first tokens or the turn's end; the turn's error is raised here, before any reply."""
        waiter = asyncio.ensure_future(self.arrived.wait())
        try:
            await asyncio.wait({waiter, task}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the caller went away while waiting: so does the turn
            task.cancel()
            raise
        finally:
            waiter.cancel()
        if task.done():
            task.result()

    async def events(self, task: asyncio.Task) -> AsyncIterator[Text | Any]:
        """Text events as tokens arrive, the last Text of each completion, then the turn's Served.

        Closing the iterator before the end cancels the turn (the generation stops; nothing is recorded)."""
        renderer, markers, strip = self.renderer, self.markers, self.strip
        decoders: dict[int, IncrementalDecoder] = {}
        holds: dict[int, Holdback] = {}
        pending: dict[int, tuple[list[str], list[float]]] = {}  # tokens not yet sent with a Text
        sent: dict[int, int] = {}  # tokens sent with a Text, per completion
        try:
            while (item := await self.queue.get()) is not None:
                index, ids, logprobs = item
                decoder = decoders.setdefault(index, IncrementalDecoder(renderer.tokenizer))
                hold = holds.setdefault(index, Holdback(markers, strip))
                tokens, lps = pending.setdefault(index, ([], []))
                tokens += renderer.decode_each(ids)
                lps += logprobs
                if text := hold.push(decoder.push(ids)):
                    yield Text(index, text, list(tokens), list(lps))
                    sent[index] = sent.get(index, 0) + len(tokens)
                    tokens.clear()
                    lps.clear()
            served = task.result()
            for index, choice in enumerate(served.choices):
                rest = holds.get(index, Holdback(markers, strip)).finish(choice.content)
                given = sent.get(index, 0)
                if rest or given < len(choice.tokens):
                    yield Text(index, rest, choice.tokens[given:], choice.logprobs[given:])
            yield served
        finally:
            if not task.done():  # the client went away: the turn is cancelled, its generation stops
                task.cancel()


TokenSink = Callable[[int, list[int], list[float]], None]
