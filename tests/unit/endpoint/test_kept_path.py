"""Trained tokens are the path that led to the outcome: abandoned replies are recorded but never trained.

A retried prompt, a reply the scaffold dropped (mini-swe-agent's format error: the next prompt is the history
without the reply plus a user message), an n > 1 choice the client did not continue: each stays in its turn of
the trajectory document and in no segment's tokens. Only a real history edit opens a new segment.
"""

from __future__ import annotations

import pytest

from dockyard.agents.trajectory import trial_tokens
from dockyard.models.tokenizer import build_char_tokenizer
from services.endpoint.rendering import Renderer
from services.endpoint.sessions import Sampled, Session, SessionStore

SYSTEM = {"role": "system", "content": "you are a helpful assistant who runs commands " * 4}
TASK = {"role": "user", "content": "fix the bug"}
FORMAT_ERROR = {"role": "user", "content": "format error: reply with exactly one command"}


@pytest.fixture(scope="module")
def renderer() -> Renderer:
    return Renderer(build_char_tokenizer())


def sample(renderer: Renderer, text: str, malformed: bool = False, logprob: float = -0.5) -> Sampled:
    ids = renderer.encode(text) + [renderer.eos_token_id]
    return Sampled(ids, [logprob] * len(ids), renderer.decode(ids), "eos", reply(text), malformed)


def reply(text: str) -> dict:
    return {"role": "assistant", "content": text}


def call(session: Session, renderer: Renderer, messages: list[dict], *replies: Sampled):
    plan = session.plan(renderer, messages, None)
    session.record(plan, list(replies), 5, [5])
    return plan


def trained_ids(segment: dict) -> list[int]:
    return [t for t, m in zip(segment["token_ids"], segment["loss_mask"], strict=True) if m]


def test_a_retried_prompt_trains_only_the_attempt_the_scaffold_continued(renderer: Renderer) -> None:
    session = SessionStore(4, 60, 10).open("retry")
    first = [SYSTEM, TASK]
    lost, kept, last = sample(renderer, "ls", logprob=-1.0), sample(renderer, "cat a"), sample(renderer, "done")
    plan1 = call(session, renderer, first, lost)  # the client never saw this reply (a timeout) and asks again
    plan2 = call(session, renderer, first, kept)
    assert plan2.prompt_ids == plan1.prompt_ids and plan2.new_segment is None and plan2.extends == "retry"
    call(session, renderer, [*first, reply("cat a"), {"role": "user", "content": "a: 1"}], last)
    traj = session.trajectory()
    [segment] = traj["segments"]
    assert traj["splits"] == {} and traj["turns"] == 3
    assert trained_ids(segment) == kept.token_ids + last.token_ids
    assert segment["token_ids"][: len(plan1.prompt_ids)] == plan1.prompt_ids
    assert -1.0 not in segment["logprobs"]
    assert [(t["trained"], t["abandoned"]) for t in segment["turns"]] == [(False, "retry"), (True, ""), (True, "")]
    assert traj["abandoned"] == {"retry": 1} and traj["invalid_actions"] == 0
    # The dropped attempt is still on record, with its ids.
    assert segment["turns"][0]["completions"][0]["token_ids"] == lost.token_ids


def test_a_dropped_malformed_reply_is_masked_counted_and_opens_no_segment(renderer: Renderer) -> None:
    """mini-swe-agent 2.x: a reply that is not a valid action is never added to the history; a user message
    with the format error is, and the model is asked again from there."""
    session = SessionStore(4, 60, 10).open("dropped")
    history = [SYSTEM, TASK]
    good = sample(renderer, "run: ls")
    call(session, renderer, history, good)
    history = [*history, reply("run: ls"), {"role": "user", "content": "a.py b.py"}]
    bad = sample(renderer, "i think i should look", malformed=False)
    plan2 = call(session, renderer, history, bad)
    history = [*history, FORMAT_ERROR]  # bad reply dropped
    fixed = sample(renderer, "run: cat a.py")
    plan3 = call(session, renderer, history, fixed)
    assert plan3.new_segment is None and plan3.extends == "context"
    # The new prompt is turn 2's prompt up to its generation prompt, byte for byte, then only the new message.
    context = plan2.prompt_ids[: -len(renderer.encode("assistant: "))]
    assert plan3.prompt_ids[: len(context)] == context
    assert renderer.decode(plan3.prompt_ids[len(context) :]) == f"user: {FORMAT_ERROR['content']}\nassistant: "
    traj = session.trajectory()
    [segment] = traj["segments"]
    assert traj["splits"] == {} and traj["invalid_actions"] == 1 and traj["abandoned"] == {"dropped": 1}
    assert trained_ids(segment) == good.token_ids + fixed.token_ids
    assert segment["token_ids"] == plan3.prompt_ids + fixed.token_ids
    assert segment["turns"][1]["abandoned"] == "dropped" and segment["turns"][2]["extends"] == "context"


