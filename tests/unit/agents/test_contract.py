"""The agent path's contract: the endpoint's recording reads back as the same document; others are refused."""

from __future__ import annotations

import json

import pytest

from dockyard.agents.contract import (
    ContractError,
    RecordedTokens,
    SessionOpened,
    SessionStatus,
    TrajectoryDocument,
)
from dockyard.agents.trajectory import trial_tokens
from dockyard.models.tokenizer import build_char_tokenizer
from services.endpoint.rendering import Renderer
from services.endpoint.sessions import Sampled, SessionStore


def _served() -> dict:
    renderer = Renderer(build_char_tokenizer())
    session = SessionStore(4, 60, 10).open("s")
    ids = renderer.encode("ok") + [renderer.eos_token_id]
    reply = {"role": "assistant", "content": "ok"}
    sampled = Sampled(ids, [-0.5] * len(ids), renderer.decode(ids), "eos", reply)
    session.record(session.plan(renderer, [{"role": "user", "content": "hi"}], None), [sampled], 2, [2])
    return json.loads(json.dumps(session.trajectory()))


def test_the_served_json_parses_into_the_document_and_dumps_back_unchanged() -> None:
    served = _served()
    document = TrajectoryDocument.parse(json.dumps(served))
    assert document.to_json() == served and list(document.to_json()) == list(served)
    assert document.status is SessionStatus.OK and document.turns == 1
    assert document.segments[0].turns[0].completions[0].finish_reason == "eos"
    assert trial_tokens(document, 100).segments == trial_tokens(served, 100).segments


def test_a_document_without_a_version_reads_as_version_1_and_another_version_is_refused() -> None:
    served = _served()
    del served["schema_version"]
    assert TrajectoryDocument.parse(served).schema_version == 1
    with pytest.raises(ContractError, match="schema version 2"):
        TrajectoryDocument.parse({**served, "schema_version": 2})


@pytest.mark.parametrize(
    ("body", "names"),
    [
        (b'{"type": "error", "error": {"type": "not_found_error", "message": "x"}}', "session_id: Field required"),
        (b"<html>", "not JSON"),
        (b"[]", "not an object"),
    ],
)
def test_garbled_documents_are_a_contract_error_saying_what_is_wrong(body: bytes, names: str) -> None:
    with pytest.raises(ContractError, match=names):
        TrajectoryDocument.parse(body)


def test_token_lists_of_different_lengths_are_refused() -> None:
    served = _served()
    served["segments"][0]["loss_mask"].pop()
    with pytest.raises(ContractError, match="differ in length"):
        TrajectoryDocument.parse(served)
    with pytest.raises(ContractError, match="differ in length"):
        RecordedTokens.parse(served)


def test_a_new_session_reply_needs_its_key() -> None:
    assert SessionOpened.parse(b'{"session_id": "s-1", "api_key": "dys-s-1-x"}').api_key == "dys-s-1-x"
    with pytest.raises(ContractError, match="api_key"):
        SessionOpened.parse(b'{"session_id": "s-1"}')


def test_a_document_written_before_the_kept_path_fields_reads_as_all_trained_and_nothing_abandoned() -> None:
    served = _served()
    del served["abandoned"]
    for turn in served["segments"][0]["turns"]:
        for name in ("parent", "extends", "trained", "abandoned"):
            del turn[name]
    document = TrajectoryDocument.parse(served)
    [turn] = document.segments[0].turns
    assert document.abandoned == {} and (turn.parent, turn.extends, turn.trained, turn.abandoned) == (
        -1,
        "start",
        True,
        "",
    )
