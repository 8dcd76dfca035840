"""Weight refit between a trainer process and a rollout process on ONE GPU (colocated transport) vs a raw copy.

    parent: a rendezvous as the coordinator hands it out (epoch 0: trainer rank 0 hosts the store, rollout rank 1)
    trainer process (cuda:0): a Qwen2-shaped bf16 state dict (random)
        ──ColocatedTransport.send──   what the trainer's PushWeights runs with cluster.weight_sync_transport=colocated:
                                      manifest, CUDA IPC handles of its tensors (kept across versions), receipt
    rollout process (cuda:0): a TorchEngine holding the same-shaped model
        ──engine.receive_weights──    what the rollout's ReceiveWeights runs: refit plan, copies device to device
                                      out of the trainer's memory into the engine's parameters, version tag
    baseline, in the rollout process, same GPU: one raw copy of a buffer of the same bytes into another
    (also printed, for information: one torch._foreach_copy_ of a local copy of the tensors into the engine's)

Shapes: Qwen2.5-0.5B (494M parameters, tied embeddings, ~1 GB) and Qwen2-7B (~15.2 GB). Each round
starts both processes at a barrier and takes the time from the later start (both ready) to the
later end, on the one monotonic clock both processes read; the best of --repeats after a
warm-up (the first refit of an epoch maps the trainer's tensors; later ones reuse the mappings, as a
run's syncs do). Checksum off unless --checksum (the device fingerprint on both sides).
After the last refit the processes compare per-tensor sums (exact equality). Both sides keep their
parameters in one arena each (weights/arena.py), as the trainer and the rollout do when colocated,
so the receiver's copies merge into one memcpy (--separate-tensors: one copy per tensor). The trainer
side gathers its tensors on every refit as PolicyTrainer.named_weights does (packed: the same alias
objects again, arena.Aliases; separate: a detached alias of each parameter). With the
checksum off and the trainer's tensors unchanged in layout and storage (its own bf16 parameters,
stepped in place), every refit after the first is a replay of the receiver's copies, asked and
answered through the shared-memory mailbox (colocated.py, "repeat"); a trainer that sends cast
copies (fp32 master weights) takes the whole protocol every time.

Prints `colocated_sync_vs_copy_<shape>: R` per shape and, last, `colocated_sync_vs_copy: R`, the
smallest of them (raw copy time / refit time; 1.0 = the refit moves weights as fast as a bare copy;
goal R >= 0.8).

    python bench/colocated_sync.py                       # one GPU: 0.5B and 7B shapes
    python bench/colocated_sync.py --shapes 0.5b         # one shape
    python bench/colocated_sync.py --device cpu          # CPU shared memory, a tiny model (seconds)
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import queue
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.weight_sync import QWEN2_7B, TINY, say, skeleton  # noqa: E402

QWEN25_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
)
SHAPES = {"0.5b": QWEN25_05B, "7b": QWEN2_7B, "tiny": TINY}


def member(role: str, group, shape: str, args: argparse.Namespace, barrier, out) -> None:
    import torch

    from dockyard.models import build_char_tokenizer
    from dockyard.weights import arena
    from dockyard.weights.colocated import ColocatedTransport
    from services.rollout.torch_engine import TorchEngine

    trainer = role == "trainer"
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    timeout = timedelta(seconds=args.timeout)
    transport = ColocatedTransport(timeout, args.bucket_mb * 2**20, args.checksum, str(device))

    def sync_device() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    model = skeleton(SHAPES[shape], device)
    gen = torch.Generator(device=device).manual_seed(1234)
    engine = None
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen) if trainer else p.zero_()
    if trainer:
        aliases = None
        if not args.separate_tensors:  # what PolicyTrainer does when colocated (bf16 parameters sent as they are)
            arena.pack(model)
            aliases = arena.Aliases(model)
        if device.type == "cpu":  # CPU tensors are shared as they are only from shared memory (as on a GPU)
            torch.multiprocessing.set_sharing_strategy("file_system")
            model.share_memory()

        def weights() -> list:  # what PolicyTrainer.named_weights gives a sync, made on each refit as it does
            if aliases is not None:
                return aliases.get()
            return [(name, p.detach()) for name, p in model.named_parameters()]

        tensors = weights()
    else:  # contiguous_weights: what the rollout service sets when colocated
        engine = TorchEngine(model, build_char_tokenizer(), device, contiguous_weights=not args.separate_tensors)
        tensors = list(engine.named_weights().items())
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    src = dst = None
    local: list = []
    if not trainer:
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        local = [t.clone() for _, t in tensors]  # for the per-tensor copy (information only)
    sync_device()
    say(role, f"{shape}: {len(tensors)} tensors, {nbytes / 1e9:.2f} GB on {device}")

    def timed(run) -> tuple[float, float]:
        barrier.wait()  # a common start
        start = time.perf_counter()  # CLOCK_MONOTONIC: one clock for both processes
        run()
        sync_device()
        return start, time.perf_counter()

    def raw() -> None:
        if dst is not None:
            dst.copy_(src)

    def per_tensor() -> None:
        if local:
            torch._foreach_copy_([t for _, t in tensors], local)

    version = 0
    loop = asyncio.new_event_loop()  # one for the whole run, as the rollout service's is

    def refit() -> None:
        nonlocal version
        version += 1
        if trainer:
            transport.send(weights(), version, group)
        else:
            loop.run_until_complete(engine.receive_weights(transport, version, group, timeout))

    def replayed() -> None:  # the receiver's copies alone (a repeat's graph), for the breakdown
        if not trainer and transport.peer.replay is not None:
            transport.peer.replay[2].run()
            copies[0] = len(transport.peer.replay[2].dsts)

    copies = [0]

    results: dict[str, list[tuple[float, float]]] = {"raw": [], "per_tensor": [], "refit": [], "replayed": []}
    for i in range(args.repeats + 1):  # the first round warms both paths up (and maps the handles)
        for name, run in (("raw", raw), ("per_tensor", per_tensor), ("refit", refit), ("replayed", replayed)):
            start, end = timed(run)
            if i > 0:
                results[name].append((start, end))
            say(role, f"{'warm-up' if i == 0 else f'round {i}'} {name}: {(end - start) * 1e3:.2f} ms")
    if local:
        with torch.no_grad():  # the per-tensor copies wrote the engine's zeros back: one more refit
            for _, t in tensors:
                t.zero_()
    barrier.wait()
    refit()
    sync_device()
    with torch.no_grad():
        sums = [float(t.double().sum()) for _, t in tensors]
    if engine is not None:
        assert engine.weight_version == version
    barrier.wait()  # the trainer's memory stays mapped until the rollout is done reading it
    transport.close()
    loop.close()
    out.put((role, nbytes, results, sums, copies[0]))


def run_shape(shape: str, args: argparse.Namespace) -> float:
    import secrets
    import socket

    from dockyard.weights.group import WeightSyncGroup

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    secret = secrets.token_hex(32)

    def group(role: str) -> WeightSyncGroup:
        return WeightSyncGroup("127.0.0.1", port, 2, 0 if role == "trainer" else 1, 0, "gloo", secret=secret)

    ctx = mp.get_context("spawn")
    out, barrier = ctx.Queue(), ctx.Barrier(2)
    procs = [
        ctx.Process(target=member, args=(role, group(role), shape, args, barrier, out), daemon=True)
        for role in ("trainer", "rollout")
    ]
    for p in procs:
        p.start()
    got = {}
    try:
        while len(got) < 2:
            try:
                role, nbytes, results, sums, copies = out.get(timeout=5)
                got[role] = (nbytes, results, sums, copies)
            except queue.Empty:
                dead = [p for p in procs if not p.is_alive() and p.exitcode != 0]
                if dead:
                    sys.exit(f"a member process died (exit code {dead[0].exitcode}); see its output above")
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    nbytes = got["trainer"][0]
    pairs = zip(got["trainer"][1]["refit"], got["rollout"][1]["refit"], strict=True)
    # From the later of the two starts (both ready: the barrier wakes them microseconds apart) to the later end.
    refit = min(max(a[1], b[1]) - max(a[0], b[0]) for a, b in pairs)

    def alone(name: str) -> float:  # the rollout process on its own
        return min(end - start for start, end in got["rollout"][1][name])

    raw = alone("raw")
    gb = nbytes / 1e9
    print(f"{shape}: {gb:.2f} GB bf16 in {len(got['trainer'][2])} tensors on {args.device}, checksum {args.checksum}")
    print(f"  raw copy of one buffer:                    {raw * 1e3:9.2f} ms  {gb / raw:8.1f} GB/s")
    per_tensor = alone("per_tensor")
    print(f"  per-tensor copies (one _foreach_copy_):    {per_tensor * 1e3:9.2f} ms  {gb / per_tensor:8.1f} GB/s")
    replayed = alone("replayed")
    print(
        f"  the receiver's replayed copies alone:      {replayed * 1e3:9.2f} ms  {gb / replayed:8.1f} GB/s"
        f"  ({got['rollout'][3]} copies after merging adjacent ones)"
    )
    print(f"  refit (handles, copies into the engine):   {refit * 1e3:9.2f} ms  {gb / refit:8.1f} GB/s")
    equal = got["trainer"][2] == got["rollout"][2]
    print(f"  engine weights equal the trainer's (per-tensor sums): {equal}")
    if not equal:
        sys.exit("the engine's weights differ from the trainer's after the refit")
    ratio = raw / refit
    print(f"colocated_sync_vs_copy_{shape}: {ratio:.3f}", flush=True)
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: shared memory, tiny model")
    parser.add_argument("--shapes", default=None, help="comma-separated: 0.5b, 7b, tiny (default 0.5b,7b; cpu: tiny)")
    parser.add_argument("--bucket-mb", type=int, default=256, help="cluster.weight_sync_bucket_mb")
    parser.add_argument("--checksum", action="store_true", help="the device fingerprint on both sides")
    parser.add_argument(
        "--separate-tensors", action="store_true", help="leave both sides' parameters unpacked (no arena): a copy each"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=120.0, help="weight-sync timeout, seconds")
    args = parser.parse_args()
    shapes = (args.shapes or ("tiny" if args.device == "cpu" else "0.5b,7b")).split(",")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit("no GPU: run with --device cpu for the shared-memory path")
    ratios = [run_shape(shape, args) for shape in shapes]
    print(f"colocated_sync_vs_copy: {min(ratios):.3f}")


if __name__ == "__main__":
    main()
