"""Token-faithful session recorder: every turn's exact prompt ids, sampled ids, logprobs and weight version.

    request messages ──Session.plan(renderer)──> Plan(prompt ids) ──Generate──> Session.record(plan, completions)

A session is a list of segments; a segment is a tree of turns whose token ids
chain. A new turn's prompt extends a recorded turn of the segment (its anchor:
the turn whose messages are the longest prefix of the request's history), in one
of three ways, byte for byte, and earlier model output is never re-tokenized:
- `reply`: the history goes on after one of the anchor's replies: the anchor's
  prompt + that reply's sampled ids, then the template's closing of the
  assistant turn and the tokenized rendering of the new messages only;
- `context`: the scaffold dropped the anchor's reply (its next message is not an
  assistant one): the anchor's prompt up to its generation prompt, then the new
  messages (the dropped reply is an invalid action);
- `retry`: the same history again: the anchor's prompt ids exactly (less what the
  endpoint wrote after its generation prompt: an empty thinking block, `prefill`).
Which of these tokens are trained (the kept path) is kept_path.py's rule.

Guarantees:
- A request extends the segment only when the tools are the same, its history
  starts with a recorded turn's history (compared as role, content and tool calls
  (name, arguments); tool-call ids and whitespace-free JSON formatting do not
  matter), a reply it sends back is one the anchor sampled, and the template
  renders the recorded history as a text prefix of the new one and the reply's
  calls and closing the same whatever follows them (Renderer.continuation: the
  reply's header may differ, as Qwen3's empty think block of the last turn). History is
  matched and rendered modulo reasoning: a reply sent back with or without its
  reasoning (`reasoning_content`, thinking blocks, reasoning items) is that reply,
  and the recorded ids, think tokens included, stay the prompt's prefix; only a
  fresh render shows the template the reasoning the client sent. Otherwise
  (an edited or truncated earlier message, a reply sent back changed, other tools)
  the conversation is rendered afresh as a new segment and the reason is counted
  (`history_changed`, `template`), so tokens of two histories are never mixed.
- The trajectory is the contract's TrajectoryDocument (dockyard/agents/contract.py),
  built by kept_path.py: a segment's ids are its kept path, loss mask 1 exactly on
  the sampled tokens the scaffold built on.
- The store holds at most `max_sessions`; sessions idle longer than
  `idle_seconds` are dropped first; a new session beyond the bound is refused
  (SessionLimit). A session takes at most `max_turns` turns (SessionLimit). A session that is not
  held is created only when the caller may open one (`open(create=True)`: the service token's
  calls); otherwise it is UnknownSession, so a deleted or idle-dropped session's key revives nothing.
- Routing (a mixture-of-experts job that records it, docs/moe-routing.md): each turn keeps the expert
  ids of the positions it may be the first on its segment's kept path to run: the prompt from where
  its parent's kept row ends (`routing_from`: 0 at a segment's start, the parent's last sampled token
  after a reply, the parent's own start after a retry or a dropped reply) and each completion's
  sampled tokens but the last; so a turn holds the rows of its new positions, not its whole prompt.
- A session's sampling law is fixed when it opens: a greedy session (opened greedy by the service
  token, for validation) decodes every turn greedily; any other samples under the job's law. Nothing
  a later request sends changes it.

Why over 400 lines: planning a turn (the three ways it extends a recorded turn) and recording it share
the Plan and Turn shapes, whose fields each side reads; the store is the sessions' lifetime, a page.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dockyard.agents.contract import RoutingShape as ContractShape
from dockyard.agents.contract import SessionStatus, TrajectoryDocument, TrialStaging
from dockyard.experience.routing_layout import RoutingShape
from services.endpoint import kept_path
from services.endpoint.reasoning import without_reasoning
from services.endpoint.rendering import Message, Renderer, bridge


class SessionLimit(Exception):
    """Too many sessions, or too many turns in one."""


class UnknownSession(Exception):
    """A session key's session is not open (never opened, ended, or dropped after idling)."""


class SessionEnded(Exception):
    """The session was ended (its replica died and no other could go on with it); it takes no more turns."""


def message_key(message: Message) -> tuple:
    """What makes two messages the same turn of history (its reasoning does not: clients drop it or keep it)."""
    calls = tuple(
        (call["function"]["name"], json.dumps(call["function"]["arguments"], sort_keys=True))
        for call in message.get("tool_calls") or ()
    )
    return (message["role"], message.get("content") or "", calls)


