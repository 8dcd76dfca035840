"""FP8 rollouts against bf16 on one GPU: tokens/s, the engine's refit time, and the logprob mismatch.

    model: --shape 0.5b (Qwen2.5-0.5B-shaped, bench/generation.py's QWEN25_05B) or 7b (Qwen2-7B-shaped,
           bench/weight_sync.py's QWEN2_7B), random init (--init-std, default 0.05, so the next-token
           distribution is not flat), bf16 on CUDA: the trainer's weights
    engines: TorchEngine(precision=auto), then precision=fp8 (per channel and token), then fp8_block
           (per 128 inputs of each weight row and 128 features of each token), each on a copy of those weights,
           each in its own process (`--precision P` runs one; a 7B shape's engines, CUDA graph pools
           included, do not fit one GPU together), the same seed making the same weights in each
    tokens/s: one prompt of 128 tokens x --batch rows, 512 new tokens, ignore_eos, temperature 1,
           one untimed call first (compiles, captures graphs), best of --repeats
    refit: the engine side of a weight sync, as receive_weights runs it, under the engine's exclusive hold:
           the trainer's tensors copied into the engine's weight_sink() on a stream of their own (the
           transport's: the collective one receives on NCCL's) in the collective's transfers (its plan for
           --bucket-mb buckets: packed small tensors, then the large ones), issuing transfer k before finishing
           k - 1, whose tensors are reported landed once ordered after their bytes (FP8: their layers are
           requantized on the compute stream while transfer k copies), then set_weight_version; the copies
           are device-local, faster than any transport, so the overlap has less to hide behind than in a sync;
           the transport's part is the same bf16 bytes for every precision. Also timed with no landing
           reported (every layer requantized after the load, as other transports do)
    mismatch: the sampled tokens' logprobs as each engine reported them, against the bf16 trainer
           model's logprobs of the same tokens (one teacher-forced forward): mean |Δ| and the k3
           estimate of KL(gen || train) per token, as the trainer reports gen_train_kl

Prints, for P in fp8 and fp8_block
    P_vs_bf16_tokens_per_s: R       the FP8 engine's tok/s / the bf16 engine's (higher is better)
    P_vs_bf16_refit: R              its refit seconds / bf16's (lower is better)
    P_refit_landed_vs_after_load: R its refit with landings / without (below 1: the overlap pays)
    bf16_gen_train_kl: K, P_gen_train_kl: K, and the mean |Δ logprob| of each

    python bench/fp8_rollout.py                 # one CUDA GPU of compute capability 8.9+ (H100, H200)
    python bench/fp8_rollout.py --shape 7b
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import subprocess
import sys
import time

PRECISIONS = ("auto", "fp8", "fp8_block")
RESULT = "result: "  # the line a one-precision run ends with: its figures as JSON


def label(precision: str) -> str:
    """The name a precision's figures are printed under ("auto" is the bf16 engine)."""
    return "bf16" if precision == "auto" else precision


def say(message: str) -> None:
    print(message, flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--init-std", type=float, default=0.05)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", choices=["0.5b", "7b"], default="0.5b")
    parser.add_argument("--bucket-mb", type=int, default=256, help="the weight sync's buckets (cluster default)")
    parser.add_argument("--precision", choices=PRECISIONS, help="measure this engine alone (default: each, in turn)")
    return parser.parse_args()


def landing_groups(state: dict, bucket_bytes: int) -> list[list[str]]:
    """The names each transfer of the collective's plan completes (its buckets of packed small tensors, then
    each large tensor's pieces), in transfer order; transfers that complete none are left out."""
    from dockyard.weights.collective import default_direct_bytes, transfer_plan
    from dockyard.weights.refit import TensorSpec

    names = list(state)
    specs = [TensorSpec.of(name, t) for name, t in state.items()]
    plan = transfer_plan(specs, bucket_bytes, default_direct_bytes(bucket_bytes))
    groups: list[list[str]] = []
    for t in plan.transfers:
        if t.index >= 0:
            done = [names[t.index]] if t.hi == specs[t.index].nbytes else []
        else:  # the packed tensors whose last byte is in [lo, hi)
            ends = zip(plan.packed, plan.packed_offsets, strict=True)
            done = [names[i] for i, off in ends if t.lo < off + specs[i].nbytes <= t.hi]
        if done:
            groups.append(done)
    return groups


