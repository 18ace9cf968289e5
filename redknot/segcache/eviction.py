"""Which cached segments to evict when a new one needs room (the segment store's rule).

Eviction happens only when a registration needs more pages than are free. Candidates are the
unpinned segments that no live request references. Then:

1. Walk the candidates from least to most recently used, taking each, until the taken ones
   free at least the missing pages. If all candidates together cannot, evict nothing (the
   store raises ``SegmentStoreFull``).
2. Spare every taken segment but the last, most recently used first, whose pages the others
   already cover: an old large segment does not take smaller ones with it.

Recency orders the victims and size decides how many go. A miss costs recomputing the segment
and a segment holds memory, both in proportion to its tokens, so the value per byte is the
same at every size and GreedyDual-Size reduces to this LRU walk.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar


class Evictable(Protocol):
    pages: tuple[int, ...]
    pinned: bool
    refs: int


T = TypeVar("T", bound=Evictable)


def choose_victims(by_recency: Iterable[T], short: int) -> list[T] | None:
    """Victims freeing at least ``short`` pages, or None if no choice can.

    ``by_recency``: cached segments, least recently used first.
    """
    victims: list[T] = []
    freed = 0
    for seg in by_recency:
        if freed >= short:
            break
        if not seg.pinned and seg.refs == 0:
            victims.append(seg)
            freed += len(seg.pages)
    if freed < short:
        return None
    for seg in reversed(victims[:-1]):
        if freed - len(seg.pages) >= short:
            victims.remove(seg)
            freed -= len(seg.pages)
    return victims
