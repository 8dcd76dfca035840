"""Weight sync over the side group vs a raw broadcast of the same bytes, in one run.

    rank 0 (trainer) ──send_weights──> rank 1 (rollout)      timed, best of --repeats
    rank 0           ──broadcast(one flat buffer)──> rank 1   timed, best of --repeats

Prints both, then `sync_vs_raw_broadcast: R` (sync time / raw time; 1.0 is the floor).
The tensors mimic a transformer's: a few large matrices per layer and small vectors.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import time

import torch

from dockyard.weights.collective import Rendezvous, SideGroup, receive_weights, send_weights


def model_like(total_mb: int, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    hidden = 1024
    per_layer = 4 * hidden * hidden + 3 * hidden * 4 * hidden + 2 * hidden
    element = torch.finfo(dtype).bits // 8
    layers = max(1, total_mb * 2**20 // (per_layer * element))
    tensors = []
    for i in range(layers):
        for name in ("q", "k", "v", "o"):
            tensors.append((f"layers.{i}.attn.{name}", torch.randn(hidden, hidden, dtype=dtype)))
        for name in ("gate", "up"):
            tensors.append((f"layers.{i}.mlp.{name}", torch.randn(4 * hidden, hidden, dtype=dtype)))
        tensors.append((f"layers.{i}.mlp.down", torch.randn(hidden, 4 * hidden, dtype=dtype)))
        tensors.append((f"layers.{i}.norm1", torch.ones(hidden, dtype=dtype)))
        tensors.append((f"layers.{i}.norm2", torch.ones(hidden, dtype=dtype)))
    return tensors


def member(rank: int, port: int, args: argparse.Namespace, out: mp.Queue) -> None:
    dtype = getattr(torch, args.dtype)
    group = SideGroup(Rendezvous("127.0.0.1", port, 2, rank, 0, args.backend))
    tensors = [(n, t.to(group.device)) for n, t in model_like(args.mb, dtype)]
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    flat = torch.empty(sum(t.numel() for _, t in tensors), dtype=dtype, device=group.device)
    sync = send_weights if rank == 0 else receive_weights

    def timed(fn) -> float:
        best = float("inf")
        for _ in range(args.repeats):
            group._all_ok(True)  # start together
            if group.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if group.device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        return best

    raw = timed(lambda: group._broadcast(flat))
    synced = timed(lambda: sync(group, tensors, args.bucket_mb * 2**20, checksum=False))
    group.close()
    if rank == 0:
        out.put((nbytes, raw, synced))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--mb", type=int, default=256, help="total size of the weights")
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=member_entry, args=(rank, port, args, out)) for rank in (0, 1)]
    for p in procs:
        p.start()
    nbytes, raw, synced = out.get(timeout=600)
    for p in procs:
        p.join(60)
    gb = nbytes / 1e9
    print(f"backend {args.backend}, {gb:.3f} GB in {args.dtype}, buckets of {args.bucket_mb} MB")
    print(f"raw broadcast:  {raw * 1e3:9.1f} ms  {gb / raw:7.2f} GB/s")
    print(f"weight sync:    {synced * 1e3:9.1f} ms  {gb / synced:7.2f} GB/s")
    print(f"sync_vs_raw_broadcast: {synced / raw:.3f}")


def member_entry(rank: int, port: int, args: argparse.Namespace, out: mp.Queue) -> None:
    if args.backend == "nccl":
        torch.cuda.set_device(rank)
    member(rank, port, args, out)


if __name__ == "__main__":
    main()
