"""Experiment trackers: every record of a job's run folder also goes to the enabled backends.

    RunFolder.append(kind, step, values) ──Trackers.log──> one worker thread ──> each open backend
        "generation" (one per Generate)  held until the step's "train" record
        "train"       scalars, plus series: per-replica / per-worker keys and the step's Generate
                      timeline merged across replicas into lists (split_series)
                      ─> W&B: each list as a histogram; scalar-only backends: <name>/{mean,p50,p90,max}
        "validation"  val/<name>          "buffer" (the job's last counts)  buffer/<name>
    RunFolder.record_samples(step, rows) ──Trackers.samples──> W&B Table, MLflow table, SwanLab text

Guarantees: a backend's library is imported only when it is enabled, and only on the
worker thread; `missing_libraries` names every enabled backend whose library is not
installed, with the extra to install (CreateJob refuses such a job); the job's loop never
waits on a tracker; records reach each backend in the order they were written; a
backend that raises is logged once and dropped while the job goes on; `close` flushes
and finishes every backend, and waits for the worker.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

if TYPE_CHECKING:
    from dockyard.config import LoggerConfig
    from dockyard.monitoring.backends import Backend

log = structlog.get_logger()

# enabled flag -> the module its backend imports
LIBRARIES = {
    "wandb_enabled": "wandb",
    "tensorboard_enabled": "tensorboard",
    "mlflow_enabled": "mlflow",
    "swanlab_enabled": "swanlab",
}
# Per-member keys of a step (services/coordinator/step_metrics.py): merged into one list per statistic.
_MEMBER_KEY = re.compile(r"^(replica|sandbox)_(.+)_(busy_seconds|groups|tokens_per_second|tokens|running|queued)$")
SUMMARIES = ("mean", "p50", "p90", "max")


def missing_libraries(logger: LoggerConfig) -> list[str]:
    """One message per enabled tracker whose library this process cannot import."""
    return [
        f"logger.{flag}=true needs the {module} library here: pip install 'dockyard[trackers]'"
        for flag, module in LIBRARIES.items()
        if getattr(logger, flag) and importlib.util.find_spec(module) is None
    ]


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


class Trackers:
    """The enabled backends of one job; a no-op (no thread) when none is enabled."""

    def __init__(self, logger: LoggerConfig, run_dir: Path, job_id: str, config: dict[str, Any]) -> None:
        self._flags = [flag for flag in LIBRARIES if getattr(logger, flag)]
        self._backends: list[Backend] = []
        self._timeline: list[Mapping[str, Any]] = []
        self._pool = None
        if self._flags:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"trackers-{job_id}")
            self._submit(self._open, logger, run_dir, job_id, config)

    @property
    def enabled(self) -> bool:
        return self._pool is not None

    def _submit(self, fn: Callable[..., None], *args: Any) -> None:
        if self._pool is not None:
            self._pool.submit(fn, *args)

    def _open(self, logger: LoggerConfig, run_dir: Path, job_id: str, config: dict[str, Any]) -> None:
        from dockyard.monitoring.backends import BACKENDS

        for flag in self._flags:
            try:
                self._backends.append(BACKENDS[flag](logger, run_dir, job_id, config))
            except Exception as exc:
                log.warning("tracker did not start; the job goes on without it", tracker=flag, error=str(exc))

    def _each(self, method: str, *args: Any) -> None:
        for backend in list(self._backends):
            try:
                getattr(backend, method)(*args)
            except Exception as exc:
                log.warning("tracker failed; dropped for this job", tracker=backend.name, error=str(exc))
                self._backends.remove(backend)

    def log(self, kind: str, step: int, values: Mapping[str, Any]) -> None:
        """One run-folder record (see the module docstring for what each kind becomes)."""
        if self._pool is None:
            return
        if kind == "generation":
            self._timeline.append(dict(values))
            return
        numbers = {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if kind == "train":
            scalars, series = split_series(numbers, self._timeline)
            self._timeline = []
        else:
            scalars, series = numbers, {}
        prefix = {"train": "train", "validation": "val"}.get(kind, kind)
        scalars = {f"{prefix}/{k}": v for k, v in scalars.items()}
        series = {f"{prefix}/{k}": v for k, v in series.items()}
        self._submit(self._each, "log", step, scalars, series)

    def samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        if rows:
            self._submit(self._each, "samples", step, [dict(r) for r in rows])

    def close(self) -> None:
        """Finish every backend (flushing what they hold) and stop the worker."""
        if self._pool is None:
            return
        self._submit(self._each, "close")
        self._pool.shutdown(wait=True)
        self._pool = None
