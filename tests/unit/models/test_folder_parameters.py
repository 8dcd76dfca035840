"""A model folder's parameter count from its safetensors headers (what a tensor-parallel vLLM engine reports)."""

from __future__ import annotations

from dockyard.models import build_random_model
from dockyard.models.load import folder_parameters

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}


def test_the_count_is_the_models_whatever_the_sharding_of_the_files(tmp_path) -> None:
    for tied in (True, False):
        model = build_random_model({**TINY, "tie_word_embeddings": tied}, 50, seed=0)
        expected = sum(p.numel() for p in model.parameters())  # a tied lm_head counted once, as the file holds it
        one, many = tmp_path / f"one-{tied}", tmp_path / f"many-{tied}"
        model.save_pretrained(one)
        model.save_pretrained(many, max_shard_size="20KB")
        assert len(list(many.glob("*.safetensors"))) > 1
        assert folder_parameters(one) == folder_parameters(many) == expected
    assert folder_parameters(tmp_path) == 0  # no safetensors files: unknown
