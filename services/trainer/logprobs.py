"""Per-token logprobs (and entropy) of a causal LM at the rollout's sampling temperature, in chunks.

    input ids [B, L] ─model body─> last hidden state [B, L, H] ─[:, :-1], the scored positions─> h [N, H]
        ─chunks of ~CHUNK_ELEMENTS / vocab positions─> logits chunk = h_c · Wᵀ (fp32) / temperature
        ─> logsumexp, gather at the next token, entropy ─> logprob [N] (grad), entropy [N] (no grad)
        ─scatter─> [B, L-1] (0 at positions not scored)
    backward: each chunk's logits recomputed from h_c and W, dlogits = g·(onehot − softmax) / T
        ─> dh_c = dlogits · W, dW += dlogitsᵀ · h_c

Guarantees: logprobs are computed in fp32 from logits divided by the sampling
temperature (temperature 0 or 1 leaves them as they are), so they compare
with the logprobs the rollout engine reports; position t scores token t+1,
aligned with Batch.token_mask. Only one chunk of [positions, vocab] logits
exists at a time, in the forward and in the backward (the full [B, L, vocab]
logits are never built), and the results equal `full_logits_logprobs` (the
plain computation, kept as the reference) to fp32 rounding. The matmul runs
in the autocast dtype when autocast is on, as the model's own LM head would.
Works with tied embeddings (the head's weight is the embedding's) and under
FSDP2: the head runs inside the model's forward, where its weight is gathered.
Models that transform logits after the head (soft-capping, a logit scale) take
the full-logits path.
"""

from __future__ import annotations

import contextlib

import torch

from services.trainer.batch import Batch
from services.trainer.packed_attention import Segments, forward_kwargs

# Elements of one chunk of logits: 2^26 (128 MiB in bf16), ~440 positions at a 150k vocabulary. The chunk's
# logits and their gradient are live at the loss's backward, the step's memory peak (every layer's activations
# are saved then). Each chunk's matmuls still span the whole vocabulary.
CHUNK_ELEMENTS = 1 << 26


def token_logprobs(model: torch.nn.Module, batch: Batch, temperature: float) -> torch.Tensor:
    """[B, L-1] logprob of each next token under `model`, at the sampling temperature; 0 where that token is padding."""
    real = batch.attention_mask[:, 1:].bool()
    logprobs, _ = sampled_logprobs(
        model, batch.input_ids, batch.attention_mask, None, temperature, entropy=False, scored=real
    )
    return logprobs


def sampled_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    temperature: float,
    entropy: bool,
    scored: torch.Tensor | None = None,
    segments: Segments | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sampled-token logprobs [B, L-1] and, when asked, the policy's entropy per position (no grad).

    `scored`: [B, L-1], the positions to compute (e.g. the token mask); the others hold 0.
    None scores every position. `segments`: the sequences of a packed row, for a model whose
    attention packed_attention.install switched (their varlen kernel); None: the mask and
    position ids say everything.
    """
    config = getattr(model, "config", None)
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        return full_logits_logprobs(model, input_ids, attention_mask, position_ids, temperature, entropy, segments)
    head = model.get_output_embeddings()
    targets = input_ids[:, 1:]
    where = torch.ones_like(targets, dtype=torch.bool) if scored is None else scored.bool()
    found: dict[str, torch.Tensor] = {}

    def on_body_output(_module, _args, output) -> None:
        # Inside the model's forward: under FSDP2 the head's weight is gathered right now.
        hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
        picked = hidden[:, :-1][where]
        lp, ent = ChunkedHeadLogprobs.apply(picked, head.weight, targets[where], temperature, entropy)
        found.update(lp=lp, ent=ent)

    handle = model.get_decoder().register_forward_hook(on_body_output)
    try:
        # No position keeps its logits: the head runs on an empty slice, and our hook does its work.
        nothing = torch.zeros(0, dtype=torch.long, device=input_ids.device)
        model(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=nothing,
            **_mask_kwargs(input_ids, attention_mask, segments),
        )
    finally:
        handle.remove()
    shape = targets.shape
    logprobs = torch.zeros(shape, dtype=torch.float32, device=input_ids.device).masked_scatter(where, found["lp"])
    ent = None
    if entropy:
        ent = torch.zeros(shape, dtype=torch.float32, device=input_ids.device).masked_scatter(where, found["ent"])
    return logprobs, ent


def full_logits_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    temperature: float,
    entropy: bool,
    segments: Segments | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The plain computation through the model's full [B, L, vocab] logits: the reference and the baseline."""
    # use_cache=False: with a cache, transformers would ignore the packed-sequence position ids.
    kwargs = _mask_kwargs(input_ids, attention_mask, segments)
    out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs)
    logits = out.logits[:, :-1].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    ent = None
    if entropy:
        with torch.no_grad():
            flat = log_probs.detach().flatten(0, 1)
            ent = torch.cat([-(c.exp() * c).sum(-1) for c in flat.split(1024)]).view(log_probs.shape[:2])
    return log_probs.gather(-1, input_ids[:, 1:, None]).squeeze(-1), ent


