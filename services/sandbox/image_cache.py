"""Images a docker sandbox pulled or built, kept within DOCKYARD_SANDBOX_IMAGE_CACHE_GB, least recently used out first.

    pull_missing(images)  --> each one not present pulled (a job's start: docker_warm.prepare_job) --> record
    record(image, base)   --> the image is the cache's (pulled or built by this service: package and SWE
                              environment images, terminal tasks' images, SWE rows' pulled images and the
                              run images fitted on them, `base` the pulled image one was built on); last use = now
    touch(image)          --> a use of a cached image (a session or run made on it)
    evict()               --> while the cached images' sizes add up to more than max_gb: the least recently
                              used one that no container (running or not) uses, that is not kept, and that
                              no recorded image still present was built on, is removed (its tag: layers
                              other images share stay); an image whose child went is a candidate again

The record (image -> [last use, seconds since the epoch; base or ""]) is a JSON file in the work root
(`dockyard-image-cache.json`), so a restarted service still knows what it pulled.

Guarantees: only images this service recorded are ever removed, never one in `keep` (the default
sandbox image), never one a container uses, nor one used within the last `grace_seconds` (a session
handed the image whose container is not created yet), so a session's or run's image is not pulled from
under it; a base is never removed before the images built on it (a SWE row's pulled image stays while its
fitted run image does, so the row never needs a registry again while it is cached); max_gb 0 evicts
nothing. Not covered: an image's size is docker's size of it, layers shared with other images counted
in each, so the cache may hold less than max_gb on disk; images another engineer or service pulled are
not the cache's and are never touched.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections.abc import Iterable

import structlog

log = structlog.get_logger()

STATE_NAME = "dockyard-image-cache.json"
# How long after its last use an image is safe from eviction: a session opening on it creates its container within.
GRACE_SECONDS = 300.0


class ImageCache:
    def __init__(
        self,
        client,
        max_gb: float,
        work_root: str | None,
        *,
        keep: Iterable[str] = (),
        grace_seconds: float = GRACE_SECONDS,
    ) -> None:
        self._client = client
        self._grace = grace_seconds
        self._max_bytes = int(max_gb * 1024**3)
        self._path = os.path.join(work_root or tempfile.gettempdir(), STATE_NAME)
        self._keep = set(keep)
        self._lock = threading.Lock()

    def _load(self) -> dict[str, tuple[float, str]]:
        """image -> (last use, base or ""); a record of an earlier version (image -> last use) read as such."""
        try:
            with open(self._path) as file:
                state = json.load(file)
        except (OSError, ValueError):
            return {}
        entries = {}
        for image, value in state.items() if isinstance(state, dict) else ():
            if isinstance(value, int | float):
                entries[str(image)] = (float(value), "")
            elif isinstance(value, list) and len(value) == 2:
                entries[str(image)] = (float(value[0]), str(value[1]))
        return entries

    def _save(self, state: dict[str, tuple[float, str]]) -> None:
        partial = f"{self._path}.{os.getpid()}"
        with open(partial, "w") as file:
            json.dump({image: [used, base] for image, (used, base) in state.items()}, file)
        os.replace(partial, self._path)

    def recorded(self) -> dict[str, float]:
        """image -> last use."""
        with self._lock:
            return {image: used for image, (used, _) in self._load().items()}

    def record(self, image: str, base: str | None = None) -> None:
        """`image` is the cache's, used now; `base`: the (recorded) image it was built on, kept while it is."""
        with self._lock:
            state = self._load()
            state[image] = (time.time(), base if base is not None else state.get(image, (0.0, ""))[1])
            self._save(state)

    def added(self, image: str, base: str | None = None) -> None:
        """An image this service built or pulled: recorded, then the cache kept within max_gb. Blocks."""
        self.record(image, base)
        self.evict()

    def touch(self, image: str) -> None:
        with self._lock:
            state = self._load()
            if image in state:
                state[image] = (time.time(), state[image][1])
                self._save(state)

    def pull_missing(self, images: Iterable[str]) -> list[str]:
        """Pull each image not present; returns those pulled (recorded as the cache's). Blocks."""
        import docker.errors

        pulled = []
        for image in dict.fromkeys(images):
            try:
                self._client.images.get(image)
                self.touch(image)
                continue
            except docker.errors.ImageNotFound:
                pass
            self._client.images.pull(image)
            self.record(image)
            pulled.append(image)
            log.info("pulled a job's image", image=image)
        if pulled:
            self.evict()
        return pulled

    def evict(self) -> list[str]:
        """Remove least recently used cached images until the cache fits max_gb; returns those removed. Blocks."""
        import docker.errors

        if self._max_bytes <= 0:
            return []
        with self._lock:
            state = self._load()
            sizes = {}
            for image in list(state):
                try:
                    sizes[image] = self._client.images.get(image).attrs.get("Size", 0)
                except docker.errors.ImageNotFound:
                    del state[image]  # removed by someone else: no longer the cache's
            total, removed, now = sum(sizes.values()), [], time.time()
            passes = True
            while passes and total > self._max_bytes:  # a base whose last child went this pass: next pass
                passes = False
                bases = {base for _, base in state.values() if base}
                for image in sorted((i for i in sizes if i in state), key=lambda name: state[name][0]):
                    if total <= self._max_bytes:
                        break
                    if image in self._keep or image in bases or now - state[image][0] < self._grace:
                        continue
                    if self._in_use(image):
                        continue
                    try:
                        self._client.images.remove(image)
                    except docker.errors.APIError as exc:  # a container took it meanwhile
                        log.warning("could not evict an image", image=image, error=str(exc))
                        continue
                    total -= sizes[image]
                    del state[image]
                    removed.append(image)
                    passes = True
            self._save(state)
        if removed:
            log.info("evicted images from the sandbox's cache", images=removed, bytes_left=total)
        return removed

    def _in_use(self, image: str) -> bool:
        return bool(self._client.containers.list(all=True, sparse=True, filters={"ancestor": image}))
