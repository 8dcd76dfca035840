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


SHAPE = common_pb2.RoutingShape(moe_layers=2, top_k=2, num_experts=8)


def routed_group(num_experts: int = 8) -> common_pb2.Group:
    """mixed_group with routing on its single-turn trajectory and on both segments of the multi-turn one."""
    group = mixed_group()
    shape = common_pb2.RoutingShape(moe_layers=2, top_k=2, num_experts=num_experts)
    width = 1 if num_experts <= 256 else 2
    rng = np.random.default_rng(0)
    for trajectory in group.trajectories[:2]:
        trajectory.routing_shape.CopyFrom(shape)
        for part in (trajectory, *trajectory.later_segments):
            positions = len(part.prompt_token_ids) + len(part.completion_token_ids) - 1
            ids = rng.integers(0, num_experts, size=(positions, 2, 2))
            part.routing = ids.astype("<u2" if width == 2 else np.uint8).tobytes()
    return group


@pytest.mark.parametrize("experts", [8, 300])
def test_routing_travels_in_version_2_and_merges_back_exactly(experts: int) -> None:
    group = routed_group(experts)
    metadata, data = payload.split(group)
    assert data[3] == 2 and len(data) % 4 == 0
    assert not any(payload.has_tokens(t) for t in metadata.trajectories)
    assert payload.merge(metadata, data) == group
    single, multi, failed = payload.unpack(data)
    assert single[0].routing.shape == (6, 2, 2) and multi[1].routing.shape == (2, 2, 2)
    assert single[0].routing.tobytes() == group.trajectories[0].routing


def test_a_payload_without_routing_is_still_version_1_byte_for_byte() -> None:
    data = payload.pack(mixed_group().trajectories)
    assert data[3] == 1  # what readers of version 1 (the agent-trial assembler among them) read
    assert payload.unpack(data)[0][0].routing is None


def test_routing_that_does_not_fit_its_tokens_is_refused_when_packed() -> None:
    group = routed_group()
    group.trajectories[0].routing = group.trajectories[0].routing[:-4]  # one position short
    with pytest.raises(payload.PayloadError, match="routing holds 20 bytes; its 2 prompt and 5 completion tokens"):
        payload.pack(group.trajectories)
