"""Settings of the rollout service, read from DOCKYARD_ROLLOUT_* environment variables.

A bad value (a non-positive ceiling or thread count) fails here, at startup,
with pydantic's message naming the field.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from dockyard.rpc.settings import ServiceSettings, default_address, member_name_pattern


class RolloutSettings(ServiceSettings):
    """The rollout replica's own settings on top of host, port and limits."""

    model_config = SettingsConfigDict(env_prefix="DOCKYARD_ROLLOUT_", extra="ignore")

    coordinator_address: str = Field(
        default_address("coordinator"),
        description="Coordinator host:port: registration, heartbeats, weight-sync rendezvous; empty: standalone.",
    )
    device: str = Field("cpu", description="Where engines put the policy: cpu, cuda or cuda:N.")
    max_new_tokens_ceiling: int = Field(
        4096, ge=1, description="Largest max_new_tokens a Generate request may ask for on this replica."
    )
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads; unset keeps torch's default.")
    stream_interval_ms: float = Field(
        20.0,
        ge=0,
        le=60_000,
        description=(
            "Least time between two messages of one stream (GenerateStream, GenerateMultiplexed): tokens "
            "sampled meanwhile go in one message, a call's end at once; 0: a message per decode step."
        ),
    )
    weight_sync_timeout_seconds: float = Field(
        120.0,
        gt=0,
        description="Timeout of every weight-sync group wait and of waiting for a checkpoint-folder version.",
    )
    replica_name: str = Field(
        "rollout",
        pattern=member_name_pattern("rollout"),
        description="This replica's name in the fleet and in weight-sync groups: rollout or rollout-<name>.",
    )
    advertise_address: str = Field(
        "", description="host:port the coordinator calls this replica at; empty: 127.0.0.1:<port>."
    )
    heartbeat_seconds: float = Field(
        2.0, gt=0, description="Interval of heartbeats to the coordinator (registration is retried as often)."
    )
