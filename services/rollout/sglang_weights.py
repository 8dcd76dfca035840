"""The SGLang replica's side of the whole-tensor weight sync (dockyard/weights/whole_tensor.py states the protocol).

    per epoch  join rank 0's store, prove the epoch's secret (whole_tensor.join) ──>
               init_weights_update_group(A, P, rank_offset=r, W, "dockyard-P-epoch-e", b)
    version v  for each bucket i: read ".../whole-tensor/v<v>/bucket/<i>" ──>
               update_weights_from_distributed(names, dtypes, shapes, flush_cache=<last bucket>) ──>
               after the last: set ".../whole-tensor/v<v>/loaded/<r>" = "ok" (or "failed: <why>" on any error)

Guarantees: SGLang joins no group and receives no byte unless both sides
proved the epoch's secret; every SGLang call is awaited for at most the sync
timeout (SyncFailed otherwise; SGLang's own group keeps torch's default
timeout, so its scheduler may stay in a broadcast until then); rank 0 learns
of any failure from the "loaded" key with its reason; any failure destroys
SGLang's group (best effort), so the next sync forms the coordinator's next
epoch. The proof covers the rollout service process, not SGLang's scheduler
connection to the store. SGLang reports no digest of what it received (the
report's checksum is empty) and checks no layout before bytes move: a name
its model does not know fails the load after the transfer, as "failed: ...".
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import timedelta
from typing import Any

import torch

from dockyard.weights.group import SyncFailed, SyncReport, WeightSyncGroup
from dockyard.weights.whole_tensor import Entry, bucket_key, decode_bucket, group_name, join, loaded_key


def read_bucket(store: Any, version: int, index: int) -> tuple[list[Entry], bool]:
    """Bucket `index` of `version` as rank 0 announced it (blocking, bounded by the store timeout)."""
    try:
        raw = store.get(bucket_key(version, index))
    except Exception as exc:  # noqa: BLE001 - a store timeout or a vanished rank 0
        raise SyncFailed(f"no weight manifest of bucket {index} of version {version} from rank 0: {exc}") from exc
    return decode_bucket(raw, version, index)


class SglangWeights:
    """One SGLang Engine's membership of the weight-sync group, and the loads over it."""

    def __init__(self, engine: Any, io_struct: Any) -> None:
        self.engine = engine
        self.io = io_struct
        self.group: WeightSyncGroup | None = None  # the epoch SGLang's weight-update group belongs to
        self.store: Any = None

    async def load(self, group: WeightSyncGroup, version: int, timeout: timedelta) -> SyncReport:
        """Receive `version` into SGLang; SyncFailed (SGLang's group destroyed) on any failure."""
        try:
            return await self._load(group, version, timeout)
        except BaseException:
            await self.leave()
            raise

    async def _load(self, group: WeightSyncGroup, version: int, timeout: timedelta) -> SyncReport:
        start = time.perf_counter()
        name = group_name(group)
        joining = self.group != group
        if joining:
            await self.leave()
            self.store = await asyncio.to_thread(join, group, timeout)
            self.group = group  # from here on a failure destroys SGLang's side of it
        payload, index, last = 0, 0, False
        try:
            if joining:
                await self._control(
                    "init_weights_update_group",
                    self.io.InitWeightsUpdateGroupReqInput(
                        master_address=group.master_address,
                        master_port=group.master_port,
                        rank_offset=group.rank,
                        world_size=group.world_size,
                        group_name=name,
                        backend=group.backend,
                    ),
                    timeout,
                    f"joining SGLang to the weight-sync group of epoch {group.epoch}",
                )
            while not last:
                entries, last = await asyncio.to_thread(read_bucket, self.store, version, index)
                await self._control(
                    "update_weights_from_distributed",
                    self.io.UpdateWeightsFromDistributedReqInput(
                        names=[n for n, _, _ in entries],
                        dtypes=[d for _, d, _ in entries],
                        shapes=[s for _, _, s in entries],
                        group_name=name,
                        flush_cache=last,  # cached prefixes hold keys/values of the old weights
                        weight_version=str(version),
                    ),
                    timeout,
                    f"loading bucket {index} of version {version}",
                )
                payload += sum(getattr(torch, d).itemsize * torch.Size(s).numel() for _, d, s in entries)
                index += 1
        except Exception as exc:  # rank 0 learns why from the store
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.store.set, loaded_key(version, group.rank), f"failed: {exc}")
            raise
        try:
            await asyncio.to_thread(self.store.set, loaded_key(version, group.rank), "ok")
        except Exception as exc:  # noqa: BLE001 - rank 0 gone before the acknowledgement
            raise SyncFailed(f"acknowledging version {version} to rank 0 failed: {exc}") from exc
        return SyncReport("", payload, time.perf_counter() - start)

    async def _control(self, method: str, request: Any, timeout: timedelta, what: str) -> None:
        """Await the tokenizer manager's coroutine behind Engine.<method>, bounded; SyncFailed unless it succeeded.

        Engine.<method> is a blocking wrapper that runs this same coroutine on
        the Engine's own loop, which cannot run inside the service's running
        loop (SGLang's HTTP server awaits it the same way).
        """
        try:
            call = getattr(self.engine.tokenizer_manager, method)(request, None)
            ok, message = await asyncio.wait_for(call, timeout.total_seconds())
        except TimeoutError:
            raise SyncFailed(f"{what}: no answer from SGLang within {timeout.total_seconds():g}s") from None
        except Exception as exc:  # noqa: BLE001 - any SGLang error fails the sync
            raise SyncFailed(f"{what}: {exc}") from exc
        if not ok:
            raise SyncFailed(f"{what}: SGLang: {message}")

    async def leave(self) -> None:
        """Forget the epoch's group (SGLang's, best effort): the next sync forms the group it is given."""
        group, self.group, self.store = self.group, None, None
        if group is None:
            return
        request = self.io.DestroyWeightsUpdateGroupReqInput(group_name=group_name(group))
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.engine.tokenizer_manager.destroy_weights_update_group(request, None), 30)
