"""What each `loss_fn.name` sets: the knobs it fills when the config leaves them unset, and those it fixes.

    MasterConfig (sections built) ─apply_presets─> unset knobs filled from FILLED and FIXED,
                                                   reduction=constant's length resolved
                                  ─preset_errors─> [(field, message)] for a FIXED knob set otherwise

Guarantees:
- A knob the config sets (in its YAML or an override) is never changed: FILLED values are
  defaults, FIXED values are what make the preset that algorithm, and setting one to another
  value is refused by preset_errors (called by launch_rules), naming the field.
- `loss_fn.name: grpo` fills and fixes nothing: the config is what it was.
- Applied once, when MasterConfig validates; the resolved config (`resolved_yaml`) holds every
  filled value, so it parses back to the same config.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel


def _max_new_tokens(config: Any) -> int:
    return config.policy.generation.max_new_tokens


# Defaults a preset brings (a callable takes the config): the papers' values.
FILLED: dict[str, dict[str, Any]] = {
    "dapo": {
        "loss_fn.clip_low": 0.2,
        "loss_fn.clip_high": 0.28,
        # DAPO's overlong buffer: the penalty ramps over the last fifth of the generation budget.
        "grpo.reward_shaping.max_response_length": _max_new_tokens,
        "grpo.reward_shaping.overlong_buffer_length": lambda c: _max_new_tokens(c) // 5,
    },
    "dr-grpo": {"grpo.advantage.leave_one_out": False},
    "gspo": {"loss_fn.clip_low": 3e-4, "loss_fn.clip_high": 4e-4, "loss_fn.reduction": "sequence"},
    "gspo-token": {"loss_fn.clip_low": 3e-4, "loss_fn.clip_high": 4e-4, "loss_fn.reduction": "sequence"},
    "cispo": {"loss_fn.clip_low": 1.0, "loss_fn.clip_high": 0.28},
    "sapo": {"loss_fn.reduction": "sequence"},
}
# What makes the preset that algorithm: filled when unset, refused when set to anything else.
FIXED: dict[str, dict[str, Any]] = {
    "dapo": {
        "loss_fn.reduction": "token",
        "grpo.dynamic_sampling.enabled": True,
        "grpo.reward_shaping.enabled": True,
    },
    "dr-grpo": {"grpo.advantage.scale": "none", "loss_fn.reduction": "constant"},
}


def _owner(config: BaseModel, path: str) -> tuple[BaseModel, str]:
    *sections, field = path.split(".")
    owner = config
    for name in sections:
        owner = getattr(owner, name)
    return owner, field


def _value(value: Any | Callable[[Any], Any], config: Any) -> Any:
    return value(config) if callable(value) else value


def _shown(value: Any) -> str:
    """A value as an override spells it (true, not True)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def apply_presets(config: Any) -> None:
    """Fill the knobs of `config.loss_fn.name` that the config leaves unset (in place)."""
    name = config.loss_fn.name
    for path, value in {**FILLED.get(name, {}), **FIXED.get(name, {})}.items():
        owner, field = _owner(config, path)
        if field not in owner.model_fields_set:
            setattr(owner, field, _value(value, config))
    loss = config.loss_fn
    if loss.reduction == "constant" and loss.length_normaliser is None:
        loss.length_normaliser = _max_new_tokens(config)


def preset_errors(config: Any) -> list[tuple[str, str]]:
    """A FIXED knob of the preset that the config sets to another value, one entry each."""
    name = config.loss_fn.name
    errors = []
    for path, value in FIXED.get(name, {}).items():
        owner, field = _owner(config, path)
        if getattr(owner, field) != value:
            errors.append(
                (
                    path,
                    f"loss_fn.name={name} sets {path}={_shown(value)} (docs/algorithms.md, the policy-gradient "
                    f"family), but the config sets it to {_shown(getattr(owner, field))}: remove it from the "
                    f"config, set it to {_shown(value)}, or use loss_fn.name=grpo with the knobs you want",
                )
            )
    return errors
