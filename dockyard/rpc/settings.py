"""Base settings of a dockyard service, read from the environment.

Each service subclasses ServiceSettings with its own prefix, so
DOCKYARD_TRAINER_PORT sets the trainer's port and nothing else.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from dockyard.rpc.ports import DEFAULT_PORTS, default_address

__all__ = ["DEFAULT_PORTS", "ServiceSettings", "default_address", "member_name_pattern"]


class ServiceSettings(BaseSettings):
    """Settings every service has."""

    model_config = SettingsConfigDict(extra="ignore")

    host: str = Field("127.0.0.1", description="Interface to bind; 0.0.0.0 to serve other hosts.")
    port: int = Field(0, ge=0, le=65535, description="Port to bind; 0 takes the service's default.")
    max_message_mb: int = Field(64, ge=1, le=2047, description="Largest message sent or received.")
    drain_seconds: float = Field(
        0.5, ge=0, description="After SIGTERM, report NOT_SERVING this long before refusing new calls."
    )
    shutdown_grace_seconds: float = Field(5.0, ge=0, description="Time in-flight RPCs get after SIGTERM.")
    log_level: str = Field("info", description="debug, info, warning or error.")


def member_name_pattern(kind: str) -> str:
    """A fleet member's name: the kind alone (`rollout`) or the kind and a suffix (`rollout-2`)."""
    return rf"^{kind}(-[a-z0-9][a-z0-9_.:-]{{0,62}})?$"
