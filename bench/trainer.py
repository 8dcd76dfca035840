"""Trainer step throughput, MFU and peak memory, against baselines measured in the same run.

    synthetic GRPO groups (random tokens, varied lengths) ──PolicyTrainer.train_step──>  timed, peak memory
    the same step with the full-logits logprobs (the path before the chunked one) ──>     timed, peak memory
    the same rows, same micro-batches ──model(labels=...) + backward + AdamW──>          timed (baseline)

Default: a Qwen2.5-0.5B-shaped qwen2 model (hidden 896, 24 layers, 14 heads, 2 kv heads,
intermediate 4864, vocab 151936, tied embeddings; random init) in bf16 with fp32 master weights,
32 sequences of 256-512 prompt + 768-1536 completion tokens, micro-batches of <= 16384 tokens.
`--smoke` runs a tiny model on CPU in fp32 for a few seconds.

Model FLOPs per step (real tokens only; padding, activation recompute, the no-grad π_old pass of
several minibatches and the entropy are not counted), for each sequence of S tokens:
    6 · N · S  +  6 · L · d · S · (S + 1)  +  6 · V · d · H
where N = parameters of every body matmul (attention q/k/v/o and MLP of each layer), the second
term is causal attention (QKᵀ and AV: 2·2·d per query-key pair, forward, ×3 with backward,
S(S+1)/2 pairs per layer) and H = the positions the LM head (V·d, counted even when tied to the
embedding) scores: every position for the plain step and the full-logits path, the completion
tokens for the GRPO step (it computes no logits elsewhere). MFU = model FLOPs per second / peak;
the default peak is an H200's dense bf16, 989 TFLOP/s.

Prints tokens/s and MFU of each, then, last:
    peak_memory_vs_full_logits: R   peak memory of the step over the full-logits path's (CUDA only)
    trainer_vs_plain_step: R        dockyard tokens/s over the plain step's (1.0 is parity)

With `--backend jax` it times the JAX (Flax NNX) trainer's `train_step` and the torch trainer's on
the same model (the same random init), config and batch, and prints, last:
    jax_mfu: R                      the JAX step's MFU
    torch_mfu: R                    the torch step's MFU
    jax_vs_torch: R                 JAX tokens/s over torch's (1.0 is parity)

    python bench/trainer.py            # one GPU: the Qwen2.5-0.5B shape, 32 sequences
    python bench/trainer.py --smoke    # CPU, a tiny model, seconds
    python bench/trainer.py --backend jax [--smoke]
    python bench/trainer.py --packing --profile 25   # packed rows; the top 25 ops of one step
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dockyard.config import load_config_text
from services.trainer.experience import Sample, TrainingGroup

QWEN25_05B = {
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "vocab_size": 151936,
}
TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
    "vocab_size": 512,
}


def config_yaml(args: argparse.Namespace, model: dict) -> str:
    fields = ", ".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in model.items())
    budget = "null" if args.tokens_per_micro_batch is None else args.tokens_per_micro_batch
    return f"""
policy:
  model: {{{fields}}}
  dtype: {args.dtype}
  activation_checkpointing: {str(args.activation_checkpointing).lower()}
  compile_layers: {args.compile_layers}
  train_global_batch_size: {args.minibatch or args.sequences}
  train_micro_batch_size: {args.sequences}
  max_tokens_per_micro_batch: {budget}
  sequence_packing: {args.packing}
  optimizer: {{lr: 1.0e-6, max_grad_norm: 1.0}}
