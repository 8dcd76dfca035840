"""Error messages stay below gRPC's metadata limit, keeping their head and tail."""

from __future__ import annotations

from dockyard.rpc.errors import MAX_MESSAGE_CHARS, clip


def test_a_short_message_is_unchanged() -> None:
    assert clip("job_id is empty") == "job_id is empty"


def test_a_message_echoing_a_huge_value_keeps_its_ends_and_says_what_was_cut() -> None:
    message = f"no job {'x' * (1 << 20)!r}: call LoadPolicy first"
    clipped = clip(message)
    assert len(clipped) <= MAX_MESSAGE_CHARS + 64
    assert clipped.startswith("no job 'xxx") and clipped.endswith("call LoadPolicy first")
    assert "characters left out" in clipped
