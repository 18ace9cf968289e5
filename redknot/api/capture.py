"""Capture on miss: a marked segment that the store does not hold is stored for later requests,
with no client action (``--redknot-capture on``, the default).

A request marks segments (``/generate`` markup, or chat messages under
``--redknot-chat-segments``). The segment store counts its hits and misses in the scheduler; a
miss is computed inside that request under its own prefix, which is not the segment's
standalone K/V. So, once the request has sent the first bytes of its answer (its first token
when streamed, the whole answer otherwise), the middleware hands its segments to
:class:`Capturer`, which:

1. skips a segment when a capture of the same content address (namespace and tokens) is
   already under way in this server (concurrent requests that miss the same document capture
   it once);
2. (unless the answer's reuse report says every marked segment hit: then the middleware does
   not call it, nothing being missing) asks the scheduler's store about all of them in one
   control request (op
   ``registrations``: SGLang's control communicator has one request in flight at a time, and
   each waits for the scheduler's step under way, so a request per segment made ~60 round
   trips per RAG prompt) and skips those stored, being written by another registration or
   capture, or refused as too long for the region (413; retrying cannot help);
3. of the segments the store lacks, defers a content-defined chunk of an unmarked
   ``/generate`` prompt until its
   ``--redknot-auto-capture-after``-th miss (default 2; counted in ``captures_deferred``): the
   chunks that straddle two documents are seen once, and capturing them would spend a prefill
   and region pages on nothing. Marked segments and chat messages are captured at their first
   miss. A request that misses a chunk while another request's capture is deciding about it
   adds its miss to that decision. Under ``--redknot-auto-segments cdc-edges`` every missing
   chunk also teaches the documents' edges it shares with earlier misses
   (``redknot.api.edges``), and those are sent now; under ``cdc-docs`` the documents found
   between learned edges that are due (``AutoSegments.documents_due``) are sent with the
   request's segments, a marked document that misses is captured at once, and once a document
   is stored the chunks and edges it replaces are deleted (one control request;
   ``captures_superseded``): kept, they would hold the region twice;
4. sends the rest as **one batched registration** (``max_new_tokens=0``, each prompt marked
   ``redknot_capture``; at most ``MAX_BATCH_TOKENS`` tokens per batch): the scheduler computes
   client-marked segments' standalone K/V (positions from 0, no prefix) as ``POST
   /redknot/segments`` does, in as few prefill batches as its limits allow, and stores them
   unpinned, under the store's eviction and per-namespace cap; two writers of one segment are
   resolved there (``claim_write``). An automatic segment (namespace ``auto``) is computed
   after the ``--redknot-auto-capture-context`` tokens that preceded it in the prompt that
   missed it, and those that missed one after the other go in one prompt, each computed after
   the ones before it (:func:`_runs`; only the first one's context is computed in addition):
   the scheduler stores each one's rows alone, its keys rotated back to positions from 0
   (``redknot.segcache.registration``).

Under ``--redknot-auto-capture-in-place on`` (the default) most automatic chunks never come
here: the request that misses a chunk due for capture stores it from its own prefill (the HTTP
side flags it with :meth:`Capturer.due_in_place`; ``redknot.segcache.registration.
store_in_place``), its answer's reuse report lists it as ``stored``, and it reaches
:meth:`Capturer.capture` as ``stored``: counted (``captures_in_place``) and learned from
(edges), not sent.

Before any of this, the middleware takes out the automatic segments that start inside the
request's exact-prefix hit (the answer's ``meta_info.cached_tokens``; counted as
``captures_prefix_cached``): SGLang's prefix cache serves them to the prompts that continue
this one, and capturing a conversation's earlier turns was most of the GPU's work on chat
traffic (``redknot.api.middleware._in_prefix_hit``). Such a sighting still counts toward the
chunk's capture threshold (:meth:`Capturer.served`): a chunk is captured by the next request
that computes it, as a document of a RAG prompt that another prompt holds elsewhere is.

Scheduling: the capture is sent after the request that missed has its first token, so it never
delays that request; in the scheduler it waits while user requests do, and starts in steps of
a tenth of the shortest recent user prompt, 256 to 2,048 prompt tokens
(``redknot.integration.capture_order``), at the lowest priority
when the server schedules by priority (``--enable-priority-scheduling``).
At most ``MAX_CONCURRENT`` batches run at once and ``MAX_PENDING`` segments wait; more are
dropped (counted as ``captures_dropped``: the segment is captured by a later miss). One
registration request per segment was measured first: with ~60 automatic chunks per RAG prompt
it fell behind the traffic (H100, 8B shape: 0.36 of prompt tokens reused where 0.80 could be).
A capture that fails (region full of pinned or live segments, engine error) stores nothing and
is counted; it never affects the request that missed, which has been answered already.

Off per server (``--redknot-capture off``) and per request (``"redknot_capture": false`` in a
``/generate`` body, ``custom_params.redknot_capture: false`` in a chat request).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import sys
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

from redknot.api import control
from redknot.api.marks import SegmentMark, encode_marks, segment_id
from redknot.api.options import AUTO_NAMESPACE

logger = logging.getLogger(__name__)

MAX_CONCURRENT = 2  # batches of captures sent to the engine at once
MAX_BATCH_TOKENS = 8192  # segment tokens in one batch (one request, a prompt per segment)
MAX_PENDING = 1024  # segments waiting or being captured; beyond it a capture is dropped
SEEN_LIMIT = 1 << 16  # automatic chunks remembered as seen once (the oldest forgotten first)
CAPTURE_FIELD = "redknot_capture"  # per request: false turns capture off for it
SKIP_STATES = ("ready", "writing")  # stored, or being written by another writer


class _Capture(NamedTuple):
    """A segment on the capture path."""

    ns: str
    ids: list[int]
    sid: str  # its content address
    chunk: bool  # automatic: a chunk, edge or document of an unmarked prompt
    context: list[int]  # the tokens it is computed after
    start: int | None = None  # where it starts in the prompt that missed it (None: not known)


class Pending(NamedTuple):
    """A segment a request marked, waiting for the request's answer to be captured."""

    ns: str
    ids: list[int]
    chunk: bool  # a chunk of an unmarked prompt (captured at its N-th miss)
    context: list[int]  # the tokens its capture is computed after
    start: int | None  # where it starts in the request's prompt (None: client-marked)


