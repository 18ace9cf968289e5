"""EPIC's LegoLink as a token-level policy (``epic``): recompute the first ``epic_k`` tokens of
every segment, in every layer, and the new text; every other segment token keeps its cached,
aligned KV in every head and computes nothing (EPIC, as described in RedKnot §2.1 and SparseX
§2.1: independently cached chunks each start with their own attention sink; recomputing a few
initial tokens of each chunk under the real prefix repairs it).

The first tokens are counted in each served segment (a segment served as an exact-prefix hit
needs nothing). ``epic_k`` at or above every segment's length is a dense prefill; 0 is naive
reuse.
"""

from __future__ import annotations

import torch
from torch import Tensor

from redknot.recovery.tokenwise import TokenRecovery
from redknot.reference import LayerContext


class Epic(TokenRecovery):
    """The ``epic`` policy; knob ``epic_k``."""

    name = "epic"
    knobs = ("epic_k",)

    def select(self, ctx: LayerContext, q: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        k = self.options.epic_k
        device = ctx.positions.device
        rows = [
            torch.arange(seg.start, min(seg.start + k, seg.end), device=device) - ctx.past_len
            for seg in self.served.segments
        ]
        return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64, device=device)
