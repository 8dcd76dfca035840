"""A step's metrics as scalars and series, and the bounded summary of a series.

    train record + the step's Generate timeline ──split_series──> (scalars, series)
    series ──summarise──> <name>/{mean,p50,p90,max}     (for backends that take only scalars)

Guarantees: pure functions of their arguments; `summarise` yields at most four keys per series
however long it is, and none for an empty one. Both the trackers (which split a step) and the
scalar-only backends (which summarise) use this module, so neither imports the other for it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

# Per-member keys of a step (services/coordinator/step_metrics.py): merged into one list per statistic.
_MEMBER_KEY = re.compile(r"^(replica|sandbox)_(.+)_(busy_seconds|groups|tokens_per_second|tokens|running|queued)$")
SUMMARIES = ("mean", "p50", "p90", "max")


def split_series(
    metrics: Mapping[str, float], timeline: Sequence[Mapping[str, Any]]
) -> tuple[dict[str, float], dict[str, list[float]]]:
    """(scalars, series) of a step: per-replica and per-worker keys become one list per statistic
    (replica_tokens_per_second: one value per replica), and the Generate calls become
    generation_{seconds,tokens,tokens_per_second}: one value per call, whichever replica served it."""
    scalars: dict[str, float] = {}
    series: dict[str, list[float]] = {}
    for key, value in metrics.items():
        member = _MEMBER_KEY.match(key)
        if member:
            series.setdefault(f"{member[1]}_{member[3]}", []).append(float(value))
        else:
            scalars[key] = float(value)
    for call in timeline:
        seconds = float(call["end"]) - float(call["start"])
        series.setdefault("generation_seconds", []).append(seconds)
        series.setdefault("generation_tokens", []).append(float(call["tokens"]))
        series.setdefault("generation_tokens_per_second", []).append(float(call["tokens"]) / max(seconds, 1e-9))
    return scalars, series


def summarise(series: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """<name>/{mean,p50,p90,max} of each non-empty list: a bounded set of keys however long the list."""
    import numpy as np

    out = {}
    for name, values in series.items():
        if len(values) == 0:
            continue
        array = np.asarray(values, dtype=float)
        stats = (array.mean(), np.percentile(array, 50), np.percentile(array, 90), array.max())
        out.update({f"{name}/{label}": float(v) for label, v in zip(SUMMARIES, stats, strict=True)})
    return out
