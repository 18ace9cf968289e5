"""The KV of one sequence on the reference path: every layer, every KV head, every token.

Row ``j`` of every tensor is the token at position ``j`` of the sequence it was computed in,
its key already rotated to that position. Local heads keep all rows too (this is an oracle,
not a memory manager); the attention restricts what they see.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from redknot.reference.rope import Rope


@dataclass
class ReferenceKV:
    """``keys[l]`` and ``values[l]``: ``[num_kv_heads, T, head_dim]`` for every layer ``l``."""

    keys: list[Tensor]
    values: list[Tensor]

    def __post_init__(self) -> None:
        assert len(self.keys) == len(self.values), (len(self.keys), len(self.values))
        lengths = {k.shape[1] for k in self.keys} | {v.shape[1] for v in self.values}
        assert len(lengths) <= 1, f"every layer must hold the same tokens: {lengths}"

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def length(self) -> int:
        return self.keys[0].shape[1] if self.keys else 0

    def rows(self, start: int, end: int) -> ReferenceKV:
        """Rows ``[start, end)``; their keys stay rotated to their original positions."""
        return ReferenceKV(
            [k[:, start:end] for k in self.keys], [v[:, start:end] for v in self.values]
        )

    def realigned(self, rope: Rope, from_start: int, to_start: int) -> ReferenceKV:
        """The same KV with keys moved from positions ``from_start + i`` to ``to_start + i``."""
        n = self.length
        device = self.keys[0].device
        src = torch.arange(from_start, from_start + n, device=device)
        dst = torch.arange(to_start, to_start + n, device=device)
        return ReferenceKV([rope.realign(k, src, dst) for k in self.keys], list(self.values))

    @staticmethod
    def concat(parts: list[ReferenceKV]) -> ReferenceKV:
        """Rows of ``parts`` one after the other (positions are not changed)."""
        num_layers = parts[0].num_layers
        return ReferenceKV(
            [torch.cat([p.keys[l] for p in parts], dim=1) for l in range(num_layers)],
            [torch.cat([p.values[l] for p in parts], dim=1) for l in range(num_layers)],
        )
