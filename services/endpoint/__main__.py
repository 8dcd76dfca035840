"""Entry point of the policy endpoint: `python -m services.endpoint`.

Settings come from DOCKYARD_ENDPOINT_* variables, the shared token from
DOCKYARD_AUTH_TOKEN(_FILE); a bad setting fails at startup naming it, and so does
a missing token: the endpoint signs session keys with it and never runs without
one (`dockyard run` and `dockyard up` create one when none is set). Serves
HTTP with uvicorn until SIGTERM (or until a supervising `dockyard up` dies); a
SIGTERM, once uvicorn has shut down cleanly, ends the process with exit code 0.
"""

from __future__ import annotations

import signal

import uvicorn

from dockyard.rpc.auth import AuthConfigError, load_auth_settings
from dockyard.rpc.launch import die_with_parent
from dockyard.rpc.logging import configure_logging
from services.endpoint.settings import EndpointSettings

KEEP_ALIVE_SECONDS = 75.0


def _exit_cleanly(signum, frame) -> None:
    raise SystemExit(0)


def main() -> None:
    settings = EndpointSettings()
    die_with_parent()
    configure_logging("endpoint", settings.log_level)
    try:
        token = load_auth_settings().token
    except AuthConfigError as exc:
        raise SystemExit(f"endpoint: {exc}") from None
    if not token:
        raise SystemExit(
            "endpoint: no service token: set DOCKYARD_AUTH_TOKEN or DOCKYARD_AUTH_TOKEN_FILE (the endpoint signs "
            "session keys with it and refuses to run without one; `dockyard run` and `dockyard up` create one)"
        )

    from services.endpoint.app import create_app

    app = create_app(settings, token)
    # uvicorn shuts down on SIGTERM, restores the handler it found and raises the signal again: with
    # the default handler the process would then die by it (-15) after a clean shutdown.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    # Keep idle connections well past a client pool's expiry (httpx: 5 s), so a client never sends on a
    # connection the server is closing at that moment (a failed call it cannot tell from a lost server).
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
    )


if __name__ == "__main__":
    main()
