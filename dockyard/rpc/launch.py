"""Entry-point helper: the one way a service process starts.

Heavy imports (torch, transformers) happen inside `build`, after logging is
configured, so `dockyard-trainer --help`-style calls stay fast.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence

import structlog

from dockyard.rpc.auth import AuthConfigError, load_auth_settings
from dockyard.rpc.logging import configure_logging
from dockyard.rpc.ports import DEFAULT_PORTS
from dockyard.rpc.server import BindError, Service, serve
from dockyard.rpc.settings import ServiceSettings

# Set by a supervising process (dockyard.stack) to its pid: the service then
# dies with it instead of outliving it as an orphan.
PARENT_PID_ENV = "DOCKYARD_PARENT_PID"
# How often a supervised service checks that its parent is alive.
PARENT_POLL_SECONDS = 0.5

Build = Callable[[], Awaitable[tuple[Sequence[Service], Callable[[], Awaitable[None]] | None]]]


def die_with_parent() -> None:
    """SIGTERM this process once the supervising process is gone.

    A watch thread rather than PR_SET_PDEATHSIG: the kernel sends that signal when the parent
    *thread* that spawned the child exits, so a service restarted from a worker thread would
    die with the thread, not with the process."""
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent:
        return
    parent_pid = int(parent)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_SECONDS)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def run_service(name: str, settings: ServiceSettings, build: Build) -> None:
    """Configure logging, build the servicers inside the event loop, serve until SIGTERM."""
    die_with_parent()
    configure_logging(name, settings.log_level)
    try:
        # Before anything heavy loads: a bad token file or TLS setting stops the service at once.
        auth = load_auth_settings()
    except AuthConfigError as exc:
        raise SystemExit(f"{name}: {exc}") from None

    async def main() -> None:
        services, on_stop = await build()
        await serve(name, settings, services, default_port=DEFAULT_PORTS[name], on_stop=on_stop, auth=auth)

    try:
        asyncio.run(main())
    except BindError as exc:
        raise SystemExit(str(exc)) from None
    # Stopped: the servicers closed what they own. Threads still running now (a worker blocked in a
    # collective, a to_thread call, a library's pool) would hold the process past its supervisor's
    # grace and get it SIGKILLed; say which, then exit at once.
    lingering = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon)
    if lingering:
        structlog.get_logger().info("exiting with threads still running", threads=lingering)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
