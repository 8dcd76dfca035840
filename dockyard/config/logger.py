"""The `logger` section: the run folder, the trackers (W&B, TensorBoard, MLflow, SwanLab) and failure signatures.

Guarantees: the TensorBoard folder stays inside the run folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from dockyard.config.section import Section


class WandbConfig(Section):
    project: str = Field("dockyard", min_length=1, description="W&B project.")
    name: str | None = Field(
        None,
        description=(
            "Run name; null = the job id (the run id is always the job id, so a restarted coordinator "
            "resumes the same run)."
        ),
    )
    entity: str | None = Field(None, description="W&B team or user; null = the account's default.")
    mode: Literal["offline", "online"] = Field(
        "offline",
        description=(
            "`offline`: the run is written to `<run folder>/wandb/offline-run-*` only, no account or "
            "network needed (`wandb sync` uploads it later); `online` needs `WANDB_API_KEY` in the "
            "coordinator's environment."
        ),
    )
    tags: list[str] = Field(default_factory=list, description="Run tags.")


class TensorboardConfig(Section):
    log_dir: str = Field(
        "tensorboard",
        min_length=1,
        description=(
            "Event files go to this folder inside the run folder (a relative path; `tensorboard "
            "--logdir <log_dir>` shows every job)."
        ),
    )


class MlflowConfig(Section):
    tracking_uri: str | None = Field(
        None,
        description=(
            "MLflow tracking URI (`http(s)://` of a tracking server, or `file:` of a file store); "
            "null = a file store in `<run folder>/mlruns`. MLflow 3 keeps its file store in "
            "maintenance mode behind `MLFLOW_ALLOW_FILE_STORE`, which dockyard sets for `file:` URIs."
        ),
    )
    experiment_name: str = Field("dockyard", min_length=1, description="Experiment, created if missing.")
    run_name: str | None = Field(
        None,
        description=(
            "Run name; null = the job id. The run is tagged `dockyard.job_id`, and a restarted "
            "coordinator continues the run with that tag."
        ),
    )


class SwanlabConfig(Section):
    project: str = Field("dockyard", min_length=1, description="SwanLab project.")
    experiment_name: str | None = Field(None, description="Experiment name; null = the job id.")
    mode: Literal["offline", "cloud"] = Field(
        "offline",
        description=(
            "`offline`: the run is written to `<run folder>/swanlog/run-*/` (`backup.swanlab`), no "
            "account or network needed (`swanlab sync` uploads it later); `cloud` needs "
            "`SWANLAB_API_KEY`. SwanLab keeps one run per process: while one job of a coordinator "
            "logs to it, another job's SwanLab tracker is refused with a warning (the job goes on)."
        ),
    )


class SignaturesConfig(Section):
    enabled: bool = Field(True, description="Watch each GRPO step's metrics for the signatures.")
    window: int = Field(5, ge=1, le=10_000, description="Steps a detector looks at; it speaks once it has them.")
    max_uniform_group_fraction: float = Field(
        0.8,
        ge=0.0,
        le=1.0,
        description="no_learning_signal: fraction of the window's groups whose valid rewards were all equal.",
    )
    min_entropy: float = Field(
        0.02, ge=0.0, allow_inf_nan=False, description="entropy_collapse: mean token entropy (nats) below this."
    )
    entropy_drop_ratio: float = Field(
        0.1, ge=0.0, le=1.0, description="entropy_collapse: mean entropy below this fraction of the run's first window."
    )
    max_kl: float = Field(
        0.5, gt=0.0, allow_inf_nan=False, description="kl_blowup: mean KL to the reference policy (`kl`)."
    )
    max_gen_train_kl: float = Field(
        0.1,
        gt=0.0,
        allow_inf_nan=False,
        description=("generation_mismatch: mean KL between the rollout's and the trainer's logprobs (`gen_train_kl`)."),
    )
    max_stale_fraction: float = Field(
        0.3, ge=0.0, le=1.0, description="stale_drops: fraction of the groups put that the buffer dropped as too old."
    )
    max_sandbox_error_rate: float = Field(
        0.1, ge=0.0, le=1.0, description="sandbox_errors: fraction of trajectories with an ERROR verdict."
    )
    max_weight_sync_seconds: float = Field(
        60.0, gt=0.0, allow_inf_nan=False, description="slow_weight_sync: mean seconds of a step's weight sync."
    )
    max_integrity_rate: float = Field(
        0.02,
        ge=0.0,
        le=1.0,
        description="integrity_flags: fraction of trajectories flagged for touching protected (test) files.",
    )


class LoggerConfig(Section):
    log_dir: str = Field(
        "runs",
        description=(
            "Run folders go under here (`<log_dir>/<job-id>/`), relative to each service's working "
            "directory; `dockyard run` also puts service logs under `<log_dir>/logs/`."
        ),
    )
    plot: bool = Field(
        True,
        description=(
            "Write `curves.png` in the run folder: one panel per metric family the run reports (train "
            "reward, validation pass rate, loss, KL, entropy, clip fraction, staleness, tokens/s), "
            "integer steps, legends beside the data; redrawn at most every 10 s as the run goes and "
            "once at the end."
        ),
    )
    wandb_enabled: bool = Field(
        False,
        description=(
            "Log every step, validation and buffer record and the sample completions to Weights & "
            "Biases (`logger.wandb`)."
        ),
    )
    tensorboard_enabled: bool = Field(
        False, description="Write every record as TensorBoard scalars (`logger.tensorboard`)."
    )
    mlflow_enabled: bool = Field(
        False, description="Log every record and the sample completions to MLflow (`logger.mlflow`)."
    )
    swanlab_enabled: bool = Field(
        False, description="Log every record and the sample completions to SwanLab (`logger.swanlab`)."
    )
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    tensorboard: TensorboardConfig = Field(default_factory=TensorboardConfig)
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    swanlab: SwanlabConfig = Field(default_factory=SwanlabConfig)
    num_samples_per_step: int = Field(
        4,
        ge=0,
        le=1000,
        description=(
            "Completions per training step (a uniform sample of the step's trajectories: prompt, "
            "completion, reward, verdict) written to `samples.jsonl` in the run folder and to the "
            "trackers' tables; 0 = none."
        ),
    )
    save_trials: bool = Field(
        True,
        description=(
            "Every passing training trial is written whole to `trials.jsonl` in the run folder: ids, "
            "reward, and the prompt and completion (single-turn runs) or per conversation segment its "
            "messages and tools (agent runs); `dockyard export-sft` exports them as an SFT dataset "
            "(`{prompt, completion}` or chat records). Validation trials are never written."
        ),
    )
    signatures: SignaturesConfig = Field(default_factory=SignaturesConfig)

    @model_validator(mode="after")
    def _tensorboard_inside(self) -> LoggerConfig:
        folder = Path(self.tensorboard.log_dir)
        if folder.is_absolute() or ".." in folder.parts:
            raise ValueError("logger.tensorboard.log_dir is a folder inside the run folder: a relative path, no '..'")
        return self
