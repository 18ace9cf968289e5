"""``--redknot-auto-capture-in-place on`` (the default): an automatic chunk due for capture is
stored by the request that misses it, from its own prefill, instead of by a capture request
sent after its answer (``redknot.segcache.registration.store_in_place``), through the CPU
server stand-in (``tests/api/cpu_server.py``)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from redknot.api.marks import KEY_STORE, SegmentMark, SegmentMarkError, stored_marks
from tests.api.test_auto_segments import (
    DOCS,
    auto_server,
    captures,
    generate,
    marks_of,
    rag_prompt,
)


@pytest.fixture
def make_server(http_app, smollm_tokenizer):
    """The stand-in of ``test_auto_segments`` under the server's default (in place)."""
    return functools.partial(auto_server, http_app, smollm_tokenizer)


def _stored(out) -> list[dict]:
    (report,) = out["meta_info"]["redknot_reuse"]
    return report.get("stored", [])


def test_the_second_miss_stores_the_chunks_with_no_capture_request(make_server, client):
    """Chunks are due at their second miss: the first prompt stores nothing (no store flag
    sent), the second stores the chunks it misses again itself (its report lists them, no
    capture request is sent, the store holds them), and a third prompt with the documents in
    another order reads them."""
    server = make_server()
    assert server.api.capture.in_place
    prompts = [rag_prompt("You are a helpful assistant.", [0, 1, 2, 3], "Which river?"),
               rag_prompt("Answer from these documents only.", [2, 0, 3, 1], "Which harbor?"),
               rag_prompt("Be brief.", [1, 3, 0, 2], "Which bridge?")]  # fmt: skip
    out = generate(client, prompts[0])
    first = marks_of(server.tm.last)
    assert KEY_STORE not in server.tm.last.sampling_params["custom_params"]
    assert _stored(out) == []
    out = generate(client, prompts[1])
    second = marks_of(server.tm.last)
    again = {m.segment_id for m in first} & {m.segment_id for m in second}
    flagged = server.tm.last.sampling_params["custom_params"][KEY_STORE]
    assert {second[i].segment_id for i in flagged} == again  # due: seen once before
    stored = _stored(out)
    assert {(s["namespace"], s["start"]) for s in stored} == {
        ("auto", m.start) for m in second if m.segment_id in again
    }
    assert captures(server) == []  # nothing sent apart
    api = client.get("/redknot/stats").json()["api"]
    assert api["captures_in_place"] == len(stored) and api["captures_sent"] == 0
    for m in second:
        ids = server.tm.last.input_ids[m.start : m.end]
        assert (server.store.lookup("auto", ids) is not None) == (m.segment_id in again)
    out = generate(client, prompts[2])
    assert out["meta_info"]["standin_read_tokens"] > 0


def test_a_chunk_inside_the_exact_prefix_hit_is_not_stored_in_place(make_server, client):
    """A conversation (each turn the previous prompt and more), chunks due at their first miss:
    the chunks each turn computes are stored by it; those that start inside its exact-prefix
    hit (the stand-in's model of SGLang's radix cache) are served, not stored again."""
    server = make_server(exact_prefix=True, auto_capture_after=1)
    text = "You are a helpful assistant."
    for k in range(3):
        text += f"\n\nUser: {DOCS[k]}\nAssistant: noted {k}."
        out = generate(client, text)
        cached = out["meta_info"]["cached_tokens"]
        starts = [s["start"] for s in _stored(out)]
        assert starts and all(s >= cached for s in starts)
        assert (cached > 0) == (k > 0)
    assert captures(server) == []


def test_off_captures_apart(make_server, client):
    """``--redknot-auto-capture-in-place off``: no store flag, chunks captured apart."""
    server = make_server(auto_capture_in_place="off", auto_capture_after=1)
    out = generate(client, rag_prompt("Hi.", [0, 1], "Why?"))
    assert KEY_STORE not in server.tm.last.sampling_params["custom_params"]
    assert _stored(out) == [] and captures(server)
    assert server.api.counters.captures_in_place == 0


def _req(custom, ids=range(40)):
    return SimpleNamespace(
        sampling_params=SimpleNamespace(custom_params=custom), origin_input_ids=list(ids),
        rid="r", req_pool_idx=3,
    )  # fmt: skip


def test_stored_marks_checks_its_indices():
    marks = [SegmentMark(0, 4, "auto", "a"), SegmentMark(4, 8, "auto", "b")]
    assert stored_marks(_req({}), marks) == []
    assert stored_marks(_req({KEY_STORE: [1, 1]}), marks) == [marks[1]]
    for bad in ([2], [-1], [True], "0", [0.0]):
        with pytest.raises(SegmentMarkError, match="indices"):
            stored_marks(_req({KEY_STORE: bad}), marks)


def test_store_in_place_writes_after_the_prefix_hit_what_the_store_lacks():
    """The request's own write job: the missed marks it computes in full (not the one that
    starts inside its exact-prefix hit, not one another writer holds), from the hit's end on;
    its first extend writes their rows with their keys rotated back to positions from 0."""
    from redknot.segcache import registration
    from tests.segcache.test_registration import make_world

    _, pool, cache = make_world()
    store = cache.segments
    busy = store.register("auto", list(range(30, 36)), pin=False, capture=True)
    assert store.claim_write(busy)  # another capture writes it
    req = _req({}, ids=range(40))
    marks = [SegmentMark(2, 10, "auto", "x"), SegmentMark(12, 20, "auto", "y"),
             SegmentMark(20, 26, "auto", "z"), SegmentMark(30, 36, "auto", "w")]  # fmt: skip
    taken = registration.store_in_place(cache, req, marks, prefix=5)
    assert taken == marks[1:3]
    job = pool.segment_jobs[3]
    assert job.written == 5 and [s for _, s in job.parts] == [12, 20]
    writes = registration.plan_writes(pool, [3], [5], [35], "cpu")
    assert writes.tokens_gpu.tolist() == list(range(7, 21))  # prompt 12..25, batch offset -5
    assert writes.pos_gpu.tolist() == [list(range(12, 26)), [*range(8), *range(6)]]
    assert not pool.segment_jobs  # both complete in that extend: ready
    for ids in (range(12, 20), range(20, 26)):
        assert store.lookup("auto", list(ids)) is not None
    assert store.lookup("auto", list(range(2, 10))) is None
    assert torch.equal(writes.rows_gpu, torch.cat([store.lookup("auto", list(range(12, 20))).rows(),
                                                   store.lookup("auto", list(range(20, 26))).rows()]))  # fmt: skip
