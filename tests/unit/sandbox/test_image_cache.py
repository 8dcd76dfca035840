"""The sandbox's image cache (image_cache.py) against a stand-in engine: what it pulls, what it evicts
(least recently used first, never a kept image, one a container uses, or one it did not pull or build)."""

from __future__ import annotations

import docker.errors
import pytest

from services.sandbox.image_cache import ImageCache

GB = 1024**3


class FakeImage:
    def __init__(self, size: int) -> None:
        self.attrs = {"Size": size}


class FakeEngine:
    def __init__(self, images: dict[str, int], used: set[str] = frozenset()) -> None:
        self.present = dict(images)
        self.used = set(used)
        self.pulled: list[str] = []
        self.removed: list[str] = []
        self.images, self.containers = self, self  # client.images.* and client.containers.*

    def get(self, name: str) -> FakeImage:
        if name not in self.present:
            raise docker.errors.ImageNotFound(name)
        return FakeImage(self.present[name])

    def pull(self, name: str) -> None:
        self.pulled.append(name)
        self.present[name] = GB

    def remove(self, name: str) -> None:
        self.removed.append(name)
        del self.present[name]

    def list(self, all: bool, sparse: bool, filters: dict) -> list[str]:  # noqa: A002 -- docker's own name
        return [filters["ancestor"]] if filters["ancestor"] in self.used else []


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("services.sandbox.image_cache.time.time", lambda: now[0])
    return now


def test_pull_missing_pulls_only_absent_images_and_records_them(tmp_path, clock):
    engine = FakeEngine({"here:1": GB})
    cache = ImageCache(engine, 10, str(tmp_path))
    assert cache.pull_missing(["here:1", "away:1", "away:1"]) == ["away:1"]
    assert engine.pulled == ["away:1"]
    assert set(cache.recorded()) == {"away:1"}  # one already present is not the cache's


def test_eviction_removes_the_least_recently_used_unused_images_until_the_cache_fits(tmp_path, clock):
    engine = FakeEngine({"a": 2 * GB, "b": 2 * GB, "c": 2 * GB, "d": 2 * GB, "default": 5 * GB, "foreign": 9 * GB})
    engine.used = {"a"}  # a container uses the oldest
    cache = ImageCache(engine, 9.5, str(tmp_path), keep={"default"}, grace_seconds=60)
    for name in ("default", "a", "b", "c", "d"):
        clock[0] += 1
        cache.record(name)
    clock[0] += 1
    cache.touch("b")  # b used last: c is now the least recently used unused one
    assert cache.evict() == []  # all used within the grace: a session may be opening on any of them
    clock[0] += 60
    assert cache.evict() == ["c", "d"]  # 13 GB recorded: default kept, a in use, c then d out: 9 GB fit 9.5
    assert engine.removed == ["c", "d"] and "foreign" in engine.present
    assert set(cache.recorded()) == {"default", "a", "b"}


def test_the_record_survives_a_restart_and_forgets_images_removed_elsewhere(tmp_path, clock):
    engine = FakeEngine({"a": GB, "b": GB})
    ImageCache(engine, 1, str(tmp_path)).record("a")
    ImageCache(engine, 1, str(tmp_path)).record("b")
    del engine.present["a"]  # someone else removed it
    again = ImageCache(engine, 1, str(tmp_path))
    assert again.evict() == []  # b alone fits 1 GB
    assert set(again.recorded()) == {"b"}


def test_a_cache_of_0_gb_evicts_nothing(tmp_path, clock):
    engine = FakeEngine({"a": 50 * GB})
    cache = ImageCache(engine, 0, str(tmp_path))
    cache.added("a")
    assert engine.removed == [] and set(cache.recorded()) == {"a"}


def test_a_base_goes_only_after_the_images_built_on_it(tmp_path, clock):
    engine = FakeEngine({"row": 4 * GB, "fitted": 4 * GB, "other": 4 * GB})
    cache = ImageCache(engine, 1, str(tmp_path), grace_seconds=60)
    cache.added("row")  # pulled first: the least recently used
    clock[0] += 1
    cache.added("fitted", base="row")  # the run image built on it
    clock[0] += 1
    cache.added("other")
    clock[0] += 60
    engine.used = {"fitted"}
    assert cache.evict() == ["other"]  # row is fitted's base, fitted is in use: neither goes
    engine.used = set()
    assert cache.evict() == ["fitted", "row"]  # the child first, then (the next pass) its base
    assert cache.recorded() == {}


def test_a_record_of_the_earlier_format_is_read(tmp_path, clock):
    (tmp_path / "dockyard-image-cache.json").write_text('{"a": 5.0}')  # image -> last use, no base
    engine = FakeEngine({"a": GB})
    cache = ImageCache(engine, 0.5, str(tmp_path), grace_seconds=0)
    assert cache.recorded() == {"a": 5.0}
    assert cache.evict() == ["a"]
