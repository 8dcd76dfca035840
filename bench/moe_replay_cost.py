"""What routing replay costs a training step: PolicyTrainer.train_step on an MoE shape, routing off, recorded, replayed.

a random-init Qwen3-MoE policy (--hidden, --layers, --experts, --top-k; bf16 on CUDA with fp32 master weights)
    ──the same GRPO groups (--sequences of --length tokens, random ids; recorded routing: random top-k sets)──>
    train_step ×(--warmup + --steps), three ways: no routing in the batch (the baseline), policy.record_routing
    (the trainer's own routing compared with the recorded one), policy.routing_replay (the recorded experts
    used, their weights from the trainer's router)
prints ms per step of each, `record_vs_plain_step: R` and `replay_vs_plain_step: R` (time ratios; 1.0 is
parity, above it the cost), measured in the same process on the same device

python bench/moe_replay_cost.py                 # one GPU: 16 layers, hidden 1024, 64 experts, top 8
python bench/moe_replay_cost.py --smoke         # CPU, a tiny shape, seconds (checks that it runs)
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np
import torch
import yaml

from dockyard.config import load_config_text
from services.trainer.experience import Sample, TrainingGroup
from services.trainer.policy import PolicyTrainer


def config(args: argparse.Namespace, routing: str | None, device: str):
    model = {
        "model_type": "qwen3_moe",
        "hidden_size": args.hidden,
        "intermediate_size": 4 * args.hidden,
        "moe_intermediate_size": args.hidden // 2,
        "num_experts": args.experts,
        "num_experts_per_tok": args.top_k,
        "num_hidden_layers": args.layers,
        "num_attention_heads": max(1, args.hidden // 128),
        "num_key_value_heads": max(1, args.hidden // 512),
        "head_dim": 128 if args.hidden >= 128 else 32,
        "max_position_embeddings": 2 * args.length,
        "tie_word_embeddings": True,
    }
    data = {
        "policy": {
            "model": model,
            "dtype": "bfloat16" if device == "cuda" else "float32",
            "master_weights_fp32": True,
            "train_global_batch_size": args.sequences,
            "train_micro_batch_size": args.micro,
            "optimizer": {"lr": 1e-6},
            "generation": {"temperature": 1.0},
        },
        "grpo": {"num_prompts_per_step": args.sequences // 4, "num_generations_per_prompt": 4},
        "cluster": {"device": device},
    }
    return load_config_text(yaml.safe_dump(data), [routing] if routing else [])


def groups(args: argparse.Namespace, vocab: int, with_routing: bool) -> list[TrainingGroup]:
    rng = np.random.default_rng(0)
    prompt = args.length // 4
    out = []
    for g in range(args.sequences // 4):
        group = TrainingGroup(f"g{g}")
        for i in range(4):
            ids = rng.integers(3, vocab, size=args.length).tolist()
            routing = None
            if with_routing:  # k distinct experts per position and layer, ascending
                keys = rng.random((args.length - 1, args.layers, args.experts))
                routing = np.sort(np.argsort(keys, axis=-1)[..., : args.top_k], axis=-1).astype(np.uint8)
            completion = ids[prompt:]
            group.samples.append(
                Sample(f"g{g}/{i}", ids[:prompt], completion, [-1.0] * len(completion), float(i), True, routing=routing)
            )
        out.append(group)
    return out


def timed(args: argparse.Namespace, routing: str | None, device: str) -> float:
    """Mean seconds per train_step after the warm-up steps."""
    trainer = PolicyTrainer(config(args, routing, device), device=device)
    batch = groups(args, trainer.vocab_size, routing is not None)
    for _ in range(args.warmup):
        trainer.train_step(batch)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        trainer.train_step(batch)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / args.steps
    del trainer, batch  # the next shape's model and optimizer need the memory
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="a tiny shape on CPU")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.smoke:
        args.hidden, args.layers, args.experts, args.top_k = 64, 2, 8, 2
        args.sequences, args.length, args.micro, args.warmup, args.steps = 4, 64, 4, 1, 2
    print(
        f"device={device} hidden={args.hidden} layers={args.layers} experts={args.experts} top_k={args.top_k} "
        f"sequences={args.sequences}x{args.length}"
    )
    plain = timed(args, None, device)
    record = timed(args, "policy.record_routing=true", device)
    replay = timed(args, "policy.routing_replay=true", device)
    print(f"plain_step_ms={plain * 1e3:.1f} record_step_ms={record * 1e3:.1f} replay_step_ms={replay * 1e3:.1f}")
    print(f"record_vs_plain_step: {record / plain:.3f}")
    print(f"replay_vs_plain_step: {replay / plain:.3f}")


if __name__ == "__main__":
    main()
