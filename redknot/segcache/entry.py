"""Content-addressed segment keys, the entries of the segment store, and its errors.

A segment is addressed by ``(namespace, token ids)`` (SparseX's "extra key" is the namespace):
the same tokens under two namespaces are two segments, and nothing from one namespace is ever
visible from another. Its id is a 128-bit BLAKE2b digest of both::

    id = blake2b(len(ns) as u64 LE || ns as UTF-8 || tokens as i64 LE, person="redknot-seg-v1")

rendered as 32 hex characters. The length prefix keeps ``(ns, tokens)`` pairs apart whose byte
strings would otherwise concatenate to the same input; the store also compares the token ids
themselves, so even a digest collision never serves another segment's KV.
"""

from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

NAMESPACE_MAX_CHARS = 256
_PERSON = b"redknot-seg-v1"


class SegmentError(ValueError):
    """A segment request that cannot be served; the message says what is wrong."""


class SegmentNotFound(SegmentError, LookupError):
    """No segment with this id in this namespace (unknown, deleted or evicted)."""


class SegmentTooLong(SegmentError):
    """A segment longer than the whole segment region."""


class SegmentStoreFull(SegmentError):
    """The segment region cannot make room: the rest is pinned or read by live requests."""


class SegmentsDisabled(SegmentError):
    """The server runs without a segment region (``--redknot-segment-fraction 0``, or no heads to
    keep)."""


def check_namespace(namespace: Any) -> str:
    if not isinstance(namespace, str):
        raise SegmentError(f"segment namespace must be a string, got {type(namespace).__name__}")
    if len(namespace) > NAMESPACE_MAX_CHARS:
        raise SegmentError(
            f"segment namespace is {len(namespace)} characters long, at most "
            f"{NAMESPACE_MAX_CHARS} are allowed"
        )
    return namespace


def pack_tokens(token_ids: Sequence[int] | torch.Tensor | np.ndarray) -> bytes:
    """Token ids as little-endian int64 bytes; refuses empty, negative or non-integer ids."""
    if isinstance(token_ids, list) and token_ids and sys.byteorder == "little":
        # a list of non-negative ints packs in C, with the same bytes as below (about 2x
        # faster than NumPy's conversion of a Python list); anything else takes NumPy's way,
        # which says what is wrong
        try:
            return array.array("Q", token_ids).tobytes()
        except (OverflowError, TypeError):
            pass
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.detach().cpu().numpy()
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise SegmentError(f"segment token ids must be a flat sequence, got shape {arr.shape}")
    if arr.size == 0:
        raise SegmentError("a segment needs at least one token, got an empty token list")
    if arr.dtype.kind not in "iu":
        raise SegmentError(f"segment token ids must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0:
        raise SegmentError(f"segment token ids must be >= 0, got {int(arr.min())}")
    return arr.astype("<i8").tobytes()


def segment_id(namespace: str, token_ids: Sequence[int] | torch.Tensor | np.ndarray) -> str:
    """The deterministic id of ``(namespace, token_ids)`` (see the module docstring)."""
    return _digest(check_namespace(namespace), pack_tokens(token_ids))


def segment_ids(
    token_ids: Sequence[int] | torch.Tensor | np.ndarray, ranges: Sequence[tuple[str, int, int]]
) -> list[str]:
    """``segment_id(namespace, token_ids[start:end])`` of each ``(namespace, start, end)`` of
    one prompt, its tokens packed once (``0 <= start < end <= len(token_ids)``)."""
    packed = pack_tokens(token_ids)
    return [_digest(check_namespace(ns), packed[8 * a : 8 * b]) for ns, a, b in ranges]


def _digest(namespace: str, packed: bytes) -> str:
    ns = namespace.encode("utf-8")
    h = hashlib.blake2b(digest_size=16, person=_PERSON)
    h.update(len(ns).to_bytes(8, "little"))
    h.update(ns)
    h.update(packed)
    return h.hexdigest()


@dataclass(frozen=True)
class SegmentEntry:
    """A cached segment as the store saw it when it handed this entry out (a snapshot: pin,
    refs, ready and last_used may have changed since; ask the store again for fresh values)."""

    id: str  # segment_id(namespace, tokens), 32 hex characters
    namespace: str
    num_tokens: int
    pinned: bool  # never evicted; removed only by an explicit delete
    pages: tuple[int, ...]  # region pages holding tokens in order, page_tokens tokens per page
    page_tokens: int
    ready: bool  # its KV has been written (issued); lookups return only ready segments
    refs: int  # live readers (acquire/release) and writers (register/release)
    created: float  # time.time() of registration
    last_used: float  # time.time() of the last lookup hit or register
    serial: int  # registration number: tells a re-registration of a deleted id from the old one

    def rows_of(self, offsets: np.ndarray) -> np.ndarray:
        """Region rows of the tokens at ``offsets`` (int64, each in ``0 .. num_tokens - 1``)."""
        pages = np.asarray(self.pages, dtype=np.int64)
        return pages[offsets // self.page_tokens] * self.page_tokens + offsets % self.page_tokens

    def rows(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Region rows of tokens ``0 .. num_tokens - 1``: int64 [num_tokens] on ``device``."""
        pages = torch.tensor(self.pages, dtype=torch.long, device=device)
        offsets = torch.arange(self.page_tokens, dtype=torch.long, device=device)
        rows = (pages[:, None] * self.page_tokens + offsets[None, :]).reshape(-1)
        return rows[: self.num_tokens]

    def to_dict(self) -> dict[str, Any]:
        """Plain values for an API response (pages given as a count)."""
        d = asdict(self)
        d["num_pages"] = len(d.pop("pages"))
        return d
