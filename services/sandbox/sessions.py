"""Sessions: long-lived work folders (local) or containers (docker) that multi-turn work keeps across calls.

    open(make handle)  --> fewer than max_sessions open? else ResourceExhausted
                       --> Session(id = 32 random bytes, url-safe), its handle, its idle timeout
    use(id)            --> unknown / closed / reaped: NotFound; else the session, its calls one at a time
    close(id)          --> gone from the store at once (NotFound from then on); its running command
                           killed, then its work folder or container removed
    reaper (a task)    --> every few seconds: sessions not used for their idle timeout (and not in a
                           call) are closed
    close_all          --> at service shutdown, every session

Guarantees: an id is unguessable (secrets.token_urlsafe(32)) and never reused; at most
`max_sessions` sessions are open or opening at once; a session's calls run one at a time
(a command never overlaps a file write of the same session); a session in a call is never
reaped, and its idle clock starts again when the call ends; a closed session's id is
NotFound, whether CloseSession or the reaper closed it; a session made for a caller that gave
up meanwhile is closed, never left behind.

Each backend provides SessionHandle (declared in backend.py; local_sessions.py, docker_sessions.py); the store knows
nothing of processes or containers. Cleanup after a crash is the backends' (they find their
leftovers on start by marker or label).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import structlog

from dockyard.rpc.errors import NotFound, ResourceExhausted
from services.sandbox.backend import ResourceLimits, SessionHandle

log = structlog.get_logger()

REAP_INTERVAL_SECONDS = 5.0


@dataclass
class Session:
    id: str
    handle: SessionHandle
    limits: ResourceLimits
    idle_timeout: float
    last_used: float
    swe: tuple[str, str] | None = None  # (task_set, instance_id) of a SWE session
    terminal: object | None = None  # a terminal task's session: its (TaskFolder or HarborTask, WORKDIR)
    file_task: object | None = None  # a file-producing task's session: its gdpval TaskFolder
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    calls: int = 0  # calls in progress or waiting for the lock


class SessionStore:
    def __init__(self, max_sessions: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._max = max_sessions
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        self._opening = 0
        self._reaper: asyncio.Task | None = None

    def __len__(self) -> int:
        return len(self._sessions)

    async def open(
        self,
        make: Callable[[], Awaitable[SessionHandle]],
        *,
        limits: ResourceLimits,
        idle_timeout: float,
        swe: tuple[str, str] | None = None,
        terminal: object | None = None,
        file_task: object | None = None,
    ) -> Session:
        """A new session around the handle `make` returns; ResourceExhausted when max_sessions are open."""
        if len(self._sessions) + self._opening >= self._max:
            raise ResourceExhausted(
                f"sandbox sessions are full: {len(self._sessions)} open, {self._opening} opening "
                f"(DOCKYARD_SANDBOX_MAX_SESSIONS={self._max}); close one or retry later"
            )
        self._opening += 1
        making = asyncio.ensure_future(make())
        try:
            handle = await asyncio.shield(making)
        except asyncio.CancelledError:
            # The caller gave up (deadline): a session made meanwhile is nobody's, so it goes.
            await asyncio.wait([making])
            if not making.cancelled() and making.exception() is None:
                await making.result().close()
            raise
        finally:
            self._opening -= 1
        session = Session(
            secrets.token_urlsafe(32), handle, limits, idle_timeout, self._clock(), swe, terminal, file_task
        )
        self._sessions[session.id] = session
        # warm: whether the session's sandbox was started ahead (the pool PrepareSessions filled) or for it.
        log.info("session opened", session=session.id[:8], warm=handle.warm, open=len(self._sessions))
        return session

    @contextlib.asynccontextmanager
    async def use(self, session_id: str) -> AsyncIterator[Session]:
        """The session, held for one call (calls of a session run one at a time); NotFound when it is not open."""
        session = self._get(session_id)
        session.calls += 1
        try:
            async with session.lock:
                if self._sessions.get(session_id) is not session:  # closed while this call waited
                    raise NotFound(_not_found(session_id))
                yield session
        finally:
            session.calls -= 1
            session.last_used = self._clock()

    async def close(self, session_id: str) -> None:
        """Close an open session; NotFound when it is not open."""
        await self._close(self._get(session_id), "closed")

    async def reap_idle(self) -> int:
        """Close the sessions idle past their timeout and not in a call; returns how many."""
        now = self._clock()
        idle = [s for s in self._sessions.values() if s.calls == 0 and now - s.last_used >= s.idle_timeout]
        for session in idle:
            await self._close(session, "reaped (idle)")
        return len(idle)

    def start_reaper(self, interval: float = REAP_INTERVAL_SECONDS) -> None:
        async def loop() -> None:
            while True:
                await asyncio.sleep(interval)
                try:
                    await self.reap_idle()
                except Exception as exc:  # a failed close must not stop the reaping of the others
                    log.warning("session reaping failed", error=str(exc))

        self._reaper = asyncio.get_running_loop().create_task(loop())

    async def close_all(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for session in list(self._sessions.values()):
            await self._close(session, "closed at shutdown")

    def _get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise NotFound(_not_found(session_id))
        return session

    async def _close(self, session: Session, why: str) -> None:
        if self._sessions.pop(session.id, None) is None:
            return  # closed meanwhile
        session.handle.kill()  # a running command ends now; its call then releases the lock
        async with session.lock:
            await session.handle.close()
        log.info(f"session {why}", session=session.id[:8], open=len(self._sessions))


def _not_found(session_id: str) -> str:
    return f"session_id {session_id[:16]!r}...: no such session (never opened, closed, or reaped when idle)"
