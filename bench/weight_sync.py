"""End-to-end weight refit from a trainer process on GPU 0 to a rollout process on GPU 1, vs a raw broadcast.

    parent: a rendezvous as the coordinator hands it out (epoch 0: trainer rank 0 hosts the store, rollout rank 1)
    trainer process (GPU 0): a Qwen2-7B-shaped bf16 state dict (random, ~15.2 GB)
        ──CollectiveTransport.send──  what the trainer's PushWeights runs: canonical names, manifest,
                                      packing into two bucket buffers, broadcast, wait for the replica's receipt
    rollout process (GPU 1): a TorchEngine holding a Qwen2-7B-shaped model
        ──engine.receive_weights──    what the rollout's ReceiveWeights runs: refit plan onto the engine's
                                      parameters, receive, unpack into them, tag the version
    baseline, same processes and weight-sync group: one raw broadcast of a single buffer of the same bytes

The refit runs as the deployment configures it except for the checksum
(cluster.weight_sync_checksum, on by default: a fingerprint of every byte on
the device of both sides), which is off unless --checksum. --checksum-cost
times the refit both ways in the same rounds and prints, last,
`checksum_cost_vs_transfer: R` = (refit with checksum − refit without) /
refit without (goal <= 0.05), after checking that both sides' fingerprints
agree. --direct-mb 0 measures the all-packed path for comparison.

Both are timed from a common start (an all-reduce) to the later of the two
processes' end, best of --repeats after a warm-up. After the last refit the
two processes compare per-tensor sums of the weights (exact equality).
Prints, last, `sync_vs_raw_broadcast: R` = raw time / refit time (1.0 = the
refit moves weights at link speed).

    python bench/weight_sync.py                  # two GPUs, NCCL, 7B-shaped
    python bench/weight_sync.py --smoke          # CPU, gloo, a tiny model (seconds)
    python bench/weight_sync.py --direct-mb 0    # every tensor packed (the path before the direct one)
    python bench/weight_sync.py --checksum-cost  # the fingerprint's cost, as a fraction of the transfer
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

QWEN2_7B = dict(
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    tie_word_embeddings=False,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1000,
    tie_word_embeddings=False,
)


def say(role: str, message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {role}: {message}", flush=True)


def skeleton(shape: dict, device):
    """A Qwen2 causal LM of `shape` with uninitialised bf16 parameters on `device` (no CPU init)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.to_empty(device=device)


