"""The trainer's ranks: FSDP2 sharding of a policy, its full state, the small all-reduces every rank joins.

    torch.distributed initialised (torchrun)? ── no ──> rank 0 of 1: nothing sharded, nothing reduced
                          │ yes
                          └─> fully_shard(each decoder layer), then fully_shard(root), for the
                              policy and the reference; max / sum over ranks by all_reduce;
                              full state dicts gathered to CPU for a checkpoint, and scattered back

Guarantees: with one rank no function here touches a process group; with
several, every function but `world` is a collective that every rank must call
in the same order. `full_state` gives unsharded, CPU tensors keyed as an
unsharded model's, so a checkpoint does not depend on the world size. Under a mixed-precision policy the parameters stay
in their own dtype, FSDP gathers them in the compute dtype and reduces
gradients in fp32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def world() -> tuple[int, int]:
    """(this rank, number of ranks)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shard(models: list[torch.nn.Module], compute_dtype: torch.dtype | None) -> None:
    """fully_shard each model per decoder layer (its `_no_split_modules`), then the root.

    `compute_dtype`: gather parameters in this dtype (reducing in fp32); None keeps their own.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {}
    if compute_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for model in models:
        blocks = set(getattr(model, "_no_split_modules", None) or ())
        for module in model.modules():
            if type(module).__name__ in blocks:
                fully_shard(module, **kwargs)
        fully_shard(model, **kwargs)


def max_over_ranks(value: int, world_size: int) -> int:
    if world_size == 1:
        return value
    n = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    return int(n)


def extremes_over_ranks(low: float, high: float, world_size: int) -> tuple[float, float]:
    """(the least `low`, the greatest `high`) over the ranks."""
    if world_size == 1:
        return low, high
    both = torch.tensor([-low, high], dtype=torch.float64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return -float(both[0]), float(both[1])


def sum_over_ranks(values: list[float], world_size: int) -> list[float]:
    if world_size == 1:
        return values
    totals = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(totals)
    return totals.tolist()


def full_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, world_size: int
) -> tuple[dict[str, Any], dict[str, Any], list[Any]]:
    """(model state, optimizer state keyed by parameter name, every rank's torch RNG state), on CPU."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if world_size == 1:
        model_state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        return model_state, get_optimizer_state_dict(model, optimizer, options=options), rng_states(1)
    model_state = get_model_state_dict(model, options=options)
    optim_state = get_optimizer_state_dict(model, optimizer, options=options)
    return model_state, optim_state, rng_states(world_size)


def rng_states(world_size: int) -> list[Any]:
    """Every rank's torch RNG state, in rank order (a collective when world_size > 1)."""
    if world_size == 1:
        return [torch.get_rng_state()]
    states: list[Any] = [None] * world_size
    dist.all_gather_object(states, torch.get_rng_state())
    return states


def load_full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """The inverse of `full_state`'s optimizer part: each rank keeps its shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=StateDictOptions(full_state_dict=True))
