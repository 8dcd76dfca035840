"""Entry-point helper: the one way a service process starts.

Heavy imports (torch, transformers) happen inside `build`, after logging is
configured, so `dockyard-trainer --help`-style calls stay fast.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
from collections.abc import Awaitable, Callable, Sequence

from dockyard.rpc.auth import AuthConfigError, load_auth_settings
from dockyard.rpc.logging import configure_logging
from dockyard.rpc.server import Service, serve
from dockyard.rpc.settings import DEFAULT_PORTS, ServiceSettings

# Set by a supervising process (dockyard.stack) to its pid: the service then
# dies with it instead of outliving it as an orphan.
PARENT_PID_ENV = "DOCKYARD_PARENT_PID"

Build = Callable[[], Awaitable[tuple[Sequence[Service], Callable[[], Awaitable[None]] | None]]]


def _die_with_parent() -> None:
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent:
        return
    try:
        # 1 = PR_SET_PDEATHSIG: the kernel sends SIGTERM when the parent exits.
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        return  # not Linux: the parent's stop() still ends us
    if os.getppid() != int(parent):
        # The parent died before prctl took effect.
        os.kill(os.getpid(), signal.SIGTERM)


def run_service(name: str, settings: ServiceSettings, build: Build) -> None:
    """Configure logging, build the servicers inside the event loop, serve until SIGTERM."""
    _die_with_parent()
    configure_logging(name, settings.log_level)
    try:
        # Before anything heavy loads: a bad token file or TLS setting stops the service at once.
        auth = load_auth_settings()
    except AuthConfigError as exc:
        raise SystemExit(f"{name}: {exc}") from None

    async def main() -> None:
        services, on_stop = await build()
        await serve(name, settings, services, default_port=DEFAULT_PORTS[name], on_stop=on_stop, auth=auth)

    asyncio.run(main())
