"""Trainer settings (DOCKYARD_TRAINER_*)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from dockyard.rpc.settings import ServiceSettings, default_address


class TrainerSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="DOCKYARD_TRAINER_", extra="ignore")

    coordinator_address: str = Field(default_address("coordinator"), description="Coordinator host:port.")
    buffer_address: str = Field(default_address("buffer"), description="Buffer host:port.")
    consumer: str = Field("trainer-0", min_length=1, description="Name this trainer leases buffer groups under.")
    device: Literal["cpu", "cuda"] = Field("cpu", description="Where the policy lives.")
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads.")
    buffer_timeout_seconds: float = Field(30.0, gt=0, description="Deadline of one call to the buffer.")
    weight_sync_timeout_seconds: float = Field(120.0, gt=0, description="Side-group collective timeout.")
