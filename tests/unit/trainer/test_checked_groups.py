"""Groups are validated once on a path: the servicer's CheckedGroups are taken as they are downstream."""

from __future__ import annotations

import pickle

import pytest

from dockyard.config import load_config_text
from dockyard.experience.trainable import BatchError, CheckedGroups, checked_groups
from services.trainer import minibatches
from services.trainer.experience import Sample, TrainingGroup

CONFIG = """
policy:
  model: {model_type: qwen2, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1,
          num_attention_heads: 2, num_key_value_heads: 1, max_position_embeddings: 64}
  train_global_batch_size: 2
  train_micro_batch_size: 2
grpo: {num_prompts_per_step: 1, num_generations_per_prompt: 2}
"""


def _groups() -> list[TrainingGroup]:
    samples = [Sample(f"g/{i}", [1, 2], [3, 4], [-0.5, -0.5], float(i), True) for i in range(2)]
    return [TrainingGroup("g", samples)]


def test_checked_groups_refuse_what_validate_groups_refuses() -> None:
    bad = _groups()
    bad[0].samples[0].reward = float("nan")
    with pytest.raises(BatchError, match="reward is nan"):
        checked_groups(bad, vocab_size=10, max_length=None)


def test_checked_groups_survive_the_trip_to_other_ranks() -> None:
    groups = checked_groups(_groups(), vocab_size=10, max_length=None)
    again = pickle.loads(pickle.dumps(groups))
    assert isinstance(again, CheckedGroups) and again == groups


def test_prepare_step_checks_plain_groups_and_not_checked_ones(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(minibatches, "validate_groups", lambda *args: calls.append(args))
    config = load_config_text(CONFIG)
    plan = lambda batch, advantages: []  # noqa: E731
    minibatches.prepare_step(_groups(), config, 0, 10, None, None, plan, 1)
    assert len(calls) == 1
    checked = checked_groups(_groups(), vocab_size=10, max_length=None)
    minibatches.prepare_step(checked, config, 0, 10, None, None, plan, 1)
    assert len(calls) == 1