def history_digests(messages: list[Message]) -> list[bytes]:
    """digests[k]: a digest of messages[:k] by message_key, so a turn's history is found in O(1) per turn."""
    digest = hashlib.blake2b(digest_size=16).digest()
    out = [digest]
    for message in messages:
        key = json.dumps(message_key(message)).encode()
        digest = hashlib.blake2b(digest + key, digest_size=16).digest()
        out.append(digest)
    return out


@dataclass
class Sampled:
    token_ids: list[int]
    logprobs: list[float]
    text: str  # the sampled ids decoded with special tokens (what the template closing is matched against)
    finish_reason: str
    # The assistant message as returned to the client (content, parsed tool calls, reasoning).
    message: Message
    # A malformed action: a tool call that did not parse, or an unclosed thinking block.
    malformed: bool = False
    # Positions in token_ids the endpoint wrote, not the policy (a thinking budget's closing tag): context.
    forced: list[int] = field(default_factory=list)
    # Per token, the weight version that sampled it (-1 at forced ones); empty: the turn's weight_version.
    versions: list[int] = field(default_factory=list)
    # Routing: the expert ids of token_ids' positions but the last (packed, the session's routing_shape),
    # and this completion's own prompt rows where its prompt was routed otherwise (from the turn's
    # routing_from once recorded; b"": the turn's). Both b"" without routing.
    routing: bytes = b""
    prompt_routing: bytes = b""


@dataclass
class Turn:
    prompt_ids: list[int]
    # prompt_ids[tail_from:len - prefill] are the ids of `tail`, the text this turn rendered and tokenized itself.
    tail_from: int
    tail: str
    completions: list[Sampled]
    weight_version: int
    weight_versions: list[int]
    # The last `prefill` prompt ids are the endpoint's, after the generation prompt (thinking turned off).
    prefill: int = 0
    # The request's history: its length and digest (history_digests), to find this turn as an anchor.
    history: int = 0
    digest: bytes = b""
    # The turn of the segment this one's prompt extends (-1: none), how ("start", "reply", "context",
    # "retry"), and for "reply" which of its completions.
    parent: int = -1
    extends: str = "start"
    parent_choice: int = 0
    # The expert ids of prompt positions routing_from.. (packed; b"" without routing): see the module docstring.
    routing_from: int = 0
    prompt_routing: bytes = b""


@dataclass
class Segment:
    reason: str
    tools: list[dict] | None
    messages: list[Message] = field(default_factory=list)  # the last call's
    turns: list[Turn] = field(default_factory=list)


@dataclass
class Plan:
    prompt_ids: list[int]
    prompt_text_tail: str
    messages: list[Message]
    tools: list[dict] | None
    # None: the turn extends the last segment's turn `parent` (how: `extends`); else a new segment with this reason.
    new_segment: str | None
    chosen: int = 0  # for extends == "reply": the parent's completion the history went on with
    tail_from: int = 0
    parent: int = -1
    extends: str = "start"
    digest: bytes = b""
    prefill: int = 0  # the last `prefill` prompt ids follow the generation prompt (Turn.prefill)

    def prefilled(self, ids: list[int]) -> None:
        """Write `ids` after the generation prompt, as context (an empty thinking block: thinking off)."""
        self.prompt_ids = [*self.prompt_ids, *ids]
        self.prefill = len(ids)


