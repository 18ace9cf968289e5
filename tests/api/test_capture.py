"""Capture on miss against the CPU server stand-in (``cpu_server.py``: SGLang's real app and
redknot's real request API, segment store and registration path, no model): a fresh server
serves marked requests with no registration, stores what missed, and the next request hits;
capture off per request and per server; bad flags are 400s; a capture that cannot be stored
loses nothing."""

from __future__ import annotations

import types

import pytest

from redknot.api.marks import decode_marks, segment_id

DOC = "Paris is the capital of France. Berlin is the capital of Germany."


@pytest.fixture
def make_server(http_app, smollm_tokenizer, server_args):
    from tests.api.cpu_server import CpuServer

    def make(**options):
        options.setdefault("chat", "messages")
        return CpuServer(http_app, smollm_tokenizer, server_args=server_args, **options)

    return make


def _generate(client, question="Capital of France?", namespace="kb", **extra):
    text = f"Context: {DOC}\nQuestion: {question}\nAnswer:"
    start = text.index(DOC)
    body = {
        "text": text,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "redknot_segments": [{"start": start, "end": start + len(DOC), "namespace": namespace}],
        **extra,
    }
    return client.post("/generate", json=body)


def _doc_tokens(tok) -> int:
    return len(tok.encode(DOC, add_special_tokens=False))


def _captures(server) -> list:
    return server.tm.captures


def test_fresh_server_new_namespace_miss_then_capture_then_hit(
    make_server, client, smollm_tokenizer
):
    server = make_server()
    n = _doc_tokens(smollm_tokenizer)
    r = _generate(client)  # "kb" was never registered: created on first use
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["standin_read_tokens"] == 0
    assert server.store.stats("kb")["misses"] == 1
    (cap,) = _captures(server)  # the standalone segment: its tokens only, positions from 0
    (mark,) = decode_marks(cap.sampling_params["custom_params"], cap.input_ids)
    assert (mark.start, mark.end) == (0, n) and cap.sampling_params["max_new_tokens"] == 0
    assert mark.segment_id == segment_id(
        "kb", smollm_tokenizer.encode(DOC, add_special_tokens=False)
    )
    (seg,) = server.store.list("kb")
    assert seg.ready and not seg.pinned and seg.num_tokens == n
    r = _generate(client, "Capital of Germany?")  # another question, same document
    assert r.json()["meta_info"]["standin_read_tokens"] == n
    stats = client.get("/redknot/stats", params={"namespace": "kb"}).json()
    assert stats["store"]["hits"] == 1 and stats["store"]["captures"] == 1
    assert stats["api"]["captures_stored"] == 1 and stats["api"]["captures_skipped"] == 1
    assert len(_captures(server)) == 1  # the hit sent nothing
    assert "kb" in stats["namespaces"]


def test_same_document_twice_in_one_request_is_captured_once(make_server, client):
    server = make_server()
    text = f"{DOC} and again: {DOC}"
    spans = [{"start": 0, "end": len(DOC)}, {"start": text.rindex(DOC), "end": len(text)}]
    r = client.post("/generate", json={"text": text, "redknot_segments": spans})
    assert r.status_code == 200, r.text
    assert len(_captures(server)) == 1
    assert server.api.counters.captures_deduplicated == 1
    assert server.store.stats()["segments"] == 1


