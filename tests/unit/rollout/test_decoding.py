"""Sampling controls at the rollout boundary: every bad value is refused with a message naming its field."""

from __future__ import annotations

import math

import pytest

from dockyard.api.common.v1 import common_pb2
from dockyard.rpc.errors import InvalidArgument
from services.rollout.decoding import DecodingParams, decoding_from_proto, validate_num_samples

CEILING = 256


def proto(**fields) -> common_pb2.SamplingParams:
    base = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 16}
    return common_pb2.SamplingParams(**{**base, **fields})


def parse(**fields) -> DecodingParams:
    return decoding_from_proto(proto(**fields), max_new_tokens_ceiling=CEILING)


def test_valid_params_pass_through() -> None:
    params = parse(
        temperature=0.5, top_p=0.9, top_k=7, max_new_tokens=CEILING, stop=["\n", "##"], ignore_eos=True, seed=3
    )
    assert params == DecodingParams(
        temperature=0.5,
        top_p=pytest.approx(0.9),
        top_k=7,
        max_new_tokens=CEILING,
        stop=("\n", "##"),
        ignore_eos=True,
        seed=3,
    )


def test_unset_seed_is_none_and_zero_seed_is_kept() -> None:
    assert parse().seed is None
    assert parse(seed=0).seed == 0


def test_top_p_zero_means_off() -> None:
    assert parse(top_p=0.0).top_p == 1.0


def test_temperature_zero_is_greedy_and_bounds_are_inclusive() -> None:
    assert parse(temperature=0.0).greedy
    assert parse(temperature=100.0).temperature == 100.0


@pytest.mark.parametrize(
    ("fields", "field_name"),
    [
        ({"temperature": math.nan}, "sampling.temperature"),
        ({"temperature": math.inf}, "sampling.temperature"),
        ({"temperature": -0.1}, "sampling.temperature"),
        ({"temperature": 100.5}, "sampling.temperature"),
        ({"top_p": math.nan}, "sampling.top_p"),
        ({"top_p": -math.inf}, "sampling.top_p"),
        ({"top_p": 1.5}, "sampling.top_p"),
        ({"top_p": -0.2}, "sampling.top_p"),
        ({"top_k": -1}, "sampling.top_k"),
        ({"max_new_tokens": 0}, "sampling.max_new_tokens"),
        ({"max_new_tokens": -5}, "sampling.max_new_tokens"),
        ({"max_new_tokens": CEILING + 1}, "sampling.max_new_tokens"),
        ({"stop": ["ok", ""]}, "sampling.stop"),
        ({"stop": [str(i) for i in range(17)]}, "sampling.stop"),
    ],
)
def test_bad_values_are_refused_naming_the_field(fields: dict, field_name: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        parse(**fields)
    assert str(info.value).startswith(f"{field_name}:")


def test_sixteen_stop_strings_are_allowed() -> None:
    assert len(parse(stop=[str(i) for i in range(16)]).stop) == 16


@pytest.mark.parametrize("n", [0, -1, 1025])
def test_num_samples_out_of_range_is_refused(n: int) -> None:
    with pytest.raises(InvalidArgument, match=r"^num_samples:"):
        validate_num_samples(n)


@pytest.mark.parametrize("n", [1, 1024])
def test_num_samples_bounds_are_inclusive(n: int) -> None:
    assert validate_num_samples(n) == n
