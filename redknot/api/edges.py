"""Documents' edges learned from repeats: ``--redknot-auto-segments cdc-edges``.

Content-defined chunks (``chunking.py``) lose the text at every document edge of an unmarked
prompt: the chunk that holds the end of one document and the start of the next recurs only when
the same two documents are adjacent again, so its tokens are never reused. Measured on a stream
of reordered RAG prompts (``benchmarks/auto_chunk_coverage.py --stream``, chunks of 256 tokens)
the store can serve 0.780 of the prompt tokens; with the edges below, 0.922 (and the replayed
RAG traffic of ``benchmarks/trace_replay.py`` on the CPU stand-in reuses 0.927 instead of 0.800).

The edges are learned, not marked. A chunk that straddles documents A and B ends at B's first
content-defined cut wherever B appears, and that cut depends only on the ``WINDOW`` tokens
before it; so two missed chunks that end in the same ``WINDOW`` tokens share B's head as their
longest common suffix (more, when their A's end alike). Likewise two missed chunks that start at
the same cut of A share A's tail as their longest common prefix. :class:`EdgeIndex` keeps the
recent missed chunks of each such key and, when a new miss shares a suffix (prefix) of at least
the shortest stored segment with one of them, and shorter than both, learns it as an *edge*:
the capture stores it as a segment of namespace ``auto`` (``redknot.api.capture``), and
:meth:`EdgeIndex.pieces` cuts later chunks that end (start) with a learned edge so that the edge
is a segment of its own. The rest of such a chunk stays a chunk piece, captured at its second
miss like any chunk.

An edge is at least ``WINDOW`` tokens long: a shorter one's key holds tokens before it, so it
would be found again only after the same predecessor. Under ``cdc-docs`` the learned edges'
first (heads) and last (tails) ``WINDOW`` tokens are also looked for anywhere in a prompt
(:meth:`EdgeIndex.boundaries`: a document's first content-defined cut moves with what precedes
it, so its head is not always a chunk's end), and :func:`documents` pairs a head's start with
the end of the tail that follows it: the document between them, one segment. Such boundaries
are learned from ``WINDOW`` tokens up, shorter than a stored segment may be.

Bounded: at most ``KEPT_PER_KEY`` missed chunks per key and ``MAX_KEYS`` keys per side (the
least recently used forgotten first), the learned edges of ``MAX_KEYS`` keys, and the windows of
``MAX_KEYS`` boundary hashes per side; tokens are kept as int32 arrays.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from redknot.api.chunking import WINDOW, rolling_hash

KEPT_PER_KEY = 2  # missed chunks remembered per key
MAX_KEYS = 1 << 12  # keys remembered (missed chunks and learned edges, each side)
# memory: at most 2 sides x MAX_KEYS x KEPT_PER_KEY chunks of at most 4 N int32 tokens
# (about 16 MB at N = 256), plus the learned edges


def common_suffix(a: np.ndarray, b: np.ndarray) -> int:
    """How many tokens ``a`` and ``b`` end with in common."""
    m = min(len(a), len(b))
    differ = np.flatnonzero(a[len(a) - m :][::-1] != b[len(b) - m :][::-1])
    return int(differ[0]) if len(differ) else m


def _touch(table: OrderedDict, key, default) -> object:
    """``table[key]`` (``default`` when absent) made the most recent; the least recently used
    entry forgotten beyond ``MAX_KEYS``."""
    value = table.pop(key, None)
    table[key] = default if value is None else value
    if len(table) > MAX_KEYS:
        table.popitem(last=False)
    return table[key]


def _key(seq: np.ndarray) -> bytes:
    return seq[-WINDOW:].tobytes()


class _Side:
    """One side: heads (suffixes, keyed by a chunk's last ``WINDOW`` tokens) or, on reversed
    chunks, tails (prefixes, keyed by the first)."""

    def __init__(self) -> None:
        self.seen: OrderedDict[bytes, list[np.ndarray]] = OrderedDict()
        self.edges: OrderedDict[bytes, set[bytes]] = OrderedDict()  # edges as int32 bytes

    def learn(self, seq: np.ndarray, min_tokens: int) -> list[np.ndarray]:
        """Edges of ``min_tokens`` or more (and at least ``WINDOW``) newly learned from the
        missed ``seq`` (oriented: its end is the edge's end)."""
        key = _key(seq)
        seen = _touch(self.seen, key, [])
        known = set(self.edges.get(key, ()))
        new = []
        for other in seen:
            n = common_suffix(seq, other)
            edge = seq[len(seq) - n :]
            if (
                max(min_tokens, WINDOW) <= n < min(len(seq), len(other))
                and edge.tobytes() not in known
            ):
                new.append(edge)
                known.add(edge.tobytes())
        if new:
            _touch(self.edges, key, set()).update(e.tobytes() for e in new)
        seen.append(seq)
        del seen[:-KEPT_PER_KEY]
        return new

    def longest(self, seq: np.ndarray) -> int:
        """The length of the longest learned edge ``seq`` ends with (0: none)."""
        tail = seq.tobytes()
        edges = self.edges.get(_key(seq), ())
        return max((len(e) // 4 for e in edges if tail.endswith(e)), default=0)


class EdgeIndex:
    """Documents' heads and tails learned from missed chunks (see the module docstring)."""

    def __init__(self) -> None:
        self.heads, self.tails = _Side(), _Side()
        # the first WINDOW tokens of learned heads and the last of learned tails, by their
        # rolling hash: where documents start and end, found by content (cdc-docs)
        self.starts: OrderedDict[int, set[bytes]] = OrderedDict()
        self.ends: OrderedDict[int, set[bytes]] = OrderedDict()

    def learn(
        self, chunk: Sequence[int], min_tokens: int, boundary_tokens: int | None = None
    ) -> list[list[int]]:
        """The edges (token ids) of ``min_tokens`` or more newly learned from a missed chunk of
        an unmarked prompt. ``boundary_tokens`` (``cdc-docs``): edges from that length up are
        learned too, as documents' boundaries (:meth:`boundaries`); only those of
        ``min_tokens`` or more are returned (to be stored as segments)."""
        ids = np.asarray(chunk, dtype=np.int32)
        if len(ids) < WINDOW:
            return []
        least = min(min_tokens, boundary_tokens or min_tokens)
        heads = self.heads.learn(ids, least)
        tails = [t[::-1] for t in self.tails.learn(ids[::-1].copy(), least)]
        for head in heads:
            _touch(self.starts, int(rolling_hash(head[:WINDOW])[-1]), set()).add(
                head[:WINDOW].tobytes()
            )
        for tail in tails:
            _touch(self.ends, int(rolling_hash(tail[-WINDOW:])[-1]), set()).add(
                tail[-WINDOW:].tobytes()
            )
        return [e.tolist() for e in heads + tails if len(e) >= min_tokens]

    def boundaries(
        self, token_ids: Sequence[int] | np.ndarray, h: np.ndarray | None = None
    ) -> tuple[list[int], list[int]]:
        """Where learned heads start and learned tails end in ``token_ids`` (offsets,
        ascending), found by content wherever the chunks fall: the rolling hash of every
        ``WINDOW`` tokens against those of the learned edges' first (last) ``WINDOW`` tokens,
        then the tokens compared (``h``: the sequence's :func:`rolling_hash` when the caller
        has it)."""
        if not (self.starts or self.ends) or len(token_ids) < WINDOW:
            return [], []
        ids = np.asarray(token_ids, dtype=np.int32)
        h = rolling_hash(ids) if h is None else h

        def found(table: OrderedDict[int, set[bytes]]) -> list[int]:
            keys = np.fromiter(table, dtype=np.uint64, count=len(table))
            windows = h[WINDOW - 1 :]  # the hash of every window [e - W, e)
            # np.isin on the windows whose low 16 bits some key has (it sorts what it gets:
            # on all of a 13K-token prompt's windows it took 1.1 ms, this 0.14)
            low = np.zeros(1 << 16, dtype=bool)
            low[(keys & np.uint64(0xFFFF)).astype(np.intp)] = True
            maybe = np.flatnonzero(low[(windows & np.uint64(0xFFFF)).astype(np.intp)])
            ends = maybe[np.isin(windows[maybe], keys)] + WINDOW
            return [int(e) for e in ends if ids[e - WINDOW : e].tobytes() in table[int(h[e - 1])]]

        starts = [e - WINDOW for e in found(self.starts)] if self.starts else []
        return starts, found(self.ends) if self.ends else []

    def pieces(
        self, token_ids: Sequence[int] | np.ndarray, start: int, end: int, min_tokens: int
    ) -> list[tuple[int, int, str]]:
        """The chunk ``[start, end)`` of ``token_ids`` cut around the learned edges it starts
        and ends with, each piece with its kind: ``"tail"`` (a learned tail, the end of a
        document, at the chunk's start), ``"head"`` (a learned head, the start of a document,
        at its end) or ``"chunk"``; pieces shorter than ``min_tokens`` are dropped. Where both
        edges would overlap, the longer one."""
        if end - start < WINDOW:
            return [(start, end, "chunk")]
        ids = np.asarray(token_ids[start:end], dtype=np.int32)
        head, tail = self.heads.longest(ids), self.tails.longest(ids[::-1].copy())
        if not head and not tail:
            return [(start, end, "chunk")]
        if head + tail > len(ids):
            head, tail = (head, 0) if head >= tail else (0, tail)
        cuts = [start, start + tail, end - head, end]
        kinds = ["tail" if tail else "chunk", "chunk", "head" if head else "chunk"]
        return [
            (a, b, kind)
            for (a, b), kind in zip(itertools.pairwise(cuts), kinds, strict=True)
            if b - a >= min_tokens
        ]


def documents(starts: Sequence[int], ends: Sequence[int], max_tokens: int) -> list[tuple[int, int]]:
    """Document runs ``[start, end)``: a learned tail ending at ``end`` belongs to the latest
    learned head that starts at or before its last ``WINDOW`` tokens (a tail's end and the next
    head's start overlap by the separator tokens their edges both learned, shorter than a
    window), with no other head starting between; at most ``max_tokens`` long."""
    events = sorted([(p, 0, p) for p in starts] + [(q - WINDOW, 1, q) for q in ends])
    out, opened = [], None
    for _, is_end, pos in events:
        if not is_end:
            opened = pos
        elif opened is not None:
            if pos - opened <= max_tokens:
                out.append((opened, pos))
            opened = None
    return out
