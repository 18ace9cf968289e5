"""Documents' edges learned from repeats: ``--redknot-auto-segments cdc-edges``.

Content-defined chunks (``chunking.py``) lose the text at every document edge of an unmarked
prompt: the chunk that holds the end of one document and the start of the next recurs only when
the same two documents are adjacent again, so its tokens are never reused. Measured on a stream
of reordered RAG prompts (``benchmarks/auto_chunk_coverage.py --stream``, chunks of 256 tokens)
the store can serve 0.780 of the prompt tokens; with the edges below, 0.926.

The edges are learned, not marked. A chunk that straddles documents A and B ends at B's first
content-defined cut wherever B appears, and that cut depends only on the ``WINDOW`` tokens
before it; so two missed chunks that end in the same ``WINDOW`` tokens share B's head as their
longest common suffix (more, when their A's end alike). Likewise two missed chunks that start at
the same cut of A share A's tail as their longest common prefix. :class:`EdgeIndex` keeps the
recent missed chunks of each such key and, when a new miss shares a suffix (prefix) of at least
the shortest stored segment with one of them, and shorter than both, learns it as an *edge*:
the capture stores it as a segment of namespace ``auto`` (``redknot.api.capture``), and
:meth:`EdgeIndex.split` cuts later chunks that end (start) with a learned edge so that the edge
is a segment of its own. The rest of such a chunk stays a chunk piece, captured at its second
miss like any chunk.

Bounded: at most ``KEPT_PER_KEY`` missed chunks per key and ``MAX_KEYS`` keys (the least
recently used forgotten first), and the learned edges of ``MAX_KEYS`` keys.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

from redknot.api.chunking import WINDOW

KEPT_PER_KEY = 4  # missed chunks remembered per key
MAX_KEYS = 1 << 14  # keys remembered (missed chunks and learned edges, each)


def common_suffix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens ``a`` and ``b`` end with in common."""
    n = 0
    for x, y in zip(reversed(a), reversed(b)):
        if x != y:
            break
        n += 1
    return n


class _Side:
    """One side: heads (suffixes, keyed by a chunk's last ``WINDOW`` tokens) or, on reversed
    chunks, tails (prefixes, keyed by the first)."""

    def __init__(self) -> None:
        self.seen: OrderedDict[tuple[int, ...], list[tuple[int, ...]]] = OrderedDict()
        self.edges: OrderedDict[tuple[int, ...], set[tuple[int, ...]]] = OrderedDict()

    @staticmethod
    def _touch(table: OrderedDict, key: tuple[int, ...], default) -> object:
        value = table.pop(key, None)
        table[key] = default if value is None else value
        if len(table) > MAX_KEYS:
            table.popitem(last=False)
        return table[key]

    def learn(self, seq: tuple[int, ...], min_tokens: int) -> list[tuple[int, ...]]:
        """Edges newly learned from the missed ``seq`` (oriented: its end is the edge's end)."""
        key = seq[-WINDOW:]
        seen = self._touch(self.seen, key, [])
        known = self.edges.get(key, set())
        new = []
        for other in seen:
            n = common_suffix(seq, other)
            edge = seq[len(seq) - n :]
            if min_tokens <= n < min(len(seq), len(other)) and edge not in known:
                new.append(edge)
                known = known | {edge}
        if new:
            self._touch(self.edges, key, set()).update(new)
        seen.append(seq)
        del seen[:-KEPT_PER_KEY]
        return new

    def longest(self, seq: tuple[int, ...]) -> int:
        """The length of the longest learned edge ``seq`` ends with (0: none)."""
        edges = self.edges.get(seq[-WINDOW:], ())
        return max((len(e) for e in edges if seq[len(seq) - len(e) :] == e), default=0)


class EdgeIndex:
    """Documents' heads and tails learned from missed chunks (see the module docstring)."""

    def __init__(self) -> None:
        self.heads, self.tails = _Side(), _Side()

    def learn(self, chunk: Sequence[int], min_tokens: int) -> list[list[int]]:
        """The edges (token ids) newly learned from a missed chunk of an unmarked prompt."""
        ids = tuple(chunk)
        if len(ids) < WINDOW:
            return []
        heads = self.heads.learn(ids, min_tokens)
        tails = [t[::-1] for t in self.tails.learn(ids[::-1], min_tokens)]
        return [list(e) for e in heads + tails]

    def split(
        self, token_ids: Sequence[int], start: int, end: int, min_tokens: int
    ) -> list[tuple[int, int]]:
        """The chunk ``[start, end)`` of ``token_ids`` cut around the learned edges it starts
        and ends with; pieces shorter than ``min_tokens`` are dropped. Where both edges would
        overlap, the longer one."""
        if end - start < WINDOW:
            return [(start, end)]
        ids = tuple(token_ids[start:end])
        head, tail = self.heads.longest(ids), self.tails.longest(ids[::-1])
        if not head and not tail:
            return [(start, end)]
        if head + tail > len(ids):
            head, tail = (head, 0) if head >= tail else (0, tail)
        cuts = [start, start + tail, end - head, end]
        return [(a, b) for a, b in itertools.pairwise(cuts) if b - a >= min_tokens]