grpo: {{num_prompts_per_step: {args.sequences // args.group_size}, num_generations_per_prompt: {args.group_size}}}
"""


def make_groups(args: argparse.Namespace, vocab: int) -> list[TrainingGroup]:
    gen = torch.Generator().manual_seed(0)

    def length(upper: int) -> int:
        return int(torch.randint(upper // 2, upper + 1, (), generator=gen))

    groups = []
    for g in range(args.sequences // args.group_size):
        prompt = torch.randint(4, vocab, (length(args.prompt_tokens),), generator=gen).tolist()
        samples = []
        for i in range(args.group_size):
            n = length(args.completion_tokens)
            samples.append(
                Sample(
                    trajectory_id=f"g{g}/{i}",
                    prompt_ids=prompt,
                    completion_ids=torch.randint(4, vocab, (n,), generator=gen).tolist(),
                    generation_logprobs=(-torch.rand(n, generator=gen) * 4).tolist(),
                    reward=float(torch.rand((), generator=gen)),
                    valid=True,
                )
            )
        groups.append(TrainingGroup(group_id=f"g{g}", samples=samples))
    return groups


def model_flops(model_cfg, lengths: list[int], head_positions: int) -> float:
    d, layers = model_cfg.hidden_size, model_cfg.num_hidden_layers
    heads, kv = model_cfg.num_attention_heads, model_cfg.num_key_value_heads
    head_dim = getattr(model_cfg, "head_dim", None) or d // heads
    attn = d * heads * head_dim + 2 * d * kv * head_dim + heads * head_dim * d
    mlp = 3 * d * model_cfg.intermediate_size
    n = layers * (attn + mlp)
    body = sum(6 * n * s + 6 * layers * heads * head_dim * s * (s + 1) for s in lengths)
    return body + 6 * model_cfg.vocab_size * d * head_positions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU, fp32, a few seconds")
    parser.add_argument("--device", default=None, help="default: cuda when available")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=512, help="prompt lengths uniform in [n/2, n]")
    parser.add_argument("--completion-tokens", type=int, default=1536, help="completion lengths uniform in [n/2, n]")
    parser.add_argument("--tokens-per-micro-batch", type=int, default=16384)
    tri = {"nargs": "?", "const": "true", "default": "auto", "choices": ["auto", "true", "false"]}
    parser.add_argument("--packing", **tri, help="policy.sequence_packing (default auto; bare flag: true)")
    parser.add_argument(
        "--minibatch", type=int, default=None, help="trajectories per optimizer step (default: all, one step)"
    )
    parser.add_argument("--skip-full-logits", action="store_true", help="no full-logits baseline (saves its time)")
    parser.add_argument("--skip-plain", action="store_true", help="no plain LM step (its full logits may not fit)")
    parser.add_argument("--skip-padded", action="store_true", help="with packing on: no padded step to compare")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--compile-layers", **tri, help="policy.compile_layers (default auto; bare flag: true)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--backend", default="torch", choices=["torch", "jax"], help="jax: JAX vs torch step")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="peak of the device (H200 bf16 dense)")
    parser.add_argument("--profile", type=int, default=0, help="after timing, profile one GRPO step: top N ops")
    args = parser.parse_args()
    if args.smoke:
        args.device = args.device or "cpu"
        args.dtype = args.dtype or "float32"
        args.sequences, args.group_size = 8, 4
        args.prompt_tokens, args.completion_tokens, args.tokens_per_micro_batch = 32, 64, 256
        args.steps, args.warmup = 2, 1
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or "bfloat16"

    from services.trainer import packed_attention
    from services.trainer.packed_attention import forward_kwargs
    from services.trainer.policy import PolicyTrainer

    model = TINY if args.smoke else QWEN25_05B
    config = load_config_text(config_yaml(args, model))
    if args.backend == "jax":
        return jax_versus_torch(args, config, device)
    policy = PolicyTrainer(config, device)
    cfg = policy.model.config
    groups = make_groups(args, cfg.vocab_size)
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for g in groups for s in g.samples]
    completion = sum(len(s.completion_ids) for g in groups for s in g.samples)
    flops = {
        "dockyard GRPO step": model_flops(cfg, lengths, completion),
        "full-logits GRPO step": model_flops(cfg, lengths, sum(lengths)),
        "plain LM step": model_flops(cfg, lengths, sum(lengths)),
    }
    tokens = sum(lengths)
    print(
        f"model: {cfg.model_type} {policy.num_parameters() / 1e6:.1f}M parameters, {args.dtype} on {device}; "
        f"batch: {len(lengths)} sequences, {tokens} tokens (longest {max(lengths)}), "
        f"budget {args.tokens_per_micro_batch} tokens/micro-batch, packing {policy.packing} "
        f"({args.packing}), activation checkpointing {args.activation_checkpointing}, compiled layers "
        f"{policy.compiled} ({args.compile_layers})"
    )

    cuda = device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def timed(step) -> float:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for i in range(args.warmup + args.steps):
            sync()
            start = time.perf_counter()
            step()
            sync()
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    last: dict[str, float] = {}

    def grpo_step() -> None:
        last.update(policy.train_step(groups))

    ours = timed(grpo_step)
    peaks = {"dockyard GRPO step": torch.cuda.max_memory_allocated() if cuda else None}
    if args.profile:
        profile_step(grpo_step, sync, args.profile, cuda)
    seconds = {"dockyard GRPO step": ours}
    ours_last = dict(last)
    if not args.skip_full_logits:
        # The same step through the model's full [tokens, vocab] logits: the path before the chunked one.
        import services.trainer.policy as policy_module
        from services.trainer.logprobs import full_logits_logprobs

        chunked = policy_module.sampled_logprobs
        policy_module.sampled_logprobs = lambda *a, scored=None, segments=None: full_logits_logprobs(*a, segments)
        try:
            seconds["full-logits GRPO step"] = timed(grpo_step)
            peaks["full-logits GRPO step"] = torch.cuda.max_memory_allocated() if cuda else None
        finally:
            policy_module.sampled_logprobs = chunked
    # Baseline: the same micro-batches through a bare causal-LM loss, backward and AdamW step.
    from services.trainer.batch import build_batch

    batch = build_batch(groups, policy.tokenizer.pad_token_id)
    share = padding_share(policy, batch, tokens)
    # Packing saves at most the padded positions' work: 1 / (1 - share) if time went with positions.
    print(f"padded micro-batches: {100 * share:.1f}% of positions are padding (packing bound {1 / (1 - share):.2f}x)")
    advantages = torch.zeros(len(batch))
    micro = [mb.to(device) for mb in policy._plan(batch, advantages)]
    varlen = packed_attention.installed(policy.model)

    def plain_step() -> None:
        policy.optimizer.zero_grad(set_to_none=True)
        for mb in micro:
            labels = (
                mb.input_ids if mb.attention_mask is None else mb.input_ids.masked_fill(mb.attention_mask == 0, -100)
            )
            # Packed rows go through the same varlen attention as the trainer's.
            packed = {} if mb.segments is None or not varlen else forward_kwargs(mb.segments, mb.input_ids)
            with policy._autocast():
                out = policy.model(
                    input_ids=mb.input_ids,
                    position_ids=mb.position_ids,
                    labels=labels,
                    use_cache=False,
                    **({"attention_mask": mb.attention_mask} | packed),
                )
            (out.loss / len(micro)).backward()
        torch.nn.utils.clip_grad_norm_(policy.model.parameters(), 1.0)
        policy.optimizer.step()

    plain = None
    if not args.skip_plain:
        plain = timed(plain_step)
        peaks["plain LM step"] = torch.cuda.max_memory_allocated() if cuda else None
        seconds["plain LM step"] = plain
    for name, took in seconds.items():
        tflops = flops[name] / took / 1e12
        peak = "" if peaks[name] is None else f"  peak {peaks[name] / 2**30:6.1f} GiB"
        print(
            f"{name:>22}: {took * 1000:8.1f} ms/step  {tokens / took:10.0f} tokens/s  "
            f"{tflops:7.2f} TFLOP/s  MFU {100 * tflops / args.peak_tflops:5.1f}% (of {args.peak_tflops:g}){peak}"
        )
    last = ours_last
    print(
        f"breakdown (last dockyard step): batch {last['batch_seconds'] * 1000:.1f} ms, forward/backward "
        f"{last['forward_backward_seconds'] * 1000:.1f} ms, optimizer {last['optimizer_seconds'] * 1000:.1f} ms, "
        f"{int(last['num_micro_batches'])} micro-batches, {int(last['optimizer_steps'])} optimizer steps, "
        f"clip fraction {last['clip_fraction']:.3f}"
    )
    full = peaks.get("full-logits GRPO step")
    if cuda and full:
        print(f"peak_memory_vs_full_logits: {peaks['dockyard GRPO step'] / full:.3f}")
    else:
        print("peak_memory_vs_full_logits: n/a (CUDA only, and not with --skip-full-logits)")
    print(f"trainer_mfu: {flops['dockyard GRPO step'] / ours / 1e12 / args.peak_tflops:.3f}")
    if plain is not None:
        print(f"trainer_vs_plain_step: {plain / ours:.3f}")
    if policy.packing and not args.skip_padded:
        del policy, micro, plain_step, grpo_step
        padded = PolicyTrainer(
            config.model_copy(update={"policy": config.policy.model_copy(update={"sequence_packing": False})}), device
        )

        def padded_step() -> None:
            padded.train_step(groups)

        took = timed(padded_step)
        print(f"{'padded GRPO step':>22}: {took * 1000:8.1f} ms/step  {tokens / took:10.0f} tokens/s")
        print(f"packed_vs_padded: {took / ours:.3f}")


def padding_share(policy, batch, tokens: int) -> float:
    """The share of the padded micro-batches' positions that are padding, under the job's budgets."""
    from services.trainer.micro_batches import plan

    pcfg = policy.config.policy
    rows = plan(
        batch,
        torch.zeros(len(batch)),
        rank=0,
        world=1,
        max_rows=pcfg.train_micro_batch_size,
        max_tokens=pcfg.max_tokens_per_micro_batch,
        packing=False,
    )
    computed = sum(mb.input_ids.numel() for mb in rows)
    return 1 - tokens / computed


def profile_step(step, sync, rows: int, cuda: bool) -> None:
    """One step under torch.profiler: the top `rows` ops by their own device time (CPU time without CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    with profile(activities=activities) as prof:
        step()
        sync()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(f"profile of one GRPO step, top {rows} ops by {key}:")
    print(prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60))


def jax_versus_torch(args: argparse.Namespace, config, device: str) -> None:
    """The JAX trainer's step against the torch trainer's: same model, config, batch; tokens/s and MFU."""
    from services.trainer.jax_policy import JaxPolicyTrainer
    from services.trainer.policy import PolicyTrainer

    trainers = {
        "jax": JaxPolicyTrainer(
            config.model_copy(update={"policy": config.policy.model_copy(update={"backend": "jax"})}), device
        ),
        "torch": PolicyTrainer(config, device),
    }
    cfg = trainers["jax"].hf_config
    groups = make_groups(args, cfg.vocab_size)
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for g in groups for s in g.samples]
    completion = sum(len(s.completion_ids) for g in groups for s in g.samples)
    flops, tokens = model_flops(cfg, lengths, completion), sum(lengths)
    print(
        f"model: {cfg.model_type} {trainers['jax'].num_parameters() / 1e6:.1f}M parameters, {args.dtype} on {device}; "
        f"batch: {len(lengths)} sequences, {tokens} tokens (longest {max(lengths)}), "
        f"budget {args.tokens_per_micro_batch} tokens/micro-batch, packing {args.packing}"
    )
    mfu = {}
    for name, policy in trainers.items():  # JAX compiles in its warmup steps
        times, last = [], {}
        for i in range(args.warmup + args.steps):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            last = policy.train_step(groups)  # returns floats: the device work is done
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
            else:
                print(f"{name} warmup step {i}: {time.perf_counter() - start:.1f} s", flush=True)
        took = statistics.median(times)
        tflops = flops / took / 1e12
        mfu[name] = tflops / args.peak_tflops
        print(
            f"{name:>6} GRPO step: {took * 1000:8.1f} ms/step  {tokens / took:10.0f} tokens/s  {tflops:7.2f} TFLOP/s  "
            f"MFU {100 * mfu[name]:5.1f}% (of {args.peak_tflops:g}); "
            f"loss {last['loss']:.5f} grad_norm {last['grad_norm']:.4f}"
        )
    print(f"jax_mfu: {mfu['jax']:.3f}")
    print(f"torch_mfu: {mfu['torch']:.3f}")
    print(f"jax_vs_torch: {mfu['jax'] / mfu['torch']:.3f}")


if __name__ == "__main__":
    main()
