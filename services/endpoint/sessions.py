"""Token-faithful session recorder: every turn's exact prompt ids, sampled ids, logprobs and weight version.

    request messages ──Session.plan(renderer)──> Plan(prompt ids) ──Generate──> Session.record(plan, completions)

A session is a list of segments; a segment is a list of turns whose token ids
chain: turn k+1's prompt starts with turn k's prompt + its chosen sampled ids,
byte for byte, followed by the template's closing of that assistant turn and
the tokenized rendering of the new messages only. Earlier model output is never
re-tokenized.

Guarantees:
- A request continues the current segment only when its history equals what
  was recorded (the segment's messages plus one of the last turn's replies,
  compared as role, content and tool calls (name, arguments); tool-call ids and
  whitespace-free JSON formatting do not matter), the tools are the same, and
  the template renders the recorded conversation as a text prefix of the new
  one. Otherwise the conversation is rendered afresh as a new segment and the
  reason is counted (`history_changed`, `template`), so tokens of two histories
  are never mixed.
- The trajectory is the contract's TrajectoryDocument (dockyard/agents/contract.py).
  A segment lists its ids with loss mask 1 exactly on sampled tokens (0 on
  prompt, tool and closing tokens), the logprob of each sampled token (0.0
  elsewhere) and the weight version that sampled it (-1 elsewhere).
- The store holds at most `max_sessions`; sessions idle longer than
  `idle_seconds` are dropped first; a new session beyond the bound is refused
  (SessionLimit). A session takes at most `max_turns` turns (SessionLimit). A session that is not
  held is created only when the caller may open one (`open(create=True)`: the service token's
  calls); otherwise it is UnknownSession, so a deleted or idle-dropped session's key revives nothing.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dockyard.agents import contract
from dockyard.agents.contract import SessionStatus, TrajectoryDocument
from services.endpoint.rendering import Message, Renderer, bridge


class SessionLimit(Exception):
    """Too many sessions, or too many turns in one."""


class UnknownSession(Exception):
    """A session key's session is not open (never opened, ended, or dropped after idling)."""


class SessionEnded(Exception):
    """The session was ended (its replica died and no other could go on with it); it takes no more turns."""


def message_key(message: Message) -> tuple:
    """What makes two messages the same turn of history."""
    calls = tuple(
        (call["function"]["name"], json.dumps(call["function"]["arguments"], sort_keys=True))
        for call in message.get("tool_calls") or ()
    )
    return (message["role"], message.get("content") or "", calls)


@dataclass
class Sampled:
    token_ids: list[int]
    logprobs: list[float]
    text: str  # the sampled ids decoded with special tokens (what the template closing is matched against)
    finish_reason: str
    # The assistant message as returned to the client (content and parsed tool calls).
    message: Message
    # A malformed action: a tool call that did not parse, or an unclosed thinking block.
    malformed: bool = False


@dataclass
class Turn:
    prompt_ids: list[int]
    # Where this turn's own prompt tokens start (after the segment's earlier tokens).
    new_from: int
    completions: list[Sampled]
    weight_version: int
    weight_versions: list[int]
    chosen: int = 0


@dataclass
class Segment:
    reason: str
    tools: list[dict] | None
    messages: list[Message] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)


@dataclass
class Plan:
    prompt_ids: list[int]
    prompt_text_tail: str
    messages: list[Message]
    tools: list[dict] | None
    # None: a new segment with this reason; else continue the last segment after choice `chosen`.
    new_segment: str | None
    chosen: int = 0
    new_from: int = 0


