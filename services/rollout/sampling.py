"""Per-row sampling for the torch engine's decode batch: every row its own parameters and random stream.

    logits (rows, vocab) ──/ T per row──> log_softmax ──> reported logprob at the chosen token
                                              ├──top-k, top-p per row──> race of Exp(1) noise from the row's generator
                                              └──only if a row asks top_logprobs = k──> its k largest (alternatives)

Guarantees: a row's token depends only on its own logits, parameters and generator, never on the
other rows of the batch (greedy rows draw nothing); the reported logprob is log_softmax(logits / T)
at the chosen token, after temperature, before top-k/top-p (plain log_softmax when T is 0);
top-p keeps the smallest most-likely set whose mass reaches top_p within the top-k renormalised
distribution; ties go to the lower token id, as argmax does, so top_k=1 is greedy. A row's
alternatives (DecodingParams.top_logprobs = k > 0) are the k largest entries of that same
log_softmax, most likely first, taken before truncation; when no row asks, none are computed. A seeded
request's row i draws from a generator seeded by (seed, i); the noise of one draw is one
`exponential_` over the vocabulary, so the stream advances the same way in any batch.
"""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

import torch
from transformers import StopStringCriteria

from services.rollout.decoding import DecodingParams
from services.rollout.engine import TopLogprobs, UnsupportedRequest


def row_generator(seed: int, row: int, device: torch.device) -> torch.Generator:
    """The generator of row `row` of a request seeded with `seed` (decorrelated across rows and seeds)."""
    digest = hashlib.blake2b(f"{seed}:{row}".encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little") >> 1)


class Sampled(NamedTuple):
    """One step's draw: a token per row, its logprob, and (when a row asked) the alternatives."""

    tokens: torch.Tensor  # (rows,)
    logprobs: torch.Tensor  # (rows,)
    # (logprobs, token ids), each (rows, largest k asked), most likely first; None when no row asked.
    top: tuple[torch.Tensor, torch.Tensor] | None = None

    def top_lists(self, params: list[DecodingParams]) -> list[TopLogprobs | None]:
        """Each row's alternatives, cut to the k it asked (None for a row that asked none); reads the device."""
        if self.top is None:
            return [None] * len(params)
        values, ids = self.top[0].tolist(), self.top[1].tolist()
        return [
            TopLogprobs(i[: p.top_logprobs], v[: p.top_logprobs]) if p.top_logprobs else None
            for p, v, i in zip(params, values, ids, strict=True)
        ]


def sample(logits: torch.Tensor, params: list[DecodingParams], generators: list[torch.Generator]) -> Sampled:
    """One token per row of `logits` (rows, vocab), its logprob and the alternatives asked for, on the logits' device.

    Nothing here waits for the device; the caller reads the results when it needs them.
    """
    device = logits.device
    logits = logits.float()
    if any(p.temperature not in (0.0, 1.0) for p in params):
        temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=device)
        logits = logits / temps[:, None]
    logprobs = torch.log_softmax(logits, dim=-1)
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    everyone = len(drawn) == len(params)
    tokens = None if everyone else logprobs.argmax(dim=-1)
    if drawn:
        scores = _truncate(logprobs if everyone else logprobs[drawn], [params[i] for i in drawn])
        noise = torch.empty_like(scores)
        j = 0
        while j < len(drawn):  # one draw per run of rows sharing a generator (the engine's, for unseeded rows)
            end = j + 1
            while end < len(drawn) and generators[drawn[end]] is generators[drawn[j]]:
                end += 1
            noise[j:end].exponential_(generator=generators[drawn[j]])
            j = end
        # argmax of log p - log E, E ~ Exp(1), picks token k with probability p_k.
        choice = (scores - noise.clamp_(min=1e-30).log_()).argmax(dim=-1)
        if tokens is None:
            tokens = choice
        else:
            tokens[torch.tensor(drawn, device=device)] = choice
    assert tokens is not None
    picked = logprobs.gather(1, tokens[:, None]).squeeze(1)
    most = max(p.top_logprobs for p in params)
    # Only when asked: the default path computes nothing more. topk sorts, most likely first.
    top = tuple(logprobs.topk(min(most, logprobs.shape[-1]), dim=-1)) if most else None
    return Sampled(tokens, picked, top)  # type: ignore[arg-type]


def _truncate(logprobs: torch.Tensor, params: list[DecodingParams]) -> torch.Tensor:
    """Top-k then top-p per row; tokens cut away get -inf."""
    if all(p.top_k == 0 and p.top_p >= 1.0 for p in params):
        return logprobs
    vocab, device = logprobs.shape[-1], logprobs.device
    values, order = logprobs.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab, device=device)[None, :]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    values = values.masked_fill(ranks >= top_k[:, None], float("-inf"))
    # 2 > any mass: rows without top-p keep everything (a cumulative sum may round past 1).
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in params], device=device)
    probs = values.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    values = values.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.full_like(logprobs, float("-inf")).scatter(1, order, values)


class StopStrings:
    """Which completions end with a token that completes a stop string.

    transformers' StopStringCriteria does the matching on each completion's last tokens (a token
    that runs past the stop string counts); it sees only the completion, so a stop string that
    straddles the end of the prompt does not end a completion at its first token, and special
    tokens are hidden from it, as they are from the completion's text.
    """

    def __init__(self, tokenizer: Any, stops: tuple[str, ...]) -> None:
        try:
            self.matcher = StopStringCriteria(tokenizer, list(stops))
        except ValueError:  # no token sequence can produce a stop string
            raise UnsupportedRequest(f"sampling.stop: no token sequence of this tokenizer produces {stops!r}") from None
        self.special = set(tokenizer.all_special_ids)
        # The matcher's last embedding row is a dummy that matches nothing.
        self.no_match = self.matcher.embedding_vec.size(0) - 1
        self.width = self.matcher.maximum_token_len

    def hits(self, completions: list[list[int]]) -> list[bool]:
        rows = []
        for tokens in completions:
            tail = [self.no_match if t in self.special else t for t in tokens[-self.width :]]
            rows.append([self.no_match] * (self.width - len(tail)) + tail)
        return self.matcher(torch.tensor(rows, dtype=torch.long), None).tolist()
