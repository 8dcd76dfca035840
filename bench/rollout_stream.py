"""Streamed generations from a rollout replica: one GenerateStream per call, or every call on one
GenerateMultiplexed stream (the endpoint's way), against unary Generate of the same requests.

    --calls requests (--concurrency at a time, --max-tokens tokens each, ignore_eos, one seed each)
        ──Generate──> the replica                                   (the baseline: one reply per call)
        ──GenerateStream──> the replica                             (a message per decode step per call)
        ──MultiplexedCalls.stream (services/endpoint/multiplex.py)──> one GenerateMultiplexed stream
                                                                    (a reply per decode step for all calls)

The script starts one rollout process (`python -m services.rollout`, one torch thread) on a free port and
loads a tiny random policy (hidden 32, 2 layers; decode steps cost little, so the transport's cost shows).
Each of --repeats rounds runs the three paths in turn, and each path's wall time is summed over the rounds.

Prints the times and `stream_vs_generate: R`, `multiplexed_vs_generate: R` (Generate's time / the path's;
1.0 is parity, higher is better).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dockyard.api.common.v1 import common_pb2
from dockyard.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from dockyard.rpc.client import connect, wait_until_serving
from services.endpoint.multiplex import MultiplexedCalls

ROOT = Path(__file__).resolve().parents[1]
JOB = "bench-rollout-stream"
CONFIG_YAML = """
policy:
  model: {model_type: qwen2, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 2,
          num_key_value_heads: 1, intermediate_size: 64, max_position_embeddings: 1024}
  train_global_batch_size: 4
  train_micro_batch_size: 2
grpo: {num_prompts_per_step: 2, num_generations_per_prompt: 2}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(i: int, max_tokens: int) -> rollout_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=max_tokens, seed=i, ignore_eos=True)
    return rollout_pb2.GenerateRequest(
        job_id=JOB, request_id=f"bench-{i}", prompt_token_ids=[5, 6, 7, 8, 9], num_samples=1, sampling=sampling
    )


async def _run(address: str, args: argparse.Namespace) -> None:
    async with connect(address, default_timeout=600) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        await stub.LoadPolicy(rollout_pb2.LoadPolicyRequest(job_id=JOB, config_yaml=CONFIG_YAML))
        calls = MultiplexedCalls(stub)

        async def generate(i: int) -> None:
            await stub.Generate(_request(i, args.max_tokens))

        async def stream(i: int) -> None:
            async for _ in stub.GenerateStream(rollout_pb2.GenerateStreamRequest(request=_request(i, args.max_tokens))):
                pass

        async def multiplexed(i: int) -> None:
            await calls.stream(_request(i, args.max_tokens), lambda *_: None, timeout=600)

        async def round_of(one, n: int) -> float:
            gate = asyncio.Semaphore(args.concurrency)

            async def gated(i: int) -> None:
                async with gate:
                    await one(i)

            start = time.perf_counter()
            await asyncio.gather(*(gated(i) for i in range(n)))
            return time.perf_counter() - start

        paths = {"generate": generate, "stream": stream, "multiplexed": multiplexed}
        for one in paths.values():  # warm-up: compile, caches, the multiplexed stream opened
            await round_of(one, args.concurrency)
        totals = dict.fromkeys(paths, 0.0)
        for _ in range(args.repeats):
            for name, one in paths.items():
                totals[name] += await round_of(one, args.calls)
        await calls.close()
    n = args.calls * args.repeats
    print(f"calls={args.calls} x repeats={args.repeats} concurrency={args.concurrency} max_tokens={args.max_tokens}")
    for name, seconds in totals.items():
        print(f"{name:12s} {seconds:.3f} s  ({n / seconds:.1f} calls/s)")
    print(f"stream_vs_generate: {totals['generate'] / totals['stream']:.3f}")
    print(f"multiplexed_vs_generate: {totals['generate'] / totals['multiplexed']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    port = _free_port()
    env = {**os.environ, "DOCKYARD_ROLLOUT_PORT": str(port), "DOCKYARD_ROLLOUT_NUM_THREADS": "1"}
    with tempfile.TemporaryFile() as log:
        rollout = subprocess.Popen(
            [sys.executable, "-m", "services.rollout"], cwd=ROOT, env=env, stdout=log, stderr=log
        )
        try:
            asyncio.run(wait_until_serving(f"127.0.0.1:{port}", 120))
            asyncio.run(_run(f"127.0.0.1:{port}", args))
        finally:
            rollout.terminate()
            rollout.wait(30)


if __name__ == "__main__":
    main()
