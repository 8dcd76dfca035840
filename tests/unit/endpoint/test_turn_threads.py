"""Where a turn's CPU work runs: a short prompt's planning and a short reply's parsing on the event loop (a
hop to a thread would cost more than the work), a long prompt's or reply's in a worker thread, where it
cannot hold up the other calls' streams."""

from __future__ import annotations

import asyncio

from services.endpoint import turns
from services.endpoint.sessions import Session
from tests.unit.endpoint.scripted import oa


def _on_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


async def test_short_work_runs_on_the_loop_and_long_work_in_a_thread(app, backend, monkeypatch) -> None:
    where: list[tuple[str, bool]] = []
    plan, choices_of = Session.plan, turns.choices_of

    def planned(self, *args):
        where.append(("plan", _on_loop()))
        return plan(self, *args)

    def parsed(*args):
        where.append(("choices", _on_loop()))
        return choices_of(*args)

    monkeypatch.setattr(Session, "plan", planned)
    monkeypatch.setattr(turns, "choices_of", parsed)
    short, long = "ok", "a" * turns.INLINE_REPLY_TOKENS
    backend.script = [short, long, short]
    client = oa(app)
    for content in ("hi", "hi", "x" * turns.INLINE_PROMPT_CHARS):
        reply = await client.chat.completions.create(model="job-1", messages=[{"role": "user", "content": content}])
        assert reply.choices[0].message.content in (short, long)
    assert where == [
        ("plan", True),
        ("choices", True),  # "ok" and eos
        ("plan", True),
        ("choices", False),  # a reply of INLINE_REPLY_TOKENS tokens and eos
        ("plan", False),  # a prompt past INLINE_PROMPT_CHARS
        ("choices", True),
    ]
