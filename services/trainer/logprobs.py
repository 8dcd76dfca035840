"""Per-token logprobs (and entropy) of a causal LM at the rollout's sampling temperature.

    input ids [B, L] ─model─> logits[:, :-1] (fp32) / temperature ─log_softmax─>
        ─gather at input ids[:, 1:]─> logprob of each next token [B, L-1]
        ─(entropy=True)─> −Σ p·log p per position [B, L-1], no grad

Guarantees: logprobs are computed in fp32 from logits divided by the sampling
temperature (temperature 0 or 1 leaves them as they are), so they compare
with the logprobs the rollout engine reports; position t scores token t+1,
aligned with Batch.token_mask. The entropy is taken 1024 positions at a
time, so it adds no [tokens, vocab] temporary of its own.
"""

from __future__ import annotations

import torch

from services.trainer.batch import Batch


def token_logprobs(model: torch.nn.Module, batch: Batch, temperature: float) -> torch.Tensor:
    """[B, L-1] logprob of each next token under `model`, at the sampling temperature."""
    logprobs, _ = sampled_logprobs(model, batch.input_ids, batch.attention_mask, None, temperature, entropy=False)
    return logprobs


def sampled_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    temperature: float,
    entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sampled-token logprobs [B, L-1] and, when asked, the policy's entropy per position (no grad)."""
    # use_cache=False: with a cache, transformers would ignore the packed-sequence position ids.
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    logits = out.logits[:, :-1].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    ent = None
    if entropy:
        # In chunks of positions: a full [tokens, vocab] temporary is gigabytes at a 150k vocabulary.
        with torch.no_grad():
            flat = log_probs.detach().flatten(0, 1)
            ent = torch.cat([-(c.exp() * c).sum(-1) for c in flat.split(1024)]).view(log_probs.shape[:2])
    return log_probs.gather(-1, input_ids[:, 1:, None]).squeeze(-1), ent
