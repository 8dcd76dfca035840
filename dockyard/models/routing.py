"""Expert routing of mixture-of-experts policies: captured at generation, replayed in training (R3).

    engine forward ──RoutingRecorder (a forward hook per router)──> [tokens, moe_layers, k] expert ids,
        ascending per position ──to_bytes (uint8, or uint16 past 256 experts)──> GenerateResponse / payload
    trainer forward ──RoutingReplay(routing [B, S, moe_layers, k], -1 = not recorded)──> per router:
        the engine's experts where recorded (replay on) or its own top-k, weights recomputed from the
        trainer's router logits ──> the experts' forward;  mismatches counted either way

What is replayed, and what gets a gradient: only the *choice* of experts is taken from the engine.
Each chosen expert's weight is recomputed from the trainer's own router logits exactly as the model's
router computes it (softmax over every expert in float32, gathered at the chosen ids, renormalised
over the k chosen when the router renormalises: always for Mixtral, with `norm_topk_prob` for
Qwen3-MoE), so the router (gate) weights get the gradient the model's own forward gives them, through
the weights of the replayed experts; the experts get the gradient of the tokens routed to them. The
top-k selection has no gradient in either case.

Guarantees:
- Routers are found by structure (a module whose class name ends in `TopKRouter` with `top_k`), in
  `named_modules` order, so the engine and the trainer number the MoE layers alike for one model
  class, whatever the weights (a refit changes values, never the layer order or the expert ids).
- A capture holds, per position a forward ran and per MoE layer, the k chosen expert ids, ascending,
  in the wire's dtype (dockyard/experience/routing_layout.py: uint8 up to 256 experts, else uint16).
- Replay with no routing given (None), or at positions holding -1, leaves the model's own choice; a
  replay of the model's own choice changes outputs only by the order of the k experts' sum.
- `mismatch` counts, over recorded positions and MoE layers, the decisions where the model's own top-k
  set differs from the recorded one, whether the recorded one is replayed or not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from dockyard.experience.routing_layout import RoutingShape

NOT_RECORDED = -1  # a position of a replayed batch without recorded routing (padding, the last token)


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's top-k routers, one per MoE layer, in layer order; empty for a dense model."""
    return [m for _, m in model.named_modules() if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k")]


def routing_shape(model: torch.nn.Module) -> RoutingShape | None:
    """The routing shape of `model`'s forward, None for a dense model."""
    found = routers(model)
    if not found:
        return None
    return RoutingShape(len(found), int(found[0].top_k), int(found[0].num_experts))


class RoutingRecorder:
    """Forward hooks on a model's routers that, inside `recording()`, keep each forward's expert ids."""

    def __init__(self, model: torch.nn.Module) -> None:
        found = routers(model)
        self.shape = routing_shape(model)
        self._layers: list[torch.Tensor] | None = None
        self._handles = [r.register_forward_hook(self._hook) for r in found]

    def _hook(self, _module: torch.nn.Module, _args: Any, output: Any) -> None:
        if self._layers is not None:
            self._layers.append(output[2].sort(dim=-1).values)

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[torch.Tensor]]:
        """Within: each router's [tokens, k] ids, appended as the forward runs (one forward at a time)."""
        self._layers = layers = []
        try:
            yield layers
        finally:
            self._layers = None

    def stacked(self, layers: list[torch.Tensor]) -> torch.Tensor | None:
        """A forward's routing as [tokens, moe_layers, k] in the wire dtype (on the model's device); None if dense."""
        if self.shape is None or not layers:
            return None
        dtype = torch.uint8 if self.shape.dtype == np.uint8 else torch.int16
        return torch.stack(layers, dim=1).to(dtype)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def as_numpy(routing: torch.Tensor, shape: RoutingShape) -> np.ndarray:
    """A captured tensor on the host in the wire dtype (int16 holds uint16 ids bit for bit)."""
    return routing.cpu().numpy().view(shape.dtype)


class RoutingReplay:
    """Forward hooks on a model's routers: replay recorded expert ids (or not) and count mismatches."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._routers = routers(model)
        self._routing: torch.Tensor | None = None  # [tokens, moe_layers, k] int64, NOT_RECORDED where none
        self._replay = False
        # (position, layer) decisions that differ from the recorded ones, and those compared: summed on the
        # device, read once per take_counts (no host sync per router call).
        self._counts: torch.Tensor | None = None
        self._layer: dict[int, int] = {id(r): i for i, r in enumerate(self._routers)}
        self._handles = [r.register_forward_hook(self._hook) for r in self._routers]

    @property
    def active(self) -> bool:
        return bool(self._routers)

    @contextlib.contextmanager
    def applied(self, routing: torch.Tensor | None, replay: bool) -> Iterator[None]:
        """Within: forwards see `routing` ([B, S, moe_layers, k], the batch's layout; None: nothing recorded)."""
        self._routing = None if routing is None else routing.reshape(-1, *routing.shape[2:]).long()
        self._replay = replay
        try:
            yield
        finally:
            self._routing = None

    def take_counts(self) -> tuple[int, int]:
        """(mismatched, decisions) since the last call."""
        if self._counts is None:
            return 0, 0
        mismatched, decisions = self._counts.tolist()
        self._counts = None
        return int(mismatched), int(decisions)

    def _hook(self, module: torch.nn.Module, _args: Any, output: Any) -> Any:
        if self._routing is None:
            return None
        logits, scores, own = output
        recorded = self._routing[:, self._layer[id(module)]].to(own.device)
        if recorded.shape[0] != own.shape[0]:  # an idle pass, or a forward of another batch: leave it
            return None
        where = recorded[:, 0] >= 0
        with torch.no_grad():
            differs = (own.sort(dim=-1).values != recorded).any(-1) & where
            counts = torch.stack([differs.sum(), where.sum()])
            self._counts = counts if self._counts is None else self._counts + counts
        if not self._replay:
            return None
        chosen = torch.where(where[:, None], recorded, own)
        probs = torch.softmax(logits.float(), dim=-1)
        weights = probs.gather(-1, chosen)
        if getattr(module, "norm_topk_prob", True):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(scores.dtype), chosen

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
