"""Sampling bounds have one home (dockyard.config.sampling): the config, the endpoint's request
schemas, the rollout's Generate check and the vLLM engine all refuse the same values."""

from __future__ import annotations

import pytest
from annotated_types import Ge, Gt, Le
from pydantic import BaseModel, ValidationError

from dockyard.config import sampling
from dockyard.config.sampling import SamplingConfig
from services.endpoint.schemas import ChatCompletionRequest, MessagesRequest
from services.rollout import decoding, vllm_engine


def bounds(model: type[BaseModel], field: str) -> dict[str, float]:
    found = {}
    for item in model.model_fields[field].metadata:
        for kind, attr in ((Ge, "ge"), (Gt, "gt"), (Le, "le")):
            if isinstance(item, kind):
                found[attr] = getattr(item, attr)
    return found


@pytest.mark.parametrize(
    ("model", "temperature_max"),
    [
        (SamplingConfig, sampling.MAX_TEMPERATURE),
        (ChatCompletionRequest, sampling.OPENAI_MAX_TEMPERATURE),
        (MessagesRequest, sampling.ANTHROPIC_MAX_TEMPERATURE),
    ],
)
def test_every_schema_reads_the_bounds_of_the_config(model: type[BaseModel], temperature_max: float) -> None:
    assert bounds(model, "temperature") == {"ge": sampling.MIN_TEMPERATURE, "le": temperature_max}
    assert bounds(model, "top_p") == {"gt": sampling.TOP_P_ABOVE, "le": sampling.MAX_TOP_P}
    assert bounds(model, "top_k")["ge"] == sampling.MIN_TOP_K


def test_the_rollout_and_vllm_take_theirs_from_the_config() -> None:
    assert decoding.MAX_TEMPERATURE is sampling.MAX_TEMPERATURE
    assert vllm_engine.VLLM_MAX_TEMPERATURE is sampling.VLLM_MAX_TEMPERATURE


def test_the_config_refuses_a_temperature_past_the_bound() -> None:
    with pytest.raises(ValidationError, match="less than or equal to 100"):
        SamplingConfig(temperature=sampling.MAX_TEMPERATURE + 1)
