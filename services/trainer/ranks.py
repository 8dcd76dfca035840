"""Rank 0 of a torchrun trainer drives the other ranks.

    rank 0 (serves gRPC) ──command (seq, method, job id, args) over the launcher's TCPStore──> ranks 1..N-1
    then every rank runs the same PolicyTrainer method; its collectives (FSDP all-gathers,
    reduce-scatters, metric all-reduces) run in the default process group

Guarantees: every rank executes the commands in the order rank 0 issued
them, each once; rank 0 holds one lock from publishing a command until its
own part returns, so two jobs' collectives never interleave. Waiting ranks
poll the store rather than sit in a collective, so an idle trainer never
trips the process group's timeout. With one rank nothing is published and
the local part simply runs.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import structlog
import torch.distributed as dist

log = structlog.get_logger()
T = TypeVar("T")
_PREFIX = "dockyard/trainer"


def _store() -> dist.Store:
    # The store torchrun's rendezvous set up for the default group: every rank already holds it.
    return dist.distributed_c10d._get_default_store()


class Ranks:
    """Rank 0's side: publish a command, then run rank 0's own part, under one lock."""

    def __init__(self) -> None:
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self._lock = threading.Lock()
        self._seq = 0
        self._unread: list[int] = []  # published commands some follower may not have read yet

    def collective(self, method: str, job_id: str, args: tuple, local: Callable[[], T]) -> T:
        with self._lock:
            if self.world > 1:
                self._publish(method, job_id, args)
            return local()

    def stop(self) -> None:
        if self.world > 1:
            with self._lock:
                self._publish("stop", "", ())

    def _publish(self, method: str, job_id: str, args: tuple) -> None:
        store = _store()
        self._seq += 1
        # Forget the commands, and their read counters, that every follower has read: the store stays small.
        for old in list(self._unread):
            if store.add(f"{_PREFIX}/read/{old}", 0) >= self.world - 1:
                store.delete_key(f"{_PREFIX}/cmd/{old}")
                store.delete_key(f"{_PREFIX}/read/{old}")
                self._unread.remove(old)
        store.set(f"{_PREFIX}/cmd/{self._seq}", pickle.dumps((method, job_id, args)))
        self._unread.append(self._seq)


def follow(device: str, poll: timedelta = timedelta(seconds=30)) -> None:
    """Ranks > 0: run rank 0's commands until it says stop."""
    from dockyard.api.common.v1 import common_pb2
    from dockyard.config import load_config_text
    from services.trainer.policy import PolicyTrainer

    store = _store()
    jobs: dict[str, PolicyTrainer] = {}
    rank = dist.get_rank()
    seq = 0
    while True:
        seq += 1
        key = f"{_PREFIX}/cmd/{seq}"
        while not _arrived(store, key, poll):
            pass
        method, job_id, args = pickle.loads(store.get(key))
        store.add(f"{_PREFIX}/read/{seq}", 1)
        if method == "stop":
            return
        try:
            if method == "load":
                config_yaml, checkpoint_dir = args
                config = load_config_text(config_yaml, origin="config_yaml")
                jobs[job_id] = PolicyTrainer(config, device, Path(checkpoint_dir))
            elif method == "train":
                jobs[job_id].train_step([common_pb2.Group.FromString(b) for b in args[0]])
            elif method == "sft":
                jobs[job_id].sft_step(args[0])
            elif method == "weights":
                for _ in jobs[job_id].named_weights():
                    pass
            elif method == "save":
                jobs[job_id].save(*args)
            elif method == "unload":
                jobs.pop(job_id, None)
            else:
                raise ValueError(f"unknown command {method!r}")
        except Exception:
            # Rank 0 ran the same code on the same input and reports the error to its caller.
            log.exception("command failed", rank=rank, method=method, job_id=job_id)


def _arrived(store: dist.Store, key: str, poll: timedelta) -> bool:
    try:
        store.wait([key], poll)
        return True
    except dist.DistStoreError:
        return False
