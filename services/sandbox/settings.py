"""Settings of the sandbox service, read from DOCKYARD_SANDBOX_* variables.

Defaults apply to a request field left at 0; ceilings bound what a request
may ask for (above a ceiling the request is refused, not clamped).
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from dockyard.rpc.settings import ServiceSettings, default_address, member_name_pattern
from services.sandbox.images import SANDBOX_IMAGE


class SandboxSettings(ServiceSettings):
    """Backend choice, default limits, ceilings and concurrency of the sandbox."""

    model_config = SettingsConfigDict(env_prefix="DOCKYARD_SANDBOX_", extra="ignore")

    backend: Literal["local", "docker"] = Field(
        "local", description="local: child processes in namespaces (development); docker: one container per run."
    )
    image: str = Field(SANDBOX_IMAGE, description="Docker backend: default image of a run.")
    image_registry: str = Field(
        "",
        description="Docker backend: registry (host[:port][/path]) that SWE rows' prebuilt images are pulled from "
        "when not present locally, as <registry>/<image>; empty: the image name as the row gives it.",
    )
    image_registry_auth_file: str | None = Field(
        None,
        description='Docker backend: a secret file, JSON {"username": ..., "password": ...}, of the '
        "credentials for image_registry; None: pulls without credentials.",
    )
    docker_cpus: float = Field(1.0, gt=0, description="Docker backend: CPU quota per container, in cores.")
    docker_pids_limit: int = Field(
        256, ge=8, description="Docker backend: most tasks (processes, threads) per container."
    )
    docker_tmp_mb: int = Field(
        64, ge=1, description="Docker backend: size of the container's /tmp (tmpfs, counts as memory)."
    )
    docker_user: str = Field(
        "1000:1000",
        pattern=r"^[1-9][0-9]*:[1-9][0-9]*$",
        description="Docker backend: uid:gid the code runs as when the service is root (never 0).",
    )
    warm_sessions_max: int = Field(
        16,
        ge=0,
        description="Docker backend: most session containers kept started ahead per key (image, memory, CPU "
        "seconds, route) for the jobs that asked (PrepareSessions); 0: every session starts its own.",
    )
    warm_runs: int = Field(
        2,
        ge=0,
        description="Docker backend: run containers (Execute, RunTests) kept started ahead per key (image, memory, "
        "CPU seconds), for a key's runs after its first, at most 4 keys at once; 0: every run starts its own.",
    )
    image_cache_gb: float = Field(
        0.0,
        ge=0,
        description="Docker backend: most GB of images this service pulled or built that it keeps; beyond it the "
        "least recently used ones no container uses are removed; 0: none removed.",
    )

    default_timeout_seconds: float = Field(10.0, gt=0, description="Wall-clock limit when a request gives 0.")
    default_memory_mb: int = Field(512, gt=0, description="Address-space limit when a request gives 0.")
    default_cpu_seconds: float = Field(10.0, gt=0, description="CPU-time limit when a request gives 0.")
    default_max_output_bytes: int = Field(16 * 1024, gt=0, description="Per-stream output cap when a request gives 0.")

    max_timeout_seconds: float = Field(600.0, gt=0, description="Largest wall-clock limit a request may ask for.")
    max_memory_mb: int = Field(8192, gt=0, description="Largest address-space limit a request may ask for.")
    max_cpu_seconds: float = Field(600.0, gt=0, description="Largest CPU-time limit a request may ask for.")
    max_output_bytes: int = Field(
        4 * 1024 * 1024, gt=0, description="Largest per-stream output cap a request may ask for."
    )

    max_file_mb: int = Field(64, gt=0, description="Largest file the code may write (RLIMIT_FSIZE).")
    max_disk_mb: int = Field(
        256, gt=0, description="Total size of a run's work folder, a tmpfs (it counts as memory); full: FAILED."
    )
    local_user: str = Field(
        "65534:65534",
        pattern=r"^[1-9][0-9]*:[1-9][0-9]*$",
        description="Local backend: uid:gid the code runs as when the service is root (never 0).",
    )
    allow_unisolated: bool = Field(
        False,
        description="Local backend: run without namespaces (the code sees the host) when they are not available, "
        "instead of refusing to start.",
    )
    max_processes: int = Field(
        256,
        ge=0,
        description="Local backend: RLIMIT_NPROC of the code (counts every task of its uid, across runs); 0: unset.",
    )
    max_concurrency: int = Field(os.cpu_count() or 1, ge=1, description="Runs executing at once; the rest wait.")
    max_queued: int = Field(
        64, ge=0, description="Calls that may wait for a free slot; beyond that a call gets RESOURCE_EXHAUSTED."
    )
    work_root: str | None = Field(
        None, description="Folder under which work folders are made; None is the system temp."
    )
    project_root: str | None = Field(
        None,
        description="Docker backend: folder inside which a session's packages may name local project folders "
        "(built into wheels on this host, their build code run here: only trusted projects belong there); "
        "None: local project folders are refused. `dockyard run` sets its working directory.",
    )
    task_root: str | None = Field(
        None,
        description="Folder of SWE task sets (<task_root>/<name>/instances.jsonl and repos/); None: ScorePatch "
        "answers FAILED_PRECONDITION.",
    )

    max_sessions: int = Field(
        16, ge=0, description="Sessions open at once; OpenSession beyond that gets RESOURCE_EXHAUSTED (0: no sessions)."
    )
    session_idle_seconds: float = Field(
        600.0, gt=0, description="A session unused this long is closed, when OpenSession gives 0."
    )
    max_session_idle_seconds: float = Field(
        3600.0, gt=0, description="Largest idle timeout an OpenSession may ask for."
    )

    coordinator_address: str = Field(
        default_address("coordinator"),
        description="Coordinator host:port to register with and heartbeat to; empty: standalone (no registration).",
    )
    name: str = Field(
        "sandbox",
        pattern=member_name_pattern("sandbox"),
        description="This worker's name in the fleet: sandbox or sandbox-<name>.",
    )
    advertise_address: str = Field(
        "", description="host:port the coordinator calls this worker at; empty: 127.0.0.1:<port>."
    )
    heartbeat_seconds: float = Field(
        2.0, gt=0, description="Interval of heartbeats to the coordinator, which carry the running and queued calls."
    )

    @model_validator(mode="after")
    def _defaults_within_ceilings(self) -> SandboxSettings:
        for name in ("timeout_seconds", "memory_mb", "cpu_seconds", "max_output_bytes"):
            default = getattr(self, f"default_{name}")
            ceiling = getattr(self, name if name == "max_output_bytes" else f"max_{name}")
            if default > ceiling:
                raise ValueError(f"default_{name}={default} is above its ceiling {ceiling}")
        if self.session_idle_seconds > self.max_session_idle_seconds:
            raise ValueError(
                f"session_idle_seconds={self.session_idle_seconds} is above its ceiling {self.max_session_idle_seconds}"
            )
        return self
