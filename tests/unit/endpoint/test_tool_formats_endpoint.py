"""Non-Hermes formats end to end: the endpoint app serves a job whose tokenizer writes another family's
calls (the scripted backend's replica answers with what that family's template renders), and the
openai client gets structured calls, or, for a malformed one, the text and an invalid action. The former
endpoint setting is refused, and the API page's table of formats is the registry's."""

from __future__ import annotations

import json

import httpx
import pytest
import yaml
from pydantic import ValidationError

from dockyard.agents.contract import SESSION_HEADER
from dockyard.agents.tool_formats import FORMATS
from dockyard.config import SamplingConfig, load_config
from services.endpoint.backend import JobModel, load_job_model
from services.endpoint.rendering import Renderer
from services.endpoint.settings import EndpointSettings
from tests.conftest import REPO_ROOT
from tests.unit.endpoint.families import completion, family_tokenizer
from tests.unit.endpoint.scripted import ScriptedBackend, oa
from tests.unit.endpoint.test_tool_formats import CALLS, MALFORMED, TOOLS, reply

FAMILIES = ["qwen3_coder", "mistral", "harmony", "deepseek_v3"]
ASK = [{"role": "user", "content": "fix it"}]
BUILT_IN = ["policy.model_name=null", "policy.bootstrap=null"]  # the character tokenizer


@pytest.fixture(params=FAMILIES)
def backend(request) -> ScriptedBackend:
    scripted = ScriptedBackend()
    tokenizer = family_tokenizer(request.param)
    scripted.model_ = JobModel("job-1", Renderer(tokenizer), request.param, 512, sampling=SamplingConfig())
    return scripted


async def test_the_family_calls_come_back_as_tool_calls(app, backend) -> None:
    tokenizer, name = backend.model_.renderer.tokenizer, backend.model_.parser
    # What the policy samples: the template's rendering of the reply, its closing <eos> being the eos token.
    backend.script = [completion(tokenizer, ASK, reply(CALLS, "Let me look."), TOOLS).removesuffix("<eos>\n")]
    answer = await oa(app).chat.completions.create(
        model="job-1", messages=ASK, tools=TOOLS, extra_headers={SESSION_HEADER: f"s-{name}"}
    )
    choice = answer.choices[0]
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
    assert (calls, choice.finish_reason) == (CALLS, "tool_calls")
    trajectory = await oa(app).get(f"/sessions/s-{name}/trajectory", cast_to=httpx.Response)
    assert trajectory.json()["invalid_actions"] == 0


async def test_a_malformed_family_call_is_text_and_counted(app, backend) -> None:
    name = backend.model_.parser
    text = MALFORMED[name]["one good, one bad"]
    backend.script = [text]
    answer = await oa(app).chat.completions.create(
        model="job-1", messages=ASK, tools=TOOLS, extra_headers={SESSION_HEADER: f"m-{name}"}
    )
    choice = answer.choices[0]
    assert (choice.message.tool_calls, choice.finish_reason) == (None, "stop")
    assert choice.message.content == text  # the format's tokens included: the model's whole text
    trajectory = await oa(app).get(f"/sessions/m-{name}/trajectory", cast_to=httpx.Response)
    assert trajectory.json()["invalid_actions"] == 1


def test_the_former_endpoint_setting_is_refused_not_ignored(monkeypatch) -> None:
    monkeypatch.setenv("DOCKYARD_ENDPOINT_TOOL_PARSER", "hermes")
    with pytest.raises(ValidationError, match="set policy.tool_call_format"):
        EndpointSettings()


def test_the_api_page_shows_each_format_with_its_feature_and_example() -> None:
    page = (REPO_ROOT / "docs" / "endpoint-api.md").read_text(encoding="utf-8")
    rows = [line for line in page.splitlines() if line.startswith("| `") and "` | " in line]
    shown = {row.split("`")[1]: row.replace("\\|", "|") for row in rows if row.split("`")[1] in FORMATS}
    assert list(shown) == list(FORMATS)  # in the order auto tries them
    for name, row in shown.items():
        assert FORMATS[name].EXAMPLE.replace("\n", "\\n") in row
        assert all(f"`{feature}`" in row for feature in FORMATS[name].FEATURES)


@pytest.mark.parametrize(("setting", "format_"), [("auto", "hermes"), ("mistral", "mistral"), ("none", "none")])
def test_a_job_reads_calls_in_its_configured_format(tmp_path, setting: str, format_: str) -> None:
    cfg = load_config(
        REPO_ROOT / "examples" / "configs" / "tiny_agent.yaml", [*BUILT_IN, f"policy.tool_call_format={setting}"]
    )
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    assert load_job_model("job-1", tmp_path).parser == format_  # the built-in template writes Hermes


async def test_sending_the_calls_back_extends_the_recorded_reply(app, backend) -> None:
    tokenizer, name = backend.model_.renderer.tokenizer, backend.model_.parser
    backend.script = [completion(tokenizer, ASK, reply(CALLS, "Let me look."), TOOLS).removesuffix("<eos>\n"), "Done."]
    client, headers = oa(app), {SESSION_HEADER: f"t-{name}"}
    first = await client.chat.completions.create(model="job-1", messages=ASK, tools=TOOLS, extra_headers=headers)
    message = first.choices[0].message
    results = [{"role": "tool", "tool_call_id": call.id, "content": "ok"} for call in message.tool_calls]
    messages = [*ASK, message.model_dump(exclude_none=True), *results]
    await client.chat.completions.create(model="job-1", messages=messages, tools=TOOLS, extra_headers=headers)
    document = (await client.get(f"/sessions/t-{name}/trajectory", cast_to=httpx.Response)).json()
    turns = [(turn["extends"], turn["trained"]) for segment in document["segments"] for turn in segment["turns"]]
    assert (turns, document["splits"]) == ([("start", True), ("reply", True)], {})  # one token-faithful path
