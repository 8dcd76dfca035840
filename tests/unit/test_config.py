"""Job config: overrides, interpolation, validation that names the field, shipped configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from dockyard.config import ConfigError, MasterConfig, load_config, load_config_text

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "configs" / "tiny_expr.yaml"

MINIMAL = """
policy:
  model: {model_type: qwen2, hidden_size: 32}
  train_global_batch_size: ${mul:${grpo.num_prompts_per_step},${grpo.num_generations_per_prompt}}
grpo:
  num_prompts_per_step: 2
  num_generations_per_prompt: 3
"""


@pytest.mark.parametrize("path", sorted((REPO / "examples" / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_parses(path: Path) -> None:
    assert isinstance(load_config(path, strict=True), MasterConfig)


def test_mul_resolver_and_interpolation() -> None:
    cfg = load_config_text(MINIMAL)
    assert cfg.policy.train_global_batch_size == 6


def test_override_changes_value_and_interpolation_follows() -> None:
    cfg = load_config_text(MINIMAL, ["grpo.num_prompts_per_step=4"])
    assert cfg.grpo.num_prompts_per_step == 4
    assert cfg.policy.train_global_batch_size == 12


def test_override_of_a_default_not_in_the_yaml() -> None:
    cfg = load_config_text(MINIMAL, ["loss_fn.clip_high=0.28"])
    assert cfg.loss_fn.clip_high == pytest.approx(0.28)


def test_override_of_unknown_key_is_refused_unless_added() -> None:
    with pytest.raises(ConfigError, match=r"grpo\.num_prompt_per_step.*\+grpo\.num_prompt_per_step"):
        load_config_text(MINIMAL, ["grpo.num_prompt_per_step=4"])
    cfg = load_config_text(MINIMAL, ["+grpo.my_note=hello"])
    assert cfg.grpo.model_extra == {"my_note": "hello"}


def test_override_without_equals_is_refused() -> None:
    with pytest.raises(ConfigError, match="key=value"):
        load_config_text(MINIMAL, ["grpo.num_prompts_per_step"])


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("policy.generation.temperature=nan", "policy.generation.temperature"),
        ("policy.generation.top_p=1.5", "policy.generation.top_p"),
        ("grpo.max_num_steps=0", "grpo.max_num_steps"),
        ("loss_fn.kl_type=k9", "loss_fn.kl_type"),
        ("policy.optimizer.lr=-1", "policy.optimizer.lr"),
        ("loss_fn.dual_clip_c=0.5", "loss_fn.dual_clip_c"),
        ("policy.train_global_batch_size=5", "policy.train_global_batch_size"),
        ("grpo.async_grpo.enabled=true", "loss_fn.is_correction"),
        (f"policy.generation.stop_strings=[{'x' * 257}]", "policy.generation.stop_strings"),
        (f"policy.generation.stop_strings=[{','.join(['x'] * 17)}]", "policy.generation.stop_strings"),
        ("policy.generation.stop_strings=['']", "policy.generation.stop_strings"),
    ],
)
def test_bad_value_fails_naming_the_field(override: str, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config_text(MINIMAL, [override])
    assert field in str(info.value)


def test_policy_needs_a_source() -> None:
    with pytest.raises(ConfigError, match="model_name"):
        load_config_text("policy: {train_global_batch_size: 64}")


def test_extra_keys_are_kept_and_reported() -> None:
    cfg = load_config_text(MINIMAL + "env:\n  my_env_option: 3\n  sandbox: {timeout_secs: 4}\n")
    assert cfg.env.model_extra == {"my_env_option": 3}
    assert cfg.unknown_keys() == ["env.my_env_option", "env.sandbox.timeout_secs"]
    assert load_config_text(MINIMAL).unknown_keys() == []


def test_resolved_yaml_round_trips() -> None:
    cfg = load_config(TINY, ["grpo.max_num_steps=3"])
    again = load_config_text(cfg.resolved_yaml())
    assert again == cfg
    assert "${" not in cfg.resolved_yaml()


def test_missing_file_and_bad_yaml() -> None:
    with pytest.raises(ConfigError, match="no config file"):
        load_config("/nonexistent/job.yaml")
    with pytest.raises(ConfigError):
        load_config_text("policy: [unclosed")


def test_async_grpo_with_importance_sampling_correction_is_accepted() -> None:
    cfg = load_config_text(MINIMAL, ["grpo.async_grpo.enabled=true", "loss_fn.is_correction=tis", "loss_fn.is_max=2"])
    assert cfg.grpo.async_grpo.enabled and cfg.loss_fn.is_correction == "tis"


@pytest.mark.parametrize(
    ("yaml_typo", "override", "named", "suggested"),
    [
        ("logger:", None, "loger", "logger"),
        (None, "loss_fn.kl_penaltly=0.1", "loss_fn.kl_penaltly", "loss_fn.kl_penalty"),
        (None, "grpo.max_num_step=3", "grpo.max_num_step", "grpo.max_num_steps"),
        ("  kl_penalty: 0.0", None, "loss_fn.kl_penaltly", "loss_fn.kl_penalty"),
    ],
)
def test_a_typo_is_an_error_that_names_the_closest_key(yaml_typo, override, named, suggested) -> None:
    text = TINY.read_text()
    if yaml_typo == "logger:":
        text = text.replace("logger:", "loger:")
    elif yaml_typo:
        text = text.replace(yaml_typo, yaml_typo.replace("kl_penalty", "kl_penaltly"))
    with pytest.raises(ConfigError) as info:
        load_config_text(text, [override] if override else [], strict=True)
    assert named in str(info.value) and f"did you mean {suggested}?" in str(info.value)


def test_a_key_added_on_purpose_is_kept_under_strict_loading() -> None:
    cfg = load_config(TINY, ["+logger.my_tag=abc", "+myteam.owner=me"], strict=True)
    assert cfg.unknown_keys() == ["myteam", "logger.my_tag"]
    # The same keys written into the file are typos until an override adds them.
    with pytest.raises(ConfigError, match="myteam"):
        load_config_text(TINY.read_text() + "myteam: {owner: me}\n", strict=True)


def test_a_group_of_one_sample_is_refused() -> None:
    with pytest.raises(ConfigError, match="grpo.num_generations_per_prompt") as info:
        load_config_text(MINIMAL, ["grpo.num_generations_per_prompt=1"])
    assert "no baseline" in str(info.value)


def test_validating_a_config_imports_neither_torch_nor_transformers() -> None:
    import subprocess
    import sys

    code = (
        "import sys; from dockyard.config import load_config; "
        f"load_config({str(TINY)!r}, ['grpo.max_num_steps=3'], strict=True); "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert out.strip() == "[]"


def test_the_colocated_transport_is_accepted_except_for_sglang() -> None:
    cfg = load_config(TINY, ["cluster.device=cuda", "cluster.weight_sync_transport=colocated"])
    assert cfg.cluster.weight_sync_transport == "colocated"
    with pytest.raises(ConfigError, match="cluster.weight_sync_transport.*SGLang"):
        load_config(TINY, ["cluster.weight_sync_transport=colocated", "policy.generation.backend=sglang"])


def test_a_supervised_agent_job_needs_conversations() -> None:
    agent = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny_agent.yaml"
    with pytest.raises(ConfigError, match="set sft.dataset"):  # task solutions are not conversations
        load_config(agent, ["+sft.max_num_steps=2"])
    # An agent run's exported trials: the job trains on them and validates with agent trials.
    cfg = load_config(agent, ["+sft.dataset=runs/agent-sft.jsonl", "+sft.max_num_steps=2"])
    assert cfg.sft is not None and cfg.env.agentic
