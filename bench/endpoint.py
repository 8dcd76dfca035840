"""Chat completions through the policy endpoint, streamed and not, vs the same tokens through the rollout's Generate.

    --calls prompts ──POST /v1/chat/completions (httpx, --concurrency callers)──> endpoint ──Generate──> rollout
    the same, stream=true, read to [DONE] ──> endpoint ──GenerateStream──> rollout
    the same prompt ids, sampling and seeds ──Generate(prompt_token_ids) (gRPC, --concurrency callers)──> rollout

The script starts a LocalStack with the endpoint (`dockyard up`'s processes) on free ports, creates the tiny
job (random policy, character tokenizer; it keeps training in the background, as a live job does), and waits
until the endpoint serves it. Each endpoint call is a fresh session of one user message; its recorded prompt ids
(GET /v1/sessions/{id}/trajectory) and seed are then sent straight to the replica's Generate with the same
sampling and `ignore_eos` (vLLM's extension, on both paths), so both sample exactly --max-tokens tokens per
call whatever the background training does to the weights. Each of --repeats rounds sends the --calls calls in
chunks of --chunk, the three paths taking turns chunk by chunk (their order rotating), and each path's wall time
is summed over all chunks: a burst of load on a shared machine then falls on every path alike. Each chunk's
sessions are deleted once it is timed (the endpoint holds at most max_sessions, 1,024 by default, and refuses
more with a 429), so any number of --repeats runs.

Prints the times, the streamed calls' mean time to their first content chunk against their mean total, the
CPU time per call of the endpoint's process and of this client's during each path's chunks (less noisy than
the times when the job's training shares a small machine: it says what a path costs, not what it waited), and
`endpoint_vs_generate: R` and `endpoint_stream_vs_generate: R`, R = Generate's total time over the endpoint's
(throughput ratios; 1.0 is parity, lower means the endpoint costs that much; the goal of each is >= 0.8).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import httpx

from dockyard.agents.contract import SESSION_HEADER
from dockyard.api.common.v1 import common_pb2
from dockyard.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from dockyard.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from dockyard.config import load_config
from dockyard.rpc.auth import AuthSettings
from dockyard.rpc.client import connect
from dockyard.stack import LocalStack

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-endpoint-token"  # the stack's service token (the endpoint refuses to run without one)
AUTH = AuthSettings(auth_token=TOKEN)


def _cpu_seconds(pid: int) -> float:
    """The process's CPU time, user and system, all its threads (Linux's /proc)."""
    with open(f"/proc/{pid}/stat") as file:
        fields = file.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _create_job(stack: LocalStack, runs: Path, max_new_tokens: int) -> str:
    cfg = load_config(
        ROOT / "examples" / "configs" / "tiny_expr.yaml",
        [
            "policy.model_name=null",
            "policy.bootstrap=null",
            "grpo.max_num_steps=100000",
            f"logger.log_dir={runs}",
            f"policy.generation.max_new_tokens={max_new_tokens}",
        ],
    )
    async with connect(stack.address("coordinator"), auth=AUTH) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        reply = await stub.CreateJob(coordinator_pb2.CreateJobRequest(config_yaml=cfg.resolved_yaml()))
        return reply.job.job_id


async def _replica(stack: LocalStack, job: str) -> str:
    async with connect(stack.address("coordinator"), auth=AUTH) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        members = (await stub.ListMembers(coordinator_pb2.ListMembersRequest())).members
    return next(
        m.address for m in members if m.kind == coordinator_pb2.MEMBER_KIND_ROLLOUT and job in m.weight_versions
    )


def _body(job: str, i: int, max_tokens: int) -> dict:
    content = f"f({i % 7})={i % 5} f({i % 3 + 1})={i % 11}"
    return {
        "model": job,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "seed": i,
        "ignore_eos": True,
    }


async def _endpoint_round(http: httpx.AsyncClient, job: str, calls, concurrency: int, max_tokens: int, tag: str):
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with gate:
            reply = await http.post(
                "/v1/chat/completions", json=_body(job, i, max_tokens), headers={SESSION_HEADER: f"{tag}-{i}"}
            )
            reply.raise_for_status()

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in calls))
    return time.perf_counter() - start


async def _end_sessions(http: httpx.AsyncClient, tag: str, calls) -> None:
    """DELETE the calls' sessions (untimed), as a scaffold ends its trial's: the endpoint holds a bounded number."""
    for i in calls:
        (await http.delete(f"/v1/sessions/{tag}-{i}")).raise_for_status()


async def _stream_round(
    http: httpx.AsyncClient, job: str, calls, concurrency: int, max_tokens: int, tag: str, firsts: list
) -> float:
    """Streamed calls read to [DONE]; each call's (time to first content chunk, total time) added to `firsts`."""
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with gate:
            start, first = time.perf_counter(), None
            body = {**_body(job, i, max_tokens), "stream": True}
            headers = {SESSION_HEADER: f"{tag}-{i}"}
            async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as reply:
                reply.raise_for_status()
                async for line in reply.aiter_lines():
                    if first is None and line.startswith("data: {") and '"content": "' in line:
                        if any(c["delta"].get("content") for c in json.loads(line[6:])["choices"]):
                            first = time.perf_counter() - start
            firsts.append((first if first is not None else time.perf_counter() - start, time.perf_counter() - start))

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in calls))
    return time.perf_counter() - start


