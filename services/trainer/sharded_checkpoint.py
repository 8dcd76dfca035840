"""Sharded checkpoints (checkpointing.format=sharded): every rank writes its own shards with
torch.distributed.checkpoint, optionally while training goes on.

    save:  rank 0 stages <step>.tmp (config.json, tokenizer, trainer_state.pt: written by the caller)
           every rank ──dcp.save / dcp.async_save──> tmp/dcp/ (__<rank>_0.distcp + .metadata)
           rank 0, once the shards and the metadata are written ──checkpoint.publish──> step-<N>/
    load:  every rank ──dcp.load into its own (sharded) model and optimizer state──> set_state_dict
    export: dockyard/export/hf_export.py (which owns the layout's names) makes an HF folder of one

Guarantees: a checkpoint counts (checkpoint.json, written by `publish`) only once every rank's
shards and the metadata are on disk, so a crash mid-write never leaves a checkpoint that resume or
retention reads. With async_save the tensors are copied to host memory before `save` returns, so the
steps that follow never change what is written; one save is in flight at a time (`save`, `load` and
`close` wait for the one before), and a failed background write leaves only the staging folder,
which is never read, and is logged and raised by the next `wait`.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from dockyard.export.hf_export import MODEL_KEY, OPTIM_KEY, SHARDS_DIR
from services.trainer import checkpoint

log = structlog.get_logger()


class ShardedCheckpoints:
    """One job's sharded saves and loads on this rank (collective: every rank calls each method)."""

    def __init__(self, rank: int, world: int, asynchronous: bool) -> None:
        self.rank, self.world, self.asynchronous = rank, world, asynchronous
        self._pending: Future | None = None
        # Rank 0 publishes a finished async save from a thread of its own, so `wait` returns only after it.
        self._publisher = ThreadPoolExecutor(1, thread_name_prefix="checkpoint") if rank == 0 and asynchronous else None
        # Background writes talk over a gloo group of their own, never the training group (NCCL).
        self._group = dist.new_group(backend="gloo") if world > 1 and asynchronous else None

    def save(
        self,
        folder: Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        write_rest: Callable[[Path], None],
        meta: dict[str, Any],
    ) -> Path:
        """Stage `folder`'s checkpoint: `write_rest(tmp)` on rank 0, every rank's shards into tmp/dcp; it is
        published (renamed into place) when the shards are written, at once unless asynchronous."""
        self.wait()
        tmp = self._staging(folder)
        if self.rank == 0:
            write_rest(tmp)
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {MODEL_KEY: model_state, OPTIM_KEY: optim_state}
        meta = {**meta, "format": "sharded"}
        target = tmp / SHARDS_DIR
        if not self.asynchronous:
            dcp.save(state, checkpoint_id=target, no_dist=self.world == 1)
            if self.rank == 0:
                checkpoint.publish(tmp, folder, meta)
            if self.world > 1:
                dist.barrier()
            return folder
        pending = dcp.async_save(state, checkpoint_id=target, process_group=self._group, no_dist=self.world == 1)
        if self._publisher is not None:
            pending = self._publisher.submit(self._publish_when_written, pending, tmp, folder, meta)
        self._pending = pending
        return folder

    def _staging(self, folder: Path) -> Path:
        """Rank 0's staging folder, the same path on every rank."""
        names = [str(checkpoint.staging_folder(folder)) if self.rank == 0 else ""]
        if self.world > 1:
            dist.broadcast_object_list(names, src=0)
        return Path(names[0])

    @staticmethod
    def _publish_when_written(written: Future, tmp: Path, folder: Path, meta: dict[str, Any]) -> None:
        try:
            written.result()
        except BaseException as exc:
            log.error("sharded checkpoint failed", folder=str(folder), error=repr(exc))
            raise
        checkpoint.publish(tmp, folder, meta)
        log.info("sharded checkpoint written", folder=str(folder))

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and published; raise if it failed."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
        except Exception as exc:
            raise RuntimeError(f"the last sharded checkpoint was not written: {exc!r}") from exc
        finally:
            if self.world > 1:  # every rank passes only once rank 0 has published
                dist.barrier()

    def load(self, folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Every rank reads its own shards of `folder` into the model and the optimizer."""
        self.wait()
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {MODEL_KEY: model_state, OPTIM_KEY: optim_state}
        dcp.load(state, checkpoint_id=folder / SHARDS_DIR, no_dist=self.world == 1)
        set_state_dict(model, optimizer, model_state_dict=state[MODEL_KEY], optim_state_dict=state[OPTIM_KEY])

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._publisher is not None:
                self._publisher.shutdown()
            if self._group is not None:
                dist.destroy_process_group(self._group)
                self._group = None
