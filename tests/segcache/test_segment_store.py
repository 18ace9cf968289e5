"""The segment store's API: keys and ids, hits and misses, namespaces, pins, references, delete,
stats counted by hand, and the errors bad input gets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from redknot.segcache.entry import (
    SegmentError,
    SegmentNotFound,
    SegmentsDisabled,
    SegmentStoreFull,
    segment_id,
)
from redknot.segcache.store import SegmentStore

PAGE, BPT = 4, 100  # tokens per page, bytes per token


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def make_store(pages: int = 8) -> SegmentStore:
    return SegmentStore(pages, PAGE, BPT, clock=Clock())


def ready(store: SegmentStore, ns: str, tokens, *, pin: bool = False):
    """Register, write (nothing to write here), mark ready and release: a cached segment."""
    e = store.register(ns, tokens, pin=pin)
    store.mark_ready(e)
    store.release(e)
    return e


def test_segment_id_is_deterministic_and_depends_on_namespace_and_tokens():
    a = segment_id("kb1", [1, 2, 3])
    assert a == segment_id("kb1", (1, 2, 3)) == segment_id("kb1", torch.tensor([1, 2, 3]))
    assert a == segment_id("kb1", np.array([1, 2, 3], dtype=np.int32))
    assert len(a) == 32 and int(a, 16) >= 0
    assert a != segment_id("kb2", [1, 2, 3])
    assert a != segment_id("kb1", [1, 2, 4])
    assert a != segment_id("kb1", [1, 2])
    # the namespace is length-prefixed: moving bytes between namespace and tokens changes the id
    assert segment_id("", [0x31, 2]) != segment_id("1", [2])


def test_register_then_lookup_counts_misses_and_hits():
    store = make_store()
    toks = list(range(10))
    assert store.lookup("ns", toks) is None  # miss 1: never registered
    e = store.register("ns", toks, pin=False)
    assert (e.num_tokens, len(e.pages), e.ready, e.refs) == (10, 3, False, 1)
    assert store.lookup("ns", toks) is None  # miss 2: registered, K/V not written yet
    store.mark_ready(e)
    hit = store.lookup("ns", toks)
    assert hit is not None and hit.id == e.id and hit.ready
    assert store.lookup("ns", toks[:-1]) is None  # miss 3: a prefix is another segment
    store.release(e)
    s = store.stats()
    assert (s["hits"], s["misses"], s["hit_tokens"], s["bytes_saved"]) == (1, 3, 10, 10 * BPT)
    store.check()


def test_rows_address_tokens_page_by_page():
    store = make_store()
    ready(store, "ns", [9] * 3)  # takes page 0
    e = store.register("ns", list(range(6)), pin=False)
    assert e.pages == (1, 2)
    assert e.rows().tolist() == [4, 5, 6, 7, 8, 9]
    assert e.rows().dtype == torch.int64
    offsets = np.array([5, 0, 3, 4], dtype=np.int64)
    assert e.rows_of(offsets).tolist() == e.rows()[torch.from_numpy(offsets)].tolist()


def test_register_is_idempotent_and_updates_pin():
    store = make_store()
    e1 = store.register("ns", [1, 2, 3], pin=False)
    e2 = store.register("ns", [1, 2, 3], pin=True)
    assert e2.id == e1.id and e2.pages == e1.pages and e2.serial == e1.serial
    assert e2.pinned and e2.refs == 2  # each register holds one reference
    assert store.stats()["segments"] == 1 and store.stats()["pinned"] == 1
    e3 = store.register("ns", [1, 2, 3], pin=False)
    assert not e3.pinned and store.stats()["pinned"] == 0
    for _ in range(3):
        store.release(e1)
    assert store.get("ns", e1.id).refs == 0
    with pytest.raises(SegmentError, match="released more often than acquired"):
        store.release(e1)


def test_namespaces_never_cross():
    store = make_store()
    toks = [5, 6, 7, 8, 9]
    a = ready(store, "A", toks)
    b = ready(store, "B", toks)
    assert a.id != b.id and set(a.pages).isdisjoint(b.pages)
    assert [e.id for e in store.list("A")] == [a.id]
    assert [e.id for e in store.list("B")] == [b.id]
    assert store.lookup("B", toks).id == b.id
    with pytest.raises(SegmentNotFound):
        store.delete("B", a.id)  # B cannot delete A's segment, even knowing its id
    with pytest.raises(SegmentNotFound):
        store.get("B", a.id)
    assert store.delete("B", b.id) is True
    assert store.list("B") == [] and store.lookup("B", toks) is None
    assert store.lookup("A", toks).id == a.id  # A's segment is untouched
    assert store.stats("A")["hits"] == 1 and store.stats("B")["hits"] == 1
    assert store.stats("B")["misses"] == 1 and store.stats("A")["misses"] == 0
    assert store.namespaces() == ["A"]


def test_acquire_release_counts_return_to_zero():
    store = make_store()
    e = ready(store, "ns", [1, 2, 3, 4, 5])
    for _ in range(3):
        store.acquire(store.lookup("ns", [1, 2, 3, 4, 5]))
    assert store.get("ns", e.id).refs == 3 and store.stats()["referenced"] == 1
    for _ in range(3):
        store.release(e)
    assert store.get("ns", e.id).refs == 0 and store.stats()["referenced"] == 0
    store.check()


def test_delete_of_a_referenced_segment_is_deferred_to_its_last_release():
    store = make_store(pages=2)
    toks = [1, 2, 3, 4, 5, 6]
    e = ready(store, "ns", toks)
    store.acquire(e)  # a live request reads it
    assert store.delete("ns", e.id) is False  # deferred
    assert store.lookup("ns", toks) is None and store.list("ns") == []
    with pytest.raises(SegmentNotFound, match="was deleted"):
        store.acquire(e)
    s = store.stats()
    assert (s["segments"], s["pending_deletes"], s["bytes_used"]) == (0, 1, 2 * PAGE * BPT)
    # its pages are still held: a new segment cannot take them
    with pytest.raises(SegmentStoreFull):
        store.register("ns", [7, 8], pin=False)
    # re-registering the same tokens makes a new segment (new serial), not the dying one
    store.release(e)  # the reader finishes: pages freed now
    assert store.stats()["bytes_used"] == 0 and store.stats()["pending_deletes"] == 0
    again = store.register("ns", toks, pin=False)
    assert again.id == e.id and again.serial != e.serial and not again.ready
    with pytest.raises(SegmentNotFound, match="no longer cached"):
        store.release(e)  # a stale entry of the deleted registration
    store.release(again)
    store.check()


def test_pinned_segments_are_deleted_only_explicitly():
    store = make_store(pages=4)
    pinned = ready(store, "ns", list(range(8)), pin=True)  # 2 pages
    for i in range(20):  # churn through the other 2 pages
        ready(store, "ns", [100 + i] * 8)
    assert store.lookup("ns", list(range(8))).id == pinned.id
    assert store.stats()["evictions"] == 19
    with pytest.raises(SegmentStoreFull, match="pinned or read by live requests"):
        store.register("ns", list(range(200, 216)), pin=False)  # needs 4 pages
    assert store.delete("ns", pinned.id) is True
    ready(store, "ns", list(range(200, 216)))
    store.check()


def test_stats_by_hand():
    store = make_store(pages=10)
    a = ready(store, "A", [1] * 5, pin=True)  # 2 pages
    ready(store, "A", [2] * 4)  # 1 page
    b = ready(store, "B", [3] * 9)  # 3 pages
    store.lookup("A", [1] * 5)  # hit 5 tokens
    store.lookup("A", [1] * 5)  # hit 5 tokens
    store.lookup("A", [9] * 5)  # miss
    store.lookup("B", [3] * 9)  # hit 9 tokens
    store.lookup("C", [3] * 9)  # miss in an empty namespace
    store.acquire(b)
    assert store.delete("B", b.id) is False
    s = store.stats()
    assert s["hits"] == 3 and s["misses"] == 2 and s["hit_tokens"] == 19
    assert s["bytes_saved"] == 19 * BPT
    assert s["segments"] == 2 and s["pinned"] == 1 and s["referenced"] == 1
    assert s["pending_deletes"] == 1 and s["deletes"] == 1 and s["evictions"] == 0
    assert s["tokens"] == 9 and s["bytes_used"] == 6 * PAGE * BPT
    assert s["capacity_tokens"] == 40 and s["capacity_bytes"] == 40 * BPT
    assert s["namespaces"] == 1 and s["enabled"] is True
    sa = store.stats("A")
    assert (sa["hits"], sa["misses"], sa["hit_tokens"], sa["bytes_saved"]) == (2, 1, 10, 1000)
    assert (sa["segments"], sa["pinned"], sa["bytes_used"]) == (2, 1, 3 * PAGE * BPT)
    sb = store.stats("B")
    assert (sb["segments"], sb["pending_deletes"], sb["bytes_used"]) == (0, 1, 3 * PAGE * BPT)
    sc = store.stats("C")
    assert (sc["misses"], sc["segments"], sc["bytes_used"]) == (1, 0, 0)
    assert "namespaces" not in sa
    assert store.get("A", a.id).last_used > store.get("A", a.id).created


def test_clear_drops_every_segment_pinned_ones_too():
    store = make_store()
    ready(store, "ns", [1, 2], pin=True)
    held = ready(store, "ns", [3, 4])
    store.acquire(held)
    assert store.clear() == 2
    assert store.list("ns") == [] and store.stats()["pending_deletes"] == 1
    store.release(held)
    assert store.stats()["bytes_used"] == 0
    store.check()


@pytest.mark.parametrize(
    "tokens, message",
    [
        ([], "at least one token"),
        ([1, -2], ">= 0"),
        ([1.5, 2.0], "integers"),
        ([[1, 2]], "flat sequence"),
    ],
)
def test_bad_tokens_are_clear_errors(tokens, message):
    store = make_store()
    with pytest.raises(SegmentError, match=message):
        store.register("ns", tokens, pin=False)
    with pytest.raises(SegmentError, match=message):
        store.lookup("ns", tokens)


def test_other_bad_input_is_a_clear_error():
    store = make_store(pages=2)
    with pytest.raises(SegmentError, match="longer than the segment region, which holds 8"):
        store.register("ns", list(range(9)), pin=False)
    with pytest.raises(SegmentNotFound, match="no segment 'ffff' in namespace 'ns'"):
        store.delete("ns", "ffff")
    with pytest.raises(SegmentError, match="namespace must be a string"):
        store.lookup(7, [1])
    with pytest.raises(SegmentError, match="at most 256"):
        store.list("x" * 257)
    with pytest.raises(SegmentError, match="segment id must be a string"):
        store.get("ns", 123)
    assert store.stats()["segments"] == 0 and store.stats()["misses"] == 0


def test_disabled_store_misses_and_refuses_registration():
    store = SegmentStore(0, PAGE, BPT)
    assert not store.enabled and store.stats()["enabled"] is False
    assert store.lookup("ns", [1, 2]) is None
    with pytest.raises(SegmentsDisabled, match="--redknot-segment-fraction"):
        store.register("ns", [1, 2], pin=True)
    assert store.stats()["misses"] == 1


def test_namespace_counters_are_bounded(monkeypatch):
    from redknot.segcache import counters

    monkeypatch.setattr(counters, "MAX_TRACKED_NAMESPACES", 4)
    store = make_store()
    ready(store, "kept", [1])
    for i in range(10):
        store.lookup(f"probe{i}", [1])
    assert len(store._counters) <= 4
    assert "kept" in store._counters  # a namespace that holds segments keeps its counters
    assert store.stats()["misses"] == 10  # the totals still count everything
    assert store.stats("probe9")["misses"] == 1 and store.stats("probe0")["misses"] == 0


def test_lookup_by_a_verified_id_counts_as_a_lookup_by_content():
    from redknot.segcache.entry import segment_id

    store = make_store()
    toks = list(range(10))
    e = ready(store, "ns", toks)
    sid = segment_id("ns", toks)
    hit = store.lookup_id("ns", sid, len(toks))
    assert hit is not None and hit.id == e.id == sid
    assert store.lookup_id("other", sid, len(toks)) is None  # another namespace's id
    assert store.lookup_id("ns", segment_id("ns", toks[:-1]), 9) is None
    s = store.stats()
    assert (s["hits"], s["misses"], s["hit_tokens"]) == (1, 2, 10)
    # an id the caller did not check (a prompt no hit could pay for: only counted) must at
    # least name a segment of the marked length
    assert store.lookup_id("ns", sid, 10).id == sid and store.lookup_id("ns", sid, 9) is None
    assert store.stats()["misses"] == 3
    store.check()


def test_a_requests_lookups_find_what_each_lookup_finds_and_count_once_per_namespace():
    """``lookup_ids`` (a marked request's lookups) returns what ``lookup_id`` returns key by
    key, counts the same totals, touches the same segments, and reports to the observer once
    per namespace with the namespace's sums."""
    from redknot.segcache.entry import segment_id

    class Observer:
        def __init__(self):
            self.calls = []

        def lookup(self, ns, hits, misses, tokens, saved):
            self.calls.append((ns, hits, misses, tokens, saved))

        def usage(self, *args):
            pass

    def world():
        store = SegmentStore(8, PAGE, BPT, clock=Clock(), observer=Observer())
        docs = {(ns, n): list(range(n + ord(ns[0]), 2 * n + ord(ns[0]))) for ns, n in
                (("a", 5), ("a", 7), ("b", 3))}  # fmt: skip
        for (ns, _), toks in docs.items():
            ready(store, ns, toks)
        return store, docs

    store, docs = world()
    keys = [(ns, segment_id(ns, toks), len(toks)) for (ns, _), toks in docs.items()]
    keys += [("a", segment_id("a", [9, 9]), 2), ("b", keys[0][1], 5), ("c", "0" * 32, 4)]
    got = store.lookup_ids(keys)
    one_by_one, _ = world()
    want = [one_by_one.lookup_id(*key) for key in keys]
    assert [e and e.id for e in got] == [e and e.id for e in want]
    assert [e is not None for e in got] == [True, True, True, False, False, False]
    assert store.stats() == one_by_one.stats()
    for ns in "abc":
        assert store.stats(ns) == one_by_one.stats(ns)
    # the same segments touched in the same order (eviction's recency)
    assert [e.last_used for e in got if e] == [e.last_used for e in want if e]
    assert list(store._lru) == list(one_by_one._lru)
    assert store.observer.calls == [("a", 2, 1, 12, 12 * BPT), ("b", 1, 1, 3, 3 * BPT),
                                    ("c", 0, 1, 0, 0)]  # fmt: skip
    assert len(one_by_one.observer.calls) == len(keys)
    assert store.lookup_ids([]) == [] and store.observer.calls[-1][0] == "c"
    # find_ids (the scheduler's lookups before the gate decides): the same lookups, counts and
    # recency, each hit's entry made on demand
    by_serial, _ = world()
    serials = by_serial.find_ids(keys)
    assert [s is not None for s in serials] == [True, True, True, False, False, False]
    made = [by_serial.entry_of(s) for s in serials if s is not None]
    assert [e.id for e in made] == [e.id for e in want if e]
    assert [e.num_tokens for e in made] == [e.num_tokens for e in want if e]
    assert by_serial.stats() == one_by_one.stats() and list(by_serial._lru) == list(store._lru)
    assert by_serial.observer.calls == store.observer.calls[:3]
    before, order = store.stats(), list(store._lru)
    with pytest.raises(SegmentError, match="at most 256"):  # nothing looked up or counted
        store.lookup_ids([keys[0], ("x" * 300, "0" * 32, 4)])
    assert store.stats() == before and list(store._lru) == order
    store.check()
