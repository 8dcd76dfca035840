"""One sampling law: every turn samples with the job's policy.generation, whatever the client sends.

The trainer recomputes logprobs at `policy.generation.temperature`; a turn sampled at a client's
temperature would train with wrong importance ratios. Through the official openai and anthropic
clients against the endpoint app (with the scripted backend of test_app.py, which records the
SamplingParams each Generate got): a job at temperature 0.8, top_p 0.9, top_k 5 and a client that
sends 0.3 / 0.5 / 2 (top level, in `extra_body`, streamed) samples at the job's values, and each reply
says so in its X-Dockyard-Sampling header. Greedy decoding is the service token's (validation) only.
A session the token opens greedy (an external scaffold's validation trial) is greedy for all its turns.
"""

from __future__ import annotations

import anthropic
import openai
import pytest

from dockyard.agents.contract import SAMPLING_HEADER, SESSION_HEADER
from dockyard.agents.scaffold import Budget, run_scaffold
from dockyard.config import SamplingConfig
from tests.unit.endpoint.scripted import ScriptedBackend, an, oa

JOB = SamplingConfig(temperature=0.8, top_p=0.9, top_k=5)
HEADER = "temperature=0.8 top_p=0.9 top_k=5"
MESSAGES = [{"role": "user", "content": "hi"}]


class RecordingBackend(ScriptedBackend):
    """The scripted backend with the job at JOB; keeps the SamplingParams of every Generate."""

    def __init__(self) -> None:
        super().__init__()
        self.model_.sampling = JOB
        self.sampled: list = []

    async def complete(self, job_id, session, prompt_ids, n, sampling, images=None, on_tokens=None, **options):
        self.sampled.append(sampling)
        return await super().complete(job_id, session, prompt_ids, n, sampling, images, on_tokens, **options)

    def law(self) -> tuple[float, float, int]:
        last = self.sampled[-1]
        return round(last.temperature, 6), round(last.top_p, 6), last.top_k


@pytest.fixture
def backend() -> RecordingBackend:
    return RecordingBackend()


@pytest.mark.parametrize(
    "sent",
    [
        {"temperature": 0.3, "top_p": 0.5},
        {"extra_body": {"temperature": 0.3, "top_p": 0.5, "top_k": 2}},
        {"temperature": 0.3, "extra_body": {"top_k": 2}},
    ],
    ids=["top-level", "extra_body", "both"],
)
async def test_openai_client_settings_do_not_change_the_jobs_law(app, backend, sent) -> None:
    raw = await oa(app).chat.completions.with_raw_response.create(
        model="job-1", messages=MESSAGES, extra_headers={SESSION_HEADER: "s1"}, max_tokens=7, seed=3, **sent
    )
    assert raw.parse().choices[0].message.content == "ok"
    assert backend.law() == (0.8, 0.9, 5)
    # What the client may still choose: it shapes the reply, not the law.
    assert backend.sampled[-1].max_new_tokens == 7 and backend.sampled[-1].seed == 3
    assert raw.headers[SAMPLING_HEADER] == HEADER


async def test_anthropic_client_settings_do_not_change_the_jobs_law(app, backend) -> None:
    raw = await an(app).messages.with_raw_response.create(
        model="job-1",
        max_tokens=9,
        messages=MESSAGES,
        # This anthropic release takes no sampling arguments of its own: a client sends them in the body.
        extra_body={"temperature": 0.3, "top_p": 0.5, "top_k": 2},
        stop_sequences=["zz"],
        extra_headers={SESSION_HEADER: "s2"},
    )
    assert (await raw.parse()).content[0].text == "ok"
    assert backend.law() == (0.8, 0.9, 5)
    assert backend.sampled[-1].max_new_tokens == 9 and list(backend.sampled[-1].stop) == ["zz"]
    assert raw.headers[SAMPLING_HEADER] == HEADER


async def test_streamed_replies_state_the_law_too(app, backend) -> None:
    async with oa(app).chat.completions.with_streaming_response.create(
        model="job-1", messages=MESSAGES, temperature=0.3, stream=True
    ) as reply:
        assert reply.headers[SAMPLING_HEADER] == HEADER
        async for _ in reply.iter_lines():
            pass
    async with an(app).messages.with_streaming_response.create(
        model="job-1", max_tokens=4, messages=MESSAGES, extra_body={"temperature": 0.3}, stream=True
    ) as reply:
        assert reply.headers[SAMPLING_HEADER] == HEADER
        async for _ in reply.iter_lines():
            pass
    assert [round(s.temperature, 6) for s in backend.sampled] == [0.8, 0.8]


