"""A work_root too long for a routed session's unix socket is refused when the sandbox starts, at the
exact bound the kernel enforces."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

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


def test_a_root_at_the_bound_binds_and_one_byte_more_cannot(base: Path) -> None:
    asyncio.run(_bind(_root_with_excess(base, 0)))
    with pytest.raises(OSError):
        asyncio.run(_bind(_root_with_excess(base, 1)))


def test_the_docker_backend_refuses_a_work_root_too_long_for_its_routes(base: Path) -> None:
    root = _root_with_excess(base, 1)
    with pytest.raises(ValidationError, match="work_root .* 1 bytes too long"):
        SandboxSettings(backend="docker", work_root=str(root))
    SandboxSettings(backend="docker", work_root=str(_root_with_excess(base, 0)))
    # The local backend opens no routed session, so its work folders may be deeper.
    SandboxSettings(backend="local", work_root=str(root))
