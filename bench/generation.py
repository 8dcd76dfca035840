"""Tokens/s of the built-in torch engine against plain `model.generate` on the same model and batch, one GPU.

    model: Qwen2.5-0.5B-shaped (hidden 896, 24 layers, 14 heads, 2 kv heads, intermediate 4864,
           vocab 151936, tied embeddings), random init, bf16
    batch: one prompt of 128 tokens sampled --batch times (a GRPO group), 512 new tokens, ignore_eos,
           temperature 1.0
    engine:   TorchEngine.generate (static KV cache, compiled by transformers on CUDA; per-token
              logprobs, version tagging, row finishing included), one warm-up run of the same shape first
    baseline: model.generate(do_sample=True) with transformers' default dynamic cache, short warm-up

Prints progress, tokens/s of both per batch size, then `engine_vs_hf_generate: R`
(engine tokens/s / baseline tokens/s at the largest batch size; higher is better).

    python bench/generation.py                      # CUDA, batch 64 and 256
    python bench/generation.py --batch-sizes 256     # one batch size (about half the time)
    python bench/generation.py --smoke              # CPU, tiny model, seconds
"""

from __future__ import annotations

import argparse
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


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU, short generations")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="default 64 256 (smoke: 4 8)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="default 128 (smoke: 16)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 512 (smoke: 16)")
    parser.add_argument("--device", default=None, help="default cuda (smoke: cpu)")
    args = parser.parse_args()
    smoke = args.smoke
    batches = args.batch_sizes or ([4, 8] if smoke else [64, 256])
    prompt_tokens = args.prompt_tokens or (16 if smoke else 128)
    new_tokens = args.new_tokens or (16 if smoke else 512)
    device = args.device or ("cpu" if smoke else "cuda")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from dockyard.models import build_char_tokenizer
    from services.rollout.decoding import DecodingParams
    from services.rollout.torch_engine import TorchEngine

    if device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --smoke on CPU")
    torch.manual_seed(0)
    say(f"building a {'tiny' if smoke else 'Qwen2.5-0.5B'}-shaped model (random init, bf16) on {device}")
    config = Qwen2Config(**(TINY if smoke else QWEN25_05B))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(device)
    tokenizer = build_char_tokenizer()
    # The char tokenizer gives one id per character (after its BOS): a prompt of exactly prompt_tokens ids.
    prefix = len(tokenizer("")["input_ids"])
    prompt = ("12+34*(5-6)=" * prompt_tokens)[: prompt_tokens - prefix]
    prompt_ids = tokenizer(prompt)["input_ids"]
    assert len(prompt_ids) == prompt_tokens, len(prompt_ids)
    engine = TorchEngine(model, tokenizer, device, kv_cache="static")  # also gives the model a neutral config
    decoding = DecodingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=0)
    say(f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters; prompt {prompt_tokens} tokens")

    def synced(fn):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        value = fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return value, time.perf_counter() - start

    def hf_generate(batch: int, steps: int):
        ids = torch.tensor([prompt_ids] * batch, device=device)
        with torch.inference_mode():
            return model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=steps,
            )

    rates: dict[int, tuple[float, float]] = {}
    for batch in batches:
        tokens = batch * new_tokens
        say(f"batch {batch}: baseline warm-up (model.generate, dynamic cache, 8 tokens)")
        hf_generate(batch, 8)
        say(f"batch {batch}: baseline, {new_tokens} new tokens")
        out, hf_seconds = synced(lambda batch=batch: hf_generate(batch, new_tokens))
        assert out.shape == (batch, prompt_tokens + new_tokens), out.shape
        say(f"batch {batch}: baseline {hf_seconds:.1f} s, {tokens / hf_seconds:,.0f} tok/s")

        say(f"batch {batch}: engine warm-up of the same shape (static cache; compiles on CUDA)")
        _, warm = synced(lambda batch=batch: engine.generate_blocking(prompt, batch, decoding))
        say(f"batch {batch}: engine warm-up took {warm:.1f} s; timed run")
        result, engine_seconds = synced(lambda batch=batch: engine.generate_blocking(prompt, batch, decoding))
        assert all(len(c.token_ids) == new_tokens for c in result.completions)
        assert all(len(c.logprobs) == new_tokens for c in result.completions)
        say(f"batch {batch}: engine {engine_seconds:.1f} s, {tokens / engine_seconds:,.0f} tok/s")
        rates[batch] = (tokens / engine_seconds, tokens / hf_seconds)

    print(f"model {'tiny' if smoke else 'Qwen2.5-0.5B-shaped'} bf16 on {device}; {prompt_tokens}+{new_tokens} tokens")
    for batch, (engine_rate, hf_rate) in rates.items():
        print(
            f"batch {batch:4d}: engine {engine_rate:10,.0f} tok/s   model.generate {hf_rate:10,.0f} tok/s   "
            f"x{engine_rate / hf_rate:.2f}"
        )
    engine_rate, hf_rate = rates[max(rates)]
    print(f"engine_vs_hf_generate: {engine_rate / hf_rate:.3f}")


if __name__ == "__main__":
    main()
