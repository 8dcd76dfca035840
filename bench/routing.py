"""Sticky sessions against random routing, and session admission on and off, through the policy endpoint.

    --sessions trials ──openai AsyncOpenAI (X-Dockyard-Session)──> the endpoint app (create_app, Backend.complete,
        Router) ──Generate──> --replicas TorchEngines (prefix cache of --cache-tokens positions each)
    each trial: --turns turns; turn k sends the history + the model's reply + a user message of --message-chars

The endpoint is the real app, driven by the official openai client over ASGI; its backend is the real
Backend (routing, failover, admission) with the two calls that face the fleet replaced: the member list
is the fixed set of replicas and Generate calls each replica's TorchEngine in this process (no gRPC,
and no training job refitting the weights, which would empty every cache at each step). The model is a
random-init Qwen2-shaped policy with the character tokenizer, sized so that prefill costs.

(a) `sticky` vs `random`: the same trials (same messages, same seeds), --sessions at once, once with
    the endpoint's sticky routing and once with every call sent to a replica drawn at random. Prints the
    prefill tokens computed and saved per replica and `sticky_vs_random_prefill_saved: R` (saved tokens,
    sticky / random; > 1 means stickiness keeps the caches warm).
(b) admission off vs on, with --crowd sessions at once, more than the caches hold (each trial's history
    grows to about turns x (message + reply) tokens): trials per second and evictions of each, then
    `admission_vs_none_throughput: R` (trials/s on / off) and `admission_vs_none_evictions: R` (on / off).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import httpx
import openai
import torch

from dockyard.agents.contract import SESSION_HEADER
from dockyard.api.rollout.v1 import rollout_pb2
from dockyard.config import SamplingConfig
from dockyard.models import build_char_tokenizer, build_random_model
from services.endpoint.app import create_app
from services.endpoint.backend import Backend, Generated, JobModel
from services.endpoint.rendering import Renderer
from services.endpoint.routing import Replica, Router
from services.endpoint.settings import EndpointSettings
from services.rollout.decoding import DecodingParams
from services.rollout.torch_engine import TorchEngine
from services.rollout.wire import kv_cache_proto

JOB = "bench-job"
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def engines(n: int, cache_tokens: int, hidden: int, layers: int) -> list[TorchEngine]:
    tok = build_char_tokenizer()
    config = {
        "model_type": "qwen2",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 2 * hidden,
        "max_position_embeddings": 4096,
    }
    built = []
    for _ in range(n):
        model = build_random_model(
            config,
            len(tok),
            seed=0,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            bos_token_id=tok.bos_token_id,
        )
        built.append(TorchEngine(model, tok, "cpu", prefix_cache_tokens=cache_tokens))
    return built


class InProcessFleet(Backend):
    """The endpoint's Backend with its replicas in this process (routing, failover and admission unchanged)."""

    def __init__(self, replicas: list[TorchEngine], router: Router, random_routing: bool = False) -> None:
        self.router, self.engines = router, {f"rollout-{i}": e for i, e in enumerate(replicas)}
        self._members = (0.0, [])
        self._model = JobModel(JOB, Renderer(replicas[0].tokenizer), "none", 16, sampling=SamplingConfig())
        self._random = random.Random(0) if random_routing else None

    async def close(self) -> None: ...

    async def model(self, job_id: str) -> JobModel:
        return self._model

    async def _replicas(self, job_id: str) -> list[Replica]:
        return [Replica(name, name) for name in self.engines]

    async def pick(self, job_id: str, session: str | None, size: int) -> Replica:
        if self._random is None:
            return await super().pick(job_id, session, size)
        return Replica(*[self._random.choice(list(self.engines))] * 2)

    async def generate(self, job_id, replica, prompt_ids, n, sampling, images=None, *, top_logprobs=0) -> Generated:
        engine = self.engines[replica.name]
        decoding = DecodingParams(
            temperature=sampling.temperature,
            max_new_tokens=sampling.max_new_tokens,
            seed=sampling.seed or None,
            top_logprobs=top_logprobs,
        )
        result = await engine.generate(list(prompt_ids), n, decoding)
        self.router.served(replica.name, kv_cache_proto(engine.kv_cache_stats))
        completions = [
            rollout_pb2.Completion(
                token_ids=c.token_ids,
                logprobs=c.logprobs,
                text=c.text,
                finish_reason="length",
                top_logprobs=[rollout_pb2.TopLogprobs(token_ids=i, logprobs=lp) for i, lp in c.top_logprobs],
            )
            for c in result.completions
        ]
        return Generated(list(prompt_ids), completions, result.weight_version, [result.weight_version], replica.name)


