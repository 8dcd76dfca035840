"""Entry-point helper: the one way a service process starts.

Heavy imports (torch, transformers) happen inside `build`, after logging is
configured, so `dockyard-trainer --help`-style calls stay fast.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from dockyard.rpc.logging import configure_logging
from dockyard.rpc.server import Service, serve
from dockyard.rpc.settings import DEFAULT_PORTS, ServiceSettings

Build = Callable[[], Awaitable[tuple[Sequence[Service], Callable[[], Awaitable[None]] | None]]]


def run_service(name: str, settings: ServiceSettings, build: Build) -> None:
    """Configure logging, build the servicers inside the event loop, serve until SIGTERM."""
    configure_logging(name, settings.log_level)

    async def main() -> None:
        services, on_stop = await build()
        await serve(name, settings, services, default_port=DEFAULT_PORTS[name], on_stop=on_stop)

    asyncio.run(main())
