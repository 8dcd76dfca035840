"""env.reward naming a function: its syntax in the config, finding its source without importing it,
the ast check that it is defined, preflight's finding, and the async launch rule of the penalty."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dockyard.config import ConfigError, EnvConfig, load_config
from dockyard.preflight import ERROR, OK, SKIP, check_reward_functions
from dockyard.tasks.reward_functions import RewardFunctionError, load, locate, syntax_error

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "examples" / "configs" / "tiny_expr.yaml"
GOOD = "def score(task, completion, verdict):\n    return 1.0\n"


@pytest.mark.parametrize("spec", ["pass_fraction", "all_pass", "pkg.mod:score", "mod:_f1", "a/b c.py:score"])
def test_accepted_reward_names(spec: str) -> None:
    assert syntax_error(spec) is None


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("pass_rate", "is not a reward"),
        ("pkg.mod", "is not a reward"),
        ("pkg.mod:1f", "is not a reward"),
        ("pkg mod:f", "neither a dotted module name nor a path ending in .py"),
        ("rewards/x.txt:f", "neither a dotted module name nor a path ending in .py"),
    ],
)
def test_refused_reward_names_say_what_is_accepted(spec: str, why: str) -> None:
    assert why in (syntax_error(spec) or "")
    with pytest.raises(ValueError, match="env.reward"):
        EnvConfig(reward=spec)


def test_a_list_of_weighted_rewards_is_the_sum_of_its_terms() -> None:
    env = EnvConfig(reward=[{"reward": "rewards.py:score", "weight": 0.7}, {"reward": "all_pass", "weight": 0.3}])
    assert env.reward_terms == [("rewards.py:score", 0.7), ("all_pass", 0.3)]
    assert EnvConfig().reward_terms == [("pass_fraction", 1.0)]
    with pytest.raises(ValueError, match="a list of 1 to 16"):
        EnvConfig(reward=[])
    with pytest.raises(ValueError, match="weight"):
        EnvConfig(reward=[{"reward": "all_pass", "weight": float("nan")}])


def test_a_file_is_found_relative_to_the_working_directory(tmp_path: Path) -> None:
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "mine.py").write_text(GOOD)
    found = load("rewards/mine.py:score", cwd=str(tmp_path))
    assert (found.function, found.source, found.origin) == ("score", GOOD, "rewards/mine.py:score")
    with pytest.raises(RewardFunctionError, match=f"no file {tmp_path}/rewards/other.py"):
        locate("rewards/other.py:score", cwd=str(tmp_path))


def test_a_module_is_found_without_importing_it_or_its_packages(tmp_path: Path) -> None:
    package = tmp_path / "userpkg_unimported"
    (package / "inner").mkdir(parents=True)
    marker = tmp_path / "imported"
    side_effect = f"open({str(marker)!r}, 'w').close()\n"
    (package / "__init__.py").write_text(side_effect)
    (package / "inner" / "__init__.py").write_text(side_effect)
    (package / "inner" / "scoring.py").write_text(side_effect + GOOD)
    found = load("userpkg_unimported.inner.scoring:score", cwd=str(tmp_path))
    assert found.path == str(package / "inner" / "scoring.py") and "return 1.0" in found.source
    assert not marker.exists() and "userpkg_unimported" not in sys.modules
    with pytest.raises(RewardFunctionError, match="no module 'userpkg_unimported.missing'"):
        load("userpkg_unimported.missing:score", cwd=str(tmp_path))
    with pytest.raises(RewardFunctionError, match="'userpkg_unimported.inner.scoring' is a module, not a package"):
        load("userpkg_unimported.inner.scoring.deeper:score", cwd=str(tmp_path))


@pytest.mark.parametrize(
    ("source", "why"),
    [
        (
            "def other(task, completion, verdict):\n    return 0\n",
            "defines no top-level function 'score' (it defines: other)",
        ),
        ("async def score(task, completion, verdict):\n    return 0\n", "line 1: 'score' is async"),
        ("def score(task):\n    return 0\n", "must take three arguments"),
        ("def score(task, completion, verdict)\n    return 0\n", "line 1: not valid Python"),
        ("class C:\n    def score(task, completion, verdict):\n        return 0\n", "defines no top-level function"),
    ],
)
def test_a_file_without_the_function_is_refused_naming_the_file(tmp_path: Path, source: str, why: str) -> None:
    (tmp_path / "r.py").write_text(source)
    with pytest.raises(RewardFunctionError) as err:
        load("r.py:score", cwd=str(tmp_path))
    assert str(tmp_path / "r.py") in str(err.value) and why in str(err.value)


def test_preflight_checks_each_named_function(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.py").write_text(GOOD)
    base = ["policy.model_name=null", "policy.bootstrap=null"]
    assert check_reward_functions(load_config(TINY, base)).status == SKIP
    ok = check_reward_functions(load_config(TINY, [*base, "env.reward=r.py:score"]))
    assert ok.status == OK and "r.py:score" in ok.message
    bad = check_reward_functions(load_config(TINY, [*base, "env.reward=r.py:missing"]))
    assert bad.status == ERROR and "defines no top-level function 'missing'" in bad.message


def test_the_invalid_action_penalty_is_shaping_refused_with_async_grpo() -> None:
    base = ["policy.model_name=null", "policy.bootstrap=null", "grpo.invalid_action_penalty=0.5"]
    assert load_config(TINY, base).grpo.invalid_action_penalty == 0.5  # synchronous: allowed
    async_grpo = ["grpo.async_grpo.enabled=true", "loss_fn.is_correction=tis", "loss_fn.is_max=2"]
    with pytest.raises(ConfigError, match="grpo.invalid_action_penalty"):
        load_config(TINY, [*base, *async_grpo])
    assert load_config(TINY, [*base[:2], *async_grpo]).grpo.invalid_action_penalty == 0.0


def test_the_shipped_example_is_found_and_defines_its_function() -> None:
    found = load("examples/rewards/concise.py:score", cwd=str(REPO))
    assert found.function == "score" and found.path == str(REPO / "examples" / "rewards" / "concise.py")
