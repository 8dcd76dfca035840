"""HeldDeltas: streamed tokens merged per completion between hand-offs, due once per multiple of the interval."""

from __future__ import annotations

from types import SimpleNamespace

from services.rollout import engine as engine_module
from services.rollout.engine import HeldDeltas, TokenDelta


def test_without_an_interval_every_batch_is_due_merged_per_completion() -> None:
    held = HeldDeltas(0.0)
    held.add(1, [7], [-0.7])
    held.add(0, [5], [-0.5])
    held.add(1, [8], [-0.8])
    assert held.take() == [TokenDelta(0, [5], [-0.5]), TokenDelta(1, [7, 8], [-0.7, -0.8])]
    assert held.take() == []  # nothing held


def test_with_an_interval_tokens_wait_for_the_next_multiple_of_it(monkeypatch) -> None:
    now = [10.25]
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    a, b = HeldDeltas(0.5), HeldDeltas(0.5)
    assert a.take() == []  # nothing held: no hand-off, and the first tokens still go at once
    a.add(0, [1], [-0.1])
    assert a.take() == [TokenDelta(0, [1], [-0.1])]  # a stream's first tokens: at once
    a.add(0, [2], [-0.2])
    b.add(0, [9], [-0.9])
    now[0] = 10.375
    assert a.take() == [] and b.take() == [TokenDelta(0, [9], [-0.9])]  # b's first: at once
    a.add(0, [3], [-0.3])
    b.add(0, [10], [-1.0])
    assert a.take() == [] and b.take() == []  # both wait for the same moment
    now[0] = 10.5
    assert a.take() == [TokenDelta(0, [2, 3], [-0.2, -0.3])]
    assert b.take() == [TokenDelta(0, [10], [-1.0])]
