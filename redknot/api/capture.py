"""Capture on miss: a marked segment that the store does not hold is stored for later requests,
with no client action (``--redknot-capture on``, the default).

A request marks segments (``/generate`` markup, or chat messages under
``--redknot-chat-segments``). The segment store counts its hits and misses in the scheduler; a
miss is computed inside that request under its own prefix, which is not the segment's
standalone K/V. So, once the request has sent the first bytes of its answer (its first token
when streamed, the whole answer otherwise), the middleware hands its segments to
:class:`Capturer`, which for each one:

1. skips it when a capture of the same content address (namespace and tokens) is already under
   way in this server (concurrent requests that miss the same document capture it once);
2. asks the scheduler's store (control op ``registration``) and skips it when it is stored,
   being written by another registration or capture, or was refused as too long for the region
   (413; retrying cannot help);
3. otherwise sends a registration of exactly its tokens (``max_new_tokens=0``, marked
   ``redknot_capture``): the scheduler computes its standalone K/V (positions from 0, no prefix)
   as ``POST /redknot/segments`` does and stores it unpinned, under the store's eviction and
   per-namespace cap; two writers of one segment are resolved there (``claim_write``).

Scheduling: the capture is sent after the request that missed has its first token, so it never
delays that request; it competes with later requests like any prefill of its length, at the
lowest priority when the server schedules by priority (``--enable-priority-scheduling``).
At most ``MAX_CONCURRENT`` captures run at once and ``MAX_PENDING`` wait; more are dropped
(counted as ``captures_dropped``: the segment is captured by a later miss). A capture that fails
(region full of pinned or live segments, engine error) stores nothing and is counted; it never
affects the request that missed, which has been answered already.

Off per server (``--redknot-capture off``) and per request (``"redknot_capture": false`` in a
``/generate`` body, ``custom_params.redknot_capture: false`` in a chat request).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import sys
import weakref
from collections.abc import Sequence
from typing import Any

from redknot.api import control
from redknot.api.marks import SegmentMark, encode_marks, segment_id

logger = logging.getLogger(__name__)

MAX_CONCURRENT = 2  # captures sent to the engine at once (each is one prefill of its segment)
MAX_PENDING = 256  # captures waiting or running; beyond it a capture is dropped
CAPTURE_FIELD = "redknot_capture"  # per request: false turns capture off for it
SKIP_STATES = ("ready", "writing")  # stored, or being written by another writer

# Segments (namespace, token ids) a request marked, collected while it is served: the
# middleware sets a fresh list per request, the chat hook appends to it.
PENDING: contextvars.ContextVar[list[tuple[str, list[int]]] | None] = contextvars.ContextVar(
    "redknot_capture_pending", default=None
)


def check_flag(value: Any, where: str) -> bool:
    """The per-request capture flag (``true``/``false``), or a ``SegmentMarkError``."""
    from redknot.api.marks import SegmentMarkError

    if not isinstance(value, bool):
        raise SegmentMarkError(f"{where} must be true or false, got {value!r}")
    return value


def note(segments: Sequence[tuple[str, Sequence[int]]]) -> None:
    """Add a request's marked segments to the current request's pending captures."""
    pending = PENDING.get()
    if pending is not None:
        pending.extend((ns, list(ids)) for ns, ids in segments)


class Capturer:
    """Captures of the HTTP server process (see the module docstring)."""

    def __init__(self, api: Any, *, enabled: bool):
        self.api = api
        self.enabled = enabled
        self._inflight: set[str] = set()
        self._pending = 0
        self._limits: weakref.WeakKeyDictionary[Any, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    def _limit(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        sem = self._limits.get(loop)
        if sem is None:
            sem = self._limits[loop] = asyncio.Semaphore(MAX_CONCURRENT)
        return sem

    async def capture(self, segments: Sequence[tuple[str, Sequence[int]]]) -> None:
        """Capture those of ``segments`` the store lacks; never raises."""
        if self.enabled and segments:
            await asyncio.gather(*(self._one(ns, list(ids)) for ns, ids in segments))

    async def _one(self, namespace: str, ids: list[int]) -> None:
        count = self.api.counters.add
        sid = segment_id(namespace, ids)
        if sid in self._inflight:
            count(captures_deduplicated=1)
            return
        if self._pending >= MAX_PENDING:
            count(captures_dropped=1)
            return
        self._inflight.add(sid)
        self._pending += 1
        try:
            async with self._limit():
                tm = self.api.tokenizer_manager
                state = await control.call(tm, "registration", namespace, sid)
                if state["state"] in SKIP_STATES or state["status"] == 413:
                    count(captures_skipped=1)
                    return
                count(captures_sent=1)
                await self._register(namespace, ids, sid)
                state = await control.call(tm, "registration", namespace, sid)
                if state["state"] in SKIP_STATES:
                    count(captures_stored=1)
                else:
                    count(captures_failed=1)
                    logger.info(
                        "redknot capture: segment %s (%d tokens, namespace %r) not stored: %s",
                        sid, len(ids), namespace, state["reason"],
                    )  # fmt: skip
        except Exception as e:  # noqa: BLE001 (a capture must never disturb serving)
            count(captures_failed=1)
            logger.warning("redknot capture: segment %s failed: %s: %s", sid, type(e).__name__, e)
        finally:
            self._inflight.discard(sid)
            self._pending -= 1

    async def _register(self, namespace: str, ids: list[int], sid: str) -> None:
        from sglang.srt.managers.io_struct import GenerateReqInput

        mark = SegmentMark(0, len(ids), namespace, sid)
        custom = encode_marks([mark], register=True, capture=True)
        obj = GenerateReqInput(
            input_ids=ids,
            sampling_params={"max_new_tokens": 0, "custom_params": custom},
            priority=self._lowest_priority(),
        )
        await self.api.tokenizer_manager.generate_request(obj, None).__anext__()

    def _lowest_priority(self) -> int | None:
        """The value SGLang schedules last, when it schedules by priority (else ``None``: a
        priority on a server without priority scheduling may be refused)."""
        args = getattr(self.api.tokenizer_manager, "server_args", None)
        if not getattr(args, "enable_priority_scheduling", False):
            return None
        low_first = getattr(args, "schedule_low_priority_values_first", False)
        return sys.maxsize if low_first else -sys.maxsize - 1