async def test_greedy_is_the_service_tokens_only(app, backend) -> None:
    raw = await oa(app).chat.completions.with_raw_response.create(
        model="job-1", messages=MESSAGES, extra_headers={SAMPLING_HEADER: "greedy"}
    )
    assert backend.law() == (0.0, 0.9, 5) and raw.headers[SAMPLING_HEADER] == "temperature=0 top_p=0.9 top_k=5"
    opened = await oa(app).post("/sessions", cast_to=object, body={})
    key = opened["api_key"]
    with pytest.raises(openai.PermissionDeniedError, match="service token"):
        await oa(app, key).chat.completions.create(
            model="job-1", messages=MESSAGES, extra_headers={SAMPLING_HEADER: "greedy"}
        )
    with pytest.raises(anthropic.PermissionDeniedError, match="service token"):
        await an(app, key).messages.create(
            model="job-1", max_tokens=4, messages=MESSAGES, extra_headers={SAMPLING_HEADER: "greedy"}
        )
    with pytest.raises(openai.BadRequestError, match="authoritative"):
        await oa(app).chat.completions.create(
            model="job-1", messages=MESSAGES, extra_headers={SAMPLING_HEADER: "temperature=0.3"}
        )
    assert len(backend.sampled) == 1  # nothing refused reached a replica
    # The session key's own calls are served, at the job's law.
    await oa(app, key).chat.completions.create(model="job-1", messages=MESSAGES, temperature=0.0)
    assert backend.law() == (0.8, 0.9, 5)


async def test_a_job_without_generation_settings_is_refused_clearly(app, backend) -> None:
    backend.model_.sampling = None
    with pytest.raises(openai.BadRequestError, match="no policy.generation settings"):
        await oa(app).chat.completions.create(model="job-1", messages=MESSAGES)
    assert backend.sampled == []
    backend.model_.sampling = JOB  # the endpoint kept serving
    await oa(app).chat.completions.create(model="job-1", messages=MESSAGES)
    assert backend.law() == (0.8, 0.9, 5)


@pytest.mark.parametrize(("trial", "expected"), [(0.5, 0.8), (0.0, 0.0)], ids=["training", "validation"])
async def test_the_built_in_scaffold_samples_under_the_same_law(app, backend, trial, expected) -> None:
    """Training trials sample at the job's law whatever their settings say; validation (temperature 0)
    asks for greedy decoding with the service token, as the coordinator's built-in trials call."""
    client = oa(app).with_options(default_headers={SESSION_HEADER: f"trial-{trial}"})
    outcome = await run_scaffold(
        client, "job-1", "hi", [], None, SamplingConfig(temperature=trial), Budget(2, 1000, 30.0), seed=1
    )
    assert outcome.finish_reason == "answer"
    assert backend.law() == (expected, 0.9, 5)


async def test_a_validation_session_is_greedy_for_its_key_and_a_training_session_is_not(app, backend) -> None:
    """An external scaffold holds only its session key, so the coordinator opens a validation trial's
    session greedy (the service token's header on POST /v1/sessions): every call the key makes is greedy,
    whatever it sends; a training session's calls sample at the job's law; a key cannot open either."""
    greedy = await oa(app).post("/sessions", cast_to=object, body={}, options={"headers": {SAMPLING_HEADER: "greedy"}})
    training = await oa(app).post("/sessions", cast_to=object, body={})
    for sent in ({}, {"temperature": 1.0}, {"extra_body": {"temperature": 0.7, "top_k": 0}}):
        raw = await oa(app, greedy["api_key"]).chat.completions.with_raw_response.create(
            model="job-1", messages=MESSAGES, **sent
        )
        assert backend.law() == (0.0, 0.9, 5) and raw.headers[SAMPLING_HEADER] == "temperature=0 top_p=0.9 top_k=5"
        raw = await oa(app, training["api_key"]).chat.completions.with_raw_response.create(
            model="job-1", messages=MESSAGES, temperature=0.0, **{k: v for k, v in sent.items() if k != "temperature"}
        )
        assert backend.law() == (0.8, 0.9, 5) and raw.headers[SAMPLING_HEADER] == HEADER
    # The greedy session's Anthropic calls too; and a key may neither open a session nor ask for greedy.
    await an(app, greedy["api_key"]).messages.create(
        model="job-1", max_tokens=4, messages=MESSAGES, extra_body={"temperature": 1.0}
    )
    assert backend.law() == (0.0, 0.9, 5)
    for headers in ({SAMPLING_HEADER: "greedy"}, {}):
        with pytest.raises(openai.PermissionDeniedError):
            await oa(app, training["api_key"]).post("/sessions", cast_to=object, body={}, options={"headers": headers})
