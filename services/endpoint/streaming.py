"""A streamed reply's live text: token ids as the rollout samples them in, content a client may see now out.

    GenerateStream deltas ──LiveTurn.tokens──> per completion: IncrementalDecoder (ids -> text, an
        incomplete UTF-8 tail held) ──Thinking (a reasoning job: the block's text as reasoning)──>
        ──Holdback(markers)──> Text events, as they come
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
`tokens` and `logprobs` concatenated are the completion's), so logprobs stream as content does. A
reasoning job's thinking block streams as `reasoning` under the same rule (what is released is always
a prefix of the finished reply's reasoning: its surrounding whitespace and a partial closing tag are
held). A request for top_logprobs streams nothing before the end (the alternatives come with the
finished completion), and neither does a thinking budget's reply (its closing tag may be written by
the endpoint between two generations).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from dockyard.agents.tool_formats import call_markers, visible_text
from services.endpoint.reasoning import CLOSE, OPEN

_INCOMPLETE = "\ufffd"  # what decoding shows for bytes of a character that has not fully arrived


class StreamDiverged(RuntimeError):
    """The text a stream released is not a prefix of the finished reply's content (a bug, never sent on)."""


class IncrementalDecoder:
    """Ids in, the new text out: decodes a short window of recent ids rather than the whole completion."""

    def __init__(self, tokenizer: Any, parser: str = "none") -> None:
        self.tokenizer, self.parser = tokenizer, parser
        self.ids: list[int] = []
        self._window = 0  # where the decoded window starts: ids before it are released and settled
        self._released = 0  # ids whose text was released

    def _decode(self, ids: list[int]) -> str:
        return visible_text(self.parser, self.tokenizer, ids)  # as the finished reply is decoded (turns.py)

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


def _without_partial(text: str, marker: str) -> str:
    """`text` less an end of it that is a proper start of `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return text[:-k]
    return text


class Thinking:
    """A reasoning job's completion text in, (reasoning, content text) out, as reasoning.split cuts it: a
    block opened by the prompt or by the text's start is reasoning until its closing tag; what follows it
    (leading whitespace dropped), or the whole text when no block opens, goes on as content."""

    def __init__(self, opened: bool) -> None:
        self.block = opened  # the completion has a thinking block (its reply a reasoning field, maybe empty)
        self.state = "reasoning" if opened else "start"
        self.text = ""  # the text of the current state not yet settled
        self.released = ""  # reasoning released so far

    def push(self, text: str) -> tuple[str, str]:
        self.text += text
        thought = ""
        if self.state == "start":
            body = self.text.lstrip()
            if OPEN.startswith(body):  # empty, or a part of the opening tag: not known yet
                return "", ""
            if not body.startswith(OPEN):
                self.state = "content"
            else:
                self.state, self.text, self.block = "reasoning", body[len(OPEN) :], True
        if self.state == "reasoning":
            before, closed, after = self.text.partition(CLOSE)
            if not closed:
                return self._release(_without_partial(before.lstrip(), CLOSE).rstrip()), ""
            thought = self._release(before.strip())
            self.state, self.text = "after", after
        if self.state == "after":  # the content starts past the whitespace after the closing tag
            self.text = self.text.lstrip()
            if not self.text:
                return thought, ""
            self.state = "content"
        rest, self.text = self.text, ""
        return thought, rest

    def _release(self, shown: str) -> str:
        delta = shown[len(self.released) :] if shown.startswith(self.released) else ""
        self.released += delta
        return delta

    def finish(self, reasoning: str | None) -> str:
        """The rest of the finished reply's reasoning; StreamDiverged if what was released does not begin it."""
        if not (reasoning or "").startswith(self.released):
            raise StreamDiverged(f"released reasoning {self.released!r}, but the reply's is {reasoning!r}")
        rest = (reasoning or "")[len(self.released) :]
        self.released = reasoning or ""
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
    reasoning: str = ""  # reasoning a client may see now (a reasoning job's thinking block)
    block: bool = False  # the completion has a thinking block: its reply carries reasoning (maybe "")
    top_logprobs: list[list[tuple[str, float]]] = field(default_factory=list)  # per token, when asked


