"""Decoding parameters, checked once at the rollout service's boundary.

    GenerateRequest.sampling (proto)     ──decoding_from_proto──┐
                                                                ├──> DecodingParams ──> engine
    no sampling: job's policy.generation ──validate_decoding────┘

Guarantees: every DecodingParams an engine receives from the service is
valid — finite numbers, temperature in [0, 100], top_p in (0, 1], top_k >= 0,
1 <= max_new_tokens <= the replica's ceiling, 1..16 non-empty stop strings of at
most 256 characters or none — and every refusal is an InvalidArgument whose message starts with the
offending field's name (``sampling.<field>`` for the proto message,
``policy.generation.<field>`` for the job's defaults). A proto top_p of 0 (the
proto3 default) means "off" and is read as 1. ``top_logprobs`` (alternatives
reported per sampled token) is a GenerateRequest field, not a sampling one:
it is checked by `validate_top_logprobs` (0..20, OpenAI's bound) and set on the
DecodingParams the request samples with, whichever way those came.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dockyard.config.sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_TEMPERATURE
from dockyard.rpc.errors import InvalidArgument

if TYPE_CHECKING:  # the engines (and bench/) need no protobuf runtime
    from dockyard.api.common.v1 import common_pb2

MAX_NUM_SAMPLES = 1024
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs (and vLLM's default max_logprobs)


@dataclass(frozen=True)
class DecodingParams:
    """What one generation request asks of an engine."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass; 1 = off
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 32
    stop: tuple[str, ...] = ()  # a completion ends right after the token that completes one
    ignore_eos: bool = False  # keep generating past eos up to max_new_tokens
    seed: int | None = None  # None = nondeterministic
    top_logprobs: int = 0  # alternatives reported per sampled token; 0 = none (nothing computed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _finite(field: str, value: float) -> float:
    if not math.isfinite(value):
        raise InvalidArgument(f"{field}: must be a finite number, got {value}")
    return value


def validate_decoding(
    temperature: float,
    top_p: float,
    top_k: int,
    max_new_tokens: int,
    stop: list[str] | tuple[str, ...],
    ignore_eos: bool,
    seed: int | None,
    *,
    max_new_tokens_ceiling: int,
    prefix: str = "sampling.",
) -> DecodingParams:
    """A DecodingParams from raw values, or InvalidArgument naming the field."""
    temperature = _finite(f"{prefix}temperature", float(temperature))
    if not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise InvalidArgument(f"{prefix}temperature: must be in [0, {MAX_TEMPERATURE:g}], got {temperature}")
    top_p = _finite(f"{prefix}top_p", float(top_p))
    if top_p == 0.0:
        top_p = 1.0
    if not 0.0 < top_p <= 1.0:
        raise InvalidArgument(f"{prefix}top_p: must be in (0, 1] (0 means off), got {top_p}")
    if top_k < 0:
        raise InvalidArgument(f"{prefix}top_k: must be >= 0 (0 means off), got {top_k}")
    if not 1 <= max_new_tokens <= max_new_tokens_ceiling:
        raise InvalidArgument(
            f"{prefix}max_new_tokens: must be in [1, {max_new_tokens_ceiling}] on this replica, got {max_new_tokens}"
        )
    stop = tuple(stop)
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"{prefix}stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    if any(s == "" for s in stop):
        raise InvalidArgument(f"{prefix}stop: stop strings must be non-empty")
    if (longest := max((len(s) for s in stop), default=0)) > MAX_STOP_CHARS:
        raise InvalidArgument(
            f"{prefix}stop: a stop string is at most {MAX_STOP_CHARS} characters, got one of {longest}"
        )
    return DecodingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=int(top_k),
        max_new_tokens=int(max_new_tokens),
        stop=stop,
        ignore_eos=bool(ignore_eos),
        seed=None if seed is None else int(seed),
    )


def decoding_from_proto(msg: common_pb2.SamplingParams, *, max_new_tokens_ceiling: int) -> DecodingParams:
    """Validate a proto SamplingParams message; its fields are taken literally (temperature 0 is greedy)."""
    return validate_decoding(
        temperature=msg.temperature,
        top_p=msg.top_p,
        top_k=msg.top_k,
        max_new_tokens=msg.max_new_tokens,
        stop=list(msg.stop),
        ignore_eos=msg.ignore_eos,
        seed=msg.seed if msg.HasField("seed") else None,
        max_new_tokens_ceiling=max_new_tokens_ceiling,
    )


def default_decoding(generation: Any, *, max_new_tokens_ceiling: int) -> DecodingParams:
    """A job's `policy.generation` defaults as DecodingParams (a Generate without `sampling` uses them)."""
    return validate_decoding(
        temperature=generation.temperature,
        top_p=generation.top_p,
        top_k=generation.top_k,
        max_new_tokens=generation.max_new_tokens,
        stop=generation.stop_strings,
        ignore_eos=generation.ignore_eos,
        seed=None,
        max_new_tokens_ceiling=max_new_tokens_ceiling,
        prefix="policy.generation.",
    )


def validate_num_samples(num_samples: int) -> int:
    if not 1 <= num_samples <= MAX_NUM_SAMPLES:
        raise InvalidArgument(f"num_samples: must be in [1, {MAX_NUM_SAMPLES}], got {num_samples}")
    return num_samples


def validate_top_logprobs(top_logprobs: int) -> int:
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"top_logprobs: must be in [0, {MAX_TOP_LOGPROBS}] (0 means none), got {top_logprobs}")
    return int(top_logprobs)
