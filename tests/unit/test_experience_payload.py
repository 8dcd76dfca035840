"""The packed payload (dockyard/experience/payload.py): what split packs, merge and unpack give back."""

from __future__ import annotations

import numpy as np
import pytest

from dockyard.api.common.v1 import common_pb2
from dockyard.experience import payload
from tests.conftest import make_group


def mixed_group() -> common_pb2.Group:
    """Single-turn, multi-turn (mask, later segment) and a trial that failed before any token."""
    group = make_group("g", n=3, tokens=5)
    group.trajectories[1].completion_loss_mask[:] = [1, 0, 0, 1, 1]
    group.trajectories[1].later_segments.add(
        prompt_token_ids=[9, 8], completion_token_ids=[7], completion_logprobs=[-2.5], completion_loss_mask=[1]
    )
    failed = group.trajectories[2]
    for name in ("prompt_token_ids", "completion_token_ids", "completion_logprobs"):
        failed.ClearField(name)
    failed.valid = False
    return group


def test_split_then_merge_gives_the_group_back_field_for_field() -> None:
    group = mixed_group()
    metadata, data = payload.split(group)
    assert not any(payload.has_tokens(t) for t in metadata.trajectories)
    assert [t.reward for t in metadata.trajectories] == [t.reward for t in group.trajectories]
    assert payload.merge(metadata, data) == group
    assert len(data) % 4 == 0  # every section aligned: the arrays are views


def test_unpack_gives_each_trajectorys_segments_as_typed_arrays() -> None:
    single, multi, failed = payload.unpack(payload.pack(mixed_group().trajectories))
    assert failed == []
    [s] = single
    assert (s.prompt.dtype, s.completion.dtype, s.logprobs.dtype, s.mask) == (np.int32, np.int32, np.float32, None)
    assert s.prompt.tolist() == [1, 2] and s.completion.tolist() == [3, 4, 5, 6, 7]
    assert np.allclose(s.logprobs, -0.1)
    first, later = multi
    assert first.mask.tolist() == [1, 0, 0, 1, 1]
    assert (later.prompt.tolist(), later.completion.tolist(), later.logprobs.tolist()) == ([9, 8], [7], [-2.5])


@pytest.mark.parametrize(
    ("mangle", "words"),
    [
        (lambda d: d[:-1], "header describes"),
        (lambda d: d + b"\0\0\0\0", "header describes"),
        (lambda d: b"XYZ" + d[3:], "not a packed payload"),
        (lambda d: d[:3] + bytes([9]) + d[4:], "payload version 9"),
        (lambda d: d[:4] + (10**6).to_bytes(4, "little") + d[8:], "names 1000000 trajectories"),
    ],
)
def test_bytes_not_of_the_layout_raise_payload_error(mangle, words) -> None:
    data = payload.pack(mixed_group().trajectories)
    with pytest.raises(payload.PayloadError, match=words):
        payload.unpack(mangle(data))


def test_a_segment_with_one_logprob_short_is_refused_when_packed() -> None:
    group = make_group("g")
    del group.trajectories[0].completion_logprobs[-1]
    with pytest.raises(payload.PayloadError, match="3 completion tokens, 2 logprobs"):
        payload.pack(group.trajectories)


def test_chunks_cover_the_bytes_in_order() -> None:
    data = bytes(range(256)) * 10
    assert b"".join(payload.chunks(data, 1000)) == data
    assert [len(c) for c in payload.chunks(data, 1000)] == [1000, 1000, 560]
    assert list(payload.chunks(b"")) == [b""]