def test_repeated_format_errors_extend_one_row_and_fit_the_budget_they_used_to_exceed(renderer: Renderer) -> None:
    """The issue's pattern: every reply dropped. Each turn used to open a segment repeating the whole context,
    so the rows summed past the budget after a few turns with nearly every token masked."""
    session = SessionStore(4, 60, 20).open("storm")
    history = [{"role": "system", "content": "x" * 2000}, TASK]
    for k in range(6):
        call(session, renderer, history, sample(renderer, f"no command {k}"))
        history = [*history, FORMAT_ERROR]
    last = sample(renderer, "run: ls")
    call(session, renderer, history, last)
    traj = session.trajectory()
    assert len(traj["segments"]) == 1 and traj["invalid_actions"] == 6 and traj["abandoned"] == {"dropped": 6}
    row = traj["segments"][0]
    assert trained_ids(row) == last.token_ids
    # One row: the system prompt, the task, six format errors and the kept reply; well inside 4,096 tokens,
    # where six segments of the 2,000-token context each would not be.
    tokens = trial_tokens(traj, max_tokens=4096)
    assert not tokens.truncated and len(tokens.segments) == 1 and tokens.unique_tokens == len(row["token_ids"])
    assert len(row["token_ids"]) < 2400


def test_an_unchosen_choice_is_not_trained_and_the_last_turn_trains_its_first(renderer: Renderer) -> None:
    session = SessionStore(4, 60, 10).open("choices")
    first = [TASK]
    a, b = sample(renderer, "a", logprob=-1.0), sample(renderer, "b")
    call(session, renderer, first, a, b)
    c, d = sample(renderer, "c"), sample(renderer, "d", logprob=-2.0)
    call(session, renderer, [*first, reply("b"), {"role": "user", "content": "ok"}], c, d)
    traj = session.trajectory()
    [segment] = traj["segments"]
    assert trained_ids(segment) == b.token_ids + c.token_ids
    assert not {-1.0, -2.0} & set(segment["logprobs"])
    assert [t["chosen"] for t in segment["turns"]] == [1, 0]
    assert traj["abandoned"] == {"unchosen": 2} and traj["invalid_actions"] == 0


def test_going_back_to_an_earlier_choice_abandons_the_branch_left(renderer: Renderer) -> None:
    session = SessionStore(4, 60, 10).open("branch")
    a, b = sample(renderer, "a"), sample(renderer, "b")
    call(session, renderer, [TASK], a, b)
    left = sample(renderer, "left", logprob=-3.0)
    call(session, renderer, [TASK, reply("a"), {"role": "user", "content": "1"}], left)
    after = sample(renderer, "after")
    plan = call(session, renderer, [TASK, reply("b"), {"role": "user", "content": "2"}], after)
    assert plan.new_segment is None and (plan.parent, plan.chosen) == (0, 1)
    traj = session.trajectory()
    [segment] = traj["segments"]
    assert trained_ids(segment) == b.token_ids + after.token_ids and -3.0 not in segment["logprobs"]
    assert segment["turns"][1]["abandoned"] == "branch"
    assert traj["abandoned"] == {"unchosen": 1, "branch": 1}


def test_a_real_history_edit_still_opens_a_segment_and_keeps_the_last_reply_built_on(renderer: Renderer) -> None:
    session = SessionStore(4, 60, 10).open("edit")
    history = [SYSTEM, TASK]
    first = sample(renderer, "run: ls")
    call(session, renderer, history, first)
    # The scaffold summarises: the task message itself is rewritten.
    edited = [SYSTEM, {"role": "user", "content": "fix the bug; you listed the files"}]
    second = sample(renderer, "run: cat a.py")
    plan = call(session, renderer, edited, second)
    assert plan.new_segment == "history_changed"
    traj = session.trajectory()
    assert [s["reason"] for s in traj["segments"]] == ["start", "history_changed"]
    assert [trained_ids(s) for s in traj["segments"]] == [first.token_ids, second.token_ids]
    assert traj["abandoned"] == {} and traj["invalid_actions"] == 0
    # The two rows share the system prompt's tokens: the budget counts them once.
    rows = [s["token_ids"] for s in traj["segments"]]
    shared = next(i for i, (x, y) in enumerate(zip(*rows, strict=False)) if x != y)
    tokens = trial_tokens(traj, max_tokens=10_000)
    assert tokens.unique_tokens == len(rows[0]) + len(rows[1]) - shared
    assert trial_tokens(traj, max_tokens=tokens.unique_tokens).truncated is False


def test_a_retry_after_a_dropped_reply_goes_on_from_the_same_context(renderer: Renderer) -> None:
    session = SessionStore(4, 60, 10).open("both")
    history = [TASK]
    call(session, renderer, history, sample(renderer, "junk"))
    history = [TASK, FORMAT_ERROR]
    plan2 = call(session, renderer, history, sample(renderer, "lost"))
    plan3 = call(session, renderer, history, sample(renderer, "kept"))
    assert plan3.prompt_ids == plan2.prompt_ids and plan3.extends == "retry"
    done = sample(renderer, "done")
    call(session, renderer, [*history, reply("kept"), {"role": "user", "content": "fine"}], done)
    traj = session.trajectory()
    [segment] = traj["segments"]
    assert trained_ids(segment) == sample(renderer, "kept").token_ids + done.token_ids
    assert traj["abandoned"] == {"dropped": 1, "retry": 1} and traj["invalid_actions"] == 1