def _chat_about_doc(client, question: str) -> None:
    """An OpenAI chat request of two user messages, ``DOC`` then ``question``."""
    body = {
        "model": "m",
        "max_completion_tokens": 4,
        "messages": [{"role": "user", "content": DOC}, {"role": "user", "content": question}],
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text


def test_chat_document_in_two_requests_hits_the_second_time(make_server, client):
    server = make_server()
    for question in ("Capital of France?", "Capital of Germany?"):
        _chat_about_doc(client, question)
    stats = server.store.stats()
    assert stats["hits"] == 1  # the document; the two questions differ
    assert stats["misses"] == 3 and stats["captures"] == 3


def test_capture_off_per_request_and_per_server(make_server, client):
    server = make_server()
    for _ in range(2):
        assert _generate(client, redknot_capture=False).status_code == 200
    assert server.store.stats()["misses"] == 2 and not _captures(server)
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": DOC}],
        "custom_params": {"redknot_capture": False},
    }
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert not _captures(server)

    server = make_server(capture="off")
    for _ in range(2):
        assert _generate(client).status_code == 200
    assert server.store.stats()["misses"] == 2 and server.store.stats()["segments"] == 0
    assert not _captures(server)


@pytest.mark.parametrize("value", ["no", 0, None, [False]])
def test_bad_capture_flag_is_a_400(make_server, client, value):
    server = make_server()
    r = _generate(client, redknot_capture=value)
    assert r.status_code == 400 and "redknot_capture must be true or false" in r.text
    r = client.post("/generate", json={"text": "plain", "redknot_capture": value})
    assert r.status_code == 400
    assert not server.tm.received


def test_capture_flag_without_segments_is_removed(make_server, client):
    server = make_server()
    r = client.post("/generate", json={"text": "plain prompt", "redknot_capture": False})
    assert r.status_code == 200, r.text
    assert server.tm.last.text == "plain prompt" and not _captures(server)


def test_fixed_namespaces_keep_unknown_ones_a_400(make_server, client):
    server = make_server(namespaces="kb")
    assert _generate(client).status_code == 200
    r = _generate(client, namespace="other")
    assert r.status_code == 400 and "fixed by --redknot-namespaces" in r.text
    assert server.store.namespaces() == ["kb"]


def test_capture_longer_than_the_region_stores_nothing_and_loses_nothing(make_server, client):
    server = make_server(region_tokens=8)  # the document has more tokens than the region
    pinned = client.post("/redknot/segments", json={"input_ids": [5, 6, 7], "pin": True})
    assert pinned.status_code == 200, pinned.text
    for _ in range(2):
        r = _generate(client)
        assert r.status_code == 200 and r.json()["meta_info"]["standin_read_tokens"] == 0
    api = server.api.counters
    assert api.captures_failed == 1 and api.captures_skipped == 1  # 413 is not retried
    assert [e.num_tokens for e in server.store.list("default")] == [3]  # the pin stays


def test_a_flooding_namespace_does_not_evict_another(make_server, client, smollm_tokenizer):
    server = make_server(region_tokens=256, namespace_fraction=0.5)
    keep = client.post("/redknot/segments", json={"namespace": "b", "text": DOC})
    assert keep.status_code == 200, keep.text
    for i in range(40):
        text = f"Flood document number {i} " * 6
        spans = [{"start": 0, "end": len(text), "namespace": "a"}]
        r = client.post("/generate", json={"text": text, "redknot_segments": spans})
        assert r.status_code == 200, r.text
    assert server.store.stats("a")["evictions"] > 0
    assert [e.id for e in server.store.list("b")] == [keep.json()["segment_id"]]
    assert server.store.stats("b")["evictions"] == 0
    server.store.check()


def test_the_misses_of_one_request_are_captured_in_one_batch(make_server, client):
    server = make_server(region_tokens=4096)
    docs = [f"Document {k}: " + " ".join(f"fact{k}-{j}" for j in range(30)) for k in range(3)]
    text = "Context:\n" + "\n".join(docs) + "\nQuestion: which facts?"
    spans = [
        {"start": text.index(d), "end": text.index(d) + len(d), "namespace": "kb"} for d in docs
    ]
    body = {"text": text, "sampling_params": {"max_new_tokens": 2}, "redknot_segments": spans}
    assert client.post("/generate", json=body).status_code == 200
    batches = [obj for obj in server.tm.received if isinstance(obj.sampling_params, list)]
    assert len(batches) == 1 and len(batches[0].input_ids) == 3  # one request, three prompts
    assert len(_captures(server)) == 3 and server.store.stats("kb")["segments"] == 3
    r = client.post("/generate", json=body)
    assert r.json()["meta_info"]["standin_read_tokens"] == sum(
        len(c.input_ids) for c in _captures(server)
    )


