"""Regressions of the bugs ``benchmarks/fuzz_api.py`` found: each request here used to get a 500,
slip past the segment checks, or reach the model altered."""

from __future__ import annotations

import types

import pytest

from redknot.api import segment
from redknot.api.marks import SegmentMark, SegmentMarkError, decode_marks, encode_marks

DOC = "Paris is the capital of France."
JSON = {"content-type": "application/json"}


def _custom(sampling_params):
    return (sampling_params or {}).get("custom_params") or {}


def test_batch_marked_only_in_band(make_api, client, bpe_tokenizer):
    """Was a 500: a batch of texts with markers and no ``redknot_segments`` field."""
    api = make_api(bpe_tokenizer)
    r = client.post("/generate", json={"text": ["Q: " + segment(DOC), "plain"]})
    assert r.status_code == 200, r.text
    obj = api.tokenizer_manager.last
    (mark,) = decode_marks(_custom(obj.sampling_params[0]), obj.input_ids[0])
    assert obj.input_ids[0][mark.start : mark.end] == bpe_tokenizer.encode(
        DOC, add_special_tokens=False
    )
    assert obj.input_ids[1] == bpe_tokenizer.encode("plain")
    assert decode_marks(_custom(obj.sampling_params[1])) == []


def test_batch_with_null_segments_field(make_api, client, bpe_tokenizer):
    """Was a 500: a batch of input_ids with ``"redknot_segments": null``."""
    api = make_api(bpe_tokenizer)
    body = {"input_ids": [[1, 2, 3], [4, 5]], "redknot_segments": None}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    assert api.tokenizer_manager.last.input_ids == [[1, 2, 3], [4, 5]]


@pytest.mark.parametrize("custom", ["x", 5, [1, 2], True, 1.5])
def test_custom_params_not_an_object(make_api, client, bpe_tokenizer, custom):
    """Was a 500 ('int' object is not iterable, dictionary update sequence ...)."""
    make_api(bpe_tokenizer)
    body = {
        "text": DOC,
        "redknot_segments": [{"start": 0, "end": 5}],
        "sampling_params": {"custom_params": custom},
    }
    r = client.post("/generate", json=body)
    assert r.status_code == 400, r.text
    assert "sampling_params.custom_params must be an object" in r.json()["error"]["message"]


def test_unmarked_body_with_odd_custom_params_is_left_to_sglang(http_app, client, bpe_tokenizer):
    """Was a 500 from the middleware: ``redknot_`` in a prompt and a non-object
    ``custom_params``; now SGLang's own checks answer (here those of the CPU stand-in)."""
    from tests.api.cpu_server import CpuServer

    server = CpuServer(http_app, bpe_tokenizer)
    body = {"text": "about redknot_ things", "sampling_params": {"custom_params": 5}}
    r = client.post("/generate", json=body)
    assert r.status_code == 400, r.text
    assert "redknot" not in r.text  # not the middleware's answer
    assert server.tm.last.text == body["text"]  # passed on untouched


@pytest.mark.parametrize(
    "raw, message",
    [
        (  # an escaped reserved key
            (
                b'{"input_ids": [1, 2, 3], "sampling_params": {"custom_params": '
                b'{"\\u0072edknot_seg_bounds": [0, 2]}}}'
            ),
            "are reserved for redknot",
        ),
        (  # an escaped field name
            b'{"input_ids": [1, 2, 3], "\\u0072edknot_segments": [{"start": 0, "end": 9}]}',
            "out of range",
        ),
        (b'{"text": "a\\uDb80\\uDc01b"}', "unbalanced"),  # a marker escaped in mixed case
        (b'{"text": "a\\udB80\\udC03b"}', "end marker"),
    ],
)
def test_escaped_markup_is_read(make_api, client, bpe_tokenizer, raw, message):
    """Were passed to SGLang unread: markup spelt with JSON escapes the byte scan missed."""
    api = make_api(bpe_tokenizer)
    before = len(api.tokenizer_manager.received)
    r = client.post("/generate", content=raw, headers=JSON)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    assert len(api.tokenizer_manager.received) == before


def test_the_byte_scan_finds_each_spelling_of_markup_and_nothing_else():
    """The scan that decides whether a body is parsed: each trigger alone is found wherever it
    lies, and a body holding only a trigger's first byte (a backslash escape, an "r", another
    four-byte character) is not."""
    from redknot.api.middleware import _TRIGGERS, _may_mark

    ids = b'{"input_ids": [' + b", ".join(str(i).encode() for i in range(2000)) + b"]"
    for trigger in _TRIGGERS:
        for body in (trigger + ids + b"}", ids + b', "k": "' + trigger + b'"}'):
            assert _may_mark(body), (trigger, body[-40:])
    for near in (
        b'"a\\nb\\"',
        b'"return_logprob": true',
        "\U000f1000".encode(),
        "\U00010000".encode(),
    ):
        assert not _may_mark(ids + b', "k": ' + near + b"}"), near
    assert _may_mark(ids + b', "text": "a\\u00e9"}')