@dataclass
class LiveTurn:
    """What a turn tells its streamed reply while it runs: the reply's headers' law, then tokens as they come."""

    law: Any = None  # the turn's TurnSampling, set before anything generates
    prompt_tokens: int = 0
    renderer: Any = None  # the job's Renderer: decodes the tokens
    parser: str = "none"  # the job's tool-call format: what decoding keeps of special tokens
    markers: tuple[str, ...] | None = ()  # what the reply holds back (held_markers)
    strip: bool = False
    thinking: bool | None = None  # a reasoning job: whether the prompt opened the block; None: no reasoning
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # (index, ids, logprobs), then None: the end
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def start(
        self,
        law: Any,
        prompt_tokens: int,
        renderer: Any,
        parser: str,
        chat: Any,
        thinking: bool | None,
        whole: bool = False,
    ) -> None:
        """The turn is about to generate: its law, prompt size, tokenizer, its format's markers, whether a
        reasoning job's prompt opened the block (None: not a reasoning job), and whether nothing may show
        before the end (`whole`: a thinking budget's reply, or top_logprobs asked)."""
        self.law, self.prompt_tokens, self.renderer, self.parser = law, prompt_tokens, renderer, parser
        self.markers, self.strip = held_markers(parser, chat.tools, chat.stop)
        if whole:
            self.markers = None
        self.thinking = thinking

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

    async def events(
        self, task: asyncio.Task, pause: Callable[[], Awaitable[None]] | None = None
    ) -> AsyncIterator[Text | Any]:
        """Text events as tokens arrive, the last Text of each completion, then the turn's Served.

        `pause` is awaited each time the events have caught up with a running generation, right before they
        wait for its next tokens: the reply sends what it holds then (sse.EventStream), so what became ready
        together goes out together and nothing waits for the generation's next step. Closing the iterator
        before the end cancels the turn (the generation stops; nothing is recorded)."""
        renderer, markers, strip = self.renderer, self.markers, self.strip
        decoders: dict[int, IncrementalDecoder] = {}
        holds: dict[int, Holdback] = {}
        thoughts: dict[int, Thinking] = {}
        pending: dict[int, tuple[list[str], list[float]]] = {}  # tokens not yet sent with a Text
        sent: dict[int, int] = {}  # tokens sent with a Text, per completion
        try:
            ended = False
            while not ended:
                # Tokens that arrived together go out together: one event per completion, not per delta.
                arrived: dict[int, tuple[list[int], list[float]]] = {}
                # A finished turn's end is queued next, with nothing to wait for: what is held goes with it.
                if pause is not None and self.queue.empty() and not task.done():
                    await pause()
                item = await self.queue.get()
                while item is not None:
                    ids_so_far, lps_so_far = arrived.setdefault(item[0], ([], []))
                    ids_so_far += item[1]
                    lps_so_far += item[2]
                    if self.queue.empty():
                        break
                    item = self.queue.get_nowait()
                ended = item is None  # the turn's end is queued after its last tokens
                for index, (ids, logprobs) in arrived.items():
                    decoder = decoders.setdefault(index, IncrementalDecoder(renderer.tokenizer, self.parser))
                    hold = holds.setdefault(index, Holdback(markers, strip))
                    tokens, lps = pending.setdefault(index, ([], []))
                    tokens += renderer.decode_each(ids)
                    lps += logprobs
                    thought, text, block = "", decoder.push(ids), False
                    if self.thinking is not None and markers is not None:
                        thinking = thoughts.setdefault(index, Thinking(self.thinking))
                        thought, text = thinking.push(text)
                        block = thinking.block
                    text = hold.push(text)
                    if thought or text:
                        yield Text(index, text, list(tokens), list(lps), thought, block)
                        sent[index] = sent.get(index, 0) + len(tokens)
                        tokens.clear()
                        lps.clear()
            served = task.result()
            for index, choice in enumerate(served.choices):
                thought = thoughts.get(index, Thinking(False)).finish(choice.reasoning)
                rest = holds.get(index, Holdback(markers, strip)).finish(choice.content)
                given = sent.get(index, 0)
                if rest or thought or given < len(choice.tokens) or choice.reasoning is not None:
                    tops = choice.top_logprobs[given:]
                    block = choice.reasoning is not None
                    yield Text(index, rest, choice.tokens[given:], choice.logprobs[given:], thought, block, tops)
            yield served
        finally:
            if not task.done():  # the client went away: the turn is cancelled, its generation stops
                task.cancel()


TokenSink = Callable[[int, list[int], list[float]], None]
