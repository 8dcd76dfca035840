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
    name: str | None = Field(None, description="Run name; null = the job id.")
    entity: str | None = Field(None, description="W&B team or user; null = the account's default.")
    mode: Literal["offline", "online"] = Field(
        "offline", description="offline = written to <run>/wandb only (no account); online needs WANDB_API_KEY."
    )
    tags: list[str] = Field(default_factory=list, description="Run tags.")


class TensorboardConfig(Section):
    log_dir: str = Field("tensorboard", min_length=1, description="Event files go here, inside the run folder.")


class MlflowConfig(Section):
    tracking_uri: str | None = Field(
        None, description="MLflow tracking URI (http(s)://... or file:...); null = file:<run folder>/mlruns."
    )
    experiment_name: str = Field("dockyard", min_length=1, description="MLflow experiment (created if missing).")
    run_name: str | None = Field(None, description="Run name; null = the job id.")


class SwanlabConfig(Section):
    project: str = Field("dockyard", min_length=1, description="SwanLab project.")
    experiment_name: str | None = Field(None, description="Experiment name; null = the job id.")
    mode: Literal["offline", "cloud"] = Field(
        "offline", description="offline = written to <run>/swanlog only (no account); cloud needs SWANLAB_API_KEY."
    )


class SignaturesConfig(Section):
    enabled: bool = Field(True, description="Watch each GRPO step's metrics for known failure signatures.")
    window: int = Field(5, ge=1, le=10_000, description="Steps a detector looks at; it speaks once it has them.")
    max_uniform_group_fraction: float = Field(
        0.8, ge=0.0, le=1.0, description="Groups whose valid rewards are all equal (no learning signal)."
    )
    min_entropy: float = Field(0.02, ge=0.0, allow_inf_nan=False, description="Mean token entropy floor (nats).")
    entropy_drop_ratio: float = Field(
        0.1, ge=0.0, le=1.0, description="Entropy below this fraction of its first window's: collapse."
    )
    max_kl: float = Field(0.5, gt=0.0, allow_inf_nan=False, description="Mean KL to the reference policy.")
    max_gen_train_kl: float = Field(
        0.1, gt=0.0, allow_inf_nan=False, description="Mean KL between generation and training logprobs."
    )
    max_stale_fraction: float = Field(0.3, ge=0.0, le=1.0, description="Groups the buffer dropped as too old.")
    max_sandbox_error_rate: float = Field(0.1, ge=0.0, le=1.0, description="Trajectories with an ERROR verdict.")
    max_weight_sync_seconds: float = Field(
        60.0, gt=0.0, allow_inf_nan=False, description="Mean seconds of a step's weight sync."
    )
    max_integrity_rate: float = Field(
        0.02, ge=0.0, le=1.0, description="Trajectories flagged for touching protected (test) files."
    )


class LoggerConfig(Section):
    log_dir: str = Field("runs", description="Run folders go under here.")
    plot: bool = Field(True, description="Write the run's curves as PNG panels, rewritten as the run goes.")
    wandb_enabled: bool = Field(False, description="Log to Weights & Biases (the trackers extra).")
    tensorboard_enabled: bool = Field(False, description="Write TensorBoard event files (the trackers extra).")
    mlflow_enabled: bool = Field(False, description="Log to MLflow (the trackers extra).")
    swanlab_enabled: bool = Field(False, description="Log to SwanLab (the trackers extra).")
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    tensorboard: TensorboardConfig = Field(default_factory=TensorboardConfig)
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    swanlab: SwanlabConfig = Field(default_factory=SwanlabConfig)
    num_samples_per_step: int = Field(
        4, ge=0, le=1000, description="Completions per step to samples.jsonl and the trackers' tables."
    )
    save_trials: bool = Field(
        True,
        description="Write each passing training trial to trials.jsonl: its prompt and completion, or an agent "
        "trial's conversation (what `dockyard export-sft` exports as demonstrations).",
    )
    signatures: SignaturesConfig = Field(default_factory=SignaturesConfig)

    @model_validator(mode="after")
    def _tensorboard_inside(self) -> LoggerConfig:
        folder = Path(self.tensorboard.log_dir)
        if folder.is_absolute() or ".." in folder.parts:
            raise ValueError("logger.tensorboard.log_dir is a folder inside the run folder: a relative path, no '..'")
        return self