def test_capture_batches_hold_at_most_their_token_limit():
    from redknot.api.capture import _batches, _Capture, _runs

    segs = [_Capture("ns", [0] * n, str(k), False, []) for k, n in enumerate([5, 4, 2, 9, 1, 12])]
    cut = _batches(_runs(segs), 10)
    assert [[run[0][2] for run in b] for b in cut] == [["0", "1"], ["2"], ["3", "4"], ["5"]]
    assert _batches([], 10) == []
    # a capture's context counts: it is computed with its segment
    with_context = [
        _Capture("ns", [0] * 4, "a", True, [1] * 4),
        _Capture("ns", [0] * 4, "b", True, [1] * 3),
    ]
    assert [[run[0][2] for run in b] for b in _batches(_runs(with_context), 10)] == [["a"], ["b"]]


def test_segments_that_follow_one_another_are_captured_in_one_prompt():
    """``_runs``: automatic segments of one namespace that start where the previous one ends in
    the prompt that missed them form a run (one prompt, only the first one's context); a gap,
    another namespace or an unknown start (a document, an edge, a client's segment) ends it."""
    from redknot.api.capture import _Capture, _runs

    def seg(name, start, n=4, ns="auto"):
        return _Capture(ns, [0] * n, name, True, [9] * 3, start)

    segs = [seg("a", 10), seg("b", 14), seg("c", 18, 2), seg("d", 30), seg("e", 34, ns="kb"),
            seg("f", None), seg("g", 38), seg("h", 42)]  # fmt: skip
    assert [[s[2] for s in run] for run in _runs(segs)] == [
        ["a", "b", "c"],
        ["d"],
        ["e"],
        ["f"],
        ["g", "h"],
    ]


def test_a_request_whose_segments_all_hit_does_not_ask_the_store(make_server, client):
    """Its answer's report says every marked segment hit: nothing can be missing, so no control
    round trip to the scheduler is spent on it (streamed or not); a miss still asks."""
    server = make_server()
    asked = server.record_control_ops()
    assert _generate(client).status_code == 200  # a miss: asked, then captured
    assert "registrations" in asked and len(_captures(server)) == 1
    asked.clear()
    for stream in (False, True):
        r = _generate(client, "Capital of Germany?", stream=stream)
        assert r.status_code == 200
    assert asked == [] and len(_captures(server)) == 1
    stats = client.get("/redknot/stats", params={"namespace": "kb"}).json()
    assert stats["store"]["hits"] == 2 and stats["api"]["captures_skipped"] == 2
    asked.clear()
    other = _generate(client, namespace="kb2")  # the same text in a new namespace misses
    assert other.status_code == 200 and "registrations" in asked


def test_chat_segments_are_inert_where_the_gate_recomputes_every_prompt(make_server, client):
    """A chat request's messages marked on a server whose reuse gate recomputes every prompt
    the model takes carry only their count: nothing is looked up, stored or captured."""
    from redknot.api.marks import KEY_BOUNDS, KEY_RECOMPUTED
    from tests.api.test_reuse_report import _HopelessGate

    server = make_server()
    server.scheduler.model_config = types.SimpleNamespace(context_len=4096)
    server.scheduler.pool.reuse_gate = _HopelessGate(4096)
    for question in ("Capital of France?", "Capital of Germany?"):
        _chat_about_doc(client, question)
        sent = server.tm.last.sampling_params["custom_params"]
        assert sent[KEY_RECOMPUTED] == 2 and KEY_BOUNDS not in sent  # the two messages
    stats = server.store.stats()
    assert stats["hits"] == stats["misses"] == stats["captures"] == 0
    assert not _captures(server)
