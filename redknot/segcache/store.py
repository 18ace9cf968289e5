"""The segment store: content-addressed cached segments in the pool's segment region.

Scheduler-side bookkeeping only (no tensors): which segments are cached, which region pages
hold their K/V (``redknot.pool.segment_region``), who reads them, and what to evict. It runs in
the scheduler process, single-threaded, so the methods below are never concurrent.

Life of a segment::

    >>> e = store.lookup(ns, tokens)                 # ready segment, or None (a miss)
    >>> if e is None:
    ...     e = store.register(ns, tokens, pin=False)  # pages allocated, one ref for the writer
    ...     # ... the forward writes its K/V at e.rows(), then:
    ...     store.mark_ready(e)
    ... else:
    ...     store.acquire(e)                           # one ref for this reader
    >>> store.release(e)                               # when the request is done with it

| rule | |
| --- | --- |
| lookup | counts a hit (ready segment of these exact tokens in this namespace) or a miss, and a hit |
|        | makes the segment the most recently used. Acquire right away: only register evicts. |
| register | idempotent per key: an existing segment is returned (pin set to ``pin``, recency |
|          | touched), a new one gets ``ceil(n / page_tokens)`` pages. Either way the caller holds |
|          | one reference and must ``release`` it. A new segment is not ready until ``mark_ready``. |
| eviction | only in register, only when free pages are short: unpinned, unreferenced segments, |
|          | least recently used first (exact rule: ``redknot.segcache.eviction``). When they |
|          | cannot make room, nothing is evicted and ``SegmentStoreFull`` is raised. |
| namespace cap | a namespace holds at most ``namespace_pages`` pages (``--redknot-namespace-fraction`` |
|          | of the region): a new segment beyond it first evicts that namespace's own unpinned, |
|          | unreferenced segments (same rule), never another namespace's; if they cannot make |
|          | room, ``SegmentStoreFull`` is raised. One client cannot flood others out. |
| capture | ``register(..., capture=True)`` is a capture on miss (``redknot.api.capture``); it is |
|          | counted as ``captures`` in its namespace and otherwise stored like a registration |
|          | (unpinned, so pinned segments are never evicted for it). |
| delete | explicit, pinned or not. Unreferenced: pages freed now, returns True. Referenced: the |
|        | segment disappears at once from lookup/list/register (a re-register makes a new one) and |
|        | its pages are freed when the last reader releases it (deferred), returns False. |
| flush | ``clear()`` (SGLang's cache reset, also run after weight updates) drops every segment, |
|       | pinned ones included: their K/V belongs to the old weights. |

``bytes_saved`` counts, per hit, ``num_tokens * bytes_per_token``: the K/V of the stored heads
that the hit served from the cache instead of recomputing it (``bytes_per_token`` is the region's
per-token cost, all layers of this rank). ``bytes_used`` counts whole pages held, including
those of deleted segments still being read.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from redknot.segcache.counters import Counters
from redknot.segcache.entry import (
    SegmentEntry,
    SegmentError,
    SegmentNotFound,
    SegmentsDisabled,
    SegmentStoreFull,
    SegmentTooLong,
    _digest,
    check_namespace,
    pack_tokens,
)
from redknot.segcache.eviction import choose_victims
from redknot.segcache.pages import PageAllocator

MAX_FAILURES = 1024  # registration failures remembered for their answers


class SegmentObserver(Protocol):
    """Receives the store's events (the Prometheus exporter of ``redknot.segcache.metrics``)."""

    def lookup(self, namespace: str, hits: int, misses: int, tokens: int, bytes_saved: int) -> None:
        """Lookups in ``namespace``: ``hits`` found (``tokens``, ``bytes_saved`` served),
        ``misses`` not."""

    def evicted(self, namespace: str) -> None: ...

    def captured(self, namespace: str) -> None:
        """A capture on miss stored a segment of ``namespace``."""

    def usage(self, namespace: str, segments: int, pinned: int, bytes_used: int) -> None:
        """Changes (deltas) of the namespace's segments, pinned segments and bytes held."""


