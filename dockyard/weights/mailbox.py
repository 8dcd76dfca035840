"""Shared-memory words between the processes of one colocated weight-sync epoch: the path of a repeat.

    rank 0: Mailbox.create(world) ─> a small file (/dev/shm where there is one), mapped; its path
            travels to the receivers in a signed message, and rank 0 unlinks it once all mapped it
    rank r: Mailbox.open(path, world)
    word 0  v: rank 0 asks every receiver to replay its last version as version v; -v: version v is sent
            in full (its manifest is in the store); written by rank 0 only
    word r  rank r's answer: v (version v loaded), -v (failed; the reason is in the store); written by rank r only

A repeat costs two writes and two spins on these words instead of store round trips (tens of
microseconds each), which a sync of a small model on one GPU cannot hide behind its copies.

Guarantees: every word is one aligned int64 written by one process, so a reader sees it whole.
Only integers travel here (nothing is unpickled or executed), so a process that could write the
file can at most make a sync fail or repeat what the receivers already hold.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from dockyard.weights.handles import create_shared_file, remove_file

WORD = 8


class Mailbox:
    def __init__(self, path: str, world: int, fd: int, linked: bool = True) -> None:
        self.path, self.world = path, world
        try:
            self._map = mmap.mmap(fd, world * WORD)
        finally:
            os.close(fd)
        self._words = np.frombuffer(self._map, dtype=np.int64, count=world)
        self._linked = linked  # rank 0's box: its own to unlink

    @classmethod
    def create(cls, world: int) -> Mailbox:
        path = create_shared_file(world * WORD)  # zeros: nothing asked, nothing answered
        return cls(path, world, os.open(path, os.O_RDWR))

    @classmethod
    def open(cls, path: str, world: int) -> Mailbox:
        return cls(path, world, os.open(path, os.O_RDWR), linked=False)  # rank 0's to unlink

    def ask(self, version: int) -> None:
        self._words[0] = version

    def asked(self) -> int:
        return int(self._words[0])

    def answer(self, rank: int, value: int) -> None:
        self._words[rank] = value

    def answers(self) -> list[int]:
        return self._words[1:].tolist()

    def unlink(self) -> None:
        """Remove the file (the mappings stay valid): once every receiver has mapped it."""
        if self._linked:
            self._linked = False
            remove_file(self.path)

    def close(self) -> None:
        self.unlink()
        if not self._map.closed:
            self._words = np.zeros(self.world, dtype=np.int64)  # the old array exports the map's buffer
            self._map.close()
