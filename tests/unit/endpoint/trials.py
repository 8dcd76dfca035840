"""Recorded agent trials for the staging tests: sessions of the endpoint app over a scripted backend whose
logprobs vary per token (so a lost or reordered float would show), each trial a different shape."""

from __future__ import annotations

import random

from dockyard.agents.contract import SESSION_HEADER
from tests.unit.endpoint.scripted import ScriptedBackend, oa

# Each trial's shape: replies the scaffold kept and dropped; an edited history (a second segment); a long
# one that the budget cuts; one that made no model call (no tokens, so no part).
KINDS = ("dropped", "two_segments", "long", "silent")


class VariedBackend(ScriptedBackend):
    """The scripted replica, each sampled token with a logprob of its own."""

    def __init__(self) -> None:
        super().__init__()
        self._rng = random.Random(7)

    async def complete(self, *args, **kwargs):
        generated = await super().complete(*args, **kwargs)
        for completion in generated.completions:
            completion.logprobs[:] = [-self._rng.random() * 3 for _ in completion.token_ids]
        return generated


async def record(app, backend: ScriptedBackend, session_id: str, kind: str) -> None:
    """Run a trial of `kind` in session `session_id` as the built-in scaffold does (the token, the header)."""
    client = oa(app).with_options(default_headers={SESSION_HEADER: session_id})
    messages = [{"role": "system", "content": "one command per reply"}, {"role": "user", "content": "fix it"}]

    async def call(reply: str):
        backend.script = [reply]
        return (await client.chat.completions.create(model="job-1", messages=messages)).choices[0].message

    if kind == "silent":
        return
    first = await call("run ls")
    messages += [first.model_dump(exclude_none=True), {"role": "user", "content": "a.py b.py"}]
    if kind == "dropped":
        await call("hmm")  # not an action: the scaffold drops it (trained 0) and says so
        messages += [{"role": "user", "content": "format error: one command"}]
        await call("run cat a.py")
    elif kind == "two_segments":
        messages[1] = {"role": "user", "content": "fix it, edited"}  # a history the recording cannot extend
        await call("run pwd")
    else:
        for i in range(6):
            reply = await call(f"run cat file_{i}.py and more")
            messages += [reply.model_dump(exclude_none=True), {"role": "user", "content": f"contents {i}" * 3}]
