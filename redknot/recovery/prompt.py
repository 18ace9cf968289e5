"""A composed prompt that reuses cached segments: its tokens, where each segment sits, and the
KV each segment was cached with (standalone, positions from 0).

Rows are positions in the composed prompt. Three kinds of rows, by how their KV is obtained:

| rows                         | KV                                                          |
| ---------------------------- | ----------------------------------------------------------- |
| ``[0, prefix_len)``          | an exact-prefix hit: cached KV, used as is by every policy  |
| ``[s, e)`` of each segment   | the segment's cached KV re-aligned to ``s`` (or recomputed) |
| every other row (new tokens) | computed by every policy                                    |

A segment cached standalone is an exact prefix when it starts the prompt:
:meth:`ReusePrompt.with_exact_prefix` turns such a segment into the prefix hit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from redknot.headmap import HeadMap
from redknot.reference import ReferenceKV, ReferenceRunner


@dataclass(frozen=True, eq=False)
class Segment:
    """Rows ``[start, end)`` of the prompt hold a cached segment; ``cache`` is its KV computed
    alone (``cache.length == end - start``, keys rotated to positions ``0 .. end - start - 1``)."""

    start: int
    end: int
    cache: ReferenceKV

    def __post_init__(self) -> None:
        assert 0 <= self.start < self.end, (self.start, self.end)
        assert self.cache.length == self.end - self.start, (self.cache.length, self.start)

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, eq=False)
class ReusePrompt:
    """``ids``: the composed prompt; ``segments``: ascending, disjoint, after the prefix;
    ``prefix``: KV of rows ``[0, prefix.length)`` from an exact-prefix hit, or ``None``."""

    ids: tuple[int, ...]
    segments: tuple[Segment, ...] = ()
    prefix: ReferenceKV | None = None
    _segment_rows: Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.prefix_len >= len(self.ids):
            raise ValueError(
                f"the prefix hit covers {self.prefix_len} of {len(self.ids)} tokens; at least "
                "one new token must follow it"
            )
        last = self.prefix_len
        for seg in self.segments:
            if seg.start < last or seg.end > len(self.ids):
                raise ValueError(
                    f"segment [{seg.start}, {seg.end}) overlaps the prefix hit or another "
                    f"segment, or ends past the prompt ({len(self.ids)} tokens)"
                )
            last = seg.end
        rows = [torch.arange(s.start, s.end) for s in self.segments]
        object.__setattr__(
            self, "_segment_rows", torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
        )

    @property
    def num_rows(self) -> int:
        return len(self.ids)

    @property
    def prefix_len(self) -> int:
        return 0 if self.prefix is None else self.prefix.length

    @property
    def num_segment_rows(self) -> int:
        return int(self._segment_rows.numel())

    @property
    def question_start(self) -> int:
        """First row after the last segment (the prefix end when there is none)."""
        return self.segments[-1].end if self.segments else self.prefix_len

    def segment_rows(self, device: torch.device | str = "cpu") -> Tensor:
        """``[S]`` int64 ascending rows of all segments."""
        return self._segment_rows.to(device)

    def is_segment_row(self, device: torch.device | str = "cpu") -> Tensor:
        """``[num_rows]`` bool: which rows belong to a segment."""
        mask = torch.zeros(self.num_rows, dtype=torch.bool)
        mask[self._segment_rows] = True
        return mask.to(device)

    def with_exact_prefix(self) -> ReusePrompt:
        """The same prompt with a segment that starts it served as an exact-prefix hit (its
        standalone KV is exactly the dense KV there, for every head)."""
        if self.prefix is None and self.segments and self.segments[0].start == 0:
            first = self.segments[0]
            if first.end == self.num_rows:
                return self  # nothing would be left to compute
            return ReusePrompt(self.ids, self.segments[1:], first.cache)
        return self

    def without_reuse(self) -> ReusePrompt:
        """The same tokens with nothing cached (dense prefill)."""
        return ReusePrompt(self.ids)


def cache_kv(
    runner: ReferenceRunner,
    ids: Sequence[int],
    head_map: HeadMap | None = None,
    context: Sequence[int] = (),
) -> ReferenceKV:
    """KV of ``ids`` computed alone from position 0 (a segment's or a prefix's cache entry),
    under ``head_map`` as the serving policy computes every prefill (``None``: dense). With a
    ``context``, ``ids`` are computed after it and only their rows are kept, their keys moved
    to positions from 0 (a segment captured after the tokens that preceded it)."""
    if not context:
        return runner.forward(list(ids), head_map=head_map, logits_rows="none").kv
    kv = runner.forward([*context, *ids], head_map=head_map, logits_rows="none").kv
    n = len(context)
    return kv.rows(n, n + len(ids)).realigned(runner.model.rope, n, 0)


def reused_mask(spans: Sequence[tuple[int, int]], num_rows: int, device=None) -> Tensor:
    """``[T]`` bool: rows inside one of the ``spans`` (``(start, end)`` rows, ascending)."""
    mask = torch.zeros(num_rows, dtype=torch.bool, device=device)
    for start, end in spans:
        mask[start:end] = True
    return mask