@dataclass
class _Record:
    serial: int
    id: str
    namespace: str
    packed: bytes  # token ids, little-endian int64
    num_tokens: int
    pages: tuple[int, ...]
    pinned: bool
    created: float
    last_used: float
    ready: bool = False
    writing: bool = False  # a registration's forward is filling it (one writer at a time)
    refs: int = 0
    visible: bool = True  # False once deleted; the pages stay until the last release


class SegmentStore:
    """Cached segments in ``num_pages`` pages of ``page_tokens`` tokens (``bytes_per_token`` each).

    ``num_pages == 0`` is a disabled store: lookups miss, registrations raise ``SegmentsDisabled``.
    """

    def __init__(
        self,
        num_pages: int,
        page_tokens: int,
        bytes_per_token: int,
        *,
        observer: SegmentObserver | None = None,
        clock: Callable[[], float] = time.time,
        namespace_fraction: float = 1.0,
    ) -> None:
        assert page_tokens > 0 and bytes_per_token >= 0, (page_tokens, bytes_per_token)
        assert 0 < namespace_fraction <= 1, namespace_fraction
        self.page_tokens = page_tokens
        self.bytes_per_token = bytes_per_token
        self.observer = observer
        self._clock = clock
        self._pages = PageAllocator(num_pages)
        # the most pages one namespace may hold (at least one page when the region has any)
        self.namespace_pages = max(int(num_pages * namespace_fraction), min(num_pages, 1))
        self._namespace_held: dict[str, int] = {}  # pages of visible segments per namespace
        self._serial = 0
        self._records: dict[int, _Record] = {}  # serial -> every record holding pages
        self._by_id: dict[str, _Record] = {}  # id -> visible record
        self._by_namespace: dict[str, dict[int, _Record]] = {}  # visible, registration order
        self._lru: OrderedDict[int, _Record] = OrderedDict()  # visible, least recent first
        self._counters = Counters(lambda ns: ns in self._by_namespace)
        self._failed: OrderedDict[str, tuple[int, str]] = OrderedDict()  # id -> (status, why)

    @classmethod
    def for_pool(
        cls, pool: Any, observer: SegmentObserver | None = None, namespace_fraction: float = 1.0
    ) -> SegmentStore:
        """The store of ``pool.segments`` (a disabled store when the pool has no region)."""
        region = getattr(pool, "segments", None)
        if region is None:
            return cls(0, 1, 0, observer=observer)
        return cls(
            region.num_pages,
            region.page_tokens,
            region.bytes_per_token,
            observer=observer,
            namespace_fraction=namespace_fraction,
        )

    # ---- capacity ----------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self._pages.num_pages > 0

    @property
    def capacity_tokens(self) -> int:
        return self._pages.num_pages * self.page_tokens

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_tokens * self.bytes_per_token

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_tokens)

    # ---- the API -----------------------------------------------------------------------------

    def lookup(self, namespace: str, token_ids: Sequence[int]) -> SegmentEntry | None:
        """The ready segment of exactly these tokens in ``namespace``, or None; counts hit/miss.
        (The scheduler looks its marks up by id, :meth:`lookup_id`.)"""
        namespace = check_namespace(namespace)
        packed = pack_tokens(token_ids)
        rec = self._by_id.get(_digest(namespace, packed))
        hit = rec is not None and rec.ready and rec.packed == packed
        return self._looked_up(namespace, rec if hit else None, len(packed) // 8)

    def lookup_id(self, namespace: str, segment_id: str, num_tokens: int) -> SegmentEntry | None:
        """The ready segment of id ``segment_id`` in ``namespace`` (``num_tokens`` long), or
        None; counts hit/miss. The caller vouches for the id: checked against the request's
        tokens (``redknot.api.marks.segments_of``; the tokens are then neither packed nor
        hashed again, a content address of 128 bits naming one token sequence), or used only to
        count and report (no K/V read)."""
        return self.lookup_ids([(namespace, segment_id, num_tokens)])[0]

    def lookup_ids(self, keys: Sequence[tuple[str, str, int]]) -> list[SegmentEntry | None]:
        """:meth:`lookup_id` of each ``(namespace, segment_id, num_tokens)``, the lookups
        counted once per namespace (a marked request looks its segments up on the scheduler's
        path to its prefill, where a count per segment cost more than the lookup). A namespace
        the store refuses raises ``SegmentError`` before anything is looked up or counted."""
        return [None if s is None else self.entry_of(s) for s in self.find_ids(keys)]

    def find_ids(self, keys: Sequence[tuple[str, str, int]]) -> list[int | None]:
        """:meth:`lookup_ids` giving each hit's serial instead of its entry (:meth:`entry_of`
        makes the entry, as long as nothing has run on the store since): a request the reuse
        gate serves without its hits needs none, and making eight took an eighth of the host time
        of its lookups and decision (``benchmarks/reuse_start_cost.py``)."""
        namespaces = [check_namespace(namespace) for namespace, _, _ in keys]
        out: list[int | None] = []
        tally: dict[str, list[int]] = {}  # namespace -> [hits, misses, hit tokens]
        for namespace, (_, segment_id, num_tokens) in zip(namespaces, keys, strict=True):
            rec = self._ready_record(namespace, segment_id, num_tokens)
            counts = tally.get(namespace)
            if counts is None:
                counts = tally[namespace] = [0, 0, 0]
            if rec is None:
                counts[1] += 1
                out.append(None)
                continue
            counts[0] += 1
            counts[2] += num_tokens
            self._touch(rec)
            out.append(rec.serial)
        for namespace, (hits, misses, tokens) in tally.items():
            self._count_lookups(namespace, hits, misses, tokens)
        return out

    def entry_of(self, serial: int) -> SegmentEntry:
        """The entry of the segment :meth:`find_ids` gave ``serial`` for (``KeyError`` when it
        is gone)."""
        return self._entry(self._records[serial])

    def is_ready(self, namespace: str, segment_id: str, num_tokens: int) -> bool:
        """Whether :meth:`lookup_id` would find the segment now; counts nothing (SamKV cuts a
        prompt on it before the request runs, and looks it up when it does)."""
        return self._ready_record(check_namespace(namespace), segment_id, num_tokens) is not None

    def _ready_record(self, namespace: str, segment_id: str, num_tokens: int) -> _Record | None:
        rec = self._by_id.get(segment_id)
        hit = (
            rec is not None and rec.ready and rec.namespace == namespace
            and rec.num_tokens == num_tokens
        )  # fmt: skip
        return rec if hit else None

    def _looked_up(self, namespace: str, rec: _Record | None, tokens: int) -> SegmentEntry | None:
        self._count_lookups(namespace, int(rec is not None), int(rec is None),
                            tokens if rec is not None else 0)  # fmt: skip
        if rec is None:
            return None
        self._touch(rec)
        return self._entry(rec)

    def _count_lookups(self, namespace: str, hits: int, misses: int, tokens: int) -> None:
        """Count ``hits`` (serving ``tokens``) and ``misses`` of lookups in ``namespace``."""
        saved = tokens * self.bytes_per_token
        self._counters.add(
            namespace, hits=hits, misses=misses, hit_tokens=tokens, bytes_saved=saved
        )
        if self.observer is not None:
            self.observer.lookup(namespace, hits, misses, tokens, saved)

    def register(
        self, namespace: str, token_ids: Sequence[int], *, pin: bool, capture: bool = False
    ) -> SegmentEntry:
        """The segment of these tokens, allocated if new; the caller holds one reference.
        ``capture``: stored on a miss rather than registered (counted as a capture; an existing
        segment keeps its pin)."""
        namespace = check_namespace(namespace)
        packed = pack_tokens(token_ids)
        num_tokens = len(packed) // 8
        if not self.enabled:
            raise SegmentsDisabled(
                "segment caching is off on this server: start it with "
                "--redknot-segment-fraction > 0 (and heads to keep: with every head global, a "
                "token-level --redknot-policy, or --redknot-segment-heads all with "
                "--redknot-kernel triton)"
            )
        need = self.pages_for(num_tokens)
        if need > self._pages.num_pages:
            raise SegmentTooLong(
                f"segment of {num_tokens} tokens is longer than the segment region, which holds "
                f"{self.capacity_tokens} tokens (raise --redknot-segment-fraction)"
            )
        sid = _digest(namespace, packed)
        self._failed.pop(sid, None)
        rec = self._by_id.get(sid)
        if rec is not None:
            if rec.packed != packed:
                raise SegmentError(f"segment id {sid} collides with another segment's tokens")
            if not capture:
                self._set_pin(rec, bool(pin))
            rec.refs += 1
            self._touch(rec)
            return self._entry(rec)
        self._make_namespace_room(namespace, need, num_tokens)
        self._make_room(need)
        self._serial += 1
        now = self._clock()
        rec = _Record(
            serial=self._serial,
            id=sid,
            namespace=namespace,
            packed=packed,
            num_tokens=num_tokens,
            pages=self._pages.alloc(need, self._serial),
            pinned=bool(pin),
            created=now,
            last_used=now,
            refs=1,
        )
        self._records[rec.serial] = rec
        self._by_id[sid] = rec
        self._by_namespace.setdefault(namespace, {})[rec.serial] = rec
        self._lru[rec.serial] = rec
        self._namespace_held[namespace] = self._namespace_held.get(namespace, 0) + need
        if capture:
            self._counters.add(namespace, captures=1)
            if self.observer is not None:
                self.observer.captured(namespace)
        else:
            self._counters.track(namespace)
        self._report_usage(rec, +1)
        return self._entry(rec)

    def mark_ready(self, entry: SegmentEntry) -> None:
        """The forward that writes ``entry``'s K/V has been issued: lookups may now return it."""
        rec = self._record(entry)
        rec.ready, rec.writing = True, False

    def claim_write(self, entry: SegmentEntry) -> bool:
        """Make the caller ``entry``'s only writer: False when it is ready or being written."""
        rec = self._record(entry)
        if rec.ready or rec.writing or not rec.visible:
            return False
        rec.writing = True
        return True

    def note_failure(self, segment_id: str, error: Exception | str) -> None:
        """Remember why the registration of ``segment_id`` stored nothing, for its answer: the
        HTTP status (413 too long for the region, else 409) and the reason."""
        status = 413 if isinstance(error, SegmentTooLong) else 409
        self._failed[segment_id] = (status, str(error))
        self._failed.move_to_end(segment_id)
        while len(self._failed) > MAX_FAILURES:
            self._failed.popitem(last=False)

    def registration_state(self, namespace: str, segment_id: str) -> dict[str, Any]:
        """What a registration of ``segment_id`` left: ``{"state", "status", "reason"}`` with
        state ``ready``, ``writing`` (another registration is still filling it), ``failed``
        (nothing stored; ``status`` 413 or 409 and ``reason`` say why) or ``absent`` (stored,
        then deleted or evicted at once)."""
        try:
            rec = self._find(namespace, segment_id)
        except SegmentNotFound:
            failed = self._failed.get(segment_id)
            if failed is not None:
                return {"state": "failed", "status": failed[0], "reason": failed[1]}
            return {"state": "absent", "status": 409, "reason": "it was deleted or evicted"}
        return {"state": "ready" if rec.ready else "writing", "status": 200, "reason": ""}

    def acquire(self, entry: SegmentEntry) -> None:
        """Take a reference for a reader: the segment is not evicted or freed until released."""
        rec = self._record(entry)
        if not rec.visible:
            raise SegmentNotFound(
                f"segment {entry.id} of namespace {entry.namespace!r} was deleted; look it up again"
            )
        rec.refs += 1

    def release(self, entry: SegmentEntry) -> None:
        """Drop a reference taken by ``acquire`` or ``register``."""
        rec = self._record(entry)
        if rec.refs == 0:
            raise SegmentError(f"segment {entry.id} released more often than acquired")
        rec.refs -= 1
        if rec.refs == 0 and not rec.visible:
            self._free(rec)

    def delete(self, namespace: str, segment_id: str) -> bool:
        """Delete a segment (pinned or not): True if its pages were freed now, False if they are
        freed when its last reader releases it. Raises ``SegmentNotFound`` for an unknown id."""
        rec = self._find(namespace, segment_id)
        self._hide(rec)
        self._counters.add(rec.namespace, deletes=1)
        if rec.refs == 0:
            self._free(rec)
            return True
        return False

    def get(self, namespace: str, segment_id: str) -> SegmentEntry:
        """The segment ``segment_id`` of ``namespace`` (no hit counted, recency untouched)."""
        return self._entry(self._find(namespace, segment_id))

    def list(self, namespace: str) -> list[SegmentEntry]:
        """Segments of ``namespace``, in registration order (not-ready ones included)."""
        namespace = check_namespace(namespace)
        return [self._entry(r) for r in self._by_namespace.get(namespace, {}).values()]

    def namespaces(self) -> list[str]:
        """Namespaces that hold at least one segment."""
        return sorted(self._by_namespace)

    def stats(self, namespace: str | None = None) -> dict[str, Any]:
        """Counters and usage, of one namespace or (None) of the whole store; plain ints."""
        if namespace is None:
            held = list(self._records.values())
        else:
            namespace = check_namespace(namespace)
            held = [r for r in self._records.values() if r.namespace == namespace]
        visible = [r for r in held if r.visible]
        out: dict[str, Any] = self._counters.of(namespace).as_dict()
        out.update(
            enabled=self.enabled,
            segments=len(visible),
            pinned=sum(r.pinned for r in visible),
            referenced=sum(r.refs > 0 for r in held),
            pending_deletes=len(held) - len(visible),
            namespace_cap_tokens=self.namespace_pages * self.page_tokens,
            tokens=sum(r.num_tokens for r in visible),
            bytes_used=sum(len(r.pages) for r in held) * self.page_tokens * self.bytes_per_token,
            capacity_bytes=self.capacity_bytes,
            capacity_tokens=self.capacity_tokens,
            page_tokens=self.page_tokens,
            bytes_per_token=self.bytes_per_token,
        )
        if namespace is None:
            out["namespaces"] = len(self._by_namespace)
        return out

    def clear(self) -> int:
        """Drop every segment, pinned ones too (a cache flush); returns how many were dropped.
        Segments still read are freed at their last release."""
        dropped = list(self._lru.values())
        for rec in dropped:
            self._hide(rec)
            if rec.refs == 0:
                self._free(rec)
        return len(dropped)

    def check(self) -> None:
        """Assert the store's invariants (pages owned once, indexes consistent)."""
        self._pages.check({s: r.pages for s, r in self._records.items()})
        visible = {s for s, r in self._records.items() if r.visible}
        assert visible == set(self._lru) == {r.serial for r in self._by_id.values()}
        assert visible == {s for recs in self._by_namespace.values() for s in recs}
        assert all(r.refs > 0 for r in self._records.values() if not r.visible)
        assert all(r.refs >= 0 for r in self._records.values())
        held: dict[str, int] = {}
        for r in self._lru.values():
            held[r.namespace] = held.get(r.namespace, 0) + len(r.pages)
        assert held == self._namespace_held, (held, self._namespace_held)

    # ---- internals ---------------------------------------------------------------------------

    def _find(self, namespace: str, segment_id: str) -> _Record:
        namespace = check_namespace(namespace)
        if not isinstance(segment_id, str):
            raise SegmentError(f"segment id must be a string, got {type(segment_id).__name__}")
        rec = self._by_id.get(segment_id)
        if rec is None or rec.namespace != namespace:
            raise SegmentNotFound(f"no segment {segment_id!r} in namespace {namespace!r}")
        return rec

    def _record(self, entry: SegmentEntry) -> _Record:
        rec = self._records.get(entry.serial)
        if rec is None or rec.id != entry.id:
            raise SegmentNotFound(
                f"segment {entry.id} of namespace {entry.namespace!r} is no longer cached"
            )
        return rec

    def _entry(self, rec: _Record) -> SegmentEntry:
        return SegmentEntry(
            id=rec.id,
            namespace=rec.namespace,
            num_tokens=rec.num_tokens,
            pinned=rec.pinned,
            pages=rec.pages,
            page_tokens=self.page_tokens,
            ready=rec.ready,
            refs=rec.refs,
            created=rec.created,
            last_used=rec.last_used,
            serial=rec.serial,
        )

    def _touch(self, rec: _Record) -> None:
        rec.last_used = self._clock()
        self._lru.move_to_end(rec.serial)

    def _set_pin(self, rec: _Record, pin: bool) -> None:
        if rec.pinned != pin and self.observer is not None:
            self.observer.usage(rec.namespace, 0, 1 if pin else -1, 0)
        rec.pinned = pin

    def _make_namespace_room(self, namespace: str, need: int, num_tokens: int) -> None:
        """Evict ``namespace``'s own segments until ``need`` more pages fit under its cap."""
        if self.namespace_pages >= self._pages.num_pages:
            return  # no cap below the region: the region's own rule applies
        if need > self.namespace_pages:
            raise SegmentTooLong(
                f"segment of {num_tokens} tokens is longer than what one namespace may hold "
                f"({self.namespace_pages * self.page_tokens} tokens: raise "
                "--redknot-namespace-fraction or --redknot-segment-fraction)"
            )
        short = self._namespace_held.get(namespace, 0) + need - self.namespace_pages
        if short <= 0:
            return
        own = [r for r in self._lru.values() if r.namespace == namespace]
        victims = choose_victims(own, short)
        if victims is None:
            raise SegmentStoreFull(
                f"namespace {namespace!r} holds its cap of {self.namespace_pages} pages, pinned "
                "or read by live requests (delete or unpin its segments, or raise "
                "--redknot-namespace-fraction)"
            )
        self._evict(victims)

    def _make_room(self, need: int) -> None:
        short = need - self._pages.free_pages
        if short <= 0:
            return
        victims = choose_victims(self._lru.values(), short)
        if victims is None:
            raise SegmentStoreFull(
                f"the segment region cannot hold {need} more pages: {self._pages.free_pages} "
                "free, the rest pinned or read by live requests (delete or unpin segments, or "
                "raise --redknot-segment-fraction)"
            )
        self._evict(victims)

    def _evict(self, victims: list[_Record]) -> None:
        for rec in victims:
            self._hide(rec)
            self._free(rec)
            self._counters.add(rec.namespace, evictions=1)
            if self.observer is not None:
                self.observer.evicted(rec.namespace)

    def _hide(self, rec: _Record) -> None:
        """Make ``rec`` invisible to lookups and listings (its pages are not freed here)."""
        rec.visible = False
        held = self._namespace_held[rec.namespace] - len(rec.pages)
        if held:
            self._namespace_held[rec.namespace] = held
        else:
            del self._namespace_held[rec.namespace]
        del self._by_id[rec.id]
        del self._lru[rec.serial]
        ns = self._by_namespace[rec.namespace]
        del ns[rec.serial]
        if not ns:
            del self._by_namespace[rec.namespace]
        if self.observer is not None:
            self.observer.usage(rec.namespace, -1, -int(rec.pinned), 0)

    def _free(self, rec: _Record) -> None:
        self._pages.free(rec.pages, rec.serial)
        del self._records[rec.serial]
        if self.observer is not None:
            self.observer.usage(rec.namespace, 0, 0, -self._bytes_of(rec))

    def _report_usage(self, rec: _Record, sign: int) -> None:
        if self.observer is not None:
            self.observer.usage(
                rec.namespace, sign, sign * int(rec.pinned), sign * self._bytes_of(rec)
            )

    def _bytes_of(self, rec: _Record) -> int:
        return len(rec.pages) * self.page_tokens * self.bytes_per_token
