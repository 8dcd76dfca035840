"""The buffer service on Redis vs raw redis-py on the same Redis, in one run.

    put     --concurrency callers: JobBuffer.put (the coordinator's writer): split, check, SET the payload in
                Redis (the data plane), PutGroup(metadata, key) ──> buffer ──Lua: dedup, capacity, RENAME, XADD──> redis
            --concurrency callers ──XADD───────────────────────────────────────────────────────────────────> redis
    sample  one trainer: BufferConsumer.lease(k) (SampleGroupsStream by reference, MGET of the payloads from
                Redis), unpack, AckGroups ──> buffer ──Lua: XREADGROUP, XACK+XDEL──> redis
            one trainer ──XREADGROUP COUNT k, XACK+XDEL (one pipeline)─────────────────────────────────────> redis

The script starts its own redis-server (no persistence, in a temp dir) and the
buffer service (`python -m services.buffer`, redis backend) on free ports, and
stops both at the end. For each --tokens size it builds --groups GRPO groups of
--group-size trajectories (random token ids of a 151,936-token vocabulary,
float logprobs, a 256-token prompt), then times on each path: putting all of
them, and sampling batches of --batch and acking them until all are consumed;
--repeats times, the two paths alternating, keeping the best put and the best
sample-and-ack time of each path. Both paths start from Group messages. The
service path runs the services' own clients: the writer splits each group into
metadata and a packed payload (dockyard/experience/payload.py) and checks it
(timed), the reader gets the bytes as stored and unpacks them into arrays
(timed). With --no-data-plane the payloads stream through the buffer service
(PutGroupStream, SampleGroupsStream) instead. The raw path encodes and decodes
whole Groups, what a direct Redis client of the old format needs. MB are those
of the serialized Groups. --multi-turn-tokens adds a size of multi-turn groups
(loss masks, a later segment) of that many tokens per trajectory, prompt
included.

Prints a table, then `buffer_vs_raw_redis: R` where R is the service's
put+sample throughput over raw Redis's at 4096 tokens (or at the first --tokens
size without 4096), and the same ratio at every size; put+sample throughput is
N / (put seconds + sample-and-ack seconds). 1.0 is parity; lower means the
service costs that much. `metadata_share` is the fraction of the writer's bytes
that is metadata (ids, rewards, versions, texts); `writer_bytes_through_service`
the fraction the writer sent through the buffer service (metadata, and payloads
without a data plane): the coordinator's share of the bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import redis
import redis.asyncio as aioredis

from dockyard.api.buffer.v1 import buffer_pb2, buffer_pb2_grpc
from dockyard.api.common.v1 import common_pb2
from dockyard.experience import payload
from dockyard.rpc.client import connect, health_status
from services.coordinator.job_buffer import JobBuffer
from services.trainer.consumer import BufferConsumer
from services.trainer.ledger import TrainedLedger

REPO_ROOT = Path(__file__).resolve().parent.parent
VOCAB = 151_936
PROMPT_TOKENS = 256
CONSUMER = "bench-trainer"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_groups(
    job_id: str, n: int, group_size: int, tokens: int, seed: int, multi_turn: bool = False
) -> list[common_pb2.Group]:
    """`n` groups of `group_size` distinct trajectories of `tokens` completion tokens, weight version 0;
    `multi_turn`: loss masks (every 8th token is tool output) and a small later segment."""
    rng = random.Random(seed)
    prompt_ids = [rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)]
    template = common_pb2.Group(
        job_id=job_id,
        prompt="Fix the failing test in the repository below. " * 16,
        weight_version=0,
        trajectories=[
            common_pb2.Trajectory(
                prompt_token_ids=prompt_ids,
                completion_token_ids=[rng.randrange(VOCAB) for _ in range(tokens)],
                completion_logprobs=[-rng.expovariate(2.0) for _ in range(tokens)],
                weight_version=0,
                reward=float(rng.random() < 0.5),
                valid=True,
                finish_reason="stop",
            )
            for _ in range(group_size)
        ],
    )
    if multi_turn:
        for t in template.trajectories:
            t.completion_loss_mask.extend([int(i % 8 != 0) for i in range(tokens)])
            for i in range(0, tokens, 8):
                t.completion_logprobs[i] = 0.0
            t.later_segments.add(prompt_token_ids=[1, 2], completion_token_ids=[3], completion_logprobs=[-0.5])
    groups = []
    for i in range(n):
        group = common_pb2.Group()
        group.CopyFrom(template)
        group.group_id = f"{job_id}/{i}"
        group.task_id = f"task-{i}"
        for j, trajectory in enumerate(group.trajectories):
            trajectory.trajectory_id = f"{group.group_id}/{j}"
        groups.append(group)
    return groups


@dataclass
class Timing:
    put_s: float
    sample_s: float
    metadata_bytes: int = 0
    payload_bytes: int = 0  # payload bytes the writer sent through the buffer service
    staged_bytes: int = 0  # payload bytes the writer staged in the data plane


def best(timings: list[Timing]) -> Timing:
    return Timing(
        min(t.put_s for t in timings),
        min(t.sample_s for t in timings),
        timings[0].metadata_bytes,
        timings[0].payload_bytes,
        timings[0].staged_bytes,
    )


# ---- the buffer service -----------------------------------------------------------------------


async def service_run(stub, job_id: str, groups: list[common_pb2.Group], args: argparse.Namespace) -> Timing:
    """The coordinator's writer (JobBuffer) and the trainer's reader (BufferConsumer), as the services run them."""
    producer = JobBuffer(stub, job_id, max_groups=len(groups) + 1, max_age_steps=1000)
    await producer.open()
    if (producer.data_plane is not None) != args.data_plane:
        raise RuntimeError(f"the writer's data plane is {producer.data_plane}, wanted {args.data_plane}")
    pending = iter(groups)

    async def putter() -> None:
        for group in pending:
            reply = await producer.put(group)  # packs once, stages the payload, puts the metadata
            if reply.duplicate or reply.dropped_stale:
                raise RuntimeError(f"put of {group.group_id} answered {reply}")

    start = time.perf_counter()
    await asyncio.gather(*(putter() for _ in range(args.concurrency)))
    put_s = time.perf_counter() - start

    with tempfile.TemporaryDirectory() as ledger:
        consumer = BufferConsumer(stub, CONSUMER, job_id, TrainedLedger(Path(ledger)), ack_timeout=60)
        start = time.perf_counter()
        consumed = 0
        while consumed < len(groups):
            lease = await consumer.lease(0, args.batch)  # metadata by the service, payloads as stored
            arrays = [payload.unpack(g.payload) for g in lease.groups]  # what the trainer reads
            if sum(len(a) for a in arrays) != len(lease.groups) * args.group_size:
                raise RuntimeError("a sampled payload lost trajectories")
            ids = [g.group_id for g in lease.groups]
            # Under the trainer lease the consumer's first lease() took: only the job's trainer may ack.
            ack = buffer_pb2.AckGroupsRequest(
                job_id=job_id, group_ids=ids, weight_version=0, lease_id=consumer.lease_id
            )
            acked = await stub.AckGroups(ack)
            if acked.acked != len(ids):
                raise RuntimeError(f"acked {acked.acked} of {len(ids)}")
            consumed += len(ids)
        sample_s = time.perf_counter() - start
        await consumer.close()

    stats = await stub.GetStats(buffer_pb2.GetStatsRequest(job_id=job_id))
    if (stats.puts, stats.acked, stats.held, stats.pending) != (len(groups), len(groups), 0, 0):
        raise RuntimeError(f"unexpected buffer stats after the run:\n{stats}")
    sent = dict(producer.sent_bytes)
    await producer.close()
    return Timing(put_s, sample_s, sent["metadata"], sent["payload"], sent["staged"])


# ---- raw redis-py -----------------------------------------------------------------------------


async def raw_run(r: aioredis.Redis, key: str, groups: list[common_pb2.Group], args: argparse.Namespace) -> Timing:
    await r.delete(key)
    await r.xgroup_create(key, "buffer", id="0", mkstream=True)
    pending = iter(groups)

    async def putter() -> None:
        for group in pending:
            payload = group.SerializeToString()
            await r.xadd(key, {"g": group.group_id, "s": len(payload), "p": payload})

    start = time.perf_counter()
    await asyncio.gather(*(putter() for _ in range(args.concurrency)))
    put_s = time.perf_counter() - start

    start = time.perf_counter()
    consumed = 0
    while consumed < len(groups):
        reply = await r.xreadgroup("buffer", CONSUMER, {key: ">"}, count=args.batch)
        entries = reply[0][1] if reply else []
        if not entries:
            raise RuntimeError(f"XREADGROUP returned nothing after {consumed} of {len(groups)} groups")
        read = [common_pb2.Group.FromString(fields[b"p"]) for _, fields in entries]
        ids = [entry_id for entry_id, _ in entries]
        async with r.pipeline(transaction=False) as pipe:
            pipe.xack(key, "buffer", *ids)
            pipe.xdel(key, *ids)
            acked, _ = await pipe.execute()
        if acked != len(ids):
            raise RuntimeError(f"XACK acked {acked} of {len(ids)}")
        consumed += len(read)
    sample_s = time.perf_counter() - start

    if await r.xlen(key) != 0:
        raise RuntimeError(f"{key} still holds entries after the run")
    await r.delete(key)
    return Timing(put_s, sample_s)


# ---- processes --------------------------------------------------------------------------------


def start_redis(server: str, workdir: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    with open(Path(workdir) / "redis.log", "wb") as log:
        proc = subprocess.Popen(
            [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"redis-server did not start:\n{(Path(workdir) / 'redis.log').read_text()}"
                ) from None
            time.sleep(0.05)
    client.close()
    return proc, port


def start_buffer(redis_port: int, workdir: str, data_plane: bool) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {
        **os.environ,
        "DOCKYARD_BUFFER_PORT": str(port),
        "DOCKYARD_BUFFER_BACKEND": "redis",
        "DOCKYARD_BUFFER_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
        "DOCKYARD_BUFFER_DATA_PLANE": str(data_plane).lower(),
    }
    with open(Path(workdir) / "buffer.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.buffer"], env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT
        )
    return proc, f"127.0.0.1:{port}"


async def wait_serving(proc: subprocess.Popen, address: str, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while await health_status(address) != "SERVING":
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the buffer service did not start:\n{log.read_text(errors='replace')[-4000:]}")
        await asyncio.sleep(0.1)


def stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---- main -------------------------------------------------------------------------------------


async def bench(
    address: str, redis_port: int, args: argparse.Namespace
) -> list[tuple[int, int, float, Timing, Timing]]:
    results = []
    r = aioredis.Redis(port=redis_port, max_connections=args.concurrency + 2)
    async with connect(address, service="dockyard.buffer.v1.BufferService", default_timeout=120.0) as channel:
        stub = buffer_pb2_grpc.BufferServiceStub(channel)
        # Warm up both paths: connections, the Lua scripts' first load, the consumer group.
        warm = make_groups("bench-warmup", 2 * args.concurrency, args.group_size, 256, seed=0)
        await service_run(stub, "bench-warmup", warm, args)
        await raw_run(r, "bench:raw:warmup", warm, args)
        sizes = [(tokens, args.groups, False) for tokens in args.tokens]
        if args.multi_turn_tokens:
            sizes.append((args.multi_turn_tokens - PROMPT_TOKENS - 3, args.multi_turn_groups, True))
        for tokens, n, multi_turn in sizes:
            job_id = f"bench-{tokens}"
            groups = make_groups(job_id, n, args.group_size, tokens, seed=tokens, multi_turn=multi_turn)
            mb = sum(g.ByteSize() for g in groups) / 1e6
            service, raw = [], []
            for _ in range(args.repeats):  # alternating, so that load from elsewhere hits both alike
                service.append(await service_run(stub, job_id, groups, args))
                raw.append(await raw_run(r, f"bench:raw:{tokens}", groups, args))
            results.append((tokens, n, mb, best(service), best(raw)))
    await r.aclose()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=96, help="groups put and sampled per size")
    parser.add_argument("--group-size", type=int, default=8, help="trajectories per group")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384], help="completion tokens")
    parser.add_argument(
        "--multi-turn-tokens", type=int, default=65536, help="tokens per multi-turn trajectory (0: no such size)"
    )
    parser.add_argument("--multi-turn-groups", type=int, default=24, help="groups put and sampled at that size")
    parser.add_argument("--concurrency", type=int, default=4, help="concurrent putters")
    parser.add_argument("--batch", type=int, default=8, help="max_groups of each sample (XREADGROUP COUNT)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per size and path; the best is kept")
    parser.add_argument(
        "--no-data-plane",
        dest="data_plane",
        action="store_false",
        help="stream payloads through the buffer service (DOCKYARD_BUFFER_DATA_PLANE=false) instead of around it",
    )
    parser.add_argument("--redis-server", default=shutil.which("redis-server") or "/usr/bin/redis-server")
    args = parser.parse_args()
    # Stopped by SIGTERM, still stop the processes started here.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    redis_proc = buffer_proc = None
    with tempfile.TemporaryDirectory(prefix="bench-buffer-") as workdir:
        try:
            redis_proc, redis_port = start_redis(args.redis_server, workdir)
            buffer_proc, address = start_buffer(redis_port, workdir, args.data_plane)
            asyncio.run(wait_serving(buffer_proc, address, Path(workdir) / "buffer.log"))
            with redis.Redis(port=redis_port) as client:
                version = client.info("server")["redis_version"]
            results = asyncio.run(bench(address, redis_port, args))
        finally:
            stop(buffer_proc)
            stop(redis_proc)

    print(
        f"redis {version}, {args.groups} groups of {args.group_size} trajectories per size, "
        f"{args.concurrency} concurrent putters, samples of {args.batch}, best of {args.repeats}"
    )
    header = ("tokens", "path", "MB/group", "put groups/s", "put MB/s", "sample+ack groups/s", "sample+ack MB/s")
    print(
        f"{header[0]:>6}  {header[1]:<7} {header[2]:>8} {header[3]:>12} {header[4]:>9} {header[5]:>19} {header[6]:>15}"
    )
    throughput = {}
    share = {}
    for tokens, n, mb, service, raw in results:
        for path, t in (("service", service), ("raw", raw)):
            print(
                f"{tokens:>6}  {path:<7} {mb / n:>8.3f} {n / t.put_s:>12.1f} {mb / t.put_s:>9.1f}"
                f" {n / t.sample_s:>19.1f} {mb / t.sample_s:>15.1f}"
            )
            throughput[tokens, path] = n / (t.put_s + t.sample_s)
        total = service.metadata_bytes + service.payload_bytes + service.staged_bytes
        share[tokens] = (service.metadata_bytes / total, (service.metadata_bytes + service.payload_bytes) / total)
    for tokens, *_ in results:
        print(
            f"at {tokens} tokens: service/raw {throughput[tokens, 'service'] / throughput[tokens, 'raw']:.3f}, "
            f"metadata_share {share[tokens][0]:.4f}, writer_bytes_through_service {share[tokens][1]:.4f}"
        )
    at = 4096 if 4096 in args.tokens else args.tokens[0]
    print(
        f"put+sample at {at} tokens: service {throughput[at, 'service']:.1f} groups/s, raw {throughput[at, 'raw']:.1f}"
    )
    print(f"buffer_vs_raw_redis: {throughput[at, 'service'] / throughput[at, 'raw']:.3f}")


if __name__ == "__main__":
    main()
