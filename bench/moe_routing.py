"""Routing replay (R3) on the tiny MoE recipe's policy: router disagreement and gen/train mismatch, off and on.

    examples/configs/tiny_moe.yaml's policy (Qwen3-MoE shape, random init, seed 0) in --dtype
        ──TorchEngine (the rollout's engine, in this process)──> --steps × --prompts groups of --samples
          completions, each with the experts every position was routed to
        ──PolicyTrainer (the trainer, same weights) train_step──> routing_mismatch_fraction,
          gen_train_logprob_abs_diff, gen_train_kl ──its weights copied into the engine──> next step
    run twice from the same start and seeds: policy.record_routing (replay off), then policy.routing_replay

In float32 on CPU the engine and the trainer route alike (the fraction is 0, the differences are float
rounding); in bfloat16 the engine's incremental decode and the trainer's whole-sequence forward round the
router logits differently, a token near a top-k tie goes to another expert, and replay removes that part
of the gen/train difference. On a CPU the two may still agree (CPU matmuls round alike whatever the batch
shape): --engine-router-noise S then perturbs the engine's expert *choice* on purpose (top-k of its router
logits plus N(0, S²) noise, the experts' weights from the clean logits), a stand-in for GPU rounding that
says so in its output. Prints per mode the step means and `replay_vs_off_logprob_abs_diff: R`
(on / off, < 1 means replay brings the trainer's logprobs closer to the engine's) and the same ratio for
|gen_train_kl|. The cost per training step on a larger shape is bench/gpu_moe_routing.sh's.

    python bench/moe_routing.py [--dtype bfloat16] [--steps 3] [--prompts 4] [--samples 4] [--engine-router-noise 0]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from pathlib import Path

import numpy as np
import torch

from dockyard.config import load_config
from dockyard.models.load import load_policy
from dockyard.models.routing import routers
from services.rollout.decoding import DecodingParams
from services.rollout.torch_engine import TorchEngine
from services.trainer.experience import Sample, TrainingGroup
from services.trainer.policy import PolicyTrainer

RECIPE = Path(__file__).resolve().parents[1] / "examples/configs/tiny_moe.yaml"
PROMPTS = ["f(1)=3, f(2)=5, f=", "1+2=", "x*x+7 at 3 is ", "f(0)=1, f(1)=4, f=", "2*x-1 at 5 is ", "9-4="]
METRICS = ("routing_mismatch_fraction", "gen_train_logprob_abs_diff", "gen_train_kl")


def config(dtype: str, routing: str, samples: int, prompts: int):
    overrides = [
        "policy.model_name=null",
        "policy.bootstrap=null",
        f"policy.dtype={dtype}",
        "policy.master_weights_fp32=false",
        f"grpo.num_prompts_per_step={prompts}",
        f"grpo.num_generations_per_prompt={samples}",
        routing,
    ]
    return load_config(RECIPE, overrides)


async def groups(engine: TorchEngine, step: int, prompts: int, samples: int) -> list[TrainingGroup]:
    decoding = DecodingParams(temperature=1.0, max_new_tokens=16, seed=step)
    asks = [PROMPTS[(step * prompts + i) % len(PROMPTS)] for i in range(prompts)]
    results = await asyncio.gather(*(engine.generate(p, samples, decoding) for p in asks))
    out = []
    for g, result in enumerate(results):
        group = TrainingGroup(f"s{step}g{g}")
        for i, c in enumerate(result.completions):
            routing = np.concatenate([c.prompt_routing, c.routing])
            reward = float(len(c.token_ids) % 3 == i % 3)  # any spread: the bench measures logprobs, not learning
            group.samples.append(
                Sample(
                    f"{group.group_id}/{i}",
                    result.prompt_token_ids,
                    c.token_ids,
                    c.logprobs,
                    reward,
                    True,
                    routing=routing,
                )
            )
        out.append(group)
    return out


def noisy_choice(model: torch.nn.Module, scale: float) -> None:
    """The engine's routers pick the top-k of their logits plus N(0, scale²) noise (a seeded stream); the chosen
    experts' weights are the router's own for them. Registered before the engine's recorder, which records them."""
    generator = torch.Generator().manual_seed(1234)

    def hook(module, _args, output):
        logits, scores, _own = output
        noise = torch.randn(logits.shape, generator=generator).to(logits.device, logits.dtype) * scale
        chosen = (logits + noise).topk(module.top_k, dim=-1).indices
        weights = torch.softmax(logits.float(), dim=-1).gather(-1, chosen)
        if getattr(module, "norm_topk_prob", True):
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights.to(scores.dtype), chosen

    for router in routers(model):
        router.register_forward_hook(hook, prepend=True)


def run(dtype: str, routing: str, steps: int, prompts: int, samples: int, noise: float) -> dict[str, list[float]]:
    torch.manual_seed(0)
    cfg = config(dtype, routing, samples, prompts)
    trainer = PolicyTrainer(cfg)
    model, tokenizer = load_policy(cfg.policy)
    if noise > 0:
        noisy_choice(model, noise)
    engine = TorchEngine(model, tokenizer, "cpu")
    seen: dict[str, list[float]] = {m: [] for m in METRICS}
    try:
        for step in range(steps):
            metrics = trainer.train_step(asyncio.run(groups(engine, step, prompts, samples)))
            for m in METRICS:
                seen[m].append(metrics[m])
            with torch.no_grad():
                weights = engine.named_weights()
                for name, tensor in trainer.named_weights():
                    weights[name].copy_(tensor)
            engine.set_weight_version(trainer.weight_version)
    finally:
        asyncio.run(engine.close())
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--engine-router-noise", type=float, default=0.0)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    means = {}
    for mode, routing in (("off", "policy.record_routing=true"), ("replay", "policy.routing_replay=true")):
        seen = run(args.dtype, routing, args.steps, args.prompts, args.samples, args.engine_router_noise)
        means[mode] = {m: statistics.fmean(v) for m, v in seen.items()}
        print(f"{mode:7s} " + "  ".join(f"{m}={means[mode][m]:.3g}" for m in METRICS), flush=True)
    off, on = means["off"], means["replay"]
    simulated = f" (simulated: engine router noise {args.engine_router_noise})" if args.engine_router_noise else ""
    print(f"dtype={args.dtype} steps={args.steps} trajectories_per_step={args.prompts * args.samples}{simulated}")
    print(f"router_disagreement_without_replay: {off['routing_mismatch_fraction']:.4f}")
    if off["gen_train_logprob_abs_diff"] > 0:
        ratio = on["gen_train_logprob_abs_diff"] / off["gen_train_logprob_abs_diff"]
        print(f"replay_vs_off_logprob_abs_diff: {ratio:.3f}")
    if off["gen_train_kl"] != 0:
        print(f"replay_vs_off_abs_kl: {abs(on['gen_train_kl']) / abs(off['gen_train_kl']):.3f}")


if __name__ == "__main__":
    main()