def member(role: str, group, args: argparse.Namespace, out: mp.Queue) -> None:
    import torch

    from dockyard.models import build_char_tokenizer
    from dockyard.weights.transports import CollectiveTransport
    from services.rollout.torch_engine import TorchEngine

    trainer = role == "trainer"
    if args.backend == "nccl":
        torch.cuda.set_device(group.rank)
        device = torch.device("cuda", group.rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
        device = torch.device("cpu")
    timeout = timedelta(seconds=args.timeout)
    direct = None if args.direct_mb is None else int(args.direct_mb * 2**20)
    transport = CollectiveTransport(timeout, args.bucket_mb * 2**20, args.checksum, str(device), direct)

    def sync_device() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    say(role, f"building the {'7B' if not args.smoke else 'tiny'}-shaped model on {device}")
    model = skeleton(TINY if args.smoke else QWEN2_7B, device)
    gen = torch.Generator(device=device).manual_seed(1234)
    if trainer:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02, generator=gen)
        tensors = [(name, p.detach()) for name, p in model.named_parameters()]
        engine = None
    else:
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        engine = TorchEngine(model, build_char_tokenizer(), device)
        tensors = list(engine.named_weights().items())
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    sync_device()
    say(role, f"{len(tensors)} tensors, {nbytes / 1e9:.2f} GB; joining the weight-sync group (epoch {group.epoch})")
    member = transport._member(group)
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def timed(run) -> float:
        member.all_ok(True)  # a common start
        sync_device()
        start = time.perf_counter()
        run()
        sync_device()
        return time.perf_counter() - start

    def raw() -> None:
        member.broadcast(flat, "raw broadcast")

    version = 0
    fingerprints: list[str] = []

    def refit(checksum: bool) -> None:
        nonlocal version
        version += 1
        transport.checksum = checksum
        if trainer:
            report = transport.send(tensors, version, group)
        else:
            report = asyncio.run(engine.receive_weights(transport, version, group, timeout))
        if checksum:
            fingerprints.append(report.checksum)

    paths = [("raw", raw), ("refit", lambda: refit(args.checksum))]
    if args.checksum_cost:
        paths.append(("refit_checksum", lambda: refit(True)))
    results: dict[str, list[float]] = {name: [] for name, _ in paths}
    for i in range(args.repeats + 1):  # the first round warms up every path
        for name, run in paths:
            seconds = timed(run)
            if i > 0:
                results[name].append(seconds)
            say(role, f"{'warm-up' if i == 0 else f'round {i}'} {name}: {seconds * 1e3:.1f} ms")
    with torch.no_grad():
        sums = [float(t.double().sum()) for _, t in tensors]
    if engine is not None:
        assert engine.weight_version == version
    transport.close()
    out.put((role, nbytes, results, sums, fingerprints))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny model, gloo on CPU")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default=None, help="default: nccl, gloo with --smoke")
    parser.add_argument("--bucket-mb", type=int, default=256, help="cluster.weight_sync_bucket_mb")
    parser.add_argument(
        "--direct-mb",
        type=float,
        default=None,
        help="tensors of at least this size skip the buckets (default a quarter of a bucket; 0 packs every tensor)",
    )
    parser.add_argument(
        "--checksum",
        action="store_true",
        help="fingerprint on both sides, as cluster.weight_sync_checksum (default true in deployments) does; "
        "off by default here: the figure is the transfer's",
    )
    parser.add_argument(
        "--checksum-cost",
        action="store_true",
        help="also time the refit with the checksum on, and print checksum_cost_vs_transfer",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=60.0, help="weight-sync timeout, seconds")
    args = parser.parse_args()
    args.backend = args.backend or ("gloo" if args.smoke else "nccl")
    if args.smoke and args.direct_mb is None:
        args.direct_mb = 0.01  # the tiny model's larger tensors go direct, its smaller ones packed: both paths run
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import secrets
    import socket

    from dockyard.weights.group import WeightSyncGroup

    if args.backend == "nccl":
        import torch

        if torch.cuda.device_count() < 2:
            sys.exit(f"the nccl benchmark needs two GPUs of one host; found {torch.cuda.device_count()}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    secret = secrets.token_hex(32)

    def group(member: str) -> WeightSyncGroup:
        rank = 0 if member == "trainer" else 1
        return WeightSyncGroup("127.0.0.1", port, 2, rank, 0, args.backend, secret=secret)

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=member, args=(role, group(role), args, out), daemon=True) for role in ("trainer", "rollout")
    ]
    for p in procs:
        p.start()
    got = {}
    try:
        while len(got) < 2:
            try:
                role, nbytes, results, sums, fingerprints = out.get(timeout=5)
                got[role] = (nbytes, results, sums, fingerprints)
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

    def best(name: str) -> float:
        return min(max(a, b) for a, b in zip(got["trainer"][1][name], got["rollout"][1][name], strict=True))

    raw, refit = best("raw"), best("refit")
    equal = got["trainer"][2] == got["rollout"][2]
    gb = nbytes / 1e9
    direct = "bucket/4" if args.direct_mb is None else f"{args.direct_mb:g} MiB"
    print(
        f"backend {args.backend}, {gb:.2f} GB bf16 in {len(got['trainer'][2])} tensors, "
        f"buckets of {args.bucket_mb} MiB, direct from {direct}, checksum {'on' if args.checksum else 'off'}"
    )
    print(f"raw broadcast of one buffer: {raw * 1e3:9.1f} ms  {gb / raw:7.1f} GB/s")
    print(f"refit (pack, transfer, load into the engine): {refit * 1e3:9.1f} ms  {gb / refit:7.1f} GB/s")
    print(f"engine weights equal the trainer's (per-tensor sums): {equal}")
    if not equal:
        sys.exit("the engine's weights differ from the trainer's after the refit")
    print(f"sync_vs_raw_broadcast: {raw / refit:.3f}")
    if args.checksum_cost:
        checked = best("refit_checksum")
        agree = got["trainer"][3] == got["rollout"][3] and all(len(f) == 64 for f in got["trainer"][3])
        print(f"refit with the checksum: {checked * 1e3:9.1f} ms  {gb / checked:7.1f} GB/s")
        print(f"fingerprints of both sides agree in every round: {agree}")
        if not agree:
            sys.exit("the trainer's and the engine's fingerprints differ")
        print(f"checksum_cost_vs_transfer: {(checked - refit) / refit:.3f}")


if __name__ == "__main__":
    main()
