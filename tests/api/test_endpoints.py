"""The /redknot endpoints and the control path to the scheduler's segment store."""

from __future__ import annotations

import asyncio
import types

import pytest

from redknot.api import control
from redknot.api.marks import decode_marks, segment_id

DOC = "Paris is the capital of France."


def test_register_list_delete_stats(make_api, client, bpe_tokenizer):
    api = make_api(bpe_tokenizer)
    r = client.post("/redknot/segments", json={"namespace": "kb", "text": DOC, "pin": True})
    assert r.status_code == 200, r.text
    seg = bpe_tokenizer.encode(DOC, add_special_tokens=False)
    reg = r.json()
    assert reg == {
        "segment_id": segment_id("kb", seg),
        "namespace": "kb",
        "num_tokens": len(seg),
        "pinned": True,
        "cached_tokens": 0,
        "state": "ready",
    }
    # the carrier: a max_new_tokens=0 generate request of exactly the segment's tokens
    obj = api.tokenizer_manager.last
    assert obj.input_ids == seg and obj.sampling_params["max_new_tokens"] == 0
    custom = obj.sampling_params["custom_params"]
    assert custom["redknot_register"] is True and custom["redknot_pin"] is True
    assert decode_marks(custom, seg)[0].segment_id == reg["segment_id"]

    # the namespace now exists: requests may use it
    body = {"text": "Q: " + DOC, "redknot_segments": [{"start": 3, "end": 34, "namespace": "kb"}]}
    assert client.post("/generate", json=body).status_code == 200

    listed = client.get("/redknot/segments", params={"namespace": "kb"}).json()
    assert listed["namespace"] == "kb"
    assert [s["id"] for s in listed["segments"]] == [reg["segment_id"]]

    stats = client.get("/redknot/stats").json()
    assert stats["store"]["segments"] == 1
    assert stats["api"]["registrations"] == 1 and stats["api"]["segments_marked"] == 1
    assert stats["namespaces"] == ["default", "kb"]
    assert set(stats["capture_order"]) == {"batches_for_users", "capture_steps_cut",
                                           "captures_held", "chunks_alone", "step_tokens"}  # fmt: skip
    assert "capture_order" not in stats["store"]
    one = client.get("/redknot/stats", params={"namespace": "kb"}).json()
    assert one["namespace"] == "kb" and "capture_order" not in one

    d = client.delete(f"/redknot/segments/{reg['segment_id']}", params={"namespace": "kb"})
    assert d.status_code == 200
    assert d.json() == {
        "namespace": "kb",
        "segment_id": reg["segment_id"],
        "deleted": True,
        "freed_now": True,
    }
    again = client.delete(f"/redknot/segments/{reg['segment_id']}", params={"namespace": "kb"})
    assert again.status_code == 404 and "no segment" in again.json()["error"]["message"]


def test_register_input_ids(make_api, client, bpe_tokenizer):
    api = make_api(bpe_tokenizer)
    r = client.post("/redknot/segments", json={"input_ids": [5, 6, 7]})
    assert r.status_code == 200
    assert r.json()["namespace"] == "default" and r.json()["pinned"] is False
    assert api.tokenizer_manager.last.input_ids == [5, 6, 7]


