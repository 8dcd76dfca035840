"""Settings of the buffer service, read from DOCKYARD_BUFFER_* environment variables.

An unknown backend, a redis backend without a URL or a non-positive limit
fails here, at startup, with a message naming the field.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from dockyard.rpc.settings import ServiceSettings


class BufferSettings(ServiceSettings):
    """The buffer's own settings on top of host, port and limits."""

    model_config = SettingsConfigDict(env_prefix="DOCKYARD_BUFFER_", extra="ignore")

    backend: Literal["memory", "redis"] = Field(
        "memory", description="'memory' keeps groups in this process (lost on exit); 'redis' in Redis Streams."
    )
    redis_url: str = Field("", description="redis://[:password@]host:port/db of the redis backend.")
    max_group_mb: float = Field(16.0, gt=0, description="Largest serialized group a put accepts.")

    @model_validator(mode="after")
    def _redis_needs_url(self) -> BufferSettings:
        if self.backend == "redis" and not self.redis_url:
            raise ValueError("DOCKYARD_BUFFER_REDIS_URL is required with DOCKYARD_BUFFER_BACKEND=redis")
        if self.max_group_mb >= self.max_message_mb:
            raise ValueError(
                f"DOCKYARD_BUFFER_MAX_GROUP_MB ({self.max_group_mb}) must be below "
                f"DOCKYARD_BUFFER_MAX_MESSAGE_MB ({self.max_message_mb}): a sample must fit one group"
            )
        return self