class Session:
    def __init__(self, session_id: str, max_turns: int, now: float) -> None:
        self.id = session_id
        self.max_turns = max_turns
        self.segments: list[Segment] = []
        self.splits: Counter[str] = Counter()
        self.turns = 0
        self.last_used = now
        self.replica: str | None = None
        self.ended: str | None = None
        self.lock = asyncio.Lock()

    def plan(self, renderer: Renderer, messages: list[Message], tools: list[dict] | None) -> Plan:
        """The prompt ids of the next turn: the recorded prefix plus the new messages, or a fresh render."""
        if self.ended:
            raise SessionEnded(self.ended)
        if self.turns >= self.max_turns:
            raise SessionLimit(f"session {self.id!r} has taken its {self.max_turns} turns")
        reason = "start"
        if self.segments and self.segments[-1].turns:
            segment = self.segments[-1]
            continued = self._continue(renderer, segment, messages, tools)
            if isinstance(continued, Plan):
                return continued
            reason = continued
        text = renderer.render(messages, tools, generation_prompt=True)
        ids = renderer.encode(text)
        return Plan(ids, text, messages, tools, new_segment=reason)

    def plan_fresh(self, renderer: Renderer, messages: list[Message], tools: list[dict] | None, reason: str) -> Plan:
        """A new segment rendered afresh (a turn with images: its prompt ids come from the rollout's reply)."""
        if self.ended:
            raise SessionEnded(self.ended)
        if self.turns >= self.max_turns:
            raise SessionLimit(f"session {self.id!r} has taken its {self.max_turns} turns")
        text = renderer.render(messages, tools, generation_prompt=True)
        return Plan(renderer.encode(text), text, messages, tools, new_segment=reason)

    def _continue(self, renderer: Renderer, segment: Segment, messages: list[Message], tools) -> Plan | str:
        last = segment.turns[-1]
        recorded = [message_key(m) for m in segment.messages]
        if tools != segment.tools or [message_key(m) for m in messages[: len(recorded)]] != recorded:
            return "history_changed"
        if len(messages) <= len(recorded) + 1:
            return "history_changed"
        reply = message_key(messages[len(recorded)])
        chosen = next((i for i, c in enumerate(last.completions) if message_key(c.message) == reply), None)
        if chosen is None:
            return "history_changed"
        before = segment.messages
        history = [*before, last.completions[chosen].message]
        closing = renderer.closing(before, tools)
        old = renderer.render(history, tools, generation_prompt=False)
        new = renderer.render([*history, *messages[len(history) :]], tools, generation_prompt=True)
        if closing is None or not new.startswith(old):
            return "template"
        sampled = last.completions[chosen]
        tail = bridge(sampled.text, closing) + new[len(old) :]
        prefix = [*last.prompt_ids, *sampled.token_ids]
        return Plan(
            [*prefix, *renderer.encode(tail)],
            tail,
            messages,
            tools,
            new_segment=None,
            chosen=chosen,
            new_from=len(prefix),
        )

    def record(self, plan: Plan, completions: list[Sampled], weight_version: int, weight_versions: list[int]) -> None:
        if plan.new_segment is not None:
            if self.segments:
                self.splits[plan.new_segment] += 1
            self.segments.append(Segment(reason=plan.new_segment, tools=plan.tools))
        else:
            self.segments[-1].turns[-1].chosen = plan.chosen
        segment = self.segments[-1]
        segment.messages = list(plan.messages)
        segment.turns.append(
            Turn(plan.prompt_ids, plan.new_from, completions, weight_version, list(weight_versions) or [weight_version])
        )
        self.turns += 1

    def document(self) -> TrajectoryDocument:
        """The session's recording as the contract's trajectory document."""
        return TrajectoryDocument(
            session_id=self.id,
            invalid_actions=sum(t.completions[t.chosen].malformed for s in self.segments for t in s.turns),
            status=SessionStatus.INFRASTRUCTURE_ERROR if self.ended else SessionStatus.OK,
            error=self.ended or "",
            turns=self.turns,
            splits=dict(self.splits),
            segments=[_segment_document(segment) for segment in self.segments],
        )

    def trajectory(self) -> dict[str, Any]:
        """The trajectory document as served (GET /v1/sessions/{id}/trajectory)."""
        return self.document().to_json()


def _segment_document(segment: Segment) -> contract.Segment:
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    turns = []
    for turn in segment.turns:
        new = turn.prompt_ids[len(ids) :]
        ids += new
        mask += [0] * len(new)
        logprobs += [0.0] * len(new)
        versions += [-1] * len(new)
        sampled = turn.completions[turn.chosen]
        ids += sampled.token_ids
        mask += [1] * len(sampled.token_ids)
        logprobs += sampled.logprobs
        versions += [turn.weight_version] * len(sampled.token_ids)
        turns.append(
            contract.Turn(
                prompt_token_ids=turn.prompt_ids,
                weight_version=turn.weight_version,
                weight_versions=turn.weight_versions,
                chosen=turn.chosen,
                completions=[
                    contract.Completion(token_ids=c.token_ids, logprobs=c.logprobs, finish_reason=c.finish_reason)
                    for c in turn.completions
                ],
            )
        )
    last = segment.turns[-1] if segment.turns else None
    return contract.Segment(
        reason=segment.reason,
        # The last call's messages and the reply it kept.
        messages=[*segment.messages, *([last.completions[last.chosen].message] if last else [])],
        tools=segment.tools,
        token_ids=ids,
        loss_mask=mask,
        logprobs=logprobs,
        weight_versions=versions,
        turns=turns,
    )


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

    def open(self, session_id: str, create: bool = True) -> Session:
        """The session, its idle clock reset; when new, created (SessionLimit when the store is full), or
        with create=False refused (UnknownSession): a key's session is never made anew."""
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
            session = self._sessions[session_id] = Session(session_id, self.max_turns, self._clock())
        session.last_used = self._clock()
        return session

    def delete(self, session_id: str) -> bool:
        return self._sessions.pop(session_id, None) is not None