class Session:
    def __init__(self, session_id: str, max_turns: int, now: float, greedy: bool = False) -> None:
        self.id = session_id
        self.max_turns = max_turns
        # Fixed when the session opens (a validation trial's, by the service token): every turn is greedy.
        self.greedy = greedy
        self.segments: list[Segment] = []
        self.splits: Counter[str] = Counter()
        self.turns = 0
        self.routing_shape: RoutingShape | None = None  # set by the first turn that returns routing
        self.last_used = now
        self.replica: str | None = None
        self.ended: str | None = None
        # Where its trial's tokens are staged (services/endpoint/staging.py): set only by the service token's
        # POST /v1/sessions, never by a call of the session.
        self.staging: TrialStaging | None = None
        self.lock = asyncio.Lock()

    def _check(self) -> None:
        if self.ended:
            raise SessionEnded(self.ended)
        if self.turns >= self.max_turns:
            raise SessionLimit(f"session {self.id!r} has taken its {self.max_turns} turns")

    def plan(self, renderer: Renderer, messages: list[Message], tools: list[dict] | None) -> Plan:
        """The prompt ids of the next turn: recorded ids plus the new messages, or a fresh render."""
        self._check()
        digests = history_digests(messages)
        reason = "start"
        if self.segments and self.segments[-1].turns:
            extended = self._extend(renderer, self.segments[-1], messages, tools, digests)
            if isinstance(extended, Plan):
                return extended
            reason = extended
        text = renderer.render(messages, tools, generation_prompt=True)
        return Plan(renderer.encode(text), text, messages, tools, new_segment=reason, digest=digests[-1])

    def plan_fresh(self, renderer: Renderer, messages: list[Message], tools: list[dict] | None, reason: str) -> Plan:
        """A new segment rendered afresh (a turn with images: its prompt ids come from the rollout's reply)."""
        self._check()
        text = renderer.render(messages, tools, generation_prompt=True)
        digest = history_digests(messages)[-1]
        return Plan(renderer.encode(text), text, messages, tools, new_segment=reason, digest=digest)

    def _extend(
        self, renderer: Renderer, segment: Segment, messages: list[Message], tools, digests: list[bytes]
    ) -> Plan | str:
        """A plan that extends a recorded turn of `segment`, or why the history cannot (a new segment)."""
        if tools != segment.tools:
            return "history_changed"
        found = [
            (turn.history, i)
            for i, turn in enumerate(segment.turns)
            if turn.history <= len(messages) and digests[turn.history] == turn.digest
        ]
        if not found:
            return "history_changed"
        longest = max(found)[0]
        anchors = [i for n, i in reversed(found) if n == longest]  # the latest first
        digest = digests[-1]
        if len(messages) == longest:  # the same history again: a retry of the latest such turn
            i = anchors[0]
            turn = segment.turns[i]
            ids = turn.prompt_ids[: len(turn.prompt_ids) - turn.prefill]  # this call writes its own prefill
            return Plan(ids, turn.tail, messages, tools, None, 0, turn.tail_from, i, "retry", digest)
        after = messages[longest]
        if after["role"] != "assistant":  # the anchor's reply was dropped: go on from its context
            return self._from_context(renderer, segment, anchors[0], messages, tools, digest)
        reply = message_key(after)
        for i in anchors:
            turn = segment.turns[i]
            chosen = next((k for k, c in enumerate(turn.completions) if message_key(c.message) == reply), None)
            if chosen is not None and len(messages) > longest + 1:
                return self._after_reply(renderer, segment, i, chosen, messages, tools, digest)
        return "history_changed"  # a reply sent back changed (or with nothing after it)

    def _after_reply(
        self, renderer: Renderer, segment: Segment, i: int, chosen: int, messages, tools, digest: bytes
    ) -> Plan | str:
        turn = segment.turns[i]
        sampled = turn.completions[chosen]
        plain = without_reasoning(messages)  # the reply's recorded ids carry its reasoning, whatever was sent
        before = plain[: turn.history]
        closing = renderer.closing(before, tools)
        rest = renderer.continuation(before, without_reasoning([sampled.message])[0], plain[turn.history + 1 :], tools)
        if closing is None or rest is None:
            return "template"
        tail = bridge(sampled.text, closing) + rest
        prefix = [*turn.prompt_ids, *sampled.token_ids]
        ids = [*prefix, *renderer.encode(tail)]
        return Plan(ids, tail, messages, tools, None, chosen, len(prefix), i, "reply", digest)

    def _from_context(self, renderer: Renderer, segment: Segment, i: int, messages, tools, digest: bytes) -> Plan | str:
        turn = segment.turns[i]
        plain = without_reasoning(messages)
        before = plain[: turn.history]
        context = renderer.render(before, tools, generation_prompt=False)
        end = _context_end(renderer, turn, context, renderer.render(before, tools, generation_prompt=True))
        new = renderer.render(plain, tools, generation_prompt=True)
        if end is None or not new.startswith(context):
            return "template"
        tail = new[len(context) :]
        ids = [*turn.prompt_ids[:end], *renderer.encode(tail)]
        return Plan(ids, tail, messages, tools, None, 0, end, i, "context", digest)

    def record(
        self,
        plan: Plan,
        completions: list[Sampled],
        weight_version: int,
        weight_versions: list[int],
        prompt_routing: bytes = b"",
        routing_shape: RoutingShape | None = None,
    ) -> None:
        """Record a finished turn; with routing, `prompt_routing` holds every prompt position's row and each
        completion's (its prompt_routing too, where set) is kept from the turn's routing_from on."""
        if plan.new_segment is not None:
            if self.segments:
                self.splits[plan.new_segment] += 1
            self.segments.append(Segment(reason=plan.new_segment, tools=plan.tools))
        segment = self.segments[-1]
        start, per = 0, 0
        if routing_shape is not None and prompt_routing:
            self.routing_shape = self.routing_shape or routing_shape
            per = routing_shape.bytes_per_position
            if plan.new_segment is None and plan.extends == "reply":
                start = max(plan.tail_from - 1, 0)  # the parent's last sampled token: no forward of its turn ran it
            elif plan.new_segment is None:  # a retry or a dropped reply: the kept row before it is its parent's
                start = segment.turns[plan.parent].routing_from
            for c in completions:
                c.prompt_routing = c.prompt_routing[start * per :]
        else:
            for c in completions:
                c.routing = c.prompt_routing = b""
        segment.messages = list(plan.messages)
        segment.turns.append(
            Turn(
                plan.prompt_ids,
                plan.tail_from,
                plan.prompt_text_tail,
                completions,
                weight_version,
                list(weight_versions) or [weight_version],
                prefill=plan.prefill,
                history=len(plan.messages),
                digest=plan.digest,
                parent=plan.parent,
                extends=plan.extends,
                parent_choice=plan.chosen,
                routing_from=start,
                prompt_routing=prompt_routing[start * per :] if per else b"",
            )
        )
        self.turns += 1

    def document(self) -> TrajectoryDocument:
        """The session's recording as the contract's trajectory document (kept_path.py: what is trained)."""
        segments, abandoned, invalid = kept_path.segments(self.segments, self.routing_shape)
        return TrajectoryDocument(
            session_id=self.id,
            invalid_actions=invalid,
            status=SessionStatus.INFRASTRUCTURE_ERROR if self.ended else SessionStatus.OK,
            error=self.ended or "",
            turns=self.turns,
            splits=dict(self.splits),
            segments=segments,
            abandoned=abandoned,
            routing_shape=None if self.routing_shape is None else ContractShape(**vars(self.routing_shape)),
        )

    def trajectory(self) -> dict[str, Any]:
        """The trajectory document as served (GET /v1/sessions/{id}/trajectory)."""
        return self.document().to_json()


