"""Failure signatures: small detectors over a run's recent step metrics (docs/failure_signatures.md).

    train step metrics ─Monitor.observe(step, metrics)─> the last `window` steps (cumulative buffer
        counters turned into per-step differences) + the first window of the run
        ─each DETECTORS entry─> message | None ─> [Signature(name, message), ...] active at this step
    Monitor.flags(active) ─> {"signature_<name>": 0.0 | 1.0} for every detector (a series for trackers)

Guarantees: pure (no I/O, no clock): the same series always gives the same
signatures; a detector speaks only once it has a full window of steps, and
one whose metrics a run does not report stays silent; each message names the
numbers it saw and the threshold (a `logger.signatures` field) it crossed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dockyard.config import SignaturesConfig

Step = Mapping[str, float]
# Counters the buffer reports as totals over the job; detectors want them per step.
CUMULATIVE = ("buffer_dropped_stale", "buffer_puts")


@dataclass(frozen=True)
class Signature:
    name: str
    message: str


def _values(window: Sequence[Step], key: str) -> list[float]:
    return [s[key] for s in window if key in s]


def _mean(window: Sequence[Step], key: str) -> float | None:
    values = _values(window, key)
    return sum(values) / len(values) if values else None


def no_learning_signal(window: Sequence[Step], first: Sequence[Step], cfg: SignaturesConfig) -> str | None:
    """Most groups had identical rewards, so their advantages (and gradients) were zero."""
    uniform = sum(_values(window, "uniform_reward_groups")) + sum(_values(window, "dropped_uniform_groups"))
    total = sum(_values(window, "groups")) + sum(_values(window, "dropped_uniform_groups"))
    if not _values(window, "uniform_reward_groups") or total == 0:
        return None
    fraction = uniform / total
    if fraction <= cfg.max_uniform_group_fraction:
        return None
    return (
        f"{fraction:.0%} of the last {len(window)} steps' groups had identical rewards (no learning signal; "
        f"max_uniform_group_fraction {cfg.max_uniform_group_fraction})"
    )


def entropy_collapse(window: Sequence[Step], first: Sequence[Step], cfg: SignaturesConfig) -> str | None:
    """The policy's token entropy fell to almost nothing: it samples one answer."""
    now, start = _mean(window, "entropy"), _mean(first, "entropy")
    if now is None:
        return None
    if now < cfg.min_entropy:
        return f"mean entropy {now:.4f} nats over the last {len(window)} steps is below min_entropy {cfg.min_entropy}"
    if start and now < cfg.entropy_drop_ratio * start:
        return (
            f"mean entropy fell from {start:.4f} to {now:.4f} nats, below entropy_drop_ratio "
            f"{cfg.entropy_drop_ratio} of the run's first steps"
        )
    return None


def kl_blowup(window: Sequence[Step], first: Sequence[Step], cfg: SignaturesConfig) -> str | None:
    """The policy ran far from its reference."""
    kl = _mean(window, "kl")
    if kl is None or kl <= cfg.max_kl:
        return None
    return f"mean KL to the reference {kl:.4f} over the last {len(window)} steps exceeds max_kl {cfg.max_kl}"


def generation_mismatch(window: Sequence[Step], first: Sequence[Step], cfg: SignaturesConfig) -> str | None:
    """The rollout's logprobs and the trainer's disagree: importance weights explode."""
    kl = _mean(window, "gen_train_kl")
    if kl is None or kl <= cfg.max_gen_train_kl:
        return None
    return (
        f"mean generation-vs-training KL {kl:.4f} over the last {len(window)} steps exceeds "
        f"max_gen_train_kl {cfg.max_gen_train_kl}"
    )


