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

from dockyard.redis_url import RedisConfigError, read_password, url_password, without_password
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
    data_plane: bool = Field(
        True,
        description="With the redis backend: advertise it as the data plane (GetDataPlane), so writers stage payloads "
        "in it and trainers read them from it, around this service.",
    )
    data_plane_url: str = Field(
        "",
        description="The Redis URL clients of the data plane connect to, when it differs from this service's "
        "(another host name); default: redis_url without its password. Never holds a password.",
    )
    staging_ttl_seconds: int = Field(
        3600, ge=10, description="Expiry a writer gives a staged payload; the buffer clears it when it takes it over."
    )
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

    @cached_property
    def advertised_data_plane_url(self) -> str:
        """The URL GetDataPlane gives clients; empty when there is no data plane."""
        if self.backend != "redis" or not self.data_plane:
            return ""
        return without_password(self.data_plane_url or self.redis_url)

    @model_validator(mode="after")
    def _redis_needs_url(self) -> BufferSettings:
        if self.backend == "redis" and not self.redis_url:
            raise ValueError("DOCKYARD_BUFFER_REDIS_URL is required with DOCKYARD_BUFFER_BACKEND=redis")
        if self.backend == "redis":
            _ = self.redis_password_value  # a missing or empty password file fails now, at startup
        if url_password(self.data_plane_url):
            raise RedisConfigError(
                "DOCKYARD_BUFFER_DATA_PLANE_URL holds a password: it is shown to every client; drop it "
                "(clients send theirs from DOCKYARD_DATA_PLANE_REDIS_PASSWORD)"
            )
        return self
