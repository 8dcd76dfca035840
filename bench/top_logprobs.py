"""What top_logprobs costs the torch engine: tokens per CPU second asking none (the default path) and
asking k, and the default path against another checkout's engine (the code before top_logprobs, say).

    model: a Qwen2 shape (hidden 64, 2 layers, vocab --vocab, default 32,000) with random weights, float32,
           on CPU with one torch thread (the step is small, so sampling's share of it is large)
    calls: `await TorchEngine.generate(prompt, --rows, DecodingParams(temperature 1, seed 0,
           --new-tokens, ignore_eos, top_logprobs k))`, one untimed call first, best of --repeats,
           timed in the process's CPU time (all its threads), which other programs' load leaves alone
    sides: this checkout with k = 0 and k = --k; with --baseline DIR, DIR's engine (same script, its
           code on PYTHONPATH first) with k = 0. Every side runs in its own process, the sides take
           turns for --rounds rounds (each round starting with the next side), and each side's best
           round counts (noise on a shared machine only ever slows a run down)

Prints tokens per CPU second per side, then
    top_logprobs_vs_none: R     tokens/CPU s asking k / asking none (1.0 = free)
    none_vs_baseline: R         tokens/CPU s asking none / the baseline's (1.0 = the default path unchanged)

    .venv/bin/python bench/top_logprobs.py --baseline /path/to/checkout/of/main
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout whose default path to compare")
    parser.add_argument("--k", type=int, default=20, help="top_logprobs asked on the second side (default 20)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per process, best kept")
    parser.add_argument("--rounds", type=int, default=3, help="turns each side takes")
    parser.add_argument("--side", type=int, default=None, help=argparse.SUPPRESS)  # a worker process: its k
    return parser.parse_args()


async def measure(args: argparse.Namespace) -> float:
    """Tokens per CPU second of the engine importable here, asking top_logprobs = args.side (0: not passed)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from dockyard.models import build_char_tokenizer
    from services.rollout.decoding import DecodingParams
    from services.rollout.torch_engine import TorchEngine

    torch.set_num_threads(1)
    torch.manual_seed(0)
    shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    config = Qwen2Config(**shape, intermediate_size=128, vocab_size=args.vocab, max_position_embeddings=512)
    engine = TorchEngine(AutoModelForCausalLM.from_config(config), build_char_tokenizer(), "cpu")
    asked = {"top_logprobs": args.side} if args.side else {}  # a baseline's DecodingParams may lack the field
    decoding = DecodingParams(temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True, seed=0, **asked)
    prompt = "12+34*(5-6)=123"
    await engine.generate(prompt, args.rows, decoding)
    best = 0.0
    for _ in range(args.repeats):
        # CPU time of this process (every thread): on a shared machine, waiting for a core is not the engine's.
        start = time.process_time()
        result = await engine.generate(prompt, args.rows, decoding)
        seconds = time.process_time() - start
        best = max(best, sum(len(c.token_ids) for c in result.completions) / seconds)
    await engine.close()
    return best


def side(args: argparse.Namespace, tree: Path, k: int) -> float:
    """One worker process on `tree`'s code asking k; its tokens per CPU second."""
    command = [sys.executable, __file__, "--side", str(k)]
    command += [f"--{n}={getattr(args, n.replace('-', '_'))}" for n in ("vocab", "rows", "new-tokens", "repeats")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True, cwd=tree).stdout
    return json.loads(out.strip().splitlines()[-1])["tokens_per_s"]


def main() -> None:
    args = parse_args()
    if args.side is not None:
        print(json.dumps({"tokens_per_s": asyncio.run(measure(args))}))
        return
    sides = {"none": (ROOT, 0), f"top_logprobs={args.k}": (ROOT, args.k)}
    if args.baseline is not None:
        sides["baseline"] = (args.baseline.resolve(), 0)
    best = dict.fromkeys(sides, 0.0)
    names = list(sides)
    for round_ in range(args.rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:  # each side goes first in turn
            tree, k = sides[name]
            best[name] = max(best[name], side(args, tree, k))
        print(f"round {round_ + 1}: " + ", ".join(f"{n} {v:.0f} tok/CPU s" for n, v in best.items()), flush=True)
    print(f"top_logprobs_vs_none: {best[f'top_logprobs={args.k}'] / best['none']:.3f}")
    if args.baseline is not None:
        print(f"none_vs_baseline: {best['none'] / best['baseline']:.3f}")


if __name__ == "__main__":
    main()
