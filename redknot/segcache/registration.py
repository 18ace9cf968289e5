"""Filling a registered segment's K/V: the registration request's own prefill writes it.

A registration (``redknot.api.marks.registration_of``) is a request whose whole prompt is one
segment, served standalone (positions from 0). A capture's prompt may start with a context (the
tokens that preceded its segment in the prompt that missed it) and hold several consecutive
segments (those that missed one after the other in that prompt): each is computed after what
precedes it, the context is not stored, and each segment's keys are written re-rotated from
their prompt positions to positions from 0, as a standalone segment's are. Its life in the
scheduler:

| when                                   | what                                                   |
| -------------------------------------- | ------------------------------------------------------ |
| prefix match (``match_prefix``)        | no prefix is reused: every token must be computed      |
| it gets a request slot (``start``)     | the store allocates the segment; a new one becomes a write job |
| each extend that computes its tokens   | the backend writes their K/V to the segment's rows (``plan_writes``) |
| the extend reaching its last token     | the segment is marked ready and the job's reference dropped |
| it finishes or is aborted (``finish``) | an unfinished job is dropped with its segment          |

Writes are issued on the forward stream before any later forward can read the segment, so a
segment is ready as soon as the extend that completes it is planned.

An ordinary request may store segments too (:func:`store_in_place`): the automatic chunks it
marks as due for capture (``redknot_seg_store``) that the store lacks and that it computes
(beyond its exact-prefix hit) become a write job of its own prefill, written as a capture's
(keys rotated back to positions from 0), after everything that precedes them in its prompt. No
capture request is sent for them: the prefill that computes them anyway stores them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from redknot.segcache.entry import SegmentEntry, SegmentError, SegmentNotFound

logger = logging.getLogger(__name__)


@dataclass
class WriteJob:
    """The segments one registration's prefill fills: ``parts``, each a segment and the prompt
    position it starts at (ascending, consecutive; a client's registration: one, at 0)."""

    parts: list[tuple[SegmentEntry, int]]  # those not written in full yet
    written: int = 0  # prompt tokens 0 .. written - 1 have their writes issued


@dataclass(frozen=True)
class SegmentWrites:
    """One extend's segment writes: token ``tokens_gpu[i]`` of the batch goes to region row
    ``rows_gpu[i]`` (int64 [W] each, on the device). ``pos_gpu`` (None: every write is at its
    stored position): ``[2, W]``, each write's position in its prompt and in the segment, from
    which and to which its key is rotated."""

    tokens_gpu: torch.Tensor
    rows_gpu: torch.Tensor
    pos_gpu: torch.Tensor | None = None


def is_registration(req: Any) -> bool:
    from redknot.api.marks import SegmentMarkError, registration_of

    if getattr(req, "sampling_params", None) is None:
        return False
    try:
        return registration_of(req) is not None
    except SegmentMarkError:  # validated by the API; a malformed mark is not a registration
        return False


def start(cache: Any, req: Any) -> None:
    """``req`` got its request slot: allocate its segments and plan the writes of the new
    ones (a segment stored already, or being written by another registration, is computed as
    its successors' context and not written)."""
    from redknot.api.marks import registration_of

    if not is_registration(req):
        return
    reg = registration_of(req)
    parts = [
        (entry, mark.start)
        for mark in reg.marks
        if (entry := _claim(cache.segments, req, mark, reg.pin, reg.capture, logging.WARNING))
        is not None
    ]
    if parts:
        cache.pool.segment_jobs[req.req_pool_idx] = WriteJob(parts)


def _claim(
    store: Any, req: Any, mark: Any, pin: bool, capture: bool, level: int
) -> SegmentEntry | None:
    """The segment of ``mark`` (its tokens in ``req``'s prompt), allocated with ``req`` as its
    only writer; None when it is stored already, being written by another writer, or refused by
    the store (the failure noted, and logged at ``level``)."""
    ids = list(req.origin_input_ids[mark.start : mark.end])
    try:
        entry = store.register(mark.namespace, ids, pin=pin, capture=capture)
    except SegmentError as e:
        store.note_failure(mark.segment_id, e)
        logger.log(level, "redknot: segment of request %s not stored: %s", req.rid, e)
        return None
    if entry.num_tokens != len(ids) or not store.claim_write(entry):
        store.release(entry)  # already stored, or being written by another writer
        return None
    return entry


def store_in_place(cache: Any, req: Any, marks: list[Any], prefix: int) -> list[Any]:
    """Make ``req``'s own prefill store the segments of ``marks`` (its missed marks due for
    capture) that it computes in full (starting at or after its exact-prefix hit of ``prefix``
    tokens); those it will write. A segment stored meanwhile, being written by another writer,
    or that the store refuses (logged, as a capture's failure) is left out."""
    parts, taken = [], []
    for mark in marks:
        entry = None
        if mark.start >= prefix:
            entry = _claim(cache.segments, req, mark, False, True, logging.INFO)
        if entry is not None:
            parts.append((entry, mark.start))
            taken.append(mark)
    if parts:
        cache.pool.segment_jobs[req.req_pool_idx] = WriteJob(parts, written=prefix)
    return taken


def plan_writes(
    pool: Any, req_pool_indices: list[int], prefix_cpu, lens_cpu, device
) -> SegmentWrites | None:
    """The segment writes of one extend batch; completes the jobs whose last token it computes."""
    tokens: list[int] = []
    rows: list[np.ndarray] = []
    shifts: list[int] = []  # prompt position - segment position
    positions: list[int] = []  # prompt position
    offset = 0
    for rpi, p, e in zip(req_pool_indices, list(prefix_cpu), list(lens_cpu)):
        p, e = int(p), int(e)
        job = pool.segment_jobs.get(rpi)
        if job is not None:
            if p != job.written:  # a prefix was reused after all: the segments cannot be filled
                _drop(pool, rpi)
            else:
                for entry, s in list(job.parts):
                    first, end = max(p, s), min(p + e, s + entry.num_tokens)  # prompt positions
                    if end <= first:
                        continue
                    tokens.extend(range(offset + first - p, offset + end - p))
                    rows.append(entry.rows_of(np.arange(first - s, end - s)))
                    shifts.extend([s] * (end - first))
                    positions.extend(range(first, end))
                    if end == s + entry.num_tokens:  # its last token: ready
                        pool.cache.segments.mark_ready(entry)
                        pool.cache.segments.release(entry)
                        job.parts.remove((entry, s))
                job.written = p + e
                if not job.parts:
                    del pool.segment_jobs[rpi]
        offset += e
    if not tokens:
        return None
    shifted = any(shifts)
    packed = [tokens, np.concatenate(rows)]
    if shifted:  # a capture after its context: keys rotated back to positions from 0
        packed += [positions, [q - c for q, c in zip(positions, shifts)]]
    packed_gpu = torch.from_numpy(np.vstack(packed).astype(np.int64)).to(device, non_blocking=True)
    return SegmentWrites(packed_gpu[0], packed_gpu[1], packed_gpu[2:] if shifted else None)


def finish(pool: Any, req_pool_idx: int | None) -> None:
    """A request left its slot: drop its unfinished write job (and the half-written segment)."""
    if req_pool_idx is not None and req_pool_idx in pool.segment_jobs:
        _drop(pool, req_pool_idx)


def _drop(pool: Any, rpi: int) -> None:
    job = pool.segment_jobs.pop(rpi)
    store = pool.cache.segments
    for entry, start in job.parts:
        try:
            store.delete(entry.namespace, entry.id)
        except SegmentNotFound:
            pass  # deleted through the API meanwhile
        store.release(entry)
        done = max(0, job.written - start)
        reason = (
            f"its registration ended after {done} of {entry.num_tokens} tokens (aborted, or its "
            "prompt was served from a cached prefix)"
        )
        store.note_failure(entry.id, reason)
        logger.warning(
            "redknot: segment %s of namespace %r was not stored: %s",
            entry.id, entry.namespace, reason,
        )  # fmt: skip
