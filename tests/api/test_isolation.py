"""Namespace isolation, end to end on the CPU server (``cpu_server.py``: the real request API,
control path and ``SegmentStore``): a segment registered in namespace A is never hit, listed,
deleted or counted from namespace B, and B's lookup of A's tokens takes exactly the path of a
lookup of tokens never seen."""

from __future__ import annotations

import sys

import pytest

from redknot.api.marks import decode_marks, segment_id

DOC = "Paris is the capital of France; Berlin is the capital of Germany."
OTHER = "The quick brown fox jumps over the lazy dog."
TEXT = "Context: " + DOC + " Question?"
SPAN = (9, 9 + len(DOC))


@pytest.fixture
def world(http_app, client, bpe_tokenizer):
    """A CPU server where A holds DOC and B exists (it holds another segment)."""
    from tests.api.cpu_server import CpuServer

    server = CpuServer(http_app, bpe_tokenizer)
    for ns, doc in (("A", DOC), ("B", OTHER)):
        r = client.post("/redknot/segments", json={"namespace": ns, "text": doc})
        assert r.status_code == 200, r.text
    seg = bpe_tokenizer.encode(DOC, add_special_tokens=False)
    return server, seg, segment_id("A", seg)


def _use(client, ns):
    body = {"text": TEXT, "redknot_segments": [{"start": SPAN[0], "end": SPAN[1], "namespace": ns}]}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]["standin_read_tokens"]


def _counts(store, ns):
    s = store.stats(ns)
    return {k: s[k] for k in ("hits", "misses", "hit_tokens", "segments", "deletes", "tokens")}


def test_b_gets_another_segment_id_and_a_miss(world, client):
    server, seg, a_id = world
    a_before = _counts(server.store, "A")
    a_entry = server.store.get("A", a_id)
    assert _use(client, "B") == 0  # nothing read from the store
    (mark,) = decode_marks(
        server.tm.last.sampling_params["custom_params"], server.tm.last.input_ids
    )
    assert mark.namespace == "B" and mark.segment_id == segment_id("B", seg) != a_id
    assert server.store.stats("B")["misses"] == 1 and server.store.stats("B")["hits"] == 0
    assert _counts(server.store, "A") == a_before  # A counted nothing
    assert server.store.get("A", a_id).last_used == a_entry.last_used  # nor was touched
    # the same request in A is a hit: B's miss is the namespace, not the tokens
    assert _use(client, "A") == len(seg)
    assert server.store.stats("A")["hits"] == 1


def test_b_does_not_hold_a_reference_on_a(world, client):
    server, seg, a_id = world
    server.scheduler.hold(1)  # B's request keeps running
    _use(client, "B")
    assert server.store.get("A", a_id).refs == 0
    server.scheduler.hold(1)
    assert _use(client, "A") == len(seg)
    assert server.store.get("A", a_id).refs == 1  # A's own reader
    server.scheduler.finish_running()
    assert server.store.get("A", a_id).refs == 0


def test_b_cannot_list_delete_or_count_a(world, client):
    server, seg, a_id = world
    listed_b = client.get("/redknot/segments", params={"namespace": "B"}).json()["segments"]
    assert a_id not in [s["id"] for s in listed_b] and len(listed_b) == 1
    r = client.delete(f"/redknot/segments/{a_id}", params={"namespace": "B"})
    assert r.status_code == 404
    assert r.json()["error"]["message"] == f"no segment {a_id!r} in namespace 'B'"
    listed_a = client.get("/redknot/segments", params={"namespace": "A"}).json()["segments"]
    assert [s["id"] for s in listed_a] == [a_id] and server.store.get("A", a_id).ready
    stats_b = client.get("/redknot/stats", params={"namespace": "B"}).json()["store"]
    other = len(server.tm.tokenizer.encode(OTHER, add_special_tokens=False))
    assert (stats_b["segments"], stats_b["tokens"], stats_b["deletes"]) == (1, other, 0)
    stats_a = client.get("/redknot/stats", params={"namespace": "A"}).json()["store"]
    assert (stats_a["segments"], stats_a["tokens"], stats_a["deletes"]) == (1, len(seg), 0)
    # B registering the same tokens makes its own segment, on its own pages
    r = client.post("/redknot/segments", json={"namespace": "B", "text": DOC})
    b_id = r.json()["segment_id"]
    assert b_id == segment_id("B", seg) != a_id
    a, b = server.store.get("A", a_id), server.store.get("B", b_id)
    assert set(a.pages).isdisjoint(b.pages) and a.serial != b.serial
    # deleting B's copy leaves A's
    assert client.delete(f"/redknot/segments/{b_id}", params={"namespace": "B"}).status_code == 200
    assert server.store.get("A", a_id).ready and _use(client, "A") == len(seg)


class _Recorder(dict):
    """The store's id index, recording every key it is asked for."""

    def __init__(self, *args):
        super().__init__(*args)
        self.asked: list[str] = []

    def get(self, key, default=None):
        self.asked.append(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.asked.append(key)
        return super().__getitem__(key)


def _trace(fn):
    """``fn()``'s result and the (function, line) steps it ran inside ``redknot.segcache``."""
    steps: list[tuple[str, int]] = []

    def tracer(frame, event, arg):
        if "redknot/segcache/" not in frame.f_code.co_filename:
            return None
        if event == "line":
            steps.append((frame.f_code.co_qualname, frame.f_lineno))
        return tracer

    sys.settrace(tracer)
    try:
        result = fn()
    finally:
        sys.settrace(None)
    return result, steps


def test_b_lookup_of_a_tokens_takes_the_never_seen_path(world, bpe_tokenizer):
    """What a "timed" probe from B could tell apart: nothing. B's lookup of A's tokens runs the
    same lines as B's lookup of tokens never stored anywhere, asks the id index only for B's
    own key, and leaves A's segment (counters, recency, LRU place) untouched."""
    server, seg, a_id = world
    store = server.store
    never = bpe_tokenizer.encode("Never registered anywhere.", add_special_tokens=False)
    store._by_id = index = _Recorder(store._by_id)
    store.lookup("B", [1, 2, 3])  # B's counters exist from here on (a first miss creates them)
    a_state = (_counts(store, "A"), store.get("A", a_id).last_used, list(store._lru))

    index.asked.clear()
    hit_never, path_never = _trace(lambda: store.lookup("B", never))
    asked_never = list(index.asked)
    index.asked.clear()
    hit_a, path_a = _trace(lambda: store.lookup("B", seg))
    asked_a = list(index.asked)

    assert hit_never is None and hit_a is None
    assert path_a == path_never and path_a  # the very same lines, in the same order
    assert asked_a == [segment_id("B", seg)] and asked_never == [segment_id("B", never)]
    assert a_id not in asked_a
    assert (_counts(store, "A"), store.get("A", a_id).last_used, list(store._lru)) == a_state
    assert store.stats("B")["misses"] == 3 and store.stats("B")["hits"] == 0
    # and A's own lookup of the same tokens is a hit, through its own key
    index.asked.clear()
    assert store.lookup("A", seg).id == a_id and index.asked == [a_id]
