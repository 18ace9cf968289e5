"""A registration answers what the scheduler's store made of it: stored (200), still written by
another registration of the same tokens (202), or not stored at all (413 / 409, saying why)."""

from __future__ import annotations

import pytest

from redknot.api.marks import segment_id


@pytest.fixture
def server(http_app, bpe_tokenizer):
    from tests.api.cpu_server import CpuServer

    return CpuServer(http_app, bpe_tokenizer, context_len=4096, region_tokens=64)


def _ids(n: int, start: int = 1) -> list[int]:
    return [start + i % 150 for i in range(n)]


def test_longer_than_the_region_is_413(server, client):
    ids = _ids(80)  # the region holds 64 tokens
    r = client.post("/redknot/segments", json={"namespace": "kb", "input_ids": ids})
    assert r.status_code == 413, r.text
    msg = r.json()["error"]["message"]
    assert segment_id("kb", ids) in msg and "longer than the segment region" in msg
    assert server.store.list("kb") == []
    # nothing stored, so the namespace was not created by it
    assert "kb" not in client.get("/redknot/stats").json()["namespaces"]


def test_region_full_of_pins_is_409_and_a_later_success_clears_it(server, client):
    pinned = _ids(64, start=1)
    r = client.post("/redknot/segments", json={"input_ids": pinned, "pin": True})
    assert r.status_code == 200 and r.json()["state"] == "ready", r.text
    other = _ids(16, start=200)
    r = client.post("/redknot/segments", json={"input_ids": other})
    assert r.status_code == 409, r.text
    assert "cannot hold" in r.json()["error"]["message"]
    sid = segment_id("default", pinned)
    assert client.delete(f"/redknot/segments/{sid}").status_code == 200
    r = client.post("/redknot/segments", json={"input_ids": other})
    assert r.status_code == 200 and r.json()["state"] == "ready", r.text


def test_second_registration_while_the_first_writes_is_202_and_writes_nothing(server, client):
    ids = _ids(20)
    sid = segment_id("default", ids)
    server.scheduler.hold(1)  # the first registration keeps running: its K/V is being written
    first = client.post("/redknot/segments", json={"input_ids": ids})
    assert first.status_code == 202 and first.json()["state"] == "writing", first.text
    second = client.post("/redknot/segments", json={"input_ids": ids})
    assert second.status_code == 202 and second.json()["state"] == "writing", second.text
    # one writer only: the second registration planned no write job
    assert len(server.scheduler.pool.segment_jobs) == 1
    server.scheduler.finish_running(complete=True)
    (entry,) = server.store.list("default")
    assert entry.id == sid and entry.ready and entry.refs == 0
    again = client.post("/redknot/segments", json={"input_ids": ids})
    assert again.status_code == 200 and again.json()["state"] == "ready"


def test_aborted_registration_is_remembered_until_registered_again(server, client):
    ids = _ids(20)
    sid = segment_id("default", ids)
    server.scheduler.hold(1)
    assert client.post("/redknot/segments", json={"input_ids": ids}).status_code == 202
    server.scheduler.finish_running(complete=False)  # aborted before its last token
    state = server.store.registration_state("default", sid)
    assert state["state"] == "failed" and state["status"] == 409
    assert "ended after" in state["reason"]
    r = client.post("/redknot/segments", json={"input_ids": ids})
    assert r.status_code == 200 and r.json()["state"] == "ready", r.text


def test_registration_without_a_reachable_store_is_refused_before_its_prefill(server, client):
    server.tm.server_args.dp_size = 2
    sent = len(server.tm.received)
    r = client.post("/redknot/segments", json={"input_ids": _ids(20)})
    assert r.status_code == 501 and "--dp-size 1" in r.json()["error"]["message"]
    assert len(server.tm.received) == sent  # no prefill was sent
