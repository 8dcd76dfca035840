"""Coordinator settings (DOCKYARD_COORDINATOR_*).

Rollout replicas and sandbox workers are not configured here: they register
with the coordinator (see services/coordinator/fleet.py).
"""

from __future__ import annotations

from functools import cached_property

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from dockyard.redis_url import read_password
from dockyard.rpc.settings import ServiceSettings, default_address


class CoordinatorSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="DOCKYARD_COORDINATOR_", extra="ignore", hide_input_in_errors=True)

    trainer_address: str = Field(default_address("trainer"), description="Trainer host:port.")
    buffer_address: str = Field(default_address("buffer"), description="Buffer host:port.")
    weight_sync_address: str = Field(
        "127.0.0.1",
        description="Host where the trainer's rank 0 hosts the weight-sync group store; rollouts must reach it.",
    )
    weight_sync_port: int = Field(0, ge=0, le=65535, description="Its port; 0 picks a free port on this host.")
    member_timeout_seconds: float = Field(
        8.0, gt=0, description="A rollout replica or sandbox worker with no heartbeat for this long is expired."
    )
    fleet_wait_timeout_seconds: float = Field(
        120.0, gt=0, description="How long a job waits for a rollout replica and a sandbox worker before FAILED."
    )
    max_regenerations: int = Field(
        3, ge=0, description="Times a group whose replica failed is generated again on another replica."
    )
    max_scoring_attempts: int = Field(
        3, ge=1, description="Sandbox workers one scoring call is tried on before its verdict is ERROR."
    )
    max_invalid_fraction: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="A group with more of its trajectories invalid (sandbox failures) than this fraction is "
        "generated again, at most max_regenerations times, and never trained on.",
    )
    max_concurrent_generations: int = Field(4, ge=1, description="Generate calls in flight per job.")
    max_concurrent_scoring: int = Field(8, ge=1, description="Sandbox calls in flight per job.")
    generate_timeout_seconds: float = Field(300.0, gt=0, description="Deadline of one Generate call.")
    dashboard_port: int = Field(
        0, ge=0, le=65535, description="HTTP port of the read-only dashboard (on the service's host); 0: no dashboard."
    )
    endpoint_address: str = Field(
        "127.0.0.1:8000",
        description="The policy endpoint (host:port or URL) that agent trials (env.tools) send their model calls to.",
    )
    recovery_timeout_seconds: float = Field(
        300.0, gt=0, description="How long a job waits for an unreachable trainer or buffer to come back."
    )
    train_timeout_seconds: float = Field(1800.0, gt=0, description="Deadline of LoadPolicy/TrainStep/weight sync.")
    run_root: str = Field(
        "",
        description="When set, every job's logger.log_dir and checkpointing.checkpoint_dir must lie inside this "
        "folder (relative ones are taken under it), else CreateJob is INVALID_ARGUMENT; empty: used as given.",
    )
    state_dir: str = Field(
        "runs", description="Folder of the job store: <state_dir>/<job_id>/job.json (unless a Redis URL is set)."
    )
    state_redis_url: str = Field(
        "",
        repr=False,
        description="redis://[:password@]host:port/db: keep job state in Redis instead of the folder.",
    )
    state_redis_password: str = Field("", repr=False, description="Password of that Redis, kept out of the URL.")
    state_redis_password_file: str = Field("", description="File holding that password (a mounted secret).")

    @cached_property
    def state_redis_password_value(self) -> str | None:
        """The password to send besides the URL (None: none, or it is in the URL); RedisConfigError if unusable."""
        return read_password(
            self.state_redis_url,
            self.state_redis_password,
            self.state_redis_password_file,
            "DOCKYARD_COORDINATOR_STATE_REDIS_PASSWORD",
        )

    @model_validator(mode="after")
    def _password_readable(self) -> CoordinatorSettings:
        if self.state_redis_url:
            _ = self.state_redis_password_value  # a missing or empty password file fails now, at startup
        return self
