"""The segment region of the pool: per-token K/V of cached segments, for a chosen set of heads.

A cached segment is computed once, standalone (positions from 0), and its K/V is kept here for
every one of its tokens, for the heads the served policies read back:

| ``segment_heads`` | heads kept per layer      | who reads them                                  |
| ----------------- | ------------------------- | ----------------------------------------------- |
| ``local``         | the layer's local heads   | RedKnot recovery (global heads are recomputed)  |
| ``all``           | every KV head             | token-level policies (naive, CacheBlend, EPIC)  |

The region is paged: ``num_pages`` pages of ``page_tokens`` rows each. Per layer ``l`` with
``S_l`` stored heads:

| buffer          | shape                                    | row index                          |
| --------------- | ---------------------------------------- | ---------------------------------- |
| ``k[l]``/``v[l]`` | ``[num_pages * page_tokens, S_l, D]``  | ``page * page_tokens + offset``    |

Token ``i`` of a segment whose pages are ``(p_0, p_1, ...)`` lives at row
``p_{i // page_tokens} * page_tokens + i % page_tokens`` (``SegmentEntry.rows()``). Which pages a
segment owns is decided by the scheduler-side ``redknot.segcache.store.SegmentStore``.

Memory comes out of the KV budget SGLang profiles (``redknot.pool.sizing``):
``reserved = fraction * budget``, rounded down to whole pages of the largest per-token cost of any
tensor-parallel rank, so that every rank has the same number of pages and its store makes the
same allocation and eviction decisions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from redknot.config import SEGMENT_HEAD_CHOICES
from redknot.pool.layout import HeadLayout

DEFAULT_PAGE_TOKENS = 16


def stored_heads(layout: HeadLayout, which: str) -> tuple[tuple[int, ...], ...]:
    """Per layer, the rank-local KV heads a cached segment keeps (``which``: local or all)."""
    if which not in SEGMENT_HEAD_CHOICES:
        raise ValueError(f"segment heads {which!r} is not one of {SEGMENT_HEAD_CHOICES}")
    if which == "all":
        return tuple(tuple(range(layout.num_kv_heads)) for _ in range(layout.num_layers))
    return tuple(tuple(layout.local_heads(layer)) for layer in range(layout.num_layers))


def bytes_per_segment_token(layout: HeadLayout, dtype: torch.dtype, which: str) -> int:
    """Bytes (K and V, every layer of this rank) one cached segment token costs."""
    heads = sum(len(h) for h in stored_heads(layout, which))
    return 2 * heads * layout.head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class SegmentPlan:
    which: str  # 'local' or 'all' (SEGMENT_HEAD_CHOICES)
    num_pages: int  # 0: no segment region, segment caching is off
    page_tokens: int
    reserved_bytes: int  # taken from the KV budget; the same on every TP rank

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_tokens


def plan_segments(
    rank_layouts: list[HeadLayout],
    dtype: torch.dtype,
    budget_bytes: int,
    fraction: float,
    which: str,
    page_tokens: int = DEFAULT_PAGE_TOKENS,
) -> SegmentPlan:
    """Size the region: ``fraction`` of ``budget_bytes`` in whole pages (see module docstring).

    ``rank_layouts``: the head layout of every tensor-parallel rank (one entry without TP).
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"segment fraction must be in [0, 1), got {fraction}")
    per_token = max(bytes_per_segment_token(lay, dtype, which) for lay in rank_layouts)
    if per_token == 0 or fraction == 0.0:
        return SegmentPlan(which=which, num_pages=0, page_tokens=page_tokens, reserved_bytes=0)
    page_bytes = per_token * page_tokens
    num_pages = int(budget_bytes * fraction) // page_bytes
    return SegmentPlan(
        which=which,
        num_pages=num_pages,
        page_tokens=page_tokens,
        reserved_bytes=num_pages * page_bytes,
    )


class SegmentRegion:
    """The K/V buffers of the segment region (layout in the module docstring)."""

    def __init__(
        self, layout: HeadLayout, plan: SegmentPlan, dtype: torch.dtype, device: str
    ) -> None:
        assert plan.num_pages > 0, "a region without pages is not built"
        self.layout = layout
        self.which = plan.which
        self.num_pages = plan.num_pages
        self.page_tokens = plan.page_tokens
        self.dtype = dtype
        self.heads = stored_heads(layout, plan.which)
        self.head_index = [torch.tensor(h, dtype=torch.long, device=device) for h in self.heads]
        rows, d = plan.capacity_tokens, layout.head_dim
        self.k = [torch.zeros((rows, len(h), d), dtype=dtype, device=device) for h in self.heads]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.bytes_per_token = bytes_per_segment_token(layout, dtype, plan.which)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(self, layer_id: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a segment's K/V at ``rows`` (int64 [T]); ``k``, ``v``: [T, H_kv, D], all heads."""
        if not self.heads[layer_id]:
            return
        if len(self.heads[layer_id]) != k.shape[1]:
            idx = self.head_index[layer_id]
            k, v = k.index_select(1, idx), v.index_select(1, idx)
        self.k[layer_id][rows] = k.to(self.dtype)
        self.v[layer_id][rows] = v.to(self.dtype)

    def read(self, layer_id: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the stored heads at ``rows``: two [T, S_l, D] tensors (a copy)."""
        return self.k[layer_id][rows], self.v[layer_id][rows]
