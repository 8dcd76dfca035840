"""Who may call the endpoint, and which session a call belongs to.

    Authorization: Bearer <t> | x-api-key: <t> ──Gate.authorize──> None (the service token) | the key's session id
    X-Dockyard-Session header, else the key's session ──Gate.session_of──> the call's session (or None)

Guarantees: with a service token set, a call needs that token or a session key (`dys-<id>-<HMAC-SHA256
of the id under the token>`, compared in constant time), else Unauthorized (a 401); without one,
any credential is accepted. A session key binds its calls to its own session; only the service
token opens new sessions. A session header must match the contract's SESSION_ID_PATTERN (a 400).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import uuid

from starlette.requests import Request

from dockyard.agents.contract import SESSION_HEADER, SESSION_ID_CHARS, SESSION_ID_MAX_LENGTH, SESSION_ID_PATTERN
from services.endpoint.convert import BadRequest

_SESSION_ID = re.compile(SESSION_ID_PATTERN)
_KEY = re.compile(rf"^dys-([{SESSION_ID_CHARS}]{{1,{SESSION_ID_MAX_LENGTH}}})-([0-9a-f]{{32}})$")


class Unauthorized(Exception):
    pass


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


class Gate:
    """The endpoint's checks of a call's credentials and session, under one service token (or none)."""

    def __init__(self, token: str | None) -> None:
        self.token = token

    def authorize(self, request: Request) -> str | None:
        """The session id the credentials carry (None for the service token); Unauthorized if they fail."""
        given = credentials(request)
        if given and (match := _KEY.match(given)):
            if hmac.compare_digest(given, session_key(self.token or "", match.group(1))):
                return match.group(1)
        if self.token and not (given and hmac.compare_digest(given.encode(), self.token.encode())):
            raise Unauthorized("missing or wrong token: send Authorization: Bearer <token> or x-api-key")
        return None

    def session_of(self, request: Request) -> str | None:
        """The call's session: its session header, else its key's; None when it has neither."""
        from_key = self.authorize(request)
        header = request.headers.get(SESSION_HEADER)
        if header is not None and not _SESSION_ID.match(header):
            raise BadRequest(f"{SESSION_HEADER} must match {_SESSION_ID.pattern}")
        return header or from_key

    def may_read(self, request: Request, session_id: str) -> bool:
        """Whether the call may read or end `session_id`: the service token, or that session's own key."""
        return self.authorize(request) in (None, session_id)

    def open_session(self, request: Request) -> tuple[str, str]:
        """A new session id and its key; only the service token may open one."""
        if self.authorize(request) is not None:
            raise Unauthorized("a session key cannot open other sessions; use the service token")
        session_id = f"s-{uuid.uuid4().hex}"
        return session_id, session_key(self.token or "", session_id)