async def trial(client: openai.AsyncOpenAI, http: httpx.AsyncClient, index: int, args) -> None:
    rng = random.Random(index)
    session = f"trial-{index}"
    headers = {SESSION_HEADER: session}
    messages = []
    for turn in range(args.turns):
        words = " ".join(rng.choice(WORDS) for _ in range(args.message_chars // 6))
        messages.append({"role": "user", "content": words[: args.message_chars]})
        reply = await client.chat.completions.create(
            model=JOB,
            messages=messages,
            max_tokens=args.max_tokens,
            temperature=1.0,
            seed=index * 100 + turn,
            extra_headers=headers,
        )
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
    await http.delete(f"/v1/sessions/{session}")


async def run(replicas: list[TorchEngine], router: Router, sessions: int, args, random_routing=False) -> dict:
    before = [e.kv_cache_stats for e in replicas]
    fleet = InProcessFleet(replicas, router, random_routing)
    settings = EndpointSettings(max_sessions=4 * sessions + 16)
    app = create_app(settings, None, fleet)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://endpoint", timeout=600)
    client = openai.AsyncOpenAI(base_url="http://endpoint/v1", api_key="x", http_client=http, max_retries=0)
    start = time.perf_counter()
    await asyncio.gather(*(trial(client, http, i, args) for i in range(sessions)))
    seconds = time.perf_counter() - start
    await http.aclose()
    out = {"seconds": seconds, "trials_per_second": sessions / seconds, "replicas": {}}
    for (name, engine), old in zip(fleet.engines.items(), before, strict=True):
        new = engine.kv_cache_stats
        out["replicas"][name] = {
            "computed": new.prefill_tokens_computed - old.prefill_tokens_computed,
            "saved": new.prefill_tokens_saved - old.prefill_tokens_saved,
            "evictions": new.evictions - old.evictions,
        }
    for key in ("computed", "saved", "evictions"):
        out[key] = sum(r[key] for r in out["replicas"].values())
    out["hit_rate"] = out["saved"] / max(out["saved"] + out["computed"], 1)
    out["queued"] = router.stats.queued_sessions
    return out


def show(label: str, result: dict) -> None:
    per = "  ".join(
        f"{name}: computed {r['computed']} saved {r['saved']} evictions {r['evictions']}"
        for name, r in result["replicas"].items()
    )
    print(
        f"{label:<14} {result['seconds']:7.2f} s  trials/s {result['trials_per_second']:.3f}  "
        f"prefill saved {result['saved']} computed {result['computed']} (hit rate {result['hit_rate']:.3f})  "
        f"evictions {result['evictions']}  queued {result['queued']}\n{'':<15}{per}",
        flush=True,
    )


async def main(args) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)

    def fresh(cache_tokens: int) -> list[TorchEngine]:
        return engines(args.replicas, cache_tokens, args.hidden, args.layers)

    await run(fresh(args.cache_tokens), Router(), 2, args)  # warm-up: first-call costs fall on no measured run
    # (a) one fresh fleet per routing, the same trials, caches that hold every session.
    sticky = await run(fresh(args.cache_tokens), Router(), args.sessions, args)
    show("sticky", sticky)
    rand = await run(fresh(args.cache_tokens), Router(), args.sessions, args, random_routing=True)
    show("random", rand)
    # (b) more sessions at once than the caches hold: admission off, then on, a session reserving the
    # mean final size the off run's sessions reached.
    router = Router()
    off = await run(fresh(args.crowd_cache_tokens), router, args.crowd, args)
    show("admission off", off)
    reserve = router.reserve()
    on = await run(
        fresh(args.crowd_cache_tokens),
        Router(pressure_threshold=args.threshold, session_tokens=reserve),
        args.crowd,
        args,
    )
    show("admission on", on)
    print(f"(b): {args.crowd} sessions of about {reserve} tokens, {args.replicas} caches of {args.crowd_cache_tokens}")
    print(f"sticky_hit_rate: {sticky['hit_rate']:.3f}  random_hit_rate: {rand['hit_rate']:.3f}")
    print(f"admission_vs_none_evictions: {on['evictions'] / max(off['evictions'], 1):.3f}")
    print(f"admission_vs_none_throughput: {on['trials_per_second'] / off['trials_per_second']:.3f}")
    print(f"sticky_vs_random_prefill_saved: {sticky['saved'] / max(rand['saved'], 1):.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=8, help="concurrent trials in (a)")
    parser.add_argument("--crowd", type=int, default=16, help="concurrent trials in (b), more than the caches hold")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--message-chars", type=int, default=120)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--cache-tokens", type=int, default=20000, help="prefix cache positions per replica in (a)")
    parser.add_argument("--crowd-cache-tokens", type=int, default=3000, help="... in (b): fewer than --crowd hold")
    parser.add_argument("--threshold", type=float, default=0.8, help="admission pressure threshold in (b)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    asyncio.run(main(parser.parse_args()))
