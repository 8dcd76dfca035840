"""Rank 0 of a torchrun trainer drives the other ranks, every rank dispatching from one command table.

    rank 0 (serves gRPC) ──command (seq, name, job id, args) over the launcher's TCPStore──> ranks 1..N-1
    every rank: COMMANDS[name](its Policies, job id, *args)  (rank 0 adds its own keywords)
    then the PolicyTrainer's collectives (FSDP all-gathers, reduce-scatters, metric
    all-reduces) run in the default process group

Guarantees: every rank executes the commands in the order rank 0 issued
them, each once, through the same entry of COMMANDS; rank 0 holds one lock
from publishing a command until its own part returns, so two jobs'
collectives never interleave. Only the positional arguments travel, pickled
(plain data only); keywords stay on rank 0 (the weight sync's sender), so
"weights" on rank 0 sends while the other ranks only drain the same gathers.
Waiting ranks poll the store rather than sit in a collective, so an idle
trainer never trips the process group's timeout. With one rank nothing is
published and the command simply runs.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import structlog
import torch.distributed as dist

from dockyard.config import ConfigError, MasterConfig, load_config_text
from services.trainer.experience import Row, TrainingGroup
from services.trainer.policy import PolicyTrainer, Weights

log = structlog.get_logger()
_PREFIX = "dockyard/trainer"


class Policies:
    """What each rank holds: one PolicyTrainer per loaded job."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.jobs: dict[str, PolicyTrainer] = {}


def _load(policies: Policies, job_id: str, config_yaml: str, checkpoint_dir: str) -> PolicyTrainer:
    config = load_config_text(config_yaml, origin="config_yaml")
    policy = policies.jobs[job_id] = make_policy(config, policies.device, Path(checkpoint_dir))
    return policy


def make_policy(config: MasterConfig, device: str, checkpoint_dir: Path | None) -> PolicyTrainer:
    """The job's policy on the backend it names; JAX is imported only for `policy.backend: jax`."""
    if config.policy.backend == "jax":
        try:
            from services.trainer.jax_policy import JaxPolicyTrainer
        except ImportError as exc:
            raise ConfigError(
                f"policy.backend=jax needs jax, flax and optax on the trainer ({exc}): pip install -e '.[jax]'"
            ) from None
        return JaxPolicyTrainer(config, device, checkpoint_dir)  # type: ignore[return-value]
    return PolicyTrainer(config, device, checkpoint_dir)


def _train(policies: Policies, job_id: str, groups: Sequence[TrainingGroup]) -> dict[str, float]:
    return policies.jobs[job_id].train_step(groups)


def _sft(policies: Policies, job_id: str, rows: Sequence[Row]) -> dict[str, float]:
    return policies.jobs[job_id].sft_step(rows)


def _weights(policies: Policies, job_id: str, send: Callable[[Weights], Any] | None = None) -> Any:
    """`send(weights)` on rank 0; every rank drains what is left, so each gather completes on all ranks
    (FSDP2), also after a failed send."""
    weights = policies.jobs[job_id].named_weights()
    try:
        return None if send is None else send(weights)
    finally:
        for _ in weights:
            pass


def _save(policies: Policies, job_id: str, folder: Path, metrics: dict[str, float], data_state: str) -> Path:
    return policies.jobs[job_id].save(folder, metrics, data_state)


def _unload(policies: Policies, job_id: str) -> None:
    policy = policies.jobs.pop(job_id, None)
    if policy is not None:
        policy.close()


COMMANDS: dict[str, Callable[..., Any]] = {
    "load": _load,
    "train": _train,
    "sft": _sft,
    "weights": _weights,
    "save": _save,
    "unload": _unload,
}


def _store() -> dist.Store:
    # The store torchrun's rendezvous set up for the default group: every rank already holds it.
    return dist.distributed_c10d._get_default_store()


class Ranks:
    """Rank 0's side: publish a command, then run rank 0's own part, under one lock."""

    def __init__(self, device: str) -> None:
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.policies = Policies(device)
        self._lock = threading.Lock()
        self._seq = 0
        self._unread: list[int] = []  # published commands some follower may not have read yet

    def collective(self, command: str, job_id: str, *args: Any, **local: Any) -> Any:
        """Run COMMANDS[command] on every rank; `local` keywords are rank 0's alone and never travel."""
        run = COMMANDS[command]
        with self._lock:
            if self.world > 1:
                self._publish(command, job_id, args)
            return run(self.policies, job_id, *args, **local)

    def stop(self) -> None:
        if self.world > 1:
            with self._lock:
                self._publish("stop", "", ())

    def _publish(self, command: str, job_id: str, args: tuple) -> None:
        store = _store()
        self._seq += 1
        # Forget the commands, and their read counters, that every follower has read: the store stays small.
        for old in list(self._unread):
            if store.add(f"{_PREFIX}/read/{old}", 0) >= self.world - 1:
                store.delete_key(f"{_PREFIX}/cmd/{old}")
                store.delete_key(f"{_PREFIX}/read/{old}")
                self._unread.remove(old)
        store.set(f"{_PREFIX}/cmd/{self._seq}", pickle.dumps((command, job_id, args)))
        self._unread.append(self._seq)


def follow(device: str, poll: timedelta = timedelta(seconds=30)) -> None:
    """Ranks > 0: run rank 0's commands until it says stop."""
    store = _store()
    policies = Policies(device)
    rank = dist.get_rank()
    seq = 0
    while True:
        seq += 1
        key = f"{_PREFIX}/cmd/{seq}"
        while not _arrived(store, key, poll):
            pass
        command, job_id, args = pickle.loads(store.get(key))
        store.add(f"{_PREFIX}/read/{seq}", 1)
        if command == "stop":
            return
        try:
            COMMANDS[command](policies, job_id, *args)
        except Exception:
            # Rank 0 ran the same code on the same input and reports the error to its caller.
            log.exception("command failed", rank=rank, command=command, job_id=job_id)


def _arrived(store: dist.Store, key: str, poll: timedelta) -> bool:
    try:
        store.wait([key], poll)
        return True
    except dist.DistStoreError:
        return False