async def _generate_round(stub, job: str, prompts: list[list[int]], calls, concurrency: int, max_tokens: int) -> float:
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with gate:
            sampling = common_pb2.SamplingParams(
                temperature=1.0, top_p=1.0, max_new_tokens=max_tokens, seed=i, ignore_eos=True
            )
            await stub.Generate(
                rollout_pb2.GenerateRequest(
                    job_id=job, request_id=f"bench-{i}", prompt_token_ids=prompts[i], num_samples=1, sampling=sampling
                ),
                timeout=600,
            )

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in calls))
    return time.perf_counter() - start


async def _run(stack: LocalStack, runs: Path, args) -> None:
    endpoint_pid = stack.procs["endpoint"].pid
    job = await _create_job(stack, runs, args.max_tokens)
    base, headers = f"http://{stack.address('endpoint')}", {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=600) as http:
        deadline = time.monotonic() + 300
        while (await http.post("/v1/chat/completions", json=_body(job, 0, 1))).status_code != 200:
            if time.monotonic() > deadline:
                raise SystemExit("the endpoint did not serve the job within 300 s")
            await asyncio.sleep(1)
        # Warm-up round, then the prompts the endpoint built (to send the same ids to Generate).
        await _endpoint_round(http, job, range(args.calls), args.concurrency, args.max_tokens, "warm")
        prompts = []
        for i in range(args.calls):
            trajectory = (await http.get(f"/v1/sessions/warm-{i}/trajectory")).json()
            prompts.append(trajectory["segments"][0]["turns"][0]["prompt_token_ids"])
        await _end_sessions(http, "warm", range(args.calls))
        replica = await _replica(stack, job)
        async with connect(replica, service="rollout", default_timeout=600, auth=AUTH) as channel:
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            # Chunks of --chunk calls, the two paths alternating chunk by chunk (ABBA), so a burst of load on
            # this shared machine lands on both; each path's time is summed over every chunk.
            totals = {"endpoint": 0.0, "stream": 0.0, "generate": 0.0}
            cpu = {path: [0.0, 0.0] for path in totals}  # the endpoint's, this client's
            firsts: list[tuple[float, float]] = []
            paths = list(totals)
            for r in range(args.repeats):
                for k, first in enumerate(range(0, args.calls, args.chunk)):
                    chunk = range(first, min(first + args.chunk, args.calls))
                    turn = (r + k) % len(paths)
                    for path in paths[turn:] + paths[:turn]:
                        served, client, tag = _cpu_seconds(endpoint_pid), time.process_time(), f"{path}{r}"
                        if path == "generate":
                            elapsed = await _generate_round(
                                stub, job, prompts, chunk, args.concurrency, args.max_tokens
                            )
                        elif path == "stream":
                            elapsed = await _stream_round(
                                http, job, chunk, args.concurrency, args.max_tokens, tag, firsts
                            )
                        else:
                            elapsed = await _endpoint_round(http, job, chunk, args.concurrency, args.max_tokens, tag)
                        cpu[path][0] += _cpu_seconds(endpoint_pid) - served
                        cpu[path][1] += time.process_time() - client
                        if path != "generate":
                            await _end_sessions(http, tag, chunk)
                        totals[path] += elapsed
    calls = args.calls * args.repeats
    endpoint, stream, generate = totals["endpoint"], totals["stream"], totals["generate"]
    print(
        f"calls={args.calls} x repeats={args.repeats} chunk={args.chunk} concurrency={args.concurrency} "
        f"max_tokens={args.max_tokens}"
    )
    print(f"endpoint (chat completions): {endpoint:.3f} s  ({calls / endpoint:.1f} calls/s)")
    print(f"endpoint (streamed):         {stream:.3f} s  ({calls / stream:.1f} calls/s)")
    print(f"generate (prompt_token_ids): {generate:.3f} s  ({calls / generate:.1f} calls/s)")
    mean_first = sum(f for f, _ in firsts) / len(firsts)
    mean_total = sum(t for _, t in firsts) / len(firsts)
    print(f"streamed: first content after {mean_first * 1000:.1f} ms of {mean_total * 1000:.1f} ms per call (mean)")
    for path, label in (("endpoint", "chat completions"), ("stream", "streamed"), ("generate", "generate")):
        served, client = (seconds / calls * 1000 for seconds in cpu[path])
        print(f"CPU per call, {label}: endpoint {served:.2f} ms, client {client:.2f} ms")
    print(f"endpoint_vs_generate: {generate / endpoint:.3f}")
    print(f"endpoint_stream_vs_generate: {generate / stream:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk", type=int, default=8, help="calls per timed chunk (the paths alternate per chunk)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dockyard-bench-endpoint-") as tmp:
        stack = LocalStack(Path(tmp) / "logs", free_ports=True, endpoint=True, extra_env={"DOCKYARD_AUTH_TOKEN": TOKEN})
        stack.start()
        try:
            asyncio.run(_run(stack, Path(tmp) / "runs", args))
        finally:
            stack.stop()


if __name__ == "__main__":
    main()
