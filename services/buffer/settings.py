"""Settings of the buffer service, read from DOCKYARD_BUFFER_* environment variables.

An unknown backend, a redis backend without a URL, a Redis password given
twice or in a missing or empty file, or a non-positive limit fails here, at
startup, with a message naming the field; errors never echo the input, so a
password in the URL stays out of them.
"""

from __future__ import annotations

from functools import cached_property
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from dockyard.redis_url import read_password
from dockyard.rpc.settings import ServiceSettings


class BufferSettings(ServiceSettings):
    """The buffer's own settings on top of host, port and limits."""

    model_config = SettingsConfigDict(env_prefix="DOCKYARD_BUFFER_", extra="ignore", hide_input_in_errors=True)

    backend: Literal["memory", "redis"] = Field(
        "memory", description="'memory' keeps groups in this process (lost on exit); 'redis' in Redis Streams."
    )
    redis_url: str = Field("", repr=False, description="redis://[:password@]host:port/db of the redis backend.")
    redis_password: str = Field("", repr=False, description="Redis password kept out of the URL.")
    redis_password_file: str = Field("", description="File holding the Redis password (a mounted secret).")
    max_group_mb: float = Field(16.0, gt=0, description="Largest serialized group a put accepts.")
    max_trajectory_tokens: int = Field(
        65536, ge=1, le=10_000_000, description="Most prompt + completion tokens of one trajectory a put accepts."
    )

    @cached_property
    def redis_password_value(self) -> str | None:
        """The password to send besides the URL (None: none, or it is in the URL); RedisConfigError if unusable."""
        return read_password(
            self.redis_url, self.redis_password, self.redis_password_file, "DOCKYARD_BUFFER_REDIS_PASSWORD"
        )

    @model_validator(mode="after")
    def _redis_needs_url(self) -> BufferSettings:
        if self.backend == "redis" and not self.redis_url:
            raise ValueError("DOCKYARD_BUFFER_REDIS_URL is required with DOCKYARD_BUFFER_BACKEND=redis")
        if self.backend == "redis":
            _ = self.redis_password_value  # a missing or empty password file fails now, at startup
        if self.max_group_mb >= self.max_message_mb:
            raise ValueError(
                f"DOCKYARD_BUFFER_MAX_GROUP_MB ({self.max_group_mb}) must be below "
                f"DOCKYARD_BUFFER_MAX_MESSAGE_MB ({self.max_message_mb}): a sample must fit one group"
            )
        return self