# The segments a request marked, collected while it is served: the middleware sets a fresh list
# per request, the chat hook appends to it.
PENDING: contextvars.ContextVar[list[Pending] | None] = contextvars.ContextVar(
    "redknot_capture_pending", default=None
)


def check_flag(value: Any, where: str) -> bool:
    """The per-request capture flag (``true``/``false``), or a ``SegmentMarkError``."""
    from redknot.api.marks import SegmentMarkError

    if not isinstance(value, bool):
        raise SegmentMarkError(f"{where} must be true or false, got {value!r}")
    return value


def note(
    segments: Sequence[tuple[str, Sequence[int]]],
    *,
    chunks: bool = False,
    contexts: Sequence[Sequence[int]] | None = None,
    starts: Sequence[int] | None = None,
) -> None:
    """Add a request's marked segments to the current request's pending captures (``chunks``:
    content-defined chunks of an unmarked prompt, captured at their N-th miss; ``contexts``:
    per segment, the tokens its capture is computed after, none when not given; ``starts``:
    where each starts in the prompt, so that consecutive ones are captured in one prompt)."""
    pending = PENDING.get()
    if pending is not None:
        contexts = contexts or [()] * len(segments)
        starts = starts or [None] * len(segments)
        pending.extend(
            Pending(ns, list(ids), chunks, list(ctx), start)
            for (ns, ids), ctx, start in zip(segments, contexts, starts, strict=True)
        )