def stale_drops(window: Sequence[Step], first: Sequence[Step], cfg: SignaturesConfig) -> str | None:
    """Many groups aged out before the trainer took them: generation is wasted."""
    if _values(window, "buffer_puts_step"):
        dropped = sum(_values(window, "buffer_dropped_stale_step"))
        total = sum(_values(window, "buffer_puts_step"))
    else:
        dropped = sum(_values(window, "dropped_stale_on_put"))
        total = dropped + sum(_values(window, "groups"))
    if total == 0 or dropped / total <= cfg.max_stale_fraction:
        return None
    return (
        f"{dropped:.0f} of {total:.0f} groups put in the last {len(window)} steps were dropped as too old "
        f"(max_stale_fraction {cfg.max_stale_fraction})"
    )


def sandbox_errors(window: Sequence[Step], first: Sequence[Step], cfg: SignaturesConfig) -> str | None:
    """The sandbox fails to score many trajectories (infrastructure, not the policy)."""
    total = sum(v for s in window for k, v in s.items() if k.startswith("verdict_"))
    errors = sum(_values(window, "verdict_error"))
    if total == 0 or errors / total <= cfg.max_sandbox_error_rate:
        return None
    return (
        f"{errors / total:.0%} of the last {len(window)} steps' trajectories got an ERROR verdict "
        f"(max_sandbox_error_rate {cfg.max_sandbox_error_rate})"
    )


def slow_weight_sync(window: Sequence[Step], first: Sequence[Step], cfg: SignaturesConfig) -> str | None:
    """Weight syncs take long enough to starve generation."""
    seconds = _mean(window, "weight_sync_seconds")
    if seconds is None or seconds <= cfg.max_weight_sync_seconds:
        return None
    return (
        f"weight sync took {seconds:.1f} s on average over the last {len(window)} steps "
        f"(max_weight_sync_seconds {cfg.max_weight_sync_seconds})"
    )


def integrity_flags(window: Sequence[Step], first: Sequence[Step], cfg: SignaturesConfig) -> str | None:
    """Completions touching protected (test) files: a sign of reward hacking."""
    flagged = sum(_values(window, "integrity_violations"))
    total = sum(v for s in window for k, v in s.items() if k.startswith("verdict_"))
    if total == 0 or flagged / total <= cfg.max_integrity_rate:
        return None
    return (
        f"{flagged:.0f} of {total:.0f} trajectories in the last {len(window)} steps touched protected files "
        f"(reward hacking? max_integrity_rate {cfg.max_integrity_rate})"
    )


Detector = Callable[[Sequence[Step], Sequence[Step], "SignaturesConfig"], "str | None"]
DETECTORS: dict[str, Detector] = {
    "no_learning_signal": no_learning_signal,
    "entropy_collapse": entropy_collapse,
    "kl_blowup": kl_blowup,
    "generation_mismatch": generation_mismatch,
    "stale_drops": stale_drops,
    "sandbox_errors": sandbox_errors,
    "slow_weight_sync": slow_weight_sync,
    "integrity_flags": integrity_flags,
}


class Monitor:
    """The detectors over one job's steps, fed one step at a time."""

    def __init__(self, cfg: SignaturesConfig) -> None:
        self.cfg = cfg
        self._window: deque[dict[str, float]] = deque(maxlen=cfg.window)
        self._first: list[dict[str, float]] = []
        self._totals: dict[str, float] = {}

    def observe(self, metrics: Step) -> list[Signature]:
        """Add one step's metrics; the signatures active at this step (none while the window fills)."""
        step = dict(metrics)
        for key in CUMULATIVE:
            if key in step:
                step[f"{key}_step"] = step[key] - self._totals.get(key, 0.0)
                self._totals[key] = step[key]
        self._window.append(step)
        if len(self._first) < self.cfg.window:
            self._first.append(step)
        if not self.cfg.enabled or len(self._window) < self.cfg.window:
            return []
        window = list(self._window)
        found = []
        for name, detect in DETECTORS.items():
            message = detect(window, self._first, self.cfg)
            if message is not None:
                found.append(Signature(name, message))
        return found

    @staticmethod
    def flags(active: Sequence[Signature]) -> dict[str, float]:
        names = {s.name for s in active}
        return {f"signature_{name}": float(name in names) for name in DETECTORS}
