"""The weight-sync group moves weights exactly, bucket by bucket, and refuses mismatched layouts on every rank."""

from __future__ import annotations

import multiprocessing as mp
import queue
import traceback

import torch

from dockyard.weights.collective import receive_weights, send_weights
from dockyard.weights.group import GroupMember, WeightSyncGroup
from tests.conftest import free_port


def _tensors(rank: int, mismatch: bool) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(rank)
    shapes = [(7, 5), (3,), (64, 33), (2, 2)]
    if mismatch and rank == 1:
        shapes[2] = (64, 32)
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float32]
    return [
        (f"layer{i}.w", torch.randn(s, generator=gen).to(d))
        for i, (s, d) in enumerate(zip(shapes, dtypes, strict=True))
    ]


def _member(rank: int, port: int, bucket: int, mismatch: bool, out: mp.Queue) -> None:
    try:
        member = GroupMember(WeightSyncGroup("127.0.0.1", port, 2, rank, epoch=3, secret="shared by both ranks"))
        tensors = _tensors(rank, mismatch)
        if rank == 0:
            report = send_weights(member, tensors, bucket)
        else:
            report = receive_weights(member, tensors)
        member.close()
        out.put((rank, "ok", report.checksum, report.num_bytes, [t.float().sum().item() for _, t in tensors]))
    except Exception as exc:
        out.put((rank, "error", f"{type(exc).__name__}: {exc}", traceback.format_exc(), None))


def run_pair(member, *args) -> dict[int, tuple]:
    """Runs `member(rank, port, *args, out)` for ranks 0 and 1 in spawned processes; each puts (rank, ...) on `out`."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=member, args=(rank, port, *args, out)) for rank in (0, 1)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            item = out.get(timeout=90)
            results[item[0]] = item[1:]
    except queue.Empty:
        raise AssertionError(f"a member hung; got {results}") from None
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return results


def test_receiver_holds_exactly_the_senders_weights_with_small_buckets() -> None:
    # 1 KiB buckets force several buckets and a dtype switch between them.
    results = run_pair(_member, 1024, False)
    assert results[0][0] == "ok" and results[1][0] == "ok", results
    sent_checksum, sent_bytes, sent_sums = results[0][1:]
    got_checksum, got_bytes, got_sums = results[1][1:]
    assert got_checksum == sent_checksum and len(sent_checksum) == 64
    assert got_bytes == sent_bytes == (35 + 64 * 33 + 4) * 4 + 3 * 2
    assert got_sums == sent_sums


def test_layout_mismatch_is_an_error_on_every_rank_not_a_hang() -> None:
    results = run_pair(_member, 1 << 20, True)
    for rank in (0, 1):
        status, message = results[rank][0], results[rank][1]
        assert status == "error", results
        assert "weight layouts differ" in message
