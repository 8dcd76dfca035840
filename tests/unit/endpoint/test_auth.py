"""Sessions that cannot be forged: each attack a scaffold could make with what it holds (its own session key)
or with nothing, against the real app through the official clients, and what legitimate callers keep.

tests/integration/test_endpoint_forgery.py makes the same attacks from inside a scaffold's confined container.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import anthropic
import httpx
import openai
import pytest

from dockyard.agents.contract import SESSION_HEADER
from services.endpoint.app import create_app
from services.endpoint.auth import session_key
from services.endpoint.settings import EndpointSettings
from tests.conftest import REPO_ROOT, free_port
from tests.unit.endpoint.scripted import TOKEN, ScriptedBackend, an, oa

ONE = [{"role": "user", "content": "x"}]


@pytest.fixture
def app():
    return create_app(EndpointSettings(), TOKEN, ScriptedBackend())


def plain(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://endpoint")


async def open_session(app) -> tuple[str, str]:
    reply = await plain(app).post("/v1/sessions", headers={"authorization": f"Bearer {TOKEN}"})
    assert reply.status_code == 200, reply.text
    return reply.json()["session_id"], reply.json()["api_key"]


async def turns(app, session_id: str) -> int:
    reply = await plain(app).get(f"/v1/sessions/{session_id}/trajectory", headers={"x-api-key": TOKEN})
    assert reply.status_code == 200, reply.text
    return reply.json()["turns"]


async def test_a_key_writes_only_to_its_own_session_whatever_the_header_says(app) -> None:
    mine, my_key = await open_session(app)
    theirs, _ = await open_session(app)
    for header in (theirs, "made-up"):
        with pytest.raises(openai.PermissionDeniedError) as refused:
            await oa(app, my_key).chat.completions.create(
                model="job-1", messages=ONE, extra_headers={SESSION_HEADER: header}
            )
        assert refused.value.status_code == 403 and mine in str(refused.value) and header in str(refused.value)
        with pytest.raises(anthropic.PermissionDeniedError):
            await an(app, my_key).messages.create(
                model="job-1", max_tokens=4, messages=ONE, extra_headers={SESSION_HEADER: header}
            )
    # Nothing was written anywhere, and no session was made for the made-up id.
    assert (await turns(app, theirs), await turns(app, mine)) == (0, 0)
    assert app.state.store.get("made-up") is None and len(app.state.store) == 2
    # The key's own calls (with no header, or a header naming its own session) are served and recorded.
    served = await oa(app, my_key).chat.completions.with_raw_response.create(model="job-1", messages=ONE)
    assert served.headers[SESSION_HEADER] == mine
    own_header = {SESSION_HEADER: mine}
    await an(app, my_key).messages.create(model="job-1", max_tokens=4, messages=ONE, extra_headers=own_header)
    assert (await turns(app, mine), await turns(app, theirs)) == (2, 0)


async def test_forged_empty_and_foreign_keys_are_401(app) -> None:
    session_id, key = await open_session(app)
    flipped = key[:-1] + ("0" if key[-1] != "0" else "1")
    forged = {
        "a flipped signature": flipped,
        "a made-up session's key": f"dys-made-up-{'0' * 32}",
        "a key signed under an empty secret": session_key("", session_id),
        "a key signed under another token": session_key("other", session_id),
        "garbage": "sk-garbage",
    }
    for what, credential in forged.items():
        with pytest.raises(openai.AuthenticationError) as refused:
            await oa(app, credential).chat.completions.create(model="job-1", messages=ONE)
        assert refused.value.status_code == 401, what
        with pytest.raises(anthropic.AuthenticationError):
            await an(app, credential).messages.create(model="job-1", max_tokens=4, messages=ONE)
    http = plain(app)
    for headers in ({}, {"x-api-key": ""}, {"authorization": "Bearer "}, {"authorization": "Bearer  "}):
        reply = await http.post("/v1/chat/completions", json={"model": "job-1", "messages": ONE}, headers=headers)
        assert reply.status_code == 401 and "no credentials" in reply.json()["error"]["message"], headers
    assert await turns(app, session_id) == 0 and len(app.state.store) == 1


async def test_a_key_whose_session_is_not_open_is_refused_never_revived(app) -> None:
    session_id, key = await open_session(app)
    await oa(app, key).chat.completions.create(model="job-1", messages=ONE)
    admin = {"authorization": f"Bearer {TOKEN}"}
    assert (await plain(app).delete(f"/v1/sessions/{session_id}", headers=admin)).status_code == 200
    with pytest.raises(openai.NotFoundError) as refused:
        await oa(app, key).chat.completions.create(model="job-1", messages=ONE)
    assert "not open" in str(refused.value)
    assert app.state.store.get(session_id) is None and len(app.state.store) == 0
    # The service token, the admin, still opens a session by naming it (the built-in scaffold's way).
    reply = await plain(app).post(
        "/v1/chat/completions", json={"model": "job-1", "messages": ONE}, headers={**admin, SESSION_HEADER: "named"}
    )
    assert reply.status_code == 200 and await turns(app, "named") == 1


async def test_admin_routes_need_the_service_token(app) -> None:
    mine, my_key = await open_session(app)
    theirs, _ = await open_session(app)
    http = plain(app)
    admin_only = [
        ("GET", "/v1/routing"),
        ("GET", "/openapi.json"),
        ("POST", "/v1/sessions"),
        ("DELETE", f"/v1/sessions/{theirs}"),
        ("DELETE", f"/v1/sessions/{mine}"),  # ending its own session would drop its trial's recording
        ("GET", f"/v1/sessions/{theirs}/trajectory"),
    ]
    for method, path in admin_only:
        with_key = await http.request(method, path, headers={"x-api-key": my_key})
        assert with_key.status_code == 403, (method, path, with_key.text)
        assert with_key.json()["error"]["type"] == "permission_error"
        without = await http.request(method, path)
        assert without.status_code == 401, (method, path)
    assert len(app.state.store) == 2  # both sessions are still open
    # What a key may do besides model calls: list the models, read its own trajectory.
    assert [m.id for m in (await oa(app, my_key).models.list()).data] == ["job-1"]
    own = await http.get(f"/v1/sessions/{mine}/trajectory", headers={"x-api-key": my_key})
    assert own.status_code == 200 and own.json()["session_id"] == mine
    # The service token does all of it; no interactive docs pages exist.
    admin = {"authorization": f"Bearer {TOKEN}"}
    for method, path in admin_only[:2]:
        assert (await http.request(method, path, headers=admin)).status_code == 200, path
    assert "/v1/chat/completions" in (await http.get("/openapi.json", headers=admin)).json()["paths"]
    assert (await http.get("/docs", headers=admin)).status_code == 404
    assert (await http.delete(f"/v1/sessions/{theirs}", headers=admin)).status_code == 200


def test_there_is_no_endpoint_without_a_service_token() -> None:
    for token in (None, ""):
        with pytest.raises(ValueError, match="needs a service token"):
            create_app(EndpointSettings(), token)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DOCKYARD_AUTH_TOKEN")}
    started = subprocess.run(
        [sys.executable, "-m", "services.endpoint"],
        cwd=REPO_ROOT,
        env={**env, "DOCKYARD_ENDPOINT_PORT": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode != 0 and "no service token" in started.stderr, started.stderr[-2000:]


def test_sigterm_shuts_the_endpoint_down_with_exit_code_zero(tmp_path) -> None:
    port = free_port()
    env = {**os.environ, "DOCKYARD_AUTH_TOKEN": TOKEN, "DOCKYARD_ENDPOINT_PORT": str(port)}
    with open(tmp_path / "endpoint.log", "wb") as log:
        argv = [sys.executable, "-m", "services.endpoint"]
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + 60
            while True:  # serving: /health answers
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "endpoint.log").read_text()
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0, (tmp_path / "endpoint.log").read_text()[-2000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
