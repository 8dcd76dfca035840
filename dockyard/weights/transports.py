"""The ways weights travel, chosen from the deployment (cluster.weight_sync_transport).

    collective   torch.distributed weight-sync group (NCCL on GPUs, gloo on CPUs), packed buckets
    checkpoint   a shared folder: the trainer writes version v as safetensors shards,
                 every replica reads them (layouts without a shared collective)
    colocated    trainer and replicas on one device share memory handles (colocated.py)

Guarantees: both go through `refit_plan` and report a fingerprint of the bytes
moved (fingerprint.py; equal on both sides when the receiver holds exactly the
sender's weights). Every blocking step is bounded: a collective by the group's timeout,
a wait for a checkpoint folder by `timeout`. A collective transport that
failed has closed its group; the next operation forms the weight-sync group it is
given (the coordinator hands out a new epoch after a failure).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from datetime import timedelta
from pathlib import Path

import torch

from dockyard.weights.collective import receive_weights, send_weights
from dockyard.weights.colocated import ColocatedTransport
from dockyard.weights.fingerprint import Fingerprint
from dockyard.weights.group import GroupMember, SyncFailed, SyncReport, WeightSyncGroup
from dockyard.weights.refit import TensorSpec, canonical_name, refit_plan
from dockyard.weights.transport import Transport

__all__ = ["CheckpointTransport", "CollectiveTransport", "ColocatedTransport", "Transport", "transport_from_spec"]

MANIFEST = "manifest.json"


def transport_from_spec(spec: dict, device: str | None = None) -> Transport:
    """The transport `spec` describes, for a member on `device`."""
    timeout = timedelta(seconds=float(spec["timeout_s"]))
    if spec["kind"] == "collective":
        direct = spec.get("direct_bytes")
        return CollectiveTransport(
            timeout, int(spec["bucket_bytes"]), bool(spec["checksum"]), device, None if direct is None else int(direct)
        )
    if spec["kind"] == "colocated":
        return ColocatedTransport(timeout, int(spec["bucket_bytes"]), bool(spec["checksum"]), device)
    if spec["kind"] == "checkpoint":
        return CheckpointTransport(
            spec["folder"], timeout, int(spec["shard_bytes"]), int(spec["keep"]), bool(spec["checksum"])
        )
    raise ValueError(f"unknown transport kind {spec['kind']!r}")


class CollectiveTransport(Transport):
    """A member of the weight-sync group each call is given; joined again when that group changes."""

    name = "collective"
    needs_group = True

    def __init__(
        self,
        timeout: timedelta,
        bucket_bytes: int,
        checksum: bool = True,
        device: str | None = None,
        direct_bytes: int | None = None,
    ) -> None:
        self.timeout = timeout
        self.bucket_bytes = bucket_bytes
        self.checksum = checksum
        self.direct_bytes = direct_bytes  # tensors this large skip the buckets; None = derived from bucket_bytes
        self.device = device  # the member's GPU for NCCL ("cuda:1"); None = the current one
        self.member: GroupMember | None = None

    def _member(self, group: WeightSyncGroup | None) -> GroupMember:
        if group is None:
            raise ValueError("the collective transport needs a weight-sync group from the coordinator")
        if self.member is not None and self.member.group == group:
            return self.member
        self.reset()
        try:
            self.member = GroupMember(group, self.timeout, self.device)
        except Exception as exc:  # noqa: BLE001 - store or connect errors: the peers never came
            raise SyncFailed(
                f"forming the weight-sync group of epoch {group.epoch} (rank {group.rank} of "
                f"{group.world_size}) failed within {self.timeout.total_seconds():g}s: {exc}"
            ) from exc
        return self.member

    def send(self, tensors, version, group=None) -> SyncReport:
        return self._guard(
            lambda: send_weights(self._member(group), tensors, self.bucket_bytes, self.checksum, self.direct_bytes)
        )

    def receive(self, sink, version, group=None) -> SyncReport:
        return self._guard(lambda: receive_weights(self._member(group), sink, self.checksum))

    def spec(self) -> dict:
        return {
            "kind": "collective",
            "timeout_s": self.timeout.total_seconds(),
            "bucket_bytes": self.bucket_bytes,
            "checksum": self.checksum,
            "direct_bytes": self.direct_bytes,
        }

    def _guard(self, move):
        try:
            return move()
        except SyncFailed:
            self.reset()
            raise

    def reset(self) -> None:
        if self.member is not None:
            self.member.close()
        self.member = None


class CheckpointTransport(Transport):
    """Version v lives in `folder/v<v>/` (safetensors shards + manifest.json), written atomically by a rename."""

    name = "checkpoint"

    def __init__(
        self, folder: str | Path, timeout: timedelta, shard_bytes: int = 1 << 30, keep: int = 2, checksum: bool = True
    ) -> None:
        self.folder = Path(folder)
        self.timeout = timeout
        self.shard_bytes = shard_bytes
        self.keep = keep
        self.checksum = checksum

    def spec(self) -> dict:
        return {
            "kind": "checkpoint",
            "folder": str(self.folder),
            "timeout_s": self.timeout.total_seconds(),
            "shard_bytes": self.shard_bytes,
            "keep": self.keep,
            "checksum": self.checksum,
        }

    def path(self, version: int) -> Path:
        return self.folder / f"v{version:08d}"

    def send(self, tensors, version, group=None) -> SyncReport:
        from safetensors.torch import save_file

        start = time.perf_counter()
        final = self.path(version)
        tmp = self.folder / f".tmp-v{version:08d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        digest = Fingerprint()
        entries: list[tuple] = []
        shard: dict[str, torch.Tensor] = {}
        shard_index, shard_size, total = 0, 0, 0

        def flush() -> None:
            nonlocal shard, shard_size, shard_index
            if shard:
                save_file(shard, str(tmp / f"shard-{shard_index:05d}.safetensors"))
                shard_index += 1
            shard, shard_size = {}, 0

        for name, tensor in tensors:
            name = canonical_name(name)
            cpu = tensor.detach().to("cpu").contiguous()
            if shard and shard_size + cpu.nbytes > self.shard_bytes:
                flush()
            entries.append((name, list(cpu.shape), str(cpu.dtype).removeprefix("torch."), shard_index))
            shard[name] = cpu
            shard_size += cpu.nbytes
            total += cpu.nbytes
            if self.checksum:
                digest.update(cpu)
        flush()
        manifest = {"version": version, "checksum": digest.hexdigest() if self.checksum else "", "tensors": entries}
        (tmp / MANIFEST).write_text(json.dumps(manifest))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        self._prune(version)
        return SyncReport(manifest["checksum"], total, time.perf_counter() - start)

    def _prune(self, version: int) -> None:
        for old in self.folder.glob("v*"):
            try:
                v = int(old.name[1:])
            except ValueError:
                continue
            if v <= version - self.keep:
                shutil.rmtree(old, ignore_errors=True)

    def receive(self, sink, version, group=None) -> SyncReport:
        from safetensors import safe_open

        start = time.perf_counter()
        folder = self.path(version)
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not (folder / MANIFEST).is_file():
            if time.monotonic() > deadline:
                raise SyncFailed(
                    f"no weights of version {version} appeared in {self.folder} "
                    f"within {self.timeout.total_seconds():g}s"
                )
            time.sleep(0.02)
        manifest = json.loads((folder / MANIFEST).read_text())
        if manifest["version"] != version:
            raise SyncFailed(f"{folder} holds version {manifest['version']}, not {version}")
        entries = manifest["tensors"]
        specs = [TensorSpec.from_json(e[:3]) for e in entries]
        names = refit_plan(specs, sink.layout())
        digest = Fingerprint()
        total = 0
        handles: dict[int, object] = {}
        try:
            for entry, target in zip(entries, names, strict=True):
                index = entry[3]
                if index not in handles:
                    handles[index] = safe_open(str(folder / f"shard-{index:05d}.safetensors"), framework="pt")
                tensor = handles[index].get_tensor(entry[0])  # type: ignore[attr-defined]
                if self.checksum:
                    digest.update(tensor)
                total += tensor.nbytes
                if sink.targets is not None:
                    sink.targets[target].copy_(tensor)
                else:
                    assert sink.load is not None
                    sink.load([(target, tensor.to(sink.device) if sink.device is not None else tensor)])
        except (OSError, KeyError) as exc:
            raise SyncFailed(f"reading weights of version {version} from {folder}: {exc}") from exc
        checksum = digest.hexdigest() if self.checksum else ""
        if self.checksum and manifest["checksum"] and checksum != manifest["checksum"]:
            raise SyncFailed(f"weights of version {version} in {folder} are corrupt: checksum differs from manifest")
        return SyncReport(checksum, total, time.perf_counter() - start)