def _context_end(renderer: Renderer, turn: Turn, context: str, prompt: str) -> int | None:
    """Where `turn`'s generation prompt starts in its ids: its history's tokens end there. None when that
    is not a token boundary of what the turn tokenized (or its ids are not its tail's: an image turn)."""
    if not prompt.startswith(context) or not turn.tail.endswith(prompt[len(context) :]):
        return None
    own = turn.prompt_ids[turn.tail_from : len(turn.prompt_ids) - turn.prefill]
    body = renderer.encode(turn.tail[: len(turn.tail) - (len(prompt) - len(context))])
    if own[: len(body)] != body or renderer.encode(turn.tail) != own:
        return None
    return turn.tail_from + len(body)


class SessionStore:
    def __init__(
        self,
        max_sessions: int,
        idle_seconds: float,
        max_turns: int,
        clock: Callable[[], float] = time.monotonic,
        on_drop: Callable[[str], None] | None = None,
    ) -> None:
        self.on_drop = on_drop  # told of each session dropped for being idle
        self.max_sessions = max_sessions
        self.idle_seconds = idle_seconds
        self.max_turns = max_turns
        self._clock = clock
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def expire(self) -> int:
        cutoff = self._clock() - self.idle_seconds
        idle = [sid for sid, s in self._sessions.items() if s.last_used < cutoff and not s.lock.locked()]
        for sid in idle:
            del self._sessions[sid]
            if self.on_drop is not None:
                self.on_drop(sid)
        return len(idle)

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def open(self, session_id: str, create: bool = True, greedy: bool = False) -> Session:
        """The session, its idle clock reset; when new, created (SessionLimit when the store is full;
        `greedy`: all its turns decode greedily, for good), or with create=False refused
        (UnknownSession): a key's session is never made anew."""
        session = self._sessions.get(session_id)
        if session is None and not create:
            raise UnknownSession(
                f"session {session_id!r} is not open (ended, or dropped after idling): its key opens no new one"
            )
        if session is None:
            if len(self._sessions) >= self.max_sessions:
                self.expire()
            if len(self._sessions) >= self.max_sessions:
                raise SessionLimit(f"{self.max_sessions} sessions are open; end one (DELETE /v1/sessions/{{id}})")
            session = self._sessions[session_id] = Session(session_id, self.max_turns, self._clock(), greedy)
        session.last_used = self._clock()
        return session

    def delete(self, session_id: str) -> bool:
        return self._sessions.pop(session_id, None) is not None
