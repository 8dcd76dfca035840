"""Tokens/s of the built-in torch engine against plain transformers `generate` on the same model, one device.

    model: Qwen2.5-0.5B-shaped (hidden 896, 24 layers, 14 heads, 2 kv heads, intermediate 4864,
           vocab 151936, tied embeddings), built from its config with random weights (no download), bf16
    batch: one prompt of 128 tokens sampled --batch-sizes times (a GRPO group), 512 new tokens,
           ignore_eos, temperature 1.0, unseeded
    engine:    `await TorchEngine.generate(prompt, batch, DecodingParams)` (per-token logprobs, version
               tagging and row finishing included), after one untimed call of the same shape (on CUDA
               that call compiles); every timing is the best of --repeats runs (default 1, quick 3)
    baselines, on a copy of the same weights (its own compiled forward and cache):
      static:  model.generate(do_sample=True, cache_implementation="static"): transformers' static KV
               cache, which transformers compiles on CUDA; one untimed call of the same shape first
      dynamic: model.generate(do_sample=True) with the default dynamic cache, a short warm-up
               (--no-dynamic leaves it out)
    concurrency: --groups concurrent `engine.generate` calls of one group of --group-size rows each
               (distinct prompts of the same length), against one call of groups × group-size rows;
               each pattern once untimed, then timed

Only the engine's public interface is used (`TorchEngine(model, tokenizer, device, kv_cache=...)`,
`await engine.generate(...)`), so the script measures any engine behind it; an engine that takes
`max_batch_rows` gets the most rows any measurement asks for (--max-batch-rows to choose). Needs torch,
transformers and the project's own packages; no network.

Prints progress, tokens/s per batch size, then
    engine_vs_hf_generate: R           engine tok/s / dynamic-cache generate tok/s, largest batch
    engine_vs_hf_static: R             engine tok/s / static-cache generate tok/s, largest batch
                                       (goal R >= 3 on one H200 at batch 256 with the defaults)
    concurrent_groups_vs_one_batch: R  tok/s of the concurrent groups / tok/s of the one batch
                                       (goal R >= 0.9: groups batch together as well as one call)
Higher is better for all three.

    python bench/generation.py                            # CUDA, batch 64 and 256, 8 groups of 32
    python bench/generation.py --batch-sizes 256          # one batch size
    .venv/bin/python bench/generation.py --quick          # CPU, tiny model, under a minute

--quick: a tiny Qwen2 (hidden 64, 2 layers, vocab 1000) in float32 on CPU, one torch thread,
prompt 16 + 64 new tokens, batch 4 and 16, 4 concurrent groups of 4, best of 3: it checks that
the script and the engine run, not the GPU goals.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import inspect
import os
import sys
import time

QWEN25_05B = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
    tie_word_embeddings=True,
)
TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=1000,
    tie_word_embeddings=True,
)
GOAL_STATIC = 3.0
GOAL_CONCURRENT = 0.9


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", "--smoke", action="store_true", help="tiny model on CPU, short generations")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="default 64 256 (quick: 4 16)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="default 128 (quick: 16)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 512 (quick: 64)")
    parser.add_argument("--groups", type=int, default=None, help="concurrent calls; default 8 (quick: 4); 0: skip")
    parser.add_argument("--group-size", type=int, default=None, help="rows per concurrent call; default 32 (quick: 4)")
    parser.add_argument("--device", default=None, help="default cuda (quick: cpu)")
    parser.add_argument("--dtype", default=None, help="bfloat16, float16 or float32; default bfloat16 (quick: float32)")
    parser.add_argument("--kv-cache", default="static", choices=("static", "dynamic"), help="the engine's cache")
    parser.add_argument(
        "--max-batch-rows", type=int, default=None, help="engines that bound their batch: default the most rows asked"
    )
    parser.add_argument("--no-dynamic", action="store_true", help="leave out the dynamic-cache baseline")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads; default torch's (quick: 1)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs of each, best kept; default 1 (quick: 3)")
    args = parser.parse_args()
    quick = args.quick
    args.batch_sizes = args.batch_sizes or ([4, 16] if quick else [64, 256])
    args.prompt_tokens = args.prompt_tokens or (16 if quick else 128)
    args.new_tokens = args.new_tokens or (64 if quick else 512)
    args.groups = (4 if quick else 8) if args.groups is None else args.groups
    args.group_size = args.group_size or (4 if quick else 32)
    args.device = args.device or ("cpu" if quick else "cuda")
    args.dtype = args.dtype or ("float32" if quick else "bfloat16")
    args.repeats = args.repeats or (3 if quick else 1)
    # One thread: a tiny model's small matmuls gain nothing from more, and on a loaded machine the
    # thread pool's waits swamp them (every side alike, but with seconds of noise).
    args.threads = args.threads or (1 if quick else None)
    return args


def prompts_of(tokenizer, length: int, count: int) -> list[str]:
    """`count` distinct prompts of exactly `length` ids: the char tokenizer gives one id per character."""
    prefix = len(tokenizer("")["input_ids"])  # a BOS, if the tokenizer adds one
    pattern = "12+34*(5-6)=" * length
    prompts = [(f"{i}|" + pattern)[: length - prefix] for i in range(count)]
    assert len(set(prompts)) == count, "prompts too short to tell the groups apart"
    for prompt in prompts:
        assert len(tokenizer(prompt)["input_ids"]) == length, prompt
    return prompts


async def bench(args: argparse.Namespace) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from dockyard.models import build_char_tokenizer
    from services.rollout.decoding import DecodingParams
    from services.rollout.torch_engine import TorchEngine

    device, new_tokens, prompt_tokens = args.device, args.new_tokens, args.prompt_tokens
    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --quick on CPU, or --device cpu")
    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = "tiny" if args.quick else "Qwen2.5-0.5B"
    torch.manual_seed(0)
    say(f"building a {shape}-shaped model (random init, {args.dtype}) on {device}")
    model = AutoModelForCausalLM.from_config(Qwen2Config(**(TINY if args.quick else QWEN25_05B)), dtype=dtype)
    model = model.to(device)
    tokenizer = build_char_tokenizer()
    prompts = prompts_of(tokenizer, prompt_tokens, max(args.groups, 1))
    prompt, prompt_ids = prompts[0], tokenizer(prompts[0])["input_ids"]
    # An engine that bounds its decode batch gets room for the largest batch measured, so that one
    # call of `batch` rows is decoded as one batch, as the baselines decode it.
    options = {}
    if "max_batch_rows" in inspect.signature(TorchEngine).parameters:
        options["max_batch_rows"] = args.max_batch_rows or max(*args.batch_sizes, args.groups * args.group_size)
    engine = TorchEngine(model, tokenizer, device, kv_cache=args.kv_cache, **options)
    # The baselines run a copy of the weights: their compiled forward and KV cache are their own, and
    # the engine's (captured in its own thread) are never replayed from this one.
    hf_model = copy.deepcopy(model).eval()
    decoding = DecodingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)
    say(f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters; prompt {prompt_tokens} tokens; {options}")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def hf_generate(batch: int, steps: int, cache: str | None):
        ids = torch.tensor([prompt_ids] * batch, device=device)
        extra = {"cache_implementation": cache} if cache else {}
        with torch.inference_mode():
            out = hf_model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=steps,
                **extra,
            )
        assert out.shape == (batch, prompt_tokens + steps), out.shape

    def timed_hf(batch: int, steps: int, cache: str | None, repeats: int = 1) -> float:
        """Best seconds of `repeats` runs (the least disturbed by whatever else shares the machine)."""
        best = float("inf")
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            hf_generate(batch, steps, cache)
            sync()
            best = min(best, time.perf_counter() - start)
        return best

    async def timed_engine(calls: list[tuple[str, int]], repeats: int = 1) -> float:
        """Best seconds of `repeats` rounds of these (prompt, rows) calls, all awaited at once;
        checks every completion's length."""
        best = float("inf")
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            results = await asyncio.gather(*(engine.generate(p, n, decoding) for p, n in calls))
            sync()
            best = min(best, time.perf_counter() - start)
            for result, (_, n) in zip(results, calls, strict=True):
                assert len(result.completions) == n
                assert all(len(c.token_ids) == new_tokens == len(c.logprobs) for c in result.completions)
        return best

    rates: dict[int, dict[str, float]] = {}
    for batch in args.batch_sizes:
        tokens = batch * new_tokens
        rates[batch] = {}
        if not args.no_dynamic:
            say(f"batch {batch}: dynamic-cache generate, warm-up (8 tokens), then {new_tokens} new tokens")
            timed_hf(batch, 8, None)
            seconds = timed_hf(batch, new_tokens, None, args.repeats)
            rates[batch]["dynamic"] = tokens / seconds
            say(f"batch {batch}: dynamic-cache generate {seconds:.1f} s, {tokens / seconds:,.0f} tok/s")
        say(f"batch {batch}: static-cache generate, untimed call of the same shape (compiles on CUDA)")
        warm = timed_hf(batch, new_tokens, "static")
        seconds = timed_hf(batch, new_tokens, "static", args.repeats)
        rates[batch]["static"] = tokens / seconds
        rate = f"{tokens / seconds:,.0f} tok/s"
        say(f"batch {batch}: static-cache generate {seconds:.1f} s (first call {warm:.1f} s), {rate}")

        say(f"batch {batch}: engine, untimed call of the same shape")
        warm = await timed_engine([(prompt, batch)])
        seconds = await timed_engine([(prompt, batch)], args.repeats)
        rates[batch]["engine"] = tokens / seconds
        say(f"batch {batch}: engine {seconds:.1f} s (first call {warm:.1f} s), {tokens / seconds:,.0f} tok/s")

    concurrent = None
    if args.groups:
        n, g = args.groups, args.group_size
        tokens = n * g * new_tokens
        together = [(p, g) for p in prompts[:n]]
        say(f"concurrency: {n} concurrent calls of {g} rows, untimed round first")
        await timed_engine(together)
        groups_seconds = await timed_engine(together, args.repeats)
        say(f"concurrency: {n} x {g} concurrent {groups_seconds:.1f} s, {tokens / groups_seconds:,.0f} tok/s")
        say(f"concurrency: one call of {n * g} rows, untimed call first")
        await timed_engine([(prompt, n * g)])
        one_seconds = await timed_engine([(prompt, n * g)], args.repeats)
        say(f"concurrency: one call of {n * g} rows {one_seconds:.1f} s, {tokens / one_seconds:,.0f} tok/s")
        concurrent = (n, g, tokens / groups_seconds, tokens / one_seconds)

    print(f"model {shape}-shaped {args.dtype} on {device}; {prompt_tokens}+{new_tokens} tokens; engine {engine.name}")
    for batch, r in rates.items():
        dynamic = f"   dynamic generate {r['dynamic']:10,.0f} tok/s" if "dynamic" in r else ""
        print(
            f"batch {batch:4d}: engine {r['engine']:10,.0f} tok/s   static generate {r['static']:10,.0f} tok/s"
            f"{dynamic}   x{r['engine'] / r['static']:.2f} static"
        )
    if concurrent:
        n, g, groups_rate, one_rate = concurrent
        print(f"{n} concurrent calls of {g}: {groups_rate:,.0f} tok/s   one call of {n * g}: {one_rate:,.0f} tok/s")
    top = rates[max(rates)]
    if "dynamic" in top:
        print(f"engine_vs_hf_generate: {top['engine'] / top['dynamic']:.3f}")
    print(f"goal: engine_vs_hf_static >= {GOAL_STATIC} (one H200, batch 256, Qwen2.5-0.5B shape, bf16, 128+512 tokens)")
    print(f"engine_vs_hf_static: {top['engine'] / top['static']:.3f}")
    if concurrent:
        print(f"goal: concurrent_groups_vs_one_batch >= {GOAL_CONCURRENT}")
        print(f"concurrent_groups_vs_one_batch: {concurrent[2] / concurrent[3]:.3f}")


def main() -> None:
    asyncio.run(bench(parse_args()))


if __name__ == "__main__":
    main()