@pytest.mark.parametrize(
    "body, message",
    [
        ({"text": DOC, "input_ids": [1]}, "exactly one of text and input_ids"),
        ({}, "exactly one of text and input_ids"),
        ({"text": ""}, "non-empty string"),
        ({"input_ids": []}, "the segment is empty"),
        ({"input_ids": [1, -1]}, "non-negative integers"),
        ({"input_ids": [1, 9999]}, "outside the vocabulary"),
        ({"input_ids": ["a"]}, "non-negative integers"),
        ({"text": DOC, "pin": "yes"}, "pin must be true or false"),
        ({"text": DOC, "namespace": "bad name"}, "not a valid namespace name"),
        ({"text": DOC, "ttl": 3}, "unknown fields ['ttl']"),
        ({"input_ids": list(range(64))}, "not less than the model's context (64 tokens)"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_bad_registrations_are_400(make_api, client, bpe_tokenizer, body, message):
    make_api(bpe_tokenizer, context_len=64)
    r = client.post("/redknot/segments", json=body)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


def test_declared_namespaces_are_closed(make_api, client, bpe_tokenizer):
    make_api(bpe_tokenizer, namespaces="kb,tenant1")
    assert (
        client.post("/redknot/segments", json={"namespace": "kb", "text": DOC}).status_code == 200
    )
    r = client.post("/redknot/segments", json={"namespace": "other", "text": DOC})
    assert r.status_code == 400
    assert "fixed by --redknot-namespaces" in r.json()["error"]["message"]
    r = client.get("/redknot/segments", params={"namespace": "other"})
    assert r.status_code == 400 and "unknown" in r.json()["error"]["message"]


def test_store_absent_is_503(make_api, client, bpe_tokenizer):
    api = make_api(bpe_tokenizer)
    scheduler = types.SimpleNamespace(tree_cache=types.SimpleNamespace())

    async def communicator(req):
        return [control.handle(scheduler, req)]

    api.tokenizer_manager.redknot_segments_communicator = communicator
    r = client.get("/redknot/stats")
    assert r.status_code == 503
    assert "no segment store" in r.json()["error"]["message"]


def test_lfps_rows_are_reported_with_or_without_a_segment_store(make_api, client, bpe_tokenizer):
    """``--redknot-lfps``: its state rows and refusals under ``"lfps"`` in ``/redknot/stats``,
    also on a server without a segment store (``store`` null there); a namespace's stats and a
    server with neither still answer as before."""
    api = make_api(bpe_tokenizer)
    rows = {"mode": "lfps", "rows": 8, "in_use": 3, "refused": 2, "min_tokens": 2048}
    lfps = types.SimpleNamespace(stats=lambda: dict(rows))
    scheduler = types.SimpleNamespace(
        tree_cache=types.SimpleNamespace(),
        req_to_token_pool=types.SimpleNamespace(redknot_lfps=lfps),
    )

    async def communicator(req):
        return [control.handle(scheduler, req)]

    api.tokenizer_manager.redknot_segments_communicator = communicator
    r = client.get("/redknot/stats")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["lfps"] == rows and body["store"] is None and "api" in body
    assert client.get("/redknot/stats", params={"namespace": "default"}).status_code == 503
    scheduler.req_to_token_pool = types.SimpleNamespace()
    assert client.get("/redknot/stats").status_code == 503


def test_lfps_rows_sit_beside_the_store_stats(http_app, client, bpe_tokenizer):
    """A server with a segment store and LFPS: ``lfps`` at the top, not inside ``store``."""
    from tests.api.cpu_server import CpuServer

    server = CpuServer(http_app, bpe_tokenizer)
    rows = {"mode": "topk", "rows": 4, "in_use": 0, "refused": 0, "min_tokens": 2048}
    server.scheduler.req_to_token_pool = types.SimpleNamespace(
        redknot_lfps=types.SimpleNamespace(stats=lambda: dict(rows))
    )
    stats = client.get("/redknot/stats").json()
    assert stats["lfps"] == rows and "lfps" not in stats["store"]
    assert stats["store"]["segments"] == 0


def test_dp_size_above_one_is_refused(make_api, client, bpe_tokenizer):
    api = make_api(bpe_tokenizer)
    api.tokenizer_manager.server_args.dp_size = 2
    r = client.get("/redknot/segments")
    assert r.status_code == 501 and "--dp-size 1" in r.json()["error"]["message"]


def test_control_messages_cross_sglang_ipc(sglang_plugins):
    from sglang.srt.managers.io_struct import msgpack_decode, msgpack_encode

    req = control.RedknotSegmentsReq(op="delete", namespace="kb", segment_id="ab" * 16)
    assert msgpack_decode(msgpack_encode(req)) == req
    out = control.RedknotSegmentsReqOutput(status=200, payload='{"a": 1}')
    assert msgpack_decode(msgpack_encode(out)) == out


def test_control_path_through_sglang_dispatchers(sglang_plugins):
    """A request sent by the tokenizer manager's communicator, dispatched by the scheduler's
    request dispatcher (as the hooks install them), answered back to the communicator."""
    from sglang.srt.managers.io_struct import msgpack_decode, msgpack_encode
    from sglang.utils import TypeBasedDispatcher

    from tests.api.conftest import FakeStore

    store = FakeStore()
    store.segments[("kb", "s1")] = {"id": "s1"}
    scheduler = types.SimpleNamespace(
        tree_cache=types.SimpleNamespace(segments=store),
        _request_dispatcher=TypeBasedDispatcher([]),
    )
    control.after_scheduler_dispatcher(None, scheduler)

    tm = types.SimpleNamespace(
        server_args=types.SimpleNamespace(dp_size=1), _result_dispatcher=TypeBasedDispatcher([])
    )

    def dispatch_to_scheduler(obj):  # the zmq hop, both ways, through SGLang's msgpack codec
        answer = scheduler._request_dispatcher(msgpack_decode(msgpack_encode(obj)))
        asyncio.get_running_loop().call_soon(
            tm._result_dispatcher, msgpack_decode(msgpack_encode(answer))
        )

    tm._dispatch_to_scheduler = dispatch_to_scheduler
    control.after_tokenizer_dispatcher(None, tm)

    store.segments[("kb", "s2")] = {"id": "s2"}
    store.segments[("kb", "p")] = {"id": "p", "pinned": True}  # kept: only a delete removes it

    async def run():
        listed = await control.call(tm, "list", "kb")
        deleted = await control.call(tm, "delete", "kb", "s1")
        with pytest.raises(control.ControlError) as e:
            await control.call(tm, "delete", "kb", "s1")
        many = await control.deletes(tm, [("kb", "s2"), ("kb", "s1"), ("other", "s2"), ("kb", "p")])
        return listed, deleted, e.value.status, many

    assert asyncio.run(run()) == (
        [{"id": "s1"}, {"id": "s2"}, {"id": "p", "pinned": True}],
        {"deleted": True, "freed_now": True}, 404, [True, False, False, False],
    )  # fmt: skip
    assert list(store.segments) == [("kb", "p")]