async def bench(args: argparse.Namespace) -> dict:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from bench.generation import QWEN25_05B
    from bench.weight_sync import QWEN2_7B
    from dockyard.models import build_char_tokenizer
    from services.rollout.decoding import DecodingParams
    from services.rollout.torch_engine import TorchEngine
    from services.trainer.logprobs import sampled_logprobs

    device = args.device
    torch.manual_seed(0)
    config = Qwen2Config(**{"0.5b": QWEN25_05B, "7b": QWEN2_7B}[args.shape], initializer_range=args.init_std)
    with torch.device(device):  # initialised on the GPU: a 7B shape's random init on the host takes minutes
        trainer_model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    say(f"{args.shape} shape: {sum(p.numel() for p in trainer_model.parameters()) / 1e9:.2f}B parameters")
    tokenizer = build_char_tokenizer()
    prompt = "".join("abcdefghijklmnopqrstuvwxyz"[i % 26] for i in range(args.prompt_tokens))
    decoding = DecodingParams(temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    state = {name: t.detach() for name, t in trainer_model.named_parameters()}  # the trainer's own tensors
    transfers = landing_groups(state, args.bucket_mb << 20)

    async def measure(name: str, precision: str) -> dict:
        engine = TorchEngine(
            copy.deepcopy(trainer_model), tokenizer, device, kv_cache="static", max_batch_rows=args.batch,
            precision=precision,
        )  # fmt: skip
        say(f"{name}: warm-up (compile, graph capture)")
        await engine.generate(prompt, args.batch, decoding)
        best, out = float("inf"), None
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = await engine.generate(prompt, args.batch, decoding)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        tokens_per_s = args.batch * args.new_tokens / best
        say(f"{name}: {tokens_per_s:,.0f} tok/s (batch {args.batch}, {args.new_tokens} new tokens, {best:.2f} s)")

        transfer = torch.cuda.Stream(device)  # the transport's stream (NCCL's own, for the collective one)

        def refit(landings: bool, engine=engine) -> float:
            sink = engine.weight_sink()
            current = torch.cuda.current_stream(device)
            torch.cuda.synchronize()
            start = time.perf_counter()
            with engine.exclusive(), torch.no_grad():
                previous: tuple[list[str], torch.cuda.Event] | None = None
                for names in transfers:  # the collective's pipeline: issue transfer k, then finish k - 1
                    transfer.wait_stream(current)  # as a collective's stream waits for the compute stream's work
                    with torch.cuda.stream(transfer):
                        for key in names:
                            sink.targets[key].copy_(state[key])
                    if landings and sink.landed is not None and previous is not None:
                        current.wait_event(previous[1])  # what lands next on the compute stream follows the bytes
                        sink.landed(previous[0])
                    previous = (names, transfer.record_event())
                if landings and sink.landed is not None and previous is not None:
                    current.wait_event(previous[1])
                    sink.landed(previous[0])
                current.wait_stream(transfer)
                engine.set_weight_version(engine.weight_version + 1)
            torch.cuda.synchronize()
            return time.perf_counter() - start

        refit(True)
        refit_s = min(refit(True) for _ in range(3))
        after_s = min(refit(False) for _ in range(3))
        say(f"{name}: engine refit {refit_s * 1e3:.1f} ms ({after_s * 1e3:.1f} ms with every layer after the load)")

        await engine.close()
        # Mismatch: the trainer's bf16 logprobs of the tokens this engine sampled.
        rows = out.completions[:32]
        ids = torch.tensor([out.prompt_token_ids + c.token_ids for c in rows], device=device)
        with torch.no_grad():
            train, _ = sampled_logprobs(trainer_model, ids, torch.ones_like(ids), None, 1.0, entropy=False)
        train = train[:, len(out.prompt_token_ids) - 1 :].float()
        gen = torch.tensor([c.logprobs for c in rows], device=device, dtype=torch.float32)
        log_ratio = (train - gen).clamp(-20, 20)
        kl = (log_ratio.exp() - 1 - log_ratio).mean().item()
        delta = (train - gen).abs().mean().item()
        say(f"{name}: gen_train_kl {kl:.3e}, mean |Δ logprob| {delta:.4f}")
        return {"tokens_per_s": tokens_per_s, "refit_s": refit_s, "after_s": after_s, "kl": kl, "delta": delta}

    return await measure(label(args.precision), args.precision)


def main() -> None:
    args = parse_args()
    if args.precision is not None:
        print(RESULT + json.dumps(asyncio.run(bench(args))), flush=True)
        return
    results = {}
    for precision in PRECISIONS:  # each engine in a fresh process: the GPU wholly its own
        command = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--precision", precision]
        run = subprocess.run(command, stdout=subprocess.PIPE, text=True)
        lines = run.stdout.splitlines()
        print("\n".join(line for line in lines if not line.startswith(RESULT)), flush=True)
        if run.returncode != 0:
            sys.exit(f"the {precision} run failed (exit {run.returncode})")
        results[label(precision)] = json.loads(lines[-1].removeprefix(RESULT))
    bf16 = results["bf16"]
    print(f"bf16_gen_train_kl: {bf16['kl']:.3e}")
    print(f"bf16_mean_abs_logprob_delta: {bf16['delta']:.4f}")
    for name in ("fp8", "fp8_block"):
        ours = results[name]
        print(f"{name}_vs_bf16_tokens_per_s: {ours['tokens_per_s'] / bf16['tokens_per_s']:.3f}")
        print(f"{name}_vs_bf16_refit: {ours['refit_s'] / bf16['refit_s']:.3f}")
        print(f"{name}_refit_landed_vs_after_load: {ours['refit_s'] / ours['after_s']:.3f}")
        print(f"{name}_gen_train_kl: {ours['kl']:.3e}")
        print(f"{name}_mean_abs_logprob_delta: {ours['delta']:.4f}")


if __name__ == "__main__":
    main()
