"""Settings of the policy endpoint, read from DOCKYARD_ENDPOINT_* environment variables.

A bad value (a port out of range, a non-positive bound) fails here, at startup, with pydantic's
message naming the field. DOCKYARD_ENDPOINT_TOOL_PARSER is refused: a job's `policy.tool_call_format`
picks how its tool calls are read.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from dockyard.rpc.settings import default_address

DEFAULT_PORT = 8000


class EndpointSettings(BaseSettings):
    """The HTTP endpoint's settings (it serves HTTP, not gRPC, so it has no gRPC drain or message limits)."""

    model_config = SettingsConfigDict(env_prefix="DOCKYARD_ENDPOINT_", extra="ignore")

    host: str = Field("127.0.0.1", description="Interface to bind; 0.0.0.0 to serve other hosts.")
    port: int = Field(DEFAULT_PORT, ge=0, le=65535, description="HTTP port of the policy endpoint.")
    coordinator_address: str = Field(
        default_address("coordinator"), description="Coordinator host:port: running jobs, their configs, replicas."
    )
    run_root: str = Field(
        "",
        description="Folder a relative job run_dir resolves against (the coordinator's working folder); empty: ours.",
    )
    max_body_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="Largest request body; a larger one is refused with 413."
    )
    max_sessions: int = Field(1024, ge=1, description="Sessions held at once; idle ones are dropped first.")
    session_idle_seconds: float = Field(3600.0, gt=0, description="A session unused this long is dropped.")
    max_turns_per_session: int = Field(512, ge=1, description="Turns a session may take; more are refused with 429.")
    generate_timeout_seconds: float = Field(600.0, gt=0, description="Deadline of each Generate call to a replica.")
    admission_pressure: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Admit a new session only to a replica whose admitted sessions, with it, hold at most this "
        "fraction of its KV capacity; else it waits in a FIFO queue. 0 = off (every session is admitted at once).",
    )
    admission_session_tokens: int = Field(
        0,
        ge=0,
        description="Tokens a session counts for in admission until its history is larger (e.g. the trials' "
        "max_trial_tokens); 0 = the mean size of the latest sessions that ended.",
    )
    admission_queue_size: int = Field(
        256, ge=1, description="New sessions that may wait for admission; one more is refused with 503."
    )
    admission_wait_seconds: float = Field(
        600.0, gt=0, description="Longest a new session waits for admission before it is refused with 503."
    )
    log_level: str = Field("info", description="debug, info, warning or error.")

    @model_validator(mode="before")
    @classmethod
    def _no_tool_parser(cls, values: Any) -> Any:
        # Gone: a job's own setting picks its format; an old environment must not think it still does.
        if "DOCKYARD_ENDPOINT_TOOL_PARSER" in os.environ:
            raise ValueError(
                "DOCKYARD_ENDPOINT_TOOL_PARSER is gone: set policy.tool_call_format in the job's config instead"
            )
        return values
