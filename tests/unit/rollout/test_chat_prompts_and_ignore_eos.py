"""The rollout's side of data.chat_template and policy.generation.ignore_eos: refused without a template,
and the config's ignore_eos is the default of a request that sends no sampling."""

from __future__ import annotations

import pytest

from dockyard.api.rollout.v1 import rollout_pb2
from dockyard.config import load_config_text
from dockyard.models import build_char_tokenizer
from dockyard.rpc.errors import FailedPrecondition
from services.rollout.servicer import RolloutServicer
from services.rollout.settings import RolloutSettings

CONFIG = "policy: {model: {model_type: qwen2}, train_global_batch_size: 64}\n"


class Engine:
    """An engine holding the character tokenizer, with or without its chat template."""

    name, weight_version, model_name = "fake", 0, ""

    def __init__(self, template: bool) -> None:
        self.tokenizer = build_char_tokenizer()
        if not template:
            self.tokenizer.chat_template = None
        self.closed = False

    async def close(self) -> None:
        self.closed = True


@pytest.fixture
async def servicer():
    servicer = RolloutServicer(RolloutSettings())
    yield servicer
    await servicer.close()


@pytest.mark.parametrize("template", [True, False])
async def test_chat_template_needs_one_in_the_tokenizer_at_load(servicer, monkeypatch, template: bool) -> None:
    engine = Engine(template)

    async def build(cfg):
        return engine

    monkeypatch.setattr(servicer, "_build_engine", build)
    request = rollout_pb2.LoadPolicyRequest(job_id="job", config_yaml=CONFIG + "data: {chat_template: true}\n")
    if template:
        await servicer.LoadPolicy(request, None)
        assert servicer.engines["job"] is engine
        return
    with pytest.raises(FailedPrecondition, match="data.chat_template is true but the policy's tokenizer has no"):
        await servicer.LoadPolicy(request, None)
    assert engine.closed and "job" not in servicer.engines


async def test_the_configs_ignore_eos_is_the_default_decoding(servicer) -> None:
    for value in (True, False):
        servicer.configs["job"] = load_config_text(CONFIG, [f"policy.generation.ignore_eos={str(value).lower()}"])
        assert servicer._default_decoding("job").ignore_eos is value