class Capturer:
    """Captures of the HTTP server process (see the module docstring)."""

    def __init__(
        self, api: Any, *, enabled: bool, auto_capture_after: int = 2, in_place: bool = False
    ):
        self.api = api
        self.enabled = enabled
        self.auto_capture_after = auto_capture_after
        self.in_place = in_place  # --redknot-auto-capture-in-place on
        self._inflight: set[str] = set()
        self._pending = 0
        self._seen: OrderedDict[str, int] = OrderedDict()  # automatic chunks: misses so far
        self._limits: weakref.WeakKeyDictionary[Any, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    def _limit(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        sem = self._limits.get(loop)
        if sem is None:
            sem = self._limits[loop] = asyncio.Semaphore(MAX_CONCURRENT)
        return sem

    def due_in_place(self, sid: str, chunk: bool = True) -> bool:
        """Whether the request about to be sent stores the automatic segment ``sid`` itself if
        it misses it (``--redknot-auto-capture-in-place on``): no capture of it is under way
        here and, for a chunk of an unmarked ``/generate`` prompt, this miss would be its
        ``auto_capture_after``-th (:meth:`_admit`'s rule, this one counted); a chat message's
        segment (``chunk`` False) is captured at its first miss."""
        if not (self.enabled and self.in_place) or sid in self._inflight:
            return False
        if not chunk or self.auto_capture_after <= 1:
            return True
        return self._seen.get(sid, 0) + 1 >= self.auto_capture_after

    def stored_here(self, marks: Sequence[Any], ids: Sequence[int], chunks: bool) -> list[int]:
        """The indices of ``marks`` (automatic segments of the prompt ``ids``) that the request
        stores itself if it misses them (:meth:`due_in_place`; ``chunks``: chunks of an unmarked
        ``/generate`` prompt, of which a ``cdc-docs`` document is captured apart; else a chat
        request's message segments)."""
        return [
            i for i, m in enumerate(marks)
            if self.due_in_place(m.segment_id, chunks)
            and not (chunks and self._is_document(ids[m.start : m.end]))
        ]  # fmt: skip

    async def capture(self, segments: Sequence[Pending], stored: Sequence[Pending] = ()) -> None:
        """Capture those of ``segments`` (what :func:`note` collected) the store lacks;
        ``stored``: the automatic chunks the request's own prefill stored (its reuse report's
        ``stored``), counted and learned from (edges) but not sent. Never raises."""
        if not (self.enabled and (segments or stored)):
            return
        count = self.api.counters.add
        mine: list[_Capture] = []
        taken: set[str] = set()
        auto = self._auto
        due = auto.documents_due() if auto is not None else []
        edges: list[_Capture] = []
        segments = [
            *segments,
            *(Pending(AUTO_NAMESPACE, ids, True, auto.document_context(ids), None) for ids in due),
        ]
        try:
            for seg in stored:
                self._seen.pop(segment_id(seg.ns, seg.ids), None)
                if not self._is_document(seg.ids):  # it missed: the edges it shares with misses
                    edges += self._edges(seg.ns, seg.ids, seg.context)
            if stored:
                count(captures_in_place=len(stored))
            for ns, ids, chunk, context, start in segments:
                sid = segment_id(ns, ids)
                if sid in self._inflight or sid in taken:
                    count(captures_deduplicated=1)
                    if chunk and sid in self._inflight:
                        self._sighted(sid)  # the capture under way decides with it counted
                elif self._pending + len(mine) >= MAX_PENDING:
                    count(captures_dropped=1)
                else:
                    mine.append(_Capture(ns, ids, sid, chunk, context, start))
                    taken.add(sid)
            self._inflight.update(taken)
            self._pending += len(mine)
            send = (await self._to_send(mine) if mine else []) + edges
            self._release(taken, taken - {seg.sid for seg in send})
            for batch in _batches(_runs(send), MAX_BATCH_TOKENS):
                async with self._limit():
                    await self._capture_batch(batch)
        except Exception as e:  # noqa: BLE001 (a capture must never disturb serving)
            count(captures_failed=1)
            logger.warning("redknot capture: failed: %s: %s", type(e).__name__, e)
        finally:
            self._release(taken, set(taken))
            for ids in due:  # decided, dropped or failed: queued again at a later sighting
                auto.document_unqueued(ids)

    def _release(self, held: set[str], done: set[str]) -> None:
        """The segments ``done`` of this capture's ``held`` are no longer under way here
        (decided, stored or failed); ``held`` keeps the others."""
        held -= done
        self._inflight -= done
        self._pending -= len(done)

    def served(self, segments: Sequence[Pending]) -> None:
        """Automatic chunks of a request that its exact-prefix hit served: not captured from
        that request (it computed none of them), but each sighting counts toward the chunk's
        ``--redknot-auto-capture-after``, so the next request that computes it while the store
        lacks it captures it."""
        if not self.enabled:
            return
        for seg in segments:
            if seg.chunk:
                self._sighted(segment_id(seg.ns, seg.ids))

    def _sighted(self, sid: str, misses: int = 1) -> int:
        """Count ``misses`` more misses of the automatic chunk ``sid``; its misses so far."""
        misses += self._seen.pop(sid, 0)
        self._seen[sid] = misses
        if len(self._seen) > SEEN_LIMIT:
            self._seen.popitem(last=False)
        return misses

    def _admit(self, sid: str) -> bool:
        """Whether a missing chunk of an unmarked ``/generate`` prompt is captured now: at its
        ``auto_capture_after``-th miss (``--redknot-auto-capture-after``, default 2), misses
        of requests served while an earlier capture of it was being decided included. The
        chunks that straddle two documents of such a prompt are seen once and never again, and
        capturing them would spend a prefill and region pages on nothing. Marked segments and
        chat messages (whole, or cut inside one message) are captured at their first miss."""
        if self.auto_capture_after <= 1 or self._sighted(sid) >= self.auto_capture_after:
            self._seen.pop(sid, None)
            return True
        self.api.counters.add(captures_deferred=1)
        return False

    async def _to_send(self, segments: list[_Capture]) -> list[_Capture]:
        """Those of ``segments`` the store lacks (asked in one control request) and, for a
        chunk of an unmarked prompt, that :meth:`_admit` lets through."""
        tm = self.api.tokenizer_manager
        states = await control.registrations(tm, [(seg.ns, seg.sid) for seg in segments])
        send = []
        for seg, state in zip(segments, states, strict=True):
            if state["state"] in SKIP_STATES or state["status"] == 413:
                self.api.counters.add(captures_skipped=1)
                if seg.chunk and self._is_document(seg.ids):  # cdc-docs: stored, or never will be
                    self._auto.document_stored(seg.ids, state["state"] in SKIP_STATES)
                continue
            document = seg.chunk and self._is_document(seg.ids)  # cdc-docs: not deferred
            if seg.chunk and not document:  # a chunk the store lacks: edges it shares with misses
                send += self._edges(seg.ns, seg.ids, seg.context)
            if not seg.chunk or document or self._admit(seg.sid):
                send.append(seg)
        return send

    @property
    def _auto(self) -> Any:
        """The server's automatic segments (``redknot.api.auto.AutoSegments``), or None."""
        return getattr(self.api, "auto", None)

    def _is_document(self, ids: list[int]) -> bool:
        return self._auto is not None and self._auto.is_document(ids)

    def _edges(self, ns: str, ids: list[int], context: list[int]) -> list[_Capture]:
        """``--redknot-auto-segments cdc-edges``: the documents' edges newly learned from the
        missed chunk ``ids`` (computed after ``context``), captured now (seen twice already;
        ``redknot.api.edges``)."""
        auto = self._auto
        learned = auto.learn_edges(ids) if auto is not None else []
        if learned:
            self.api.counters.add(auto_edges_learned=len(learned))
        return [
            _Capture(ns, edge, segment_id(ns, edge), True, auto.edge_context(ids, context, edge))
            for edge in learned
        ]

    async def _capture_batch(self, batch: list[list[_Capture]]) -> None:
        """One registration request for the runs of segments of ``batch`` (a prompt each), then
        what the store holds of them (asked in one control request)."""
        count = self.api.counters.add
        segments = [seg for run in batch for seg in run]
        count(captures_sent=len(segments))
        await self._register(batch)
        tm = self.api.tokenizer_manager
        states = await control.registrations(tm, [(seg.ns, seg.sid) for seg in segments])
        superseded: list[tuple[str, str]] = []
        for (ns, ids, sid, chunk, _, _), state in zip(segments, states, strict=True):
            stored = state["state"] in SKIP_STATES
            pieces = self._auto.document_pieces(ids) if chunk and self._auto is not None else None
            if pieces is not None:  # cdc-docs: a document, served whole from now on
                self._auto.document_stored(ids, stored)
                if stored:  # and the chunks and edges it replaces are freed
                    superseded += [(ns, segment_id(ns, piece)) for piece in pieces]
            if stored:
                count(captures_stored=1)
            else:
                count(captures_failed=1)
                logger.info(
                    "redknot capture: segment %s (%d tokens, namespace %r) not stored: %s",
                    sid, len(ids), ns, state["reason"],
                )  # fmt: skip
        if superseded:
            freed = await control.deletes(tm, superseded)
            count(captures_superseded=sum(freed))

    async def _register(self, runs: list[list[_Capture]]) -> None:
        """Send ``runs`` as one batch of registrations (one scheduler request each, sent
        together so that the scheduler prefills them in as few batches as its limits allow),
        each prompt the first segment's context then the run's segments, each marked."""
        from sglang.srt.managers.io_struct import GenerateReqInput

        prompts, params = [], []
        for run in runs:
            prompt, marks = list(run[0].context), []
            for seg in run:
                marks.append(SegmentMark(len(prompt), len(prompt) + len(seg.ids), seg.ns, seg.sid))
                prompt += seg.ids
            prompts.append(prompt)
            params.append(
                {
                    "max_new_tokens": 0,
                    "custom_params": encode_marks(marks, register=True, capture=True),
                }
            )
        single = len(runs) == 1
        obj = GenerateReqInput(
            input_ids=prompts[0] if single else prompts,
            sampling_params=params[0] if single else params,
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


def _runs(segments: list[_Capture]) -> list[list[_Capture]]:
    """``segments`` in order, those that follow one another in the prompt that missed them
    (the same namespace, one starting where the previous ends) joined into runs: a run is
    captured in one prompt, each segment after the ones before it, so that only the first
    one's context is computed in addition."""
    out: list[list[_Capture]] = []
    for seg in segments:
        last = out[-1][-1] if out else None
        if (
            last is not None
            and seg.start is not None
            and last.start is not None
            and seg.ns == last.ns
            and last.start + len(last.ids) == seg.start
        ):
            out[-1].append(seg)
        else:
            out.append([seg])
    return out


def _batches(runs: list[list[_Capture]], max_tokens: int) -> list[list[list[_Capture]]]:
    """``runs`` in order, cut into batches of at most ``max_tokens`` prompt tokens (context and
    segments; a longer run alone)."""
    out: list[list[list[_Capture]]] = []
    size = max_tokens
    for run in runs:
        n = len(run[0].context) + sum(len(seg.ids) for seg in run)
        if size + n > max_tokens:
            out.append([])
            size = 0
        out[-1].append(run)
        size += n
    return out
