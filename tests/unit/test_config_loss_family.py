"""loss_fn.name and grpo.adv_estimator.name: what each preset fills, what it fixes, what it refuses."""

from __future__ import annotations

import pytest

from dockyard.config import ConfigError, load_config_text
from dockyard.config.choices import ADV_ESTIMATORS, LOSS_NAMES

BASE = """
policy: {model_name: x, train_global_batch_size: 8, generation: {max_new_tokens: 40}}
grpo: {num_prompts_per_step: 2, num_generations_per_prompt: 4}
"""


def load(*overrides: str):
    return load_config_text(BASE, list(overrides))


def test_grpo_is_the_default_and_changes_nothing():
    plain, named = load(), load("loss_fn.name=grpo")
    assert plain.loss_fn.name == "grpo"
    assert plain.resolved_yaml() == named.resolved_yaml()
    assert plain == named


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_every_name_resolves_to_a_config_that_parses_back_equal(name):
    config = load(f"loss_fn.name={name}")
    assert load_config_text(config.resolved_yaml()) == config


def test_dapo_fills_clip_higher_token_reduction_dynamic_sampling_and_overlong_shaping():
    config = load("loss_fn.name=dapo")
    loss, grpo = config.loss_fn, config.grpo
    assert (loss.clip_low, loss.clip_high, loss.reduction) == (0.2, 0.28, "token")
    assert grpo.dynamic_sampling.enabled and grpo.reward_shaping.enabled
    assert (grpo.reward_shaping.max_response_length, grpo.reward_shaping.overlong_buffer_length) == (40, 8)
    # A knob the config sets is kept.
    assert load("loss_fn.name=dapo", "loss_fn.clip_high=0.3").loss_fn.clip_high == 0.3


def test_a_presets_fixed_knob_set_otherwise_is_refused_naming_it():
    with pytest.raises(ConfigError, match="loss_fn.reduction: loss_fn.name=dapo sets loss_fn.reduction=token"):
        load("loss_fn.name=dapo", "loss_fn.reduction=sequence")
    with pytest.raises(ConfigError, match="grpo.dynamic_sampling.enabled: loss_fn.name=dapo"):
        load("loss_fn.name=dapo", "grpo.dynamic_sampling.enabled=false")
    with pytest.raises(ConfigError, match="grpo.advantage.scale: loss_fn.name=dr-grpo sets grpo.advantage.scale=none"):
        load("loss_fn.name=dr-grpo", "grpo.advantage.scale=group")


def test_dapo_is_refused_with_async_grpo_naming_it():
    with pytest.raises(ConfigError, match="loss_fn.name: loss_fn.name=dapo turns on dynamic sampling"):
        load("loss_fn.name=dapo", "grpo.async_grpo.enabled=true", "loss_fn.is_correction=plain")


def test_dr_grpo_drops_the_std_and_normalises_by_a_constant_length():
    config = load("loss_fn.name=dr-grpo")
    assert (config.grpo.advantage.scale, config.grpo.advantage.leave_one_out) == ("none", False)
    assert (config.loss_fn.reduction, config.loss_fn.length_normaliser) == ("constant", 40)
    assert load("loss_fn.name=dr-grpo", "loss_fn.length_normaliser=64").loss_fn.length_normaliser == 64


@pytest.mark.parametrize("name", ["gspo", "gspo-token"])
def test_gspo_takes_the_papers_clip_range_and_refuses_packing(name):
    loss = load(f"loss_fn.name={name}").loss_fn
    assert (loss.clip_low, loss.clip_high, loss.reduction) == (3e-4, 4e-4, "sequence")
    packed = ["policy.sequence_packing=true", "policy.max_tokens_per_micro_batch=256", "loss_fn.reduction=token"]
    with pytest.raises(ConfigError, match=f"policy.sequence_packing: loss_fn.name={name} takes each sequence's ratio"):
        load(f"loss_fn.name={name}", *packed)
    assert load("loss_fn.name=sapo", *packed).policy.sequence_packing  # a token-level objective packs


def test_cispo_has_no_lower_bound_and_sapo_its_temperatures():
    cispo, sapo = load("loss_fn.name=cispo").loss_fn, load("loss_fn.name=sapo").loss_fn
    assert (cispo.clip_low, cispo.clip_high, cispo.reduction) == (1.0, 0.28, "token")
    assert (sapo.tau_pos, sapo.tau_neg, sapo.reduction) == (1.0, 1.05, "sequence")


@pytest.mark.parametrize("name", ["cispo", "sapo"])
def test_the_dual_clip_is_refused_where_nothing_is_hard_clipped(name):
    with pytest.raises(ConfigError, match=f"loss_fn.dual_clip_c: .* loss_fn.name={name} has none"):
        load(f"loss_fn.name={name}", "loss_fn.dual_clip_c=3")


@pytest.mark.parametrize("name", [n for n in ADV_ESTIMATORS if n != "opd"])
def test_every_estimator_is_selectable(name):
    assert load(f"grpo.adv_estimator.name={name}").grpo.adv_estimator.name == name


def test_an_unknown_name_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="loss_fn.name"):
        load("loss_fn.name=ppo")
    with pytest.raises(ConfigError, match="grpo.adv_estimator.name"):
        load("grpo.adv_estimator.name=vtrace")


def test_the_kl_in_the_reward_is_reinforce_pps_on_the_torch_backend_unpacked():
    assert load("grpo.adv_estimator.name=reinforce++", "grpo.adv_estimator.kl_in_reward=0.01")
    field = "grpo.adv_estimator.kl_in_reward"
    with pytest.raises(ConfigError, match=f"{field}: the KL in the reward is REINFORCE.*'s; .*name=rloo"):
        load("grpo.adv_estimator.name=rloo", f"{field}=0.01")
    with pytest.raises(ConfigError, match=f"{field}: the JAX backend"):
        load("grpo.adv_estimator.name=reinforce++", f"{field}=0.01", "policy.backend=jax")
    packed = ["policy.sequence_packing=true", "policy.max_tokens_per_micro_batch=256"]
    with pytest.raises(ConfigError, match=f"{field}: the KL in the reward needs unpacked rows"):
        load("grpo.adv_estimator.name=reinforce++-baseline", f"{field}=0.01", *packed)
