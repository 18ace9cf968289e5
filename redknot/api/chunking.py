"""Content-defined chunks of a token sequence: the cuts of ``--redknot-auto-segments cdc``.

A gear hash rolls over the token ids; position ``i`` is a *candidate* cut (a chunk may end after
token ``i``) when the top ``bits`` of ``mix(h[i])`` are zero, where ``mix`` is SplitMix64's
finaliser (it spreads every bit of ``h`` over the top bits, so that neighbouring positions,
whose plain gear hashes are shifts of each other, are not candidates together) and ``h[i]``

    h[i] = sum(gear(ids[i - k]) << k for k in range(WINDOW) if i - k >= 0)  mod 2**32

so it depends on the last ``WINDOW`` tokens only (older ones are shifted out of the 32 bits): a
candidate is a property of the content around it, not of its offset or of what came earlier.
Cuts are then taken left to right: a candidate at least ``min_tokens`` after the last cut ends a
chunk, and a chunk that reaches ``max_tokens`` is cut there. A document therefore yields the
same chunks wherever it appears and whatever precedes it, from its first cut that both
placements share on (in practice its first candidate ``min_tokens`` or more into it).

| quantity           | value                                                                 |
| ------------------ | --------------------------------------------------------------------- |
| ``gear(t)``        | top 32 bits of SplitMix64(``t + SEED``): fixed, the same in every     |
|                    | process (no Python ``hash``)                                          |
| ``bits``           | ``round(log2(avg - min))``: a candidate every ``2**bits`` tokens on   |
|                    | average, so chunks average about ``avg`` tokens                       |
| chunk lengths      | ``min_tokens <= n <= max_tokens``, except the last one (the rest)     |
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# tokens a candidate depends on (the hash's width in bits; rolling_hash needs a power of 2)
WINDOW = 32
SEED = 0x5EED_C0DE_D0C5_0001
_M64 = (1 << 64) - 1


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser (uint64 in, uint64 out)."""
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps modulo 2**64 on purpose
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def gear(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """The gear value of every token (uint64 [n], each below ``2**32``)."""
    with np.errstate(over="ignore"):
        z = np.asarray(token_ids, dtype=np.uint64) + np.uint64(SEED)
        z = z + np.uint64(0x9E3779B97F4A7C15)
    return _mix(z) >> np.uint64(32)


def rolling_hash(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """``h[i]`` of the module docstring for every position (uint64 [n], below ``2**32``)."""
    h = gear(token_ids)
    with np.errstate(over="ignore"):
        m = 1
        while m < WINDOW:  # h sums k < m; adding it m positions back, shifted by m: k < 2 m
            wider = h.copy()
            wider[m:] += h[: max(len(h) - m, 0)] << np.uint64(m)
            h, m = wider, 2 * m
    return h & np.uint64(0xFFFF_FFFF)


@dataclass(frozen=True)
class Chunker:
    """Cuts of chunks of about ``avg_tokens`` tokens, between ``min_tokens`` and
    ``max_tokens``.

    >>> chunker = Chunker.of_average(256)  # min 64, max 1024
    >>> chunker.spans(ids)  # [(0, 301), (301, 512), ..., (k, len(ids))]
    """

    min_tokens: int
    avg_tokens: int
    max_tokens: int

    def __post_init__(self) -> None:
        if not 1 <= self.min_tokens < self.avg_tokens <= self.max_tokens:
            raise ValueError(
                f"chunk sizes must satisfy 1 <= min < avg <= max, got min {self.min_tokens}, "
                f"avg {self.avg_tokens}, max {self.max_tokens}"
            )

    @classmethod
    def of_average(cls, avg_tokens: int) -> Chunker:
        """Chunks of about ``avg_tokens``, from a quarter of it to four times it."""
        return cls(max(avg_tokens // 4, 1), avg_tokens, 4 * avg_tokens)

    @property
    def bits(self) -> int:
        return max(1, round(math.log2(self.avg_tokens - self.min_tokens)))

    def candidates(
        self, token_ids: Sequence[int] | np.ndarray, h: np.ndarray | None = None
    ) -> np.ndarray:
        """Positions ``i`` after which a chunk may end (int64, ascending); ``h``: the
        sequence's :func:`rolling_hash` when the caller has it."""
        mixed = _mix(rolling_hash(token_ids) if h is None else h)
        return np.flatnonzero((mixed >> np.uint64(64 - self.bits)) == 0)

    def cuts(self, token_ids: Sequence[int] | np.ndarray, h: np.ndarray | None = None) -> list[int]:
        """Chunk ends (exclusive offsets), ascending; the last is ``len(token_ids)``."""
        n = len(token_ids)
        out, last = [], 0
        for i in self.candidates(token_ids, h).tolist():
            end = i + 1
            while end - last > self.max_tokens:  # no candidate in reach: cut at the maximum
                last += self.max_tokens
                out.append(last)
            if end - last >= self.min_tokens:
                out.append(end)
                last = end
        while n - last > self.max_tokens:
            last += self.max_tokens
            out.append(last)
        if last < n:
            out.append(n)
        return out

    def spans(
        self, token_ids: Sequence[int] | np.ndarray, h: np.ndarray | None = None
    ) -> list[tuple[int, int]]:
        """The chunks as ``[start, end)`` token ranges covering the sequence (``h``: as
        :meth:`candidates`)."""
        cuts = self.cuts(token_ids, h)
        return list(zip([0, *cuts], cuts, strict=False))  # the last start has no chunk
