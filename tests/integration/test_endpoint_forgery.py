"""Each session forgery, made from inside a scaffold's confined container, is refused.

The real endpoint app (a scripted backend stands in for the rollout replicas: the calls are about who may
do what, not what the model says) serves on the host's loopback; the real sandbox service on the docker
backend opens a session whose only route is that endpoint, and runs the attacker as an external scaffold
with the environment run_external gives every scaffold (its own session key as OPENAI_API_KEY). The
attacker also knows another trial's session id. Every attack gets a 401 or a 403; the other session's
recording is untouched and no session is made; the attacker's own calls are served.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
import uvicorn

from dockyard.agents.external import run_external
from dockyard.agents.scaffold import Budget
from dockyard.agents.session import SandboxSession
from dockyard.api.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from dockyard.config import ScaffoldConfig
from dockyard.rpc.client import connect
from services.endpoint.app import create_app
from services.endpoint.settings import EndpointSettings
from tests.conftest import docker_sandbox_env, free_port
from tests.unit.endpoint.scripted import TOKEN, ScriptedBackend

pytestmark = pytest.mark.slow

ATTACKS = r"""
import hashlib, hmac, json, os, urllib.error, urllib.request

base = os.environ["OPENAI_BASE_URL"].removesuffix("/v1")
mine = os.environ["OPENAI_API_KEY"]
victim = os.environ["VICTIM"]
body = json.dumps({"model": os.environ["DOCKYARD_MODEL"], "messages": [{"role": "user", "content": "x"}]}).encode()

def call(method, path, key=None, session=None, data=None):
    request = urllib.request.Request(base + path, data=data, method=method)
    request.add_header("content-type", "application/json")
    if key is not None:
        request.add_header("authorization", "Bearer " + key)
    if session is not None:
        request.add_header("X-Dockyard-Session", session)
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status
    except urllib.error.HTTPError as error:
        return error.code

empty_secret_key = "dys-%s-%s" % (victim, hmac.new(b"", victim.encode(), hashlib.sha256).hexdigest()[:32])
flipped = mine[:-1] + ("0" if mine[-1] != "0" else "1")
results = {
    "own key, another session's id in X-Dockyard-Session": call("POST", "/v1/chat/completions", mine, victim, body),
    "own key, a made-up session id in X-Dockyard-Session": call("POST", "/v1/chat/completions", mine, "made-up", body),
    "a made-up session's key": call("POST", "/v1/chat/completions", "dys-made-up-" + "0" * 32, None, body),
    "own key with its signature altered": call("POST", "/v1/chat/completions", flipped, None, body),
    "another session's key signed under an empty secret": call(
        "POST", "/v1/chat/completions", empty_secret_key, None, body
    ),
    "an empty key": call("POST", "/v1/chat/completions", "", None, body),
    "a garbage key": call("POST", "/v1/chat/completions", "sk-garbage", None, body),
    "no key": call("POST", "/v1/chat/completions", None, None, body),
    "open a session, own key": call("POST", "/v1/sessions", mine),
    "open a session, garbage key": call("POST", "/v1/sessions", "sk-garbage"),
    "delete another session, own key": call("DELETE", "/v1/sessions/" + victim, mine),
    "delete another session, garbage key": call("DELETE", "/v1/sessions/" + victim, "sk-garbage"),
    "read another session's trajectory, own key": call("GET", "/v1/sessions/%s/trajectory" % victim, mine),
    "read /v1/routing, own key": call("GET", "/v1/routing", mine),
    "read /v1/routing, garbage key": call("GET", "/v1/routing", "sk-garbage"),
    "read /openapi.json, own key": call("GET", "/openapi.json", mine),
    "read /openapi.json, no key": call("GET", "/openapi.json"),
    "legitimate: a model call with own key": call("POST", "/v1/chat/completions", mine, None, body),
}
print(json.dumps(results))
"""

REFUSED = {
    "own key, another session's id in X-Dockyard-Session": 403,
    "own key, a made-up session id in X-Dockyard-Session": 403,
    "a made-up session's key": 401,
    "own key with its signature altered": 401,
    "another session's key signed under an empty secret": 401,
    "an empty key": 401,
    "a garbage key": 401,
    "no key": 401,
    "open a session, own key": 403,
    "open a session, garbage key": 401,
    "delete another session, own key": 403,
    "delete another session, garbage key": 401,
    "read another session's trajectory, own key": 403,
    "read /v1/routing, own key": 403,
    "read /v1/routing, garbage key": 401,
    "read /openapi.json, own key": 403,
    "read /openapi.json, no key": 401,
    "legitimate: a model call with own key": 200,
}


@pytest.fixture
def endpoint():
    """The endpoint app on the host's loopback: (port, app)."""
    app = create_app(EndpointSettings(), TOKEN, ScriptedBackend())
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the endpoint did not start"
        time.sleep(0.05)
    yield server.config.port, app
    server.should_exit = True
    thread.join(timeout=30)


@pytest.fixture
def sandbox(start_service, docker_sandbox_image):
    return start_service("sandbox", docker_sandbox_env(docker_sandbox_image))


def test_every_forgery_from_inside_a_scaffold_container_is_refused(sandbox, endpoint) -> None:
    port, app = endpoint
    base = f"http://127.0.0.1:{port}"
    admin = {"authorization": f"Bearer {TOKEN}"}
    body = {"model": "job-1", "messages": [{"role": "user", "content": "x"}]}
    with httpx.Client(base_url=base, headers=admin, timeout=30) as http:
        attacker = http.post("/v1/sessions").json()
        victim = http.post("/v1/sessions").json()["session_id"]
        assert http.post("/v1/chat/completions", json=body, headers={"X-Dockyard-Session": victim}).is_success
        before = http.get(f"/v1/sessions/{victim}/trajectory").json()

    async def attack() -> tuple[str, str]:
        async with connect(sandbox.address) as channel:
            stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
            limits = sandbox_pb2.Limits(timeout_seconds=120, memory_mb=512, cpu_seconds=120)
            session = await SandboxSession.open(
                stub, "forgery", files={}, limits=limits, endpoint_address=f"127.0.0.1:{port}"
            )
            try:
                await session.write_file("attack.py", ATTACKS.encode())
                run = await run_external(
                    session,
                    ScaffoldConfig(command="python3 attack.py", env={"VICTIM": victim}),
                    endpoint_url=session.endpoint_url,
                    api_key=attacker["api_key"],
                    model="job-1",
                    prompt="task",
                    budget=Budget(max_turns=3, max_tokens=512, seconds=120.0),
                    max_new=16,
                )
                return run.outcome.finish_reason, run.output_tail
            finally:
                await session.close()

    finish_reason, tail = asyncio.run(attack())
    assert finish_reason == "exit", tail
    statuses = json.loads(tail.strip().splitlines()[-1])
    print(json.dumps(statuses, indent=1))
    assert statuses == REFUSED
    # The other trial's recording is as it was, the attacker's call went to its own session, and no
    # session was opened or ended by the attacks.
    with httpx.Client(base_url=base, headers=admin, timeout=30) as http:
        assert http.get(f"/v1/sessions/{victim}/trajectory").json() == before
        assert http.get(f"/v1/sessions/{attacker['session_id']}/trajectory").json()["turns"] == 1
    assert len(app.state.store) == 2 and app.state.store.get("made-up") is None
