"""WarmRuns' policy (services/sandbox/docker_warm_runs.py) with fake containers: a key's first run is cold, its
second makes the pool, a waiting container is handed out once, at most MAX_KEYS pools are kept, a key whose
container would not start runs cold for a while, and close() discards what waits; the launcher's GO is cut
off a run's stdout, never the code's output."""

from __future__ import annotations

import asyncio
import itertools

from services.sandbox import docker_warm_runs
from services.sandbox.docker_warm_runs import GO, MAX_KEYS, Launched, RunKey, WarmRun, WarmRuns, launch_header


class Engine:
    """Fake start / discard of warm containers, counting what it started and what it removed."""

    def __init__(self) -> None:
        self.ids = itertools.count()
        self.started: list[WarmRun] = []
        self.discarded: list[str] = []
        self.fail: set[str] = set()  # images whose containers do not start

    def start(self, key: RunKey) -> WarmRun:
        if key.image in self.fail:
            raise RuntimeError("python3: not found")
        warm = WarmRun(f"{key.image}-{next(self.ids)}", "/nowhere", iter(()), None)  # type: ignore[arg-type]
        self.started.append(warm)
        return warm

    def discard(self, warm: WarmRun) -> None:
        self.discarded.append(warm.container_id)


def key(image: str = "img") -> RunKey:
    return RunKey(image, 512, 10.0)


async def settled(runs: WarmRuns, waiting: int) -> None:
    for _ in range(200):
        if runs.waiting() == waiting:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{runs.waiting()} waiting, not {waiting}")


async def test_a_key_gets_its_pool_at_its_second_run_and_hands_each_container_out_once() -> None:
    engine = Engine()
    runs = WarmRuns(2, engine.start, engine.discard)
    assert await runs.take(key()) is None  # the first run of a key: cold, nothing started
    assert engine.started == []
    second = await runs.take(key())  # the pool is made; none waits yet: one started for the call
    assert second is not None and engine.started == [second]
    runs.refill(key())  # the run ended: its replacements start now
    await settled(runs, 2)
    third, fourth = await runs.take(key()), await runs.take(key())
    assert {third.container_id, fourth.container_id} == {w.container_id for w in engine.started[1:3]}
    assert len({second.container_id, third.container_id, fourth.container_id}) == 3
    await runs.close()
    assert engine.discarded == []  # none was waiting: each taken one is its run's to remove
    assert await runs.take(key()) is None  # closed: cold


async def test_at_most_max_keys_pools_and_the_oldest_is_closed() -> None:
    engine = Engine()
    runs = WarmRuns(1, engine.start, engine.discard)
    for i in range(MAX_KEYS + 1):
        await runs.take(key(f"img{i}"))
        await runs.take(key(f"img{i}"))
        runs.refill(key(f"img{i}"))
        await asyncio.sleep(0.05)
    await settled(runs, MAX_KEYS)
    assert [c for c in engine.discarded if c.startswith("img0-")], "the least recently used pool was not closed"
    await runs.close()
    assert runs.waiting() == 0 and len(engine.discarded) == 1 + MAX_KEYS


async def test_a_key_whose_container_does_not_start_runs_cold_for_a_while(monkeypatch) -> None:
    engine = Engine()
    engine.fail.add("bare")
    runs = WarmRuns(2, engine.start, engine.discard)
    now = [1000.0]
    monkeypatch.setattr(docker_warm_runs.time, "monotonic", lambda: now[0])
    assert await runs.take(key("bare")) is None
    assert await runs.take(key("bare")) is None  # the start failed: this run goes cold
    engine.fail.clear()
    assert await runs.take(key("bare")) is None  # refused for a while, no new try
    now[0] += docker_warm_runs.REFUSED_SECONDS + 1
    assert await runs.take(key("bare")) is not None  # after it: tried again
    await runs.close()


def test_the_launchers_go_is_cut_off_stdout_however_it_arrives() -> None:
    for cut in range(1, len(GO) + 1):
        launched = Launched()
        out = launched.code_output(GO[:cut]) + launched.code_output(GO[cut:] + b"hello\n")
        assert (launched.ok, out) == (True, b"hello\n")
    dead = Launched()
    assert dead.code_output(b"not the launcher") == b"not the launcher" and dead.ok is False
    assert launch_header(["sh", "-c", "echo hi"]) == b'0000000023["sh", "-c", "echo hi"]'
