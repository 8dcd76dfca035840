"""A docker session's command that ends non-zero: its own failure while the container runs, an
infrastructure error once the container is gone, including when the engine is slow to say so."""

from __future__ import annotations

from services.sandbox.docker_sessions import container_running


class SlowToStopApi:
    """inspect_container says Running for the first `running_for` calls, then stopped."""

    def __init__(self, running_for: int) -> None:
        self.running_for = running_for
        self.calls = 0

    def inspect_container(self, container_id: str) -> dict:
        self.calls += 1
        return {"State": {"Running": self.calls <= self.running_for}}


def test_a_killed_command_waits_for_the_engine_to_show_its_container_stopped() -> None:
    api = SlowToStopApi(running_for=3)
    assert container_running(api, "c0ffee", killed=True) is False
    assert api.calls == 4


def test_a_killed_command_in_a_live_container_is_the_commands_own_failure() -> None:
    api = SlowToStopApi(running_for=10**6)
    assert container_running(api, "c0ffee", killed=True) is True


def test_an_ordinary_failure_asks_the_engine_once() -> None:
    api = SlowToStopApi(running_for=1)
    assert container_running(api, "c0ffee", killed=False) is True
    assert api.calls == 1
