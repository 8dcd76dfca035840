"""The tracker backends, each through its own library, imported when the backend opens.

    Trackers worker thread ─> WandbBackend       run.log (lists as wandb.Histogram), wandb.Table samples
                            ─> TensorboardBackend SummaryWriter.add_scalar under <run>/<tensorboard.log_dir>
                            ─> MlflowBackend      MlflowClient.log_batch, log_table samples/step_<n>.json
                            ─> SwanlabBackend     run.log, swanlab.Text samples

Guarantees: the local default of each writes inside the job's run folder (W&B offline in
<run>/wandb, TensorBoard in <run>/tensorboard, MLflow's file store in <run>/mlruns, SwanLab
offline in <run>/swanlog), so no account or network is needed; a run is named after the job
id unless the config names it; every backend is only ever called from one thread.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dockyard.monitoring.series import summarise

if TYPE_CHECKING:
    from dockyard.config import LoggerConfig

SAMPLE_COLUMNS = ("step", "group_id", "prompt", "completion", "reward", "verdict")


class Backend:
    name = ""

    def log(self, step: int, scalars: dict[str, float], series: dict[str, list[float]]) -> None:
        """Scalar-only backends: each list as its summary keys."""
        self.scalars(step, {**scalars, **summarise(series)})

    def scalars(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Backends without a table keep samples to the run folder's samples.jsonl."""

    def close(self) -> None:
        pass


class WandbBackend(Backend):
    name = "wandb"

    def __init__(self, logger: LoggerConfig, run_dir: Path, job_id: str, config: dict[str, Any]) -> None:
        import wandb

        self.wandb = wandb
        cfg = logger.wandb
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name or job_id,
            id=job_id,
            resume="allow",
            mode=cfg.mode,
            dir=str(run_dir),
            config=config,
            tags=cfg.tags or None,
            reinit="create_new",  # several jobs of one coordinator log at once
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
        )

    def log(self, step: int, scalars: dict[str, float], series: dict[str, list[float]]) -> None:
        histograms = {k: self.wandb.Histogram(v) for k, v in series.items() if len(v)}
        self.run.log({**scalars, **histograms}, step=step)

    def samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        table = self.wandb.Table(columns=list(SAMPLE_COLUMNS), data=[[r[c] for c in SAMPLE_COLUMNS] for r in rows])
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()


class TensorboardBackend(Backend):
    name = "tensorboard"

    def __init__(self, logger: LoggerConfig, run_dir: Path, job_id: str, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / logger.tensorboard.log_dir))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class MlflowBackend(Backend):
    name = "mlflow"

    def __init__(self, logger: LoggerConfig, run_dir: Path, job_id: str, config: dict[str, Any]) -> None:
        cfg = logger.mlflow
        uri = cfg.tracking_uri or (run_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:") or "://" not in uri:
            # MLflow 3 keeps its file store in maintenance mode behind this switch; a local store is
            # what a run without a tracking server asks for.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        self.metric = Metric
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(cfg.experiment_name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(cfg.experiment_name)
        # A coordinator restart continues the job's run rather than starting a second one.
        found = self.client.search_runs([experiment_id], filter_string=f"tags.`dockyard.job_id` = '{job_id}'")
        if found:
            self.run_id = found[0].info.run_id
        else:
            run = self.client.create_run(
                experiment_id, run_name=cfg.run_name or job_id, tags={"dockyard.job_id": job_id}
            )
            self.run_id = run.info.run_id
            self.client.log_dict(self.run_id, config, "config.json")

    def scalars(self, step: int, values: dict[str, float]) -> None:
        import time

        now = int(time.time() * 1000)
        metrics = [self.metric(key, value, now, step) for key, value in values.items()]
        for start in range(0, len(metrics), 1000):  # log_batch takes at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=metrics[start : start + 1000])

    def samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        table = {column: [r[column] for r in rows] for column in SAMPLE_COLUMNS}
        self.client.log_table(self.run_id, data=table, artifact_file=f"samples/step_{step:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class SwanlabBackend(Backend):
    name = "swanlab"

    def __init__(self, logger: LoggerConfig, run_dir: Path, job_id: str, config: dict[str, Any]) -> None:
        import swanlab

        if swanlab.get_run() is not None:
            raise RuntimeError("SwanLab keeps one run per process and another job of this coordinator holds it")
        self.swanlab = swanlab
        cfg = logger.swanlab
        self.run = swanlab.init(
            project=cfg.project,
            experiment_name=cfg.experiment_name or job_id,
            mode=cfg.mode,
            logdir=str(run_dir / "swanlog"),
            config=config,
        )

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        texts = [
            self.swanlab.Text(
                f"prompt:\n{r['prompt']}\n\ncompletion:\n{r['completion']}",
                caption=f"{r['group_id']} reward {r['reward']:.3f} {r['verdict']}",
            )
            for r in rows
        ]
        self.run.log({"samples": texts}, step=step)

    def close(self) -> None:
        self.run.finish()


BACKENDS = {
    "wandb_enabled": WandbBackend,
    "tensorboard_enabled": TensorboardBackend,
    "mlflow_enabled": MlflowBackend,
    "swanlab_enabled": SwanlabBackend,
}
