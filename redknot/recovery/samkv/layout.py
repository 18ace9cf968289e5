"""How SamKV cuts a cached document into anchors and blocks (§3.2, §4.1).

A document of ``n`` tokens (one served segment) is cut, offsets from its first token:

| region   | offsets                          | treatment                                        |
| -------- | -------------------------------- | ------------------------------------------------ |
| initial  | ``[0, init)``                    | anchor: kept in every layer, recomputed          |
| middle   | ``[init, init + M * block)``     | ``M`` blocks of ``block`` tokens: selected per layer |
| local    | ``[init + M * block, n)``        | anchor: kept in every layer, recomputed          |

``init = min(n, init_blocks * block)``; ``M`` is the largest count that leaves at least
``local_blocks * block`` tokens at the end, so the local region also takes the remainder
(``< block`` tokens) and every middle block is whole: each layer then keeps the same number
of tokens. A document with ``M == 0`` is too short to sparsify: it is all anchor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class DocumentBlocks:
    """Segment ``index`` of the prompt, rows ``[start, end)``, cut as in the module docstring."""

    index: int
    start: int
    end: int
    init: int
    block: int
    num_blocks: int

    def __post_init__(self) -> None:
        assert 0 <= self.init <= self.length and self.block >= 1, self
        assert self.init + self.num_blocks * self.block <= self.length, self

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def middle_end(self) -> int:
        """First offset of the local region."""
        return self.init + self.num_blocks * self.block

    @property
    def local(self) -> int:
        return self.length - self.middle_end

    @property
    def sparsifiable(self) -> bool:
        return self.num_blocks > 0

    def anchor_mask(self) -> Tensor:
        """``[n]`` bool over the document's offsets: initial and local tokens."""
        mask = torch.ones(self.length, dtype=torch.bool)
        mask[self.init : self.middle_end] = False
        return mask

    def block_of(self) -> Tensor:
        """``[n]`` int64: the middle block of every offset, ``-1`` for anchors."""
        out = torch.full((self.length,), -1, dtype=torch.int64)
        middle = torch.arange(self.num_blocks * self.block)
        out[self.init : self.middle_end] = middle // self.block
        return out


def cut_document(
    index: int, start: int, end: int, *, block: int, init_blocks: int, local_blocks: int
) -> DocumentBlocks:
    """Cut rows ``[start, end)`` into anchors and whole middle blocks of ``block`` tokens."""
    n = end - start
    init = min(n, init_blocks * block)
    num_blocks = max(0, (n - init - local_blocks * block) // block)
    return DocumentBlocks(index, start, end, init, block, num_blocks)
