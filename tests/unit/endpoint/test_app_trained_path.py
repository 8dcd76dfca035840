"""Through the endpoint app with the real openai client: a scaffold's abandoned replies are recorded, not trained.

The conversation is mini-swe-agent's pattern (a reply that is not a valid action is dropped from the history and
a format error appended), plus an n = 2 call whose second choice is continued and a retried call; the scripted
backend stands in for a replica (tests/unit/endpoint/scripted.py).
"""

from __future__ import annotations

import httpx

from dockyard.agents.trajectory import trial_tokens
from services.endpoint.app import create_app
from services.endpoint.settings import EndpointSettings
from tests.unit.endpoint.scripted import TOKEN, ScriptedBackend, oa


async def test_the_trajectory_trains_only_the_replies_the_scaffold_built_on() -> None:
    backend = ScriptedBackend()
    app = create_app(EndpointSettings(max_body_bytes=64 * 1024), TOKEN, backend)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://endpoint")
    opened = (await http.post("/v1/sessions", headers={"x-api-key": TOKEN})).json()
    client = oa(app, key=opened["api_key"])  # an unchanged scaffold: the session key is its API key
    backend.script = ["run ls", "run pwd", "hmm", "run cat a", "run cat b", "done"]
    messages = [{"role": "system", "content": "one command per reply"}, {"role": "user", "content": "fix it"}]

    first = await client.chat.completions.create(model="job-1", messages=messages, n=2)
    messages += [first.choices[1].message.model_dump(exclude_none=True), {"role": "user", "content": "a.py"}]
    await client.chat.completions.create(model="job-1", messages=messages)  # "hmm": not an action, dropped
    messages += [{"role": "user", "content": "format error: one command"}]
    await client.chat.completions.create(model="job-1", messages=messages)  # lost to a client timeout
    retried = await client.chat.completions.create(model="job-1", messages=messages)
    assert retried.choices[0].message.content == "run cat b"
    messages += [retried.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "b: 1"}]
    await client.chat.completions.create(model="job-1", messages=messages)

    got = await http.get(f"/v1/sessions/{opened['session_id']}/trajectory", headers={"x-api-key": TOKEN})
    trajectory = got.json()
    assert trajectory["turns"] == 5 and trajectory["splits"] == {}
    assert trajectory["abandoned"] == {"retry": 1, "dropped": 1, "unchosen": 1}
    assert trajectory["invalid_actions"] == 1  # the dropped reply
    [segment] = trajectory["segments"]
    renderer = backend.model_.renderer

    def ids(text: str) -> list[int]:
        return renderer.encode(text) + [renderer.eos_token_id]

    # Call 3 went on from call 2's context without its reply; call 4 sent call 3's prompt again, byte for byte.
    generation_prompt = len(renderer.encode("assistant: "))
    assert backend.prompts[2][: len(backend.prompts[1]) - generation_prompt] == backend.prompts[1][:-generation_prompt]
    assert backend.prompts[3] == backend.prompts[2]
    assert segment["token_ids"] == backend.prompts[4] + ids("done")
    trained = [t for t, m in zip(segment["token_ids"], segment["loss_mask"], strict=True) if m]
    assert trained == ids("run pwd") + ids("run cat b") + ids("done")
    assert [(t["trained"], t["abandoned"]) for t in segment["turns"]] == [
        (True, ""),
        (False, "dropped"),
        (False, "retry"),
        (True, ""),
        (True, ""),
    ]
    tokens = trial_tokens(trajectory, max_tokens=len(segment["token_ids"]))
    assert not tokens.truncated and tokens.sampled_tokens == len(trained)
