"""The store's per-namespace cap and capture accounting: a namespace over its cap evicts only its
own unpinned, unreferenced segments (never another namespace's, never a pinned one), and is
refused when those cannot make room; captures are counted per namespace and never change a pin."""

from __future__ import annotations

import pytest

from redknot.segcache.entry import SegmentStoreFull, SegmentTooLong
from redknot.segcache.store import SegmentStore

PAGE = 4


def stored(store, ns, start, pages=1, *, pin=False, capture=False):
    e = store.register(ns, list(range(start, start + pages * PAGE)), pin=pin, capture=capture)
    store.mark_ready(e)
    store.release(e)
    return e


def test_a_flooding_namespace_evicts_only_its_own_segments():
    store = SegmentStore(8, PAGE, 1, namespace_fraction=0.5)  # 4 pages per namespace
    assert store.namespace_pages == 4
    others = [stored(store, "b", 1000 + 10 * i) for i in range(3)]
    for i in range(20):  # "a" floods with captures
        stored(store, "a", 10 * i, capture=True)
        store.check()
    assert store.stats("a")["segments"] == 4
    assert store.stats("a")["evictions"] == 16 and store.stats("a")["captures"] == 20
    assert [e.id for e in store.list("b")] == [e.id for e in others]  # untouched
    assert store.stats("b")["evictions"] == 0


def test_pinned_and_read_segments_are_never_evicted_by_captures():
    store = SegmentStore(8, PAGE, 1, namespace_fraction=0.5)
    pinned = [stored(store, "a", 100 * i, pin=True) for i in range(3)]
    read = stored(store, "a", 900)
    store.acquire(read)
    with pytest.raises(SegmentStoreFull, match="namespace 'a' holds its cap of 4 pages"):
        stored(store, "a", 5000, capture=True)
    assert {e.id for e in store.list("a")} == {e.id for e in [*pinned, read]}
    store.release(read)
    stored(store, "a", 5000, capture=True)  # now the unreferenced one makes room
    assert {e.id for e in pinned} <= {e.id for e in store.list("a")}
    store.check()


def test_a_segment_longer_than_the_cap_is_too_long():
    store = SegmentStore(8, PAGE, 1, namespace_fraction=0.25)
    with pytest.raises(SegmentTooLong, match="longer than what one namespace may hold"):
        stored(store, "a", 0, pages=3)
    assert store.stats()["segments"] == 0


def test_a_capture_of_a_stored_segment_keeps_its_pin_and_counts_nothing():
    store = SegmentStore(8, PAGE, 1)
    e = stored(store, "a", 0, pin=True)
    again = store.register("a", list(range(PAGE)), pin=False, capture=True)
    store.release(again)
    assert again.id == e.id and store.get("a", e.id).pinned
    assert store.stats("a")["captures"] == 0


def test_full_fraction_is_the_region_rule():
    store = SegmentStore(4, PAGE, 1)  # namespace_fraction 1.0: one namespace may fill it
    for i in range(4):
        stored(store, "a", 10 * i)
    stored(store, "b", 500)  # evicts a's oldest: the region's LRU rule, no cap
    assert store.stats("a")["segments"] == 3 and store.stats("b")["segments"] == 1
    store.check()
