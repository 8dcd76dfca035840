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
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from dockyard.monitoring.series import split_series

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


def missing_libraries(logger: LoggerConfig) -> list[str]:
    """One message per enabled tracker whose library this process cannot import."""
    return [
        f"logger.{flag}=true needs the {module} library here: pip install -e '.[trackers]' in the dockyard clone"
        for flag, module in LIBRARIES.items()
        if getattr(logger, flag) and importlib.util.find_spec(module) is None
    ]


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
