"""Hostile config text is refused fast, naming what is wrong; every integer field has a bound."""

from __future__ import annotations

import pytest

from dockyard.config import MAX_CONFIG_BYTES, MAX_CONFIG_NODES, ConfigError, load_config_text, parse_config_text

BASE = "policy: {model: {model_type: qwen2}, train_global_batch_size: 64}\n"
# 254 bytes that expand to 9^7 values.
ALIAS_BOMB = 'a: &a ["x","x","x","x","x","x","x","x","x"]\n' + "".join(
    f"{b}: &{b} [{','.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdef", "bcdefg", strict=True)
)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (ALIAS_BOMB, ["expands", str(MAX_CONFIG_NODES)]),
        ("a: &a [*a]\n", ["a.0", "refers to a node that contains it"]),
        ("x: " + "[" * 5000 + "]" * 5000, ["nested too deep"]),
        ("x: " + "[" * 40 + "]" * 40, ["nested deeper than"]),
        (BASE + "#" * MAX_CONFIG_BYTES, ["bytes", str(MAX_CONFIG_BYTES)]),
        (BASE + "grpo: {max_num_steps: 9223372036854775808}", ["grpo.max_num_steps", "2^53"]),
        (BASE.replace("qwen2}", "qwen2, hidden_size: 99999999999999999999}"), ["policy.model.hidden_size"]),
        (BASE + "extra: {n: -99999999999999999999}", ["extra.n"]),
    ],
)
def test_hostile_text_is_refused_naming_why(text: str, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config_text(text, origin="config_yaml")
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(
    "override",
    [
        "grpo.max_num_steps=1000000000",
        "sft.max_num_steps=1000000000",
        "grpo.num_prompts_per_step=100000000",
        "policy.train_micro_batch_size=100000000",
        "grpo.seed=-1",
        "data.train.seed=4294967296",
        "checkpointing.save_period=100000000",
        "env.sandbox.memory_mb=99999999",
    ],
)
def test_every_integer_field_has_a_bound(override: str) -> None:
    key = override.partition("=")[0]
    text = BASE + ("sft: {}\n" if key.startswith("sft.") else "")
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config_text(text, [override])


def test_an_ordinary_config_still_loads_and_anchors_within_bounds_work() -> None:
    config = load_config_text(BASE + "grpo: &g {max_num_steps: 3}\nsft_like: *g\n")
    assert config.grpo.max_num_steps == 3


async def test_parse_config_text_parses_off_the_event_loop() -> None:
    assert (await parse_config_text(BASE)).grpo.max_num_steps == 20
    with pytest.raises(ConfigError, match="expands"):
        await parse_config_text(ALIAS_BOMB)


def _doubling(levels: int, relative: bool = False) -> str:
    """`a: ten chars`, then each key the previous one twice: 10 * 2**levels characters once resolved."""
    dot = "." if relative else ""
    lines = ["x:", "  a: xxxxxxxxxx"]
    for i in range(levels):
        prev = "a" if i == 0 else f"c{i - 1}"
        lines.append(f"  c{i}: ${{{dot}{prev}}}${{{dot}{prev}}}" if relative else f"  c{i}: ${{x.{prev}}}${{x.{prev}}}")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("relative", [False, True], ids=["absolute", "relative"])
def test_an_interpolation_chain_that_doubles_is_refused_before_it_expands(relative: bool) -> None:
    with pytest.raises(ConfigError, match="interpolations expand past"):
        load_config_text(_doubling(40, relative))


def test_interpolations_of_reasonable_size_still_resolve() -> None:
    config = load_config_text(_doubling(10) + "policy:\n  model: {model_type: qwen2, hidden_size: 32}\n")
    assert len(config.model_extra["x"]["c9"]) == 10 * 2**10
