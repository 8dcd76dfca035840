"""Who may call the endpoint, and which session a call belongs to.

    Authorization: Bearer <t> | x-api-key: <t> ──Gate.caller──> Caller(admin: the service token | session: the key's)
    Caller + X-Dockyard-Session header ──Gate.session_of──> the call's session (or None: not recorded)

Two credentials exist. The service token (DOCKYARD_AUTH_TOKEN) is the admin's: the coordinator and
operators hold it. A session key, `dys-<id>-<HMAC-SHA256 of the id under the service token>`, is what a
scaffold holds: it is minted only by POST /v1/sessions (the service token's), and the key alone names
its session, so nothing else in a request can point it at another.

Guarantees:
- There is no endpoint without a service token: Gate refuses an empty one (a ValueError at startup),
  so session keys are never signed under an empty or guessable secret.
- Every credential is compared in constant time. No credential, a wrong token, a forged or malformed
  key is Unauthorized (401).
- A session key may: make model calls in its own session, list the models, read its own session's
  trajectory. Anything else it tries is Forbidden (403), with the reason: a session header naming
  another session (never redirected), reading another session, opening or ending a session, the
  routing state, the OpenAPI schema.
- A session header must match the contract's SESSION_ID_PATTERN (a 400).
- Only the service token opens sessions: explicitly (POST /v1/sessions) or, as the admin, by naming
  a new id in the session header; a key's session that is not open (ended, dropped after idling) is
  refused by the store (services/endpoint/sessions.py: UnknownSession), never made anew.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import uuid
from dataclasses import dataclass

from starlette.requests import Request

from dockyard.agents.contract import SESSION_HEADER, SESSION_ID_CHARS, SESSION_ID_MAX_LENGTH, SESSION_ID_PATTERN
from services.endpoint.errors import BadRequest

_SESSION_ID = re.compile(SESSION_ID_PATTERN)
_KEY = re.compile(rf"^dys-([{SESSION_ID_CHARS}]{{1,{SESSION_ID_MAX_LENGTH}}})-([0-9a-f]{{32}})$")
# What a session key may do, for the 403 that refuses anything else.
KEY_MAY = "a session key may only call /v1/chat/completions, /v1/messages and /v1/models in its own session"


class Unauthorized(Exception):
    """No credential, or one that is neither the service token nor a valid session key (401)."""


class Forbidden(Exception):
    """A valid session key asking for what only the service token, or another session's key, may do (403)."""


def session_key(token: str, session_id: str) -> str:
    """The session-scoped API key of `session_id` under the service token."""
    signature = hmac.new(token.encode(), session_id.encode(), hashlib.sha256).hexdigest()[:32]
    return f"dys-{session_id}-{signature}"


def credentials(request: Request) -> str | None:
    """The token or key a call carries: `Authorization: Bearer` wins over `x-api-key`."""
    given = request.headers.get("x-api-key")
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        given = auth[7:].strip()
    return given


@dataclass(frozen=True)
class Caller:
    """Who made a call: the admin (the service token), or the holder of one session's key."""

    admin: bool
    session: str | None = None  # the key's session (None for the admin)


class Gate:
    """The endpoint's checks of a call's credentials and session, under one service token."""

    def __init__(self, token: str | None) -> None:
        if not token:
            raise ValueError(
                "the endpoint needs a service token (DOCKYARD_AUTH_TOKEN or DOCKYARD_AUTH_TOKEN_FILE): it signs "
                "session keys with it; `dockyard run` and `dockyard up` create one when none is set"
            )
        self.token = token

    def caller(self, request: Request) -> Caller:
        """The caller the credentials prove; Unauthorized when they prove none."""
        given = credentials(request)
        if not given:
            raise Unauthorized(
                "no credentials: send the service token or a session key as Authorization: Bearer or x-api-key"
            )
        if hmac.compare_digest(given.encode(), self.token.encode()):
            return Caller(admin=True)
        if (match := _KEY.match(given)) and hmac.compare_digest(given, session_key(self.token, match.group(1))):
            return Caller(admin=False, session=match.group(1))
        raise Unauthorized("wrong credentials: neither the service token nor a valid session key")

    def admin(self, request: Request, what: str) -> None:
        """Only the service token may do `what`; a session key is Forbidden."""
        if not self.caller(request).admin:
            raise Forbidden(f"{what} needs the service token; {KEY_MAY}")

    def session_of(self, request: Request) -> tuple[str | None, bool]:
        """(the call's session, whether the call may open it when it is new).

        The admin's session is its session header (None: served, not recorded), opened when new; a key's
        is the key's own, and a header naming any other session is Forbidden."""
        caller = self.caller(request)
        header = request.headers.get(SESSION_HEADER)
        if header is not None and not _SESSION_ID.match(header):
            raise BadRequest(f"{SESSION_HEADER} must match {_SESSION_ID.pattern}")
        if caller.admin:
            return header, True
        if header is not None and header != caller.session:
            raise Forbidden(
                f"this session key belongs to session {caller.session!r}; {SESSION_HEADER} names {header!r}: "
                "a key writes only to its own session"
            )
        return caller.session, False

    def may_read(self, request: Request, session_id: str) -> None:
        """The service token reads any session; a key only its own (else Forbidden)."""
        caller = self.caller(request)
        if not caller.admin and caller.session != session_id:
            raise Forbidden(f"this session key belongs to session {caller.session!r}, not {session_id!r}")

    def open_session(self, request: Request) -> tuple[str, str]:
        """A new session id and its key; only the service token may open one."""
        self.admin(request, "opening a session")
        session_id = f"s-{uuid.uuid4().hex}"
        return session_id, session_key(self.token, session_id)