@pytest.mark.parametrize(
    "content_type", ["application/vnd.api+json", "application/merge-patch+json", "APPLICATION/JSON"]
)
def test_json_media_types_are_read(make_api, client, bpe_tokenizer, content_type):
    """Was passed unread: FastAPI parses ``application/*+json`` bodies as JSON too."""
    api = make_api(bpe_tokenizer)
    body = b'{"input_ids": [1, 2, 3], "redknot_segments": [{"start": 0, "end": 2}]}'
    r = client.post("/generate", content=body, headers={"content-type": content_type})
    assert r.status_code == 200, r.text
    (mark,) = decode_marks(_custom(api.tokenizer_manager.last.sampling_params), [1, 2, 3])
    assert (mark.start, mark.end) == (0, 2)
    reserved = b'{"text": "x", "sampling_params": {"custom_params": {"redknot_pin": true}}}'
    r = client.post("/v1/completions", content=reserved, headers={"content-type": content_type})
    assert r.status_code == 400 and "reserved for redknot" in r.json()["error"]["message"]


@pytest.mark.parametrize("name", ["default\n", "kb\n"])
def test_namespace_with_a_trailing_newline_is_refused(make_api, client, bpe_tokenizer, name):
    """Was accepted (``$`` matches before a final newline), creating namespace ``'kb\\n'``."""
    make_api(bpe_tokenizer)
    r = client.post("/redknot/segments", json={"namespace": name, "text": DOC})
    assert r.status_code == 400
    assert "not a valid namespace name" in r.json()["error"]["message"]


def test_batch_errors_name_the_prompt(make_api, client, bpe_tokenizer):
    """The message named ``redknot_segments[0]`` for any prompt of a batch."""
    make_api(bpe_tokenizer)
    body = {
        "input_ids": [[1, 2, 3], [], [4, 5]],
        "redknot_segments": [[{"start": 0, "end": 1}], [{"start": 0, "end": 1}], None],
    }
    r = client.post("/generate", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("redknot_segments[1][0] [0, 1) is out of range")


@pytest.mark.parametrize(
    "content",
    ["\U000f00100\U000f0011", "\U000f00100\U000f0011 and more", "tail \U000f0011"],
)
def test_chat_contents_holding_sentinels_are_served_as_written(
    http_app, client, smollm_tokenizer, server_args, content
):
    """Was swapped: a message whose content is the sentinel of another message reached the
    model as that other message's text."""
    from tests.api.cpu_server import CpuServer

    server = CpuServer(http_app, smollm_tokenizer, chat="messages", server_args=server_args)
    msgs = [{"role": "user", "content": DOC}, {"role": "user", "content": content}]
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": msgs, "max_tokens": 1})
    assert r.status_code == 200, r.text
    want = smollm_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    obj = server.tm.last
    assert smollm_tokenizer.decode(obj.input_ids) == want
    assert decode_marks(_custom(obj.sampling_params)) == []  # served unsegmented


def test_forged_marks_never_raise_in_the_scheduler():
    """Was a scheduler crash: marks set by an ``sgl.Engine`` caller (no HTTP checks) with a
    namespace longer than the store keys raised ``SegmentError`` out of ``reuse.start``."""
    from tests.api.cpu_server import CpuScheduler

    scheduler = CpuScheduler(region_tokens=64)
    ns = "x" * 300
    params = encode_marks([SegmentMark(0, 2, ns, "0" * 32)])
    with pytest.raises(SegmentMarkError, match="at most 256"):
        decode_marks(params, [5, 6, 7])
    for register in (False, True):
        custom = {**params, "redknot_register": register}
        sp = types.SimpleNamespace(custom_params=custom)
        assert scheduler.serve("r", [5, 6, 7], sp) == 0
    assert scheduler.store.stats()["segments"] == 0
    scheduler.store.check()


def test_markup_is_read_after_request_decompression(bpe_tokenizer, monkeypatch):
    """Was passed unread with ``SGLANG_ENABLE_REQUEST_DECOMPRESSION``: the markup middleware ran
    outside SGLang's decompression middleware and scanned the compressed bytes."""
    import orjson
    import zstandard
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from fastapi.testclient import TestClient
    from sglang.srt.entrypoints.http_request_decompression import RequestDecompressionMiddleware

    from redknot.api import server
    from redknot.api.middleware import SegmentMarkupMiddleware
    from redknot.api.service import SegmentApi
    from tests.api.conftest import FakeTokenizerManager

    monkeypatch.setattr(server, "_api", server._api)  # the session app's API, restored after
    app = FastAPI()
    app.add_middleware(RequestDecompressionMiddleware)

    async def echo(request):  # a plain Starlette endpoint: what reached the route
        return JSONResponse(orjson.loads(await request.body()))

    app.router.add_route("/generate", echo, methods=["POST"])

    server.install(app, SegmentApi(FakeTokenizerManager(bpe_tokenizer)))
    assert app.user_middleware[-1].cls is SegmentMarkupMiddleware
    client = TestClient(app)

    def send(body):
        data = zstandard.ZstdCompressor().compress(orjson.dumps(body))
        return client.post("/generate", content=data, headers={**JSON, "x-body-compressed": "zstd"})

    bad = send({"input_ids": [1, 2, 3], "redknot_segments": [{"start": 0, "end": 9}]})
    assert bad.status_code == 400 and "out of range" in bad.json()["error"]["message"]
    good = send({"input_ids": [1, 2, 3], "redknot_segments": [{"start": 1, "end": 3}]})
    assert good.status_code == 200
    assert "redknot_segments" not in good.json()
    assert decode_marks(_custom(good.json()["sampling_params"]), [1, 2, 3])[0].start == 1
