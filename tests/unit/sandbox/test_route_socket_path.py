"""A work_root too long for a routed session's unix socket is refused when a route is made, naming the
setting, at the exact bound the kernel enforces; the service still starts with it (sessions without a route
and runs need no socket)."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from dockyard.rpc.errors import FailedPrecondition
from services.sandbox.endpoint_route import EndpointRoute, socket_path_excess
from services.sandbox.settings import SandboxSettings


@pytest.fixture
def base() -> Iterator[Path]:
    """A folder with a short path (pytest's tmp_path under xdist can be past the bound already)."""
    with tempfile.TemporaryDirectory(prefix="r", dir="/tmp") as folder:
        yield Path(folder)


def _root_with_excess(base: Path, excess: int) -> Path:
    """A folder under `base` whose routes' socket paths are `excess` bytes over the limit."""
    pad = -socket_path_excess(str(base / "x")) + excess
    root = base / ("x" + "p" * pad)
    root.mkdir()
    assert socket_path_excess(str(root)) == excess
    return root


async def _bind(root: Path) -> None:
    route = EndpointRoute("127.0.0.1:9", str(root))
    try:
        await route.start()
    finally:
        await route.close()


def test_a_root_at_the_bound_binds_and_one_byte_more_is_refused_by_name(base: Path) -> None:
    asyncio.run(_bind(_root_with_excess(base, 0)))
    with pytest.raises(FailedPrecondition, match="DOCKYARD_SANDBOX_WORK_ROOT .* is 1 bytes too long"):
        EndpointRoute("127.0.0.1:9", str(_root_with_excess(base, 1)))


def test_the_bound_is_the_kernels(base: Path) -> None:
    """One byte past it, a unix socket cannot bind at all: the refusal above stands in for that failure."""
    root = _root_with_excess(base, 1)
    path = root / ("dockyard-route-" + "x" * 8)
    path.mkdir()

    async def bind() -> None:
        server = await asyncio.start_unix_server(lambda r, w: None, str(path / "endpoint.sock"))
        server.close()

    with pytest.raises(OSError):
        asyncio.run(bind())


def test_the_service_starts_with_a_long_work_root(base: Path) -> None:
    SandboxSettings(backend="docker", work_root=str(_root_with_excess(base, 30)))
