"""Per-rank head layout: for every layer, which rank-local KV heads are global and which local,
and where each head's KV lives in its store.

Invariants (rank-local head indices ``h`` in ``[0, num_kv_heads)``):

| table            | shape                     | meaning                                        |
| ---------------- | ------------------------- | ---------------------------------------------- |
| ``is_local``     | [num_layers, num_kv_heads] | 1 if head ``h`` of layer ``l`` is local       |
| ``column``       | [num_layers, num_kv_heads] | column of ``h`` in its store (global or local) |
| ``order``        | [num_layers, num_kv_heads] | heads of the layer, global ones first          |

A global head ``h`` of layer ``l`` is column ``column[l, h]`` of that layer's global store,
which has ``num_global(l)`` columns, then ``restore`` restore columns (adaptive restore: the
local heads a request promotes keep every token's K/V there, see
``redknot.kernels.extend.run_extend``); likewise for local heads and the local store.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from redknot.headmap import GLOBAL, HeadMap


@dataclass(frozen=True)
class HeadLayout:
    classes: tuple[str, ...]  # per layer, one 'G'/'L' per rank-local KV head
    num_q_heads: int  # rank-local query heads
    head_dim: int
    window: int
    sink: int
    restore: int = 0  # restore columns per layer in the global store (0: adaptive restore off)

    def __post_init__(self) -> None:
        widths = {len(row) for row in self.classes}
        assert len(widths) == 1, f"every layer must list the same number of KV heads: {widths}"
        assert self.num_q_heads % self.num_kv_heads == 0, (self.num_q_heads, self.num_kv_heads)

    @classmethod
    def from_head_map(
        cls, head_map: HeadMap, *, tp_size: int = 1, tp_rank: int = 0, restore: int = 0
    ) -> HeadLayout:
        num_q = head_map.model.num_attention_heads
        assert num_q % tp_size == 0, f"{num_q} query heads cannot be split over --tp {tp_size}"
        return cls(
            classes=head_map.classes_of_rank(tp_size, tp_rank),
            num_q_heads=num_q // tp_size,
            head_dim=head_map.model.head_dim,
            window=head_map.window,
            sink=head_map.sink,
            restore=restore,
        )

    @property
    def num_layers(self) -> int:
        return len(self.classes)

    @property
    def num_kv_heads(self) -> int:
        return len(self.classes[0])

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def global_heads(self, layer: int) -> list[int]:
        return [h for h, c in enumerate(self.classes[layer]) if c == GLOBAL]

    def local_heads(self, layer: int) -> list[int]:
        return [h for h, c in enumerate(self.classes[layer]) if c != GLOBAL]

    def num_global(self, layer: int) -> int:
        return self.classes[layer].count(GLOBAL)

    def num_local(self, layer: int) -> int:
        return self.num_kv_heads - self.num_global(layer)

    def global_columns(self, layer: int) -> int:
        """Columns of the layer's global store: its global heads, then the restore columns."""
        return self.num_global(layer) + self.restore

    @cached_property
    def all_global(self) -> bool:
        return all(self.num_local(layer) == 0 for layer in range(self.num_layers))

    @cached_property
    def local_span(self) -> int:
        """Most key positions a local head of a long sequence attends: ``sink + window``."""
        return self.sink + self.window

    def tables(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        """The int32 tables of the module docstring, on ``device``."""
        is_local, column, order = [], [], []
        for layer in range(self.num_layers):
            g, loc = self.global_heads(layer), self.local_heads(layer)
            col = [0] * self.num_kv_heads
            for i, h in enumerate(g):
                col[h] = i
            for i, h in enumerate(loc):
                col[h] = i
            is_local.append([int(h in loc) for h in range(self.num_kv_heads)])
            column.append(col)
            order.append(g + loc)
        as_t = lambda x: torch.tensor(x, dtype=torch.int32, device=device)
        return {"is_local": as_t(is_local), "column": as_t(column), "order": as_t(order)}
