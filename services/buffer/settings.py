"""Settings of the buffer service, read from DOCKYARD_BUFFER_* environment variables.

An unknown backend or a non-positive capacity fails here, at startup, with
pydantic's message naming the field.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from dockyard.rpc.settings import ServiceSettings


class BufferSettings(ServiceSettings):
    """The buffer's own settings on top of host, port and limits."""

    model_config = SettingsConfigDict(env_prefix="DOCKYARD_BUFFER_", extra="ignore")

    backend: Literal["memory"] = Field(
        "memory", description="Where groups live; 'memory' keeps them in this process (lost on exit)."
    )
    max_groups: int = Field(
        4096, ge=1, description="Capacity per job: held plus pending groups; a put beyond it is refused."
    )
