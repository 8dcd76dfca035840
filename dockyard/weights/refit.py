"""The one refit function: the trainer's tensor names and shapes mapped onto the engine's.

    trainer names (FSDP / compile / DDP wrappers) ──canonical_name──> checkpoint names
    checkpoint names + shapes ──refit_plan(engine layout)──> the engine tensor each one loads into

Guarantees: every transport (weight-sync group, checkpoint folder) goes through
`refit_plan`, so a name or shape the engine does not have, or an engine
tensor the trainer does not send, is a RefitError that names the tensors at
fault before any byte is loaded. Dtypes may differ: the receiver casts on
load (a float32 trainer feeds a bfloat16 engine). An engine that loads by
checkpoint name itself (vLLM's `load_weights` fuses q/k/v) passes no layout
and receives the canonical names unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Wrapper segments that training-time wrappers insert into parameter names.
_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module", "_orig_mod", "_checkpoint_wrapped_module", "module")


class RefitError(ValueError):
    """The trainer's tensors do not map onto the engine's; the message names them."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))

    def to_json(self) -> list:
        return [self.name, list(self.shape), self.dtype]

    @classmethod
    def from_json(cls, item: list) -> TensorSpec:
        name, shape, dtype = item
        if not hasattr(torch, dtype) or not isinstance(getattr(torch, dtype), torch.dtype):
            raise RefitError(f"tensor {name}: unknown dtype {dtype!r}")
        return cls(str(name), tuple(int(d) for d in shape), str(dtype))


def canonical_name(name: str) -> str:
    """The checkpoint name of a parameter, wrapper segments removed ("module.model.x" -> "model.x")."""
    parts = [p for p in name.split(".") if p not in _WRAPPER_SEGMENTS]
    return ".".join(parts)


def refit_plan(sent: list[TensorSpec], engine: dict[str, TensorSpec] | None) -> list[str]:
    """The engine name each sent tensor loads into, in sent order; RefitError if they do not map one to one.

    `engine` is the engine's layout by name, or None when the engine loads by
    checkpoint name itself (then the canonical names come back unchanged).
    """
    targets = [canonical_name(spec.name) for spec in sent]
    seen: set[str] = set()
    duplicates = [t for t in targets if t in seen or seen.add(t)]  # type: ignore[func-returns-value]
    if duplicates:
        raise RefitError(f"weight layouts differ: the trainer sends {duplicates[:3]} more than once")
    if engine is None:
        return targets
    unknown = [t for t in targets if t not in engine]
    missing = [name for name in engine if name not in seen]
    shapes = [
        f"{t}: trainer {list(spec.shape)} vs engine {list(engine[t].shape)}"
        for spec, t in zip(sent, targets, strict=True)
        if t in engine and spec.shape != engine[t].shape
    ]
    problems = []
    if unknown:
        problems.append(f"{len(unknown)} trainer tensors the engine lacks (e.g. {unknown[:3]})")
    if missing:
        problems.append(f"{len(missing)} engine tensors the trainer does not send (e.g. {missing[:3]})")
    if shapes:
        problems.append(f"{len(shapes)} shape mismatches (e.g. {shapes[:3]})")
    if problems:
        raise RefitError(
            "weight layouts differ between the trainer and the engine (tensor names, shapes): " + "; ".join(problems)
        )
    return targets
