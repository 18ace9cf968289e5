"""Event counters of the segment store, in total and per namespace (bounded).

Namespaces come from clients, so per-namespace counters are kept for at most
``MAX_TRACKED_NAMESPACES`` namespaces: beyond it, the counters of the least recently counted
namespace that holds no segment are dropped (lookups of arbitrary namespaces must not grow the
scheduler's memory without bound). Totals always count everything.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass

MAX_TRACKED_NAMESPACES = 1024


@dataclass
class Counts:
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    bytes_saved: int = 0
    evictions: int = 0
    captures: int = 0  # segments stored by a capture on miss
    deletes: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class Counters:
    def __init__(self, holds_segments: Callable[[str], bool]) -> None:
        self.total = Counts()
        self._holds_segments = holds_segments
        self._by_namespace: OrderedDict[str, Counts] = OrderedDict()

    def add(self, namespace: str, **deltas: int) -> None:
        """Add ``deltas`` (fields of ``Counts``) to the namespace's counters and the totals."""
        own = self.track(namespace)
        for name, value in deltas.items():
            setattr(self.total, name, getattr(self.total, name) + value)
            setattr(own, name, getattr(own, name) + value)

    def track(self, namespace: str) -> Counts:
        """The namespace's counters, created if needed (possibly dropping an idle namespace's)."""
        counts = self._by_namespace.get(namespace)
        if counts is not None:
            self._by_namespace.move_to_end(namespace)
            return counts
        if len(self._by_namespace) >= MAX_TRACKED_NAMESPACES:
            for ns in self._by_namespace:
                if not self._holds_segments(ns):
                    del self._by_namespace[ns]
                    break
        counts = self._by_namespace[namespace] = Counts()
        return counts

    def of(self, namespace: str | None) -> Counts:
        """Counters of ``namespace`` (zeros if untracked), or the totals for None."""
        if namespace is None:
            return self.total
        return self._by_namespace.get(namespace, Counts())

    def __len__(self) -> int:
        return len(self._by_namespace)

    def __contains__(self, namespace: str) -> bool:
        return namespace in self._by_namespace
