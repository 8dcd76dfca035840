"""`dockyard run` and `dockyard up` never start a stack without a service token: when none is set they create
a random one in a 0600 file, every service and the command's own clients read it, and it is never printed."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from dockyard.cli.common import stack_token
from dockyard.rpc.auth import load_auth_settings
from dockyard.stack import SERVICE_TOKEN_FILE, create_service_token, ensure_service_token


def test_a_created_token_is_random_urlsafe_and_readable_by_its_owner_only(tmp_path: Path) -> None:
    first = create_service_token(tmp_path / "logs")
    token = first.read_text().strip()
    assert first == tmp_path / "logs" / SERVICE_TOKEN_FILE
    assert stat.S_IMODE(first.stat().st_mode) == 0o600
    assert len(token) >= 43 and token.replace("-", "").replace("_", "").isalnum()
    second = create_service_token(tmp_path / "logs")  # a new stack in the same folder: a new token
    assert second == first and second.read_text().strip() != token
    assert stat.S_IMODE(second.stat().st_mode) == 0o600
    assert [p.name for p in (tmp_path / "logs").iterdir()] == [SERVICE_TOKEN_FILE]  # no temporary left


def test_a_token_that_is_set_is_kept(tmp_path: Path) -> None:
    for given in ({"DOCKYARD_AUTH_TOKEN": "mine"}, {"DOCKYARD_AUTH_TOKEN_FILE": "/run/secrets/t"}):
        environ = dict(given)
        assert ensure_service_token(tmp_path, environ) is None and environ == given
    assert not list(tmp_path.iterdir())
    environ = {"DOCKYARD_AUTH_TOKEN": ""}  # empty is unset: a token is made
    path = ensure_service_token(tmp_path, environ)
    assert path is not None and environ["DOCKYARD_AUTH_TOKEN_FILE"] == str(path.resolve())


def test_the_stack_and_the_command_use_the_token_they_show_the_path_of(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    for name in ("DOCKYARD_AUTH_TOKEN", "DOCKYARD_AUTH_TOKEN_FILE"):
        # Set, then deleted: monkeypatch then restores the variable's absence after the test, where a
        # plain delenv of an unset one records nothing and the token file stack_token names would leak
        # into every later test of this worker.
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    stack_token(tmp_path)
    path = tmp_path / SERVICE_TOKEN_FILE
    token = path.read_text().strip()
    shown = capsys.readouterr().out
    assert str(path) in shown and "DOCKYARD_AUTH_TOKEN_FILE" in shown and token not in shown
    # The command's own clients (submit, follow) read it; the services it spawns inherit the environment
    # (tests/integration/test_cli_ports.py: `dockyard status` reaches `dockyard up`'s stack with it only).
    assert load_auth_settings().token == token
