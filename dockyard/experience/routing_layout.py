"""How a mixture-of-experts policy's routing is laid out in bytes (numpy only: the buffer imports it).

    [positions, moe_layers, top_k] expert ids ──to_bytes──> row-major bytes, uint8 (<= 256 experts) or
        little-endian uint16 ──from_bytes──> the same array (a view of the bytes)

Guarantees: `to_bytes` and `from_bytes` are exact inverses for ids below `num_experts`; the dtype
depends only on the number of experts, so engine, payload and trainer agree without asking.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RoutingShape:
    """What one position's routing holds: `moe_layers` × `top_k` expert ids out of `num_experts`."""

    moe_layers: int
    top_k: int
    num_experts: int

    @property
    def dtype(self) -> np.dtype:
        return routing_dtype(self.num_experts)

    @property
    def bytes_per_position(self) -> int:
        return self.moe_layers * self.top_k * self.dtype.itemsize


def routing_dtype(num_experts: int) -> np.dtype:
    """uint8 while every expert id fits a byte, else little-endian uint16."""
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype("<u2")


def to_bytes(routing: np.ndarray, shape: RoutingShape) -> bytes:
    """[positions, moe_layers, k] expert ids as the wire carries them (row-major, the shape's dtype)."""
    return np.ascontiguousarray(routing, dtype=shape.dtype).tobytes()


def from_bytes(data: bytes, shape: RoutingShape) -> np.ndarray:
    """The [positions, moe_layers, k] array of `to_bytes`; ValueError when the length is no whole position."""
    per = shape.bytes_per_position
    if per == 0 or len(data) % per:
        raise ValueError(f"routing of {len(data)} bytes is not a whole number of positions of {per} bytes")
    return np.frombuffer(data, dtype=shape.dtype).reshape(-1, shape.moe_layers, shape.top_k)
