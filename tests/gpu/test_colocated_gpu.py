"""Two processes on one GPU: the colocated transport moves weights through CUDA IPC exactly, and an NCCL
weight-sync group of two ranks on that GPU is refused with the fix in the message (`make test-gpu`)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import queue
import traceback
from datetime import timedelta

import torch

from dockyard.weights.collective import TensorSink
from dockyard.weights.colocated import ColocatedTransport
from dockyard.weights.group import GroupMember, SyncFailed, WeightSyncGroup
from tests.conftest import free_port, missing


def _needs_gpu() -> None:
    if not torch.cuda.is_available():
        missing("no CUDA device")


def _trainer_tensors() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator(device="cuda").manual_seed(3)
    big = torch.randn(1024, 1024, generator=gen, device="cuda", dtype=torch.bfloat16)  # shared as it is
    return [
        ("_orig_mod.model.embed.weight", big),
        ("model.mlp.weight", torch.randn(64, 32, generator=gen, device="cuda").t()),  # strided: staged
        ("model.norm.weight", torch.randn(32, generator=gen, device="cuda")),
        ("model.cpu_side.weight", torch.randn(300, 7)),  # off the device: staged through a bucket
    ]


def _targets() -> dict[str, torch.Tensor]:
    return {
        "model.embed.weight": torch.zeros(1024, 1024, dtype=torch.bfloat16, device="cuda"),
        "model.mlp.weight": torch.zeros(32, 64, device="cuda"),
        "model.norm.weight": torch.zeros(32, dtype=torch.bfloat16, device="cuda"),  # cast on load
        "model.cpu_side.weight": torch.zeros(300, 7, device="cuda"),
    }


def _colocated(rank: int, port: int, out) -> None:
    try:
        torch.cuda.set_device(0)
        group = WeightSyncGroup("127.0.0.1", port, 2, rank, epoch=1, secret="s")
        transport = ColocatedTransport(timedelta(seconds=60), 4096, checksum=True, device="cuda:0")
        if rank == 0:
            tensors = _trainer_tensors()
            checksums = [transport.send(tensors, 1, group).checksum]
            with torch.no_grad():
                for _, t in tensors:
                    t.mul_(-1.0)
            checksums.append(transport.send(tensors, 2, group).checksum)
            got = [t.cpu().float().numpy() for _, t in tensors]
        else:
            targets = _targets()
            sink = TensorSink(targets=targets)
            checksums = [transport.receive(sink, v, group).checksum for v in (1, 2)]
            got = [t.cpu().float().numpy() for t in targets.values()]
        transport.close()
        # numpy, not tensors: a CPU tensor would cross the queue as a file descriptor, which needs this
        # process alive until the parent reads it
        out.put((rank, "ok", checksums, got))
    except Exception as exc:
        out.put((rank, "error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))


def _replayed(rank: int, port: int, out) -> None:
    """Checksum off, the trainer's tensors stepped in place: versions 2.. are replays (a CUDA graph), 3 and 4
    taken on an event loop (receive_on_loop)."""
    try:
        torch.cuda.set_device(0)
        group = WeightSyncGroup("127.0.0.1", port, 2, rank, epoch=1, secret="s")
        transport = ColocatedTransport(timedelta(seconds=60), 4096, checksum=False, device="cuda:0")
        gen = torch.Generator(device="cuda").manual_seed(5)
        # 3 MiB (a memcpy node) and 64 small tensors (the multi-tensor kernel), as a model's mix
        shapes = [(1024, 1536), *[(8, 32 + i) for i in range(64)]]
        seen, graphs = [], []
        if rank == 0:
            tensors = [(f"w{i}", torch.randn(s, generator=gen, device="cuda")) for i, s in enumerate(shapes)]
            for version in range(1, 5):
                with torch.no_grad():
                    for _, t in tensors:
                        t.mul_(-2.0)
                transport.send(tensors, version, group)
                seen.append([t.cpu().numpy() for _, t in tensors])
        else:
            targets = {f"w{i}": torch.zeros(s, device="cuda") for i, s in enumerate(shapes)}
            for version in range(1, 5):
                if version > 2:  # on an event loop, as the rollout service receives: the repeat runs there
                    asyncio.run(transport.receive_on_loop(TensorSink(targets=targets), version, group))
                else:
                    transport.receive(TensorSink(targets=targets), version, group)
                seen.append([t.cpu().numpy() for t in targets.values()])
                graphs.append(transport.peer.replay[2].graph is not None)
        transport.close()
        out.put((rank, "ok", seen, graphs))
    except Exception as exc:
        out.put((rank, "error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))


def _nccl(rank: int, port: int, out) -> None:
    try:
        group = WeightSyncGroup("127.0.0.1", port, 2, rank, epoch=1, backend="nccl", secret="s")
        GroupMember(group, timedelta(seconds=30), device="cuda:0")
        out.put((rank, "formed", "", ""))
    except SyncFailed as exc:
        out.put((rank, "refused", str(exc), ""))
    except Exception as exc:
        out.put((rank, "error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))


def _pair(target) -> dict[int, tuple]:
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=target, args=(rank, port, out)) for rank in (0, 1)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            item = out.get(timeout=120)
            results[item[0]] = item[1:]
    except queue.Empty:
        raise AssertionError(f"a member hung; got {results}") from None
    finally:
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.kill()
    return results


def test_two_processes_on_one_gpu_move_weights_exactly_through_cuda_ipc() -> None:
    _needs_gpu()
    results = _pair(_colocated)
    assert results[0][0] == "ok" and results[1][0] == "ok", results
    assert results[0][1] == results[1][1] and results[0][1][0] != results[0][1][1]
    sent = [torch.from_numpy(a) for a in results[0][2]]
    got = [torch.from_numpy(a) for a in results[1][2]]
    for i in (0, 1, 3):
        assert torch.equal(sent[i], got[i]), i
    assert torch.equal(sent[2].to(torch.bfloat16).float(), got[2])


def test_an_nccl_group_of_two_ranks_on_one_gpu_is_refused_with_the_fix() -> None:
    _needs_gpu()
    results = _pair(_nccl)
    for rank in (0, 1):
        status, message = results[rank][0], results[rank][1]
        assert status == "refused", results
        assert "both on GPU" in message and "cluster.weight_sync_transport=colocated" in message


def test_repeats_replay_one_captured_graph_and_carry_every_new_version() -> None:
    _needs_gpu()
    results = _pair(_replayed)
    assert results[0][0] == "ok" and results[1][0] == "ok", results
    sent, got = results[0][1], results[1][1]
    for version, (a, b) in enumerate(zip(sent, got, strict=True), start=1):
        assert all((x == y).all() for x, y in zip(a, b, strict=True)), f"version {version} differs"
    assert not (sent[0][0] == sent[1][0]).all()  # the versions really differ
    assert results[1][2] == [False, True, True, True]  # captured at the first repeat, launched after
