"""Each failure-signature detector trips on a synthetic bad series and stays silent on a healthy one."""

from __future__ import annotations

import pytest

from dockyard.config import SignaturesConfig
from dockyard.monitoring.signatures import DETECTORS, Monitor

WINDOW = 5


def healthy(step: int) -> dict[str, float]:
    """A step of a run that learns: spread rewards, steady entropy, small KLs, few drops, quick syncs."""
    return {
        "groups": 8.0,
        "uniform_reward_groups": 2.0,
        "dropped_uniform_groups": 0.0,
        "entropy": 0.9 - 0.01 * step,
        "kl": 0.01 * step,
        "gen_train_kl": 0.002,
        "buffer_puts": 8.0 * step,
        "buffer_dropped_stale": 0.0 if step < 3 else 1.0,
        "dropped_stale_on_put": 0.0,
        "verdict_passed": 30.0,
        "verdict_failed": 33.0,
        "verdict_error": 1.0,
        "weight_sync_seconds": 0.4,
        "integrity_violations": 0.0,
    }


# signature -> how step s of a run showing it differs from healthy(s)
BAD = {
    "no_learning_signal": lambda s: {"uniform_reward_groups": 8.0},
    "entropy_collapse": lambda s: {"entropy": 0.9 * 0.5**s},
    "kl_blowup": lambda s: {"kl": 0.1 * 2**s},
    "generation_mismatch": lambda s: {"gen_train_kl": 0.05 * s},
    "stale_drops": lambda s: {"buffer_dropped_stale": 4.0 * s},
    "sandbox_errors": lambda s: {"verdict_error": 20.0},
    "slow_weight_sync": lambda s: {"weight_sync_seconds": 90.0},
    "integrity_flags": lambda s: {"integrity_violations": 1.0 + s},
}


def run(steps: int, change=lambda s: {}) -> list[list[str]]:
    monitor = Monitor(SignaturesConfig(window=WINDOW))
    return [[sig.name for sig in monitor.observe({**healthy(s), **change(s)})] for s in range(1, steps + 1)]


def test_a_healthy_run_shows_no_signature() -> None:
    assert run(12) == [[]] * 12


def test_every_detector_has_a_bad_series() -> None:
    assert set(BAD) == set(DETECTORS)


@pytest.mark.parametrize("name", sorted(BAD))
def test_each_detector_trips_on_its_bad_series_once_the_window_is_full(name: str) -> None:
    steps = run(10, BAD[name])
    assert steps[: WINDOW - 1] == [[]] * (WINDOW - 1), "spoke before a full window"
    assert steps[-1] == [name]


def test_a_message_names_what_was_seen_and_the_threshold() -> None:
    monitor = Monitor(SignaturesConfig(window=2, max_weight_sync_seconds=30.0))
    for s in (1, 2):
        active = monitor.observe({**healthy(s), "weight_sync_seconds": 45.0})
    [signature] = active
    assert "45.0 s" in signature.message and "max_weight_sync_seconds 30.0" in signature.message
    assert Monitor.flags(active) == {f"signature_{n}": float(n == "slow_weight_sync") for n in DETECTORS}


def test_a_run_without_a_metric_leaves_its_detector_silent() -> None:
    monitor = Monitor(SignaturesConfig(window=2))
    assert [monitor.observe({"loss": 0.1}) for _ in range(4)] == [[]] * 4


def test_disabled_signatures_never_speak() -> None:
    monitor = Monitor(SignaturesConfig(window=1, enabled=False))
    assert monitor.observe({**healthy(1), "weight_sync_seconds": 1e6}) == []