def _mask_kwargs(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, segments: Segments | None) -> dict:
    return {"attention_mask": attention_mask} if segments is None else forward_kwargs(segments, input_ids)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    kind = t.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return t.dtype


class ChunkedHeadLogprobs(torch.autograd.Function):
    """logprob and entropy of `targets` under softmax(hidden · weightᵀ / T), one chunk of positions at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, entropy):  # type: ignore[override]
        dtype = _compute_dtype(hidden)
        scale = temperature if temperature > 0 and temperature != 1.0 else 1.0  # logits are divided by it
        chunk = max(1, CHUNK_ELEMENTS // weight.shape[0])
        n = hidden.shape[0]
        lp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        stats = _kernel(_chunk_stats, hidden.device)
        with _no_autocast(hidden):
            w = weight.to(dtype)
            for s in range(0, n, chunk):
                h = hidden[s : s + chunk].to(dtype)
                lp[s : s + chunk], lse[s : s + chunk], e = stats(h @ w.T, targets[s : s + chunk], scale, entropy)
                if entropy:
                    ent[s : s + chunk] = e
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.dtype, ctx.scale, ctx.chunk = dtype, scale, chunk
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, _grad_ent):  # type: ignore[override]
        hidden, weight, targets, lse = ctx.saved_tensors
        dtype, scale, chunk = ctx.dtype, ctx.scale, ctx.chunk
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad = _kernel(_chunk_grad, hidden.device)
        with _no_autocast(hidden):
            w = weight.to(dtype)
            for s in range(0, hidden.shape[0], chunk):
                h = hidden[s : s + chunk]
                logits = h.to(dtype) @ w.T
                d = grad(logits, targets[s : s + chunk], lse[s : s + chunk], grad_lp[s : s + chunk], scale, dtype)
                if grad_hidden is not None:
                    grad_hidden[s : s + chunk] = (d @ w).to(hidden.dtype)
                grad_weight += d.T @ h.to(dtype)  # promoted as it is added: no fp32 copy of the product
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None


def _chunk_stats(logits: torch.Tensor, targets: torch.Tensor, scale: float, entropy: bool):
    """(logprob of the target, logsumexp, entropy or None) of each row of a chunk's raw logits, in fp32."""
    z = logits.float()
    if scale != 1.0:
        z = z / scale
    lse = torch.logsumexp(z, -1)
    lp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    logp = z - lse[:, None]  # fused away on CUDA; H = −Σ p·log p (not lse − Σ p·z, which cancels when H is small)
    ent = -(torch.exp(logp) * logp).sum(-1) if entropy else None
    return lp, lse, ent


def _chunk_grad(logits, targets, lse, grad_lp, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """d loss / d raw logits of a chunk: grad · (onehot(target) − softmax) / temperature, in `dtype`."""
    z = logits.float()
    if scale != 1.0:
        z = z / scale
    onehot = torch.arange(z.shape[-1], device=z.device)[None, :] == targets[:, None]
    return ((onehot.to(z.dtype) - torch.exp(z - lse[:, None])) * (grad_lp / scale)[:, None]).to(dtype)


_COMPILED: dict = {}


def _kernel(fn, device: torch.device):
    """`fn` compiled into fused kernels on CUDA (each elementwise chain reads the chunk's logits once,
    with no fp32 copy of them); eager elsewhere, and wherever compiling fails."""
    if device.type != "cuda":
        return fn
    if fn not in _COMPILED:
        compiled = torch.compile(fn, dynamic=True)

        def call(*args):
            if _COMPILED.get(fn) is fn:  # compiling failed once: stay eager
                return fn(*args)
            try:
                return compiled(*args)
            except Exception as exc:  # an inductor/triton failure must not stop training
                _COMPILED[fn] = fn
                import structlog

                structlog.get_logger().warning("fused logprob kernels unavailable, eager fallback", error=str(exc))
                return fn(*args)

        _COMPILED[fn] = call
    return _COMPILED[fn]


def _no_autocast(t: torch.Tensor):
    kind = t.device.type
    if torch.is_autocast_enabled(kind):
        return torch.autocast(kind, enabled=False)
    return contextlib.nullcontext()
